"""Step time of a candidate layout, from FLOPs, links and the pipeline schedule.

Per microbatch and rank, a module's forward and backward take their FLOPs over peak x efficiency
plus a fixed cost per kernel (:mod:`.assumptions`; never less than the host's launch time per
layer), plus the traffic inside
its layers: TP (sequence-parallel gathers and scatters on the language model, all-reduces on an
encoder), CP (the key/value ring, partly hidden), EP (two all-to-alls per MoE layer each way).
Pipeline stages then run 1F1B: ``sum(stages) + (microbatches - 1) x slowest``, which holds the
bubble and any imbalance. An encoder on ranks of its own is one more stage before the language
model's first, paying its cross-grid transfer per microbatch; a homogeneous one adds its time to
the first stage; colocated encoders run all their forwards before the language schedule and their
backwards after it (three phases), paying the routing of their rows. Last, gradient reduction over
DP (partly hidden with ``--overlap-grad-reduce``) and the optimizer step, the grids of separate
encoders in parallel with the language model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from megatron_plugins.flops.count import Flops
from megatron_plugins.parallel.layout import ModulePlacement
from megatron_plugins.parallel.routing import summarize
from megatron_plugins.performance.assumptions import Assumptions
from megatron_plugins.performance.candidates import (
    COLOCATED,
    HOMOGENEOUS,
    SEPARATE,
    Candidate,
    EncoderPlacement,
)
from megatron_plugins.performance.gpus import Hardware
from megatron_plugins.performance.memory import (
    Memory,
    candidate_memory,
    encoder_samples,
    language_stage_params,
    microbatches,
)
from megatron_plugins.performance.network import Link, group_link, link_between
from megatron_plugins.performance.workload import EncoderWork, Workload

__all__ = ["Estimate", "Pass", "estimate", "module_busy"]


@dataclass(frozen=True)
class Pass:
    """Seconds of one microbatch's forward and backward on one rank (backward includes any
    recomputation), and of its traffic to the next stage or grid (both directions)."""

    forward: float
    backward: float
    transfer: float = 0.0

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.transfer


@dataclass(frozen=True)
class Estimate:
    """A candidate's predicted step: seconds, its parts, each module's busy seconds per rank
    (compute with its in-layer traffic, mean over its ranks), memory, work done."""

    candidate: Candidate
    step: float
    parts: dict[str, float]
    busy: dict[str, float]
    memory: Memory
    tokens: float
    model_flops: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.candidate.ranks

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.step / self.candidate.ranks / 1e12


def _rate(hardware: Hardware, assumptions: Assumptions, module: str,
          efficiency: float | None = None) -> float:
    """FLOP/s one rank reaches on ``module``'s work, its kernels' fixed costs aside."""
    base = assumptions.module_efficiency(module) if efficiency is None else efficiency
    return hardware.gpu.peak_tflops * 1e12 * base


KERNELS_PER_LAYER = 5
"""Kernels with a fixed cost in one layer's forward (four matrix products and attention); a
backward runs twice as many."""


def _timed(flops: Flops, rate: float, layers: float, assumptions: Assumptions,
           recompute_passes: int) -> Pass:
    """Forward and backward seconds of ``flops`` at ``rate`` over ``layers`` layers: the GPU's
    time (FLOPs, plus each kernel's fixed cost) or the host's launch time, whichever is longer
    (a backward launches twice a forward's kernels, plus any forward recomputed)."""
    launch = layers * assumptions.layer_overhead_ms * 1e-3
    kernels = layers * KERNELS_PER_LAYER * assumptions.kernel_us * 1e-6
    backward = flops.backward + flops.recompute
    passes = 2 + recompute_passes
    return Pass(max(flops.forward / rate + kernels, launch),
                max(backward / rate + kernels * passes, launch * passes) if backward else 0.0)


def _language_stages(candidate: Candidate, workload: Workload, hardware: Hardware,
                     assumptions: Assumptions, efficiency: float | None = None) -> list[Pass]:
    """One :class:`Pass` per language pipeline stage (its ranks' compute, TP/CP/EP traffic and
    the activations it sends on)."""
    language, work = candidate.language, workload.language
    shape = work.shape
    tp, cp, pp, ep = language.tp, language.cp, language.pp, language.ep
    whole = work.microbatch_flops(candidate.micro, candidate.recompute)
    logits = work.logits_flops(candidate.micro)
    body = Flops(whole.forward - logits.forward, whole.backward - logits.backward,
                 whole.recompute)
    tokens = sum(sum(row) for row in work.rows(candidate.micro)) / cp
    rate = _rate(hardware, assumptions, "language", efficiency)
    layers = shape.layers / pp
    act = workload.bytes_per_param
    passes = 2 if candidate.recompute else 1
    in_layer_forward = 0.0
    if tp > 1:
        in_layer_forward += 4 * group_link(language, "tp", hardware, assumptions).all_gather(
            tokens * shape.hidden * act, tp) * layers
    if cp > 1:
        key_value = tokens * 2 * shape.groups * shape.head_dim * act / tp
        in_layer_forward += ((cp - 1) * group_link(language, "cp", hardware, assumptions)
                             .send(key_value) * (1 - assumptions.cp_overlap) * layers)
    if ep > 1 and shape.moe_layers:
        routed = tokens / tp * shape.topk * shape.hidden * act
        in_layer_forward += (2 * group_link(language, "ep", hardware, assumptions)
                             .all_gather(routed, ep) * shape.moe_layers / pp)
    pipeline = (2 * group_link(language, "pp", hardware, assumptions)
                .send(tokens * shape.hidden * act / tp) if pp > 1 else 0.0)
    stages = []
    for stage in range(pp):
        flops = body * (1 / pp) + (logits if stage == pp - 1 else Flops())
        timed = _timed(flops * (1 / (tp * cp)), rate, layers, assumptions, passes - 1)
        stages.append(Pass(timed.forward + in_layer_forward,
                           timed.backward + in_layer_forward * (1 + passes) if timed.backward
                           else 0.0, pipeline))
    return stages


def _encoder_grid(candidate: Candidate, placement: EncoderPlacement) -> ModulePlacement:
    return candidate.language if placement.mode == HOMOGENEOUS else \
        candidate.encoder_grid(placement.name)


def _encoder_pass(candidate: Candidate, placement: EncoderPlacement, work: EncoderWork,
                  workload: Workload, hardware: Hardware, assumptions: Assumptions,
                  efficiency: float | None = None) -> Pass:
    """One encoder replica's rank per microbatch: compute, TP all-reduces, and the rows it sends
    to (gradients it gets from) the language model."""
    samples = encoder_samples(candidate, placement)
    shape, tp = work.shape, placement.tp
    tokens = work.tokens * samples
    rate = _rate(hardware, assumptions, placement.name, efficiency)
    again = candidate.colocated_recompute and placement.mode == COLOCATED
    flops = work.flops * samples
    if again and flops.backward:
        flops = Flops(flops.forward, flops.backward, flops.recompute + flops.forward)
    timed = _timed(flops * (1 / tp), rate, shape.layers, assumptions, int(again))
    grid = _encoder_grid(candidate, placement)
    all_reduce = (2 * shape.layers * group_link(grid, "tp", hardware, assumptions)
                  .all_reduce(tokens * shape.hidden * workload.bytes_per_param, tp))
    rows = work.output_tokens * samples * work.output_width * workload.bytes_per_param
    directions = 2 if work.trained_params else 1
    if placement.mode == SEPARATE:
        language = candidate.language
        first_stage = range(language.rank_offset,
                            language.rank_offset + language.tp * language.cp * language.dp)
        link = link_between(grid.ranks, first_stage, hardware, assumptions)
        transfer = directions * link.send(rows)
    elif placement.mode == COLOCATED:
        transfer = _routing(candidate, grid, rows / samples, workload, hardware, assumptions)
    else:
        transfer = 0.0
    backward = timed.backward + (all_reduce * (1 + int(again)) if timed.backward else 0.0)
    return Pass(timed.forward + all_reduce, backward, transfer)


@lru_cache(maxsize=4096)
def _routed(encoder: ModulePlacement, language: ModulePlacement, micro: int) -> tuple[float,
                                                                                     float]:
    summary = summarize(encoder, language, micro)
    return summary.rows_per_sample, summary.gradients_per_sample


def _routing(candidate: Candidate, grid: ModulePlacement, sample_bytes: float,
             workload: Workload, hardware: Hardware, assumptions: Assumptions) -> float:
    """Seconds per microbatch a colocated encoder's rows (and their gradients) take to reach the
    ranks that merge them, each rank moving its share over the language DP groups' link."""
    language = candidate.language
    forward, backward = _routed(grid, language, candidate.micro)
    samples = candidate.micro * language.dp
    link: Link = group_link(language, "dp", hardware, assumptions)
    return sum(link.send(copies * samples * sample_bytes / language.size)
               for copies in (forward, backward) if copies)


def _tail(params: float, dp: int, grid: ModulePlacement, workload: Workload,
          hardware: Hardware, assumptions: Assumptions) -> float:
    """Gradient reduction (exposed part) and optimizer step of one rank training ``params``."""
    if not params:
        return 0.0
    link = group_link(grid, "dp", hardware, assumptions)
    grads = params * workload.grad_bytes
    if workload.distributed_optimizer:
        reduce = link.all_gather(grads, dp) + link.all_gather(params * workload.bytes_per_param,
                                                              dp)
        local = params / dp
    else:
        reduce, local = link.all_reduce(grads, dp), params
    hidden = assumptions.grad_overlap if workload.overlap_grad_reduce else 0.0
    optimizer = local * assumptions.optimizer_bytes_moved / (hardware.gpu.memory_gbps * 1e9)
    return reduce * (1 - hidden) + optimizer


def module_busy(candidate: Candidate, workload: Workload, hardware: Hardware,
                assumptions: Assumptions, module: str, efficiency: float | None = None
                ) -> float:
    """Seconds per step one of ``module``'s ranks computes (in-layer traffic included), mean over
    its ranks, at its assumed (or the given) efficiency."""
    m = microbatches(candidate, workload)
    if module == "language":
        return _language_busy(_language_stages(candidate, workload, hardware, assumptions,
                                               efficiency), m)
    placement = next(p for p in candidate.encoders if p.name == module)
    passed = _encoder_pass(candidate, placement, workload.encoder(module), workload, hardware,
                           assumptions, efficiency)
    return _encoder_busy(candidate, placement, passed, m)


def _language_busy(stages: list[Pass], m: int) -> float:
    """A language rank's busy seconds per step: its stage's compute, mean over the stages."""
    return m * sum(p.forward + p.backward for p in stages) / len(stages)


def _encoder_busy(candidate: Candidate, placement: EncoderPlacement, passed: Pass,
                  m: int) -> float:
    """An encoder rank's busy seconds per step (a homogeneous one's spread over the stages)."""
    share = 1 / candidate.language.pp if placement.mode == HOMOGENEOUS else 1
    return m * (passed.forward + passed.backward) * share


def estimate(candidate: Candidate, workload: Workload, hardware: Hardware,
             assumptions: Assumptions, memory: Memory | None = None) -> Estimate:
    """The predicted step of ``candidate`` (``memory``: its :func:`candidate_memory`, when the
    caller has it already)."""
    m = microbatches(candidate, workload)
    language = candidate.language
    language_passes = _language_stages(candidate, workload, hardware, assumptions)
    stages = [p.total for p in language_passes]
    separate, before, after = 0.0, 0.0, 0.0
    lang_work = workload.language
    expert_dp = language.tp * language.cp * language.dp // (language.ep * language.etp)
    trained = [language_stage_params(candidate, workload, stage)
               for stage in range(language.pp)]
    tails = [_tail(sum(dense[1] for dense, _ in trained) / language.pp,
                   language.dp * language.cp, language, workload, hardware, assumptions)
             + _tail(sum(experts[1] for _, experts in trained) / language.pp, expert_dp,
                     language, workload, hardware, assumptions)]
    busy = {"language": _language_busy(language_passes, m)}
    for placement in candidate.encoders:
        work = workload.encoder(placement.name)
        passed = _encoder_pass(candidate, placement, work, workload, hardware, assumptions)
        busy[placement.name] = _encoder_busy(candidate, placement, passed, m)
        grid = _encoder_grid(candidate, placement)
        tail = _tail(work.trained_params / placement.tp, placement.dp, grid, workload, hardware,
                     assumptions)
        if placement.mode == SEPARATE:
            separate = max(separate, passed.total)
            tails.append(tail)
            continue
        tails[0] += tail
        if placement.mode == HOMOGENEOUS:
            stages[0] += passed.forward + passed.backward
        else:
            before += m * (passed.forward + passed.transfer / 2)
            after += m * (passed.backward + passed.transfer / 2)
    pipeline_stages = ([separate] if separate else []) + stages
    pipeline = sum(pipeline_stages) + (m - 1) * max(pipeline_stages)
    tail = max(tails)
    step = before + pipeline + after + tail
    model_flops = (lang_work.microbatch_flops(candidate.micro, False).model * m * language.dp
                   + sum(work.flops.model for work in workload.encoders) * workload.global_batch)
    parts = {"encoders before": before, "pipeline": pipeline, "encoders after": after,
             "reduction+optimizer": tail,
             "bubble": pipeline - m * max(pipeline_stages)}
    if memory is None:
        memory = candidate_memory(candidate, workload, hardware, assumptions)
    return Estimate(candidate, step, parts, busy, memory, workload.real_tokens, model_flops)
