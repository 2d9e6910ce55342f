"""The advisor's answer: every candidate layout estimated, those that fit memory ranked, the
homogeneous baseline and any layout the command line gives alongside, as text.

Ranked by active tokens per second per GPU (the published metric: real language positions over
the ranks the layout uses) or, with ``--advise-objective throughput``, by tokens per second.
Candidates use every node given, the last at least in part (``--gpus`` minus a node plus one, up
to ``--gpus``); the baseline is the best homogeneous layout among them, or on fewer GPUs when
none of that size runs the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from megatron_plugins.performance.assumptions import Assumptions
from megatron_plugins.performance.candidates import HOMOGENEOUS, Candidate
from megatron_plugins.performance.cost_model import Estimate, estimate
from megatron_plugins.performance.data import DataDescription
from megatron_plugins.performance.gpus import Hardware
from megatron_plugins.performance.memory import Memory, candidate_memory
from megatron_plugins.performance.workload import Workload

__all__ = ["OBJECTIVES", "Advice", "Unfit", "advise", "describe", "format_advice"]

OBJECTIVES: dict[str, Callable[[Estimate], float]] = {
    "per-gpu": lambda e: e.tokens_per_s_per_gpu,
    "throughput": lambda e: e.tokens_per_s,
}
"""``--advise-objective`` choices: what the ranking maximizes."""


@dataclass(frozen=True)
class Unfit:
    """A candidate that does not fit memory: its memory, not priced (nothing ranks it)."""

    candidate: Candidate
    memory: Memory


@dataclass(frozen=True)
class Advice:
    """The candidates that fit and can be launched here (best first, one per set of launch
    flags), the baseline, the given layouts, and what did not fit."""

    ranked: list[Estimate]
    baseline: Estimate | None
    given: list[Estimate]
    checked: int
    fitting: int
    unfit: list[Unfit]
    hardware: Hardware
    objective: str

    def gain(self, estimate: Estimate) -> float | None:
        """``estimate``'s objective over the baseline's, less one."""
        if self.baseline is None:
            return None
        score = OBJECTIVES[self.objective]
        return score(estimate) / score(self.baseline) - 1


def advise(candidates: Iterable[Candidate], given: Sequence[Candidate], workload: Workload,
           hardware: Hardware, assumptions: Assumptions, objective: str = "per-gpu") -> Advice:
    """Estimate the ``candidates`` that fit memory (the others only sized: most of a large
    search does not fit, and pricing dominates its time), rank them, and estimate the ``given``
    layouts."""
    score = OBJECTIVES[objective]
    fits: list[Estimate] = []
    unfit: list[Unfit] = []
    checked = 0
    for candidate in candidates:
        checked += 1
        memory = candidate_memory(candidate, workload, hardware, assumptions)
        if memory.fits:
            fits.append(estimate(candidate, workload, hardware, assumptions, memory))
        else:
            unfit.append(Unfit(candidate, memory))
    fits.sort(key=score, reverse=True)
    launchable: dict[tuple[str, ...], Estimate] = {}
    for estimated in fits:
        if estimated.candidate.launchable and estimated.candidate.ranks >= hardware.fewest_gpus:
            launchable.setdefault(tuple(estimated.candidate.flags()), estimated)
    homogeneous = [e for e in fits if e.candidate.kind == HOMOGENEOUS]
    baseline = next((e for e in homogeneous if e.candidate.ranks >= hardware.fewest_gpus),
                    homogeneous[0] if homogeneous else None)
    return Advice(list(launchable.values()), baseline,
                  [estimate(c, workload, hardware, assumptions) for c in given], checked,
                  len(fits), unfit, hardware, objective)


def describe(candidate: Candidate) -> str:
    """One line naming a candidate's placement and splits."""
    language = candidate.language
    parts = []
    for placement in candidate.encoders:
        where = {"homogeneous": "in the first language stage", "colocated": "on language ranks",
                 "separate": "own ranks"}[placement.mode]
        parts.append(f"{placement.name} tp={placement.tp} dp={placement.dp} ({where})")
    ep = f" ep={language.ep}" if language.ep > 1 else ""
    parts.append(f"language tp={language.tp} pp={language.pp} cp={language.cp} "
                 f"dp={language.dp}{ep}")
    extras = [f"micro-batch {candidate.micro}"]
    if candidate.recompute:
        extras.append("full recompute")
    if candidate.colocated_recompute:
        extras.append("colocated encoder recompute")
    return f"{candidate.kind}: {' | '.join(parts)} | {', '.join(extras)}"


