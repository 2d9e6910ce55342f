"""Memory per rank of a candidate layout: weights, gradients and optimizer state by precision
(the optimizer state sharded over DP with the distributed optimizer), activations held for the
backward per microbatch (full recomputation keeps each layer's input only), the microbatches in
flight on each pipeline stage (1F1B: ``pp - stage``), the logits on the last stage, and on the
language ranks the encoders they host: a colocated encoder holds every microbatch's activations
until its backward after the language schedule (one with ``--colocated-encoder-recompute``, which
then never meets the language model's peak), a homogeneous one sits in the first stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_plugins.performance.assumptions import Assumptions
from megatron_plugins.performance.candidates import (
    COLOCATED,
    HOMOGENEOUS,
    SEPARATE,
    Candidate,
    EncoderPlacement,
)
from megatron_plugins.performance.gpus import Hardware
from megatron_plugins.performance.workload import EncoderWork, Workload

__all__ = ["Memory", "candidate_memory", "encoder_samples", "language_stage_params",
           "microbatches"]

GIB = 1024 ** 3


@dataclass(frozen=True)
class Memory:
    """GiB per kind of rank (``language stage S``, ``ENCODER``) and what one GPU offers."""

    ranks: dict[str, float]
    capacity: float

    @property
    def peak(self) -> float:
        return max(self.ranks.values())

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity

    def per_rank(self) -> str:
        """GiB per kind of rank, as the advisor prints them: ``image 17.5, language stage 0
        40.1``."""
        return ", ".join(f"{kind} {gib:.1f}" for kind, gib in self.ranks.items())


def microbatches(candidate: Candidate, workload: Workload) -> int:
    """Microbatches per step: global batch over micro-batch size x language DP."""
    return workload.global_batch // (candidate.micro * candidate.language.dp)


def _state(params: float, trained: float, shards: int, workload: Workload) -> float:
    """Bytes of ``params`` weights, and of the ``trained`` ones' gradients and optimizer state
    (sharded over ``shards`` DP ranks with the distributed optimizer)."""
    shard = shards if workload.distributed_optimizer else 1
    return (params * workload.bytes_per_param + trained * workload.grad_bytes
            + trained * workload.optimizer_bytes / shard)


def language_stage_params(candidate: Candidate, workload: Workload, stage: int
                          ) -> tuple[tuple[float, float], tuple[float, float]]:
    """One language rank's (held, trained) parameters of pipeline stage ``stage``: outside the
    routed experts, then the experts'. LoRA's adapters are counted whole on every TP rank (half
    of each is), an upper bound."""
    language = candidate.language
    work = workload.language
    shape, pp, tp = work.shape, language.pp, language.tp
    dense = (shape.params - shape.expert_params) / pp / tp
    experts = shape.expert_params / pp / (language.ep * language.etp)
    if stage == 0:
        dense += work.embedding_params / tp
    if stage == pp - 1:
        dense += (work.output_params + work.mtp_params) / tp
    dense_adapters, expert_adapters = work.adapter_params
    dense_adapters /= pp
    expert_adapters /= pp * language.ep
    return ((dense + dense_adapters, dense if work.trains else dense_adapters),
            (experts + expert_adapters, experts if work.trains else expert_adapters))


def encoder_samples(candidate: Candidate, placement: EncoderPlacement) -> int:
    """Samples one encoder replica embeds per microbatch."""
    if placement.mode == HOMOGENEOUS:
        return candidate.micro
    return candidate.micro * candidate.language.dp // placement.dp


def _encoder_activations(work: EncoderWork, samples: float, tp: int, workload: Workload) -> float:
    """Bytes one encoder replica's rank holds for the backward of one microbatch of ``samples``."""
    layers = work.shape.activation_elements(work.tokens * samples) * work.shape.layers
    rows = work.output_tokens * samples * work.output_width
    return (layers / tp + rows) * workload.bytes_per_param


def _language_stages(candidate: Candidate, workload: Workload) -> list[tuple[float, float]]:
    """Per pipeline stage: (static bytes, activation bytes of the microbatches in flight)."""
    language = candidate.language
    work = workload.language
    shape = work.shape
    pp, tp = language.pp, language.tp
    rows = work.rows(candidate.micro)
    tokens = sum(sum(row) for row in rows) / language.cp
    m = microbatches(candidate, workload)
    expt_dp = language.tp * language.cp * language.dp // (language.ep * language.etp)
    stages = []
    for stage in range(pp):
        dense, experts = language_stage_params(candidate, workload, stage)
        static = (_state(*dense, language.dp * language.cp, workload)
                  + _state(*experts, expt_dp, workload))
        layers = shape.layers / pp
        full = shape.activation_elements(tokens) / tp * workload.bytes_per_param
        if candidate.recompute:
            per_microbatch = tokens * shape.hidden / tp * workload.bytes_per_param * layers
            transient = full
        else:
            per_microbatch, transient = full * layers, 0.0
        held = min(pp - stage, m) * per_microbatch + transient
        if stage == pp - 1:
            held += tokens * work.vocab / tp * (workload.bytes_per_param + 4)
        stages.append((static, held))
    return stages


def candidate_memory(candidate: Candidate, workload: Workload, hardware: Hardware,
                     assumptions: Assumptions) -> Memory:
    """Peak bytes of each kind of rank of ``candidate``, in GiB."""
    m = microbatches(candidate, workload)
    language = candidate.language
    stages = _language_stages(candidate, workload)
    ranks: dict[str, float] = {}
    hosted_static = [0.0] * len(stages)
    hosted_held = 0.0
    hosted_recomputed = 0.0
    for placement in candidate.encoders:
        work = workload.encoder(placement.name)
        static = _state(work.params / placement.tp, work.trained_params / placement.tp, placement.dp,
                        workload)
        one = _encoder_activations(work, encoder_samples(candidate, placement), placement.tp,
                                  workload)
        if placement.mode == SEPARATE:
            ranks[placement.name] = (static + min(language.pp + 1, m) * one) / GIB
        elif placement.mode == COLOCATED:
            hosted_static = [value + static for value in hosted_static]
            if candidate.colocated_recompute:
                hosted_recomputed = max(hosted_recomputed, one)
            else:
                hosted_held += m * one
        else:
            hosted_static[0] += static + min(language.pp, m) * one
    for stage, (static, held) in enumerate(stages):
        total = static + hosted_static[stage] + max(held + hosted_held, hosted_recomputed)
        ranks[f"language stage {stage}"] = total / GIB
    capacity = hardware.gpu.memory_gib * assumptions.usable_memory - assumptions.reserved_gib
    return Memory(ranks, capacity)
