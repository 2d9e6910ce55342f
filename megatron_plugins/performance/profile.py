"""``--mimo-profile FILE``: what one run measured per module, for the advisor to calibrate from.

Each rank keeps, per training step after the first :data:`WARM_UP` (:class:`ProfileSink`), its
step seconds and per module its compute and wait seconds and what it consumed; at the end of
training global rank 0 gathers them (with the timeline, one gather) and writes (version 1,
docs/performance.md "The profile file")::

    {"version": 1, "device": "cpu-simulation" | "<CUDA device name>", "peak_tflops": float|null,
     "layout": <launch.checkpoint_guards.layout_record>, "command": [argv...],
     "steps": int, "step_s": float,
     "modules": {"<name>": {"ranks": [...], "flops_per_step": float, "compute_s_per_step": float,
                            "compute_s_per_rank": [...], "wait_s_per_step": float,
                            "tokens_per_step": float, "items_per_step": float | null}}}

``step_s`` is the median over steps of the slowest rank's step; ``compute_s_per_step`` the median
over steps of the mean over the module's ranks, ``compute_s_per_rank`` each rank's median,
``wait_s_per_step`` as ``compute_s_per_step`` for waits; ``flops_per_step`` (model FLOPs of the
whole module, all replicas), ``tokens_per_step`` and ``items_per_step`` (encoders; null for the
language model) are means over steps, since batches differ.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_plugins.parallel.layout import LANGUAGE, ParallelLayout
from megatron_plugins.performance.recorder import StepRecord

__all__ = ["PROFILE_VERSION", "ProfileSink", "StepTimes", "WARM_UP", "profile", "write_profile"]

PROFILE_VERSION = 1
WARM_UP = 2
"""Steps of a run the profile leaves out (first-step allocations, lazy initialization)."""


@dataclass(frozen=True)
class StepTimes:
    """One rank's measured step: its seconds, and per module it runs (compute, wait) seconds and
    (FLOPs, tokens, items) consumed."""

    rank: int
    seconds: float
    times: dict[str, tuple[float, float]]
    consumed: dict[str, tuple[float, float, float]] = field(default_factory=dict)


class ProfileSink:
    """This rank's measured steps (the first :data:`WARM_UP` of the run left out)."""

    def __init__(self, rank: int, modules: Sequence[str]) -> None:
        self.rank = rank
        self.modules = tuple(modules)
        self.seen = 0
        self.steps: list[StepTimes] = []

    def add_step(self, record: StepRecord) -> None:
        self.seen += 1
        if self.seen <= WARM_UP:
            return
        self.steps.append(StepTimes(
            self.rank, record.seconds,
            {m: (record.compute_seconds(m), record.wait_seconds(m)) for m in self.modules},
            {m: (c.flops, c.tokens, c.items) for m, c in record.consumed.items()}))


def profile(per_rank: Sequence[Sequence[StepTimes]], layout: ParallelLayout,
            header: Mapping[str, Any]) -> dict[str, Any]:
    """The profile from every rank's measured steps (index = rank) and the ``header`` fields
    (device, peak_tflops, layout, command)."""
    steps = min((len(times) for times in per_rank), default=0)
    by_step = [[per_rank[rank][step] for rank in range(len(per_rank))] for step in range(steps)]
    modules = {}
    for module in layout.modules:
        name, ranks = module.name, list(module.ranks)

        def mean_over_ranks(step: Sequence[StepTimes], what: int) -> float:
            return statistics.fmean(step[rank].times[name][what] for rank in ranks)

        def per_step_sum(what: int) -> float:
            totals = [sum(times.consumed.get(name, (0.0, 0.0, 0.0))[what] for times in step)
                      for step in by_step]
            return statistics.fmean(totals) if totals else 0.0

        modules[name] = {
            "ranks": ranks,
            "flops_per_step": per_step_sum(0),
            "compute_s_per_step": _median([mean_over_ranks(step, 0) for step in by_step]),
            "compute_s_per_rank": [_median([per_rank[rank][s].times[name][0]
                                            for s in range(steps)]) for rank in ranks],
            "wait_s_per_step": _median([mean_over_ranks(step, 1) for step in by_step]),
            "tokens_per_step": per_step_sum(1),
            "items_per_step": None if name == LANGUAGE else per_step_sum(2),
        }
    return {"version": PROFILE_VERSION, **header, "steps": steps,
            "step_s": _median([max(times.seconds for times in step) for step in by_step]),
            "modules": modules}


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def write_profile(path: str | Path, content: Mapping[str, Any]) -> Path:
    """Write the profile as indented JSON; returns its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, indent=2) + "\n")
    return path