def _row(rank: str, estimate: Estimate, advice: Advice) -> list[str]:
    gain = advice.gain(estimate)
    versus = "" if gain is None else f", {gain:+.1%} vs baseline"
    busy = ", ".join(f"{name} {seconds:.3g} s" for name, seconds in estimate.busy.items())
    lines = [
        f"{rank} {describe(estimate.candidate)}",
        f"    {estimate.candidate.ranks} GPUs, step {estimate.step:.3g} s, "
        f"{estimate.tokens_per_s_per_gpu:,.0f} tokens/s/GPU{versus}, "
        f"{estimate.tflops_per_gpu:.0f} TFLOP/s/GPU",
        f"    memory per rank (GiB, {estimate.memory.capacity:.1f} usable): "
        f"{estimate.memory.per_rank()}",
        f"    compute per rank per step: {busy}; bubble {estimate.parts['bubble']:.3g} s, "
        f"reduction and optimizer {estimate.parts['reduction+optimizer']:.3g} s",
    ]
    flags = " ".join(estimate.candidate.flags())
    lines.append(f"    flags: {flags}" if estimate.candidate.launchable else
                 f"    (a reference: this project places an encoder in no single pipeline "
                 f"stage; launch it colocated instead, e.g. --grid ...@language)")
    return lines


def format_advice(advice: Advice, workload: Workload, data: DataDescription,
                  assumptions: Assumptions, top: int) -> str:
    """The report: hardware, model, data, assumptions, the best ``top``, baseline, given."""
    hardware, gpu = advice.hardware, advice.hardware.gpu
    lines = [f"mimo-plan --advise: {hardware.gpus} GPUs ({hardware.nodes} node(s) of "
             f"{hardware.gpus_per_node}) of {gpu.name}: {gpu.peak_tflops:g} TFLOP/s dense bf16, "
             f"{gpu.memory_gib:g} GiB, {gpu.intra_node_gbps:g} GB/s within a node, "
             f"{gpu.inter_node_gbps:g} GB/s across"]
    modules = [("language", workload.language.params, workload.language.shape)]
    modules += [(work.name, work.params, work.shape) for work in workload.encoders]
    lines.append("model: " + "; ".join(f"{name} {_count(params)} parameters ({shape.layers} "
                                      f"layers, hidden {shape.hidden})"
                                      for name, params, shape in modules)
                 + f"; global batch {workload.global_batch}")
    if workload.optimizer_offloaded:
        lines.append(f"optimizer state: {workload.optimizer_offloaded:.0%} on the CPU "
                     "(--optimizer-cpu-offload), counted off each GPU's memory; its step is "
                     "timed as on the GPU (the CPU's step and the copies are not modelled)")
    lines += data.lines()
    lines.append("assumptions:")
    lines += [f"  - {line}" for line in assumptions.lines([name for name, _, _ in modules])]
    metric = "active tokens/s per GPU" if advice.objective == "per-gpu" else "tokens/s"
    lines.append(f"checked {advice.checked} layouts of {hardware.fewest_gpus}-{hardware.gpus} "
                 f"GPUs (homogeneous ones of any size), {len(advice.unfit)} do not fit memory; "
                 f"ranked by {metric}:")
    if not advice.ranked:
        lines.append(_no_fit(advice))
    for index, estimated in enumerate(advice.ranked[:top], 1):
        lines += _row(f"{index}.", estimated, advice)
    if advice.baseline is not None:
        lines += _row("baseline", advice.baseline, advice)
    for estimated in advice.given:
        fits = "" if estimated.memory.fits else " (does NOT fit memory)"
        lines += _row(f"given{fits}", estimated, advice)
    return "\n".join(lines)


def _count(number: float) -> str:
    """``number`` with a K/M/B suffix."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if number >= scale:
            return f"{number / scale:.3g}{suffix}"
    return f"{number:.0f}"


def _no_fit(advice: Advice) -> str:
    if advice.fitting:
        return (f"of the layouts that fit memory, none is one this project launches on "
                f"{advice.hardware.fewest_gpus}-{advice.hardware.gpus} GPUs; the baseline below "
                "is a reference")
    if not advice.unfit:
        return "no layout of these GPUs runs this batch (check --global-batch-size)"
    least = min(advice.unfit, key=lambda e: e.memory.peak)
    return (f"no layout fits memory: the least any needs is {least.memory.peak:.1f} GiB on a "
            f"rank ({describe(least.candidate)}), {least.memory.capacity:.1f} GiB usable per GPU")
