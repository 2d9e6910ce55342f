"""Per-rank sums of finished steps, gathered world-wide in one small all-reduce per log interval.

Every rank adds each step it finished (:meth:`IntervalMeter.add_step`) to a row of fixed columns
(:class:`Columns`: per module of the layout its model FLOPs, tokens, items, compute and wait
seconds, then the rank's step seconds and step count); :meth:`IntervalMeter.gather` puts the
rows of all ranks into one ``[world, columns]`` matrix with a single all-reduce (each rank fills
its own row), identical on every rank, and starts the next interval. Nothing else is exchanged:
no collective per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_plugins.performance.recorder import StepRecord

__all__ = ["Columns", "IntervalMeter", "MODULE_FIELDS"]

MODULE_FIELDS = ("flops", "tokens", "items", "compute", "wait")
"""Per module: model FLOPs, tokens, items consumed; seconds computing and waiting."""


@dataclass(frozen=True)
class Columns:
    """Where each figure sits in a rank's row."""

    modules: tuple[str, ...]

    @property
    def width(self) -> int:
        return len(self.modules) * len(MODULE_FIELDS) + 2

    def of(self, module: str, what: str) -> int:
        """The column of ``what`` (one of :data:`MODULE_FIELDS`) of ``module``."""
        return self.modules.index(module) * len(MODULE_FIELDS) + MODULE_FIELDS.index(what)

    @property
    def step_seconds(self) -> int:
        return self.width - 2

    @property
    def steps(self) -> int:
        return self.width - 1


class IntervalMeter:
    """This rank's row since the last :meth:`gather` (see the module docstring)."""

    def __init__(self, modules: Sequence[str], rank: int, world_size: int,
                 device: torch.device) -> None:
        self.columns = Columns(tuple(modules))
        self._rank = rank
        self._world_size = world_size
        self._device = device
        self._row = [0.0] * self.columns.width
        self.gathers = 0
        """How many gathers this meter made (each one collective)."""

    def add_step(self, record: StepRecord) -> None:
        row, columns = self._row, self.columns
        for module in columns.modules:
            consumed = record.consumed.get(module)
            if consumed is not None:
                row[columns.of(module, "flops")] += consumed.flops
                row[columns.of(module, "tokens")] += consumed.tokens
                row[columns.of(module, "items")] += consumed.items
            row[columns.of(module, "compute")] += record.compute_seconds(module)
            row[columns.of(module, "wait")] += record.wait_seconds(module)
        row[columns.step_seconds] += record.seconds
        row[columns.steps] += 1

    @property
    def steps(self) -> int:
        """Steps this rank finished since the last gather."""
        return int(self._row[self.columns.steps])

    def gather(self) -> torch.Tensor:
        """Every rank's row since the last gather, ``[world, columns]`` float64 on the CPU; every
        rank calls it at the same point. One all-reduce."""
        matrix = torch.zeros((self._world_size, self.columns.width), dtype=torch.float64,
                             device=self._device)
        matrix[self._rank] = torch.tensor(self._row, dtype=torch.float64, device=self._device)
        dist.all_reduce(matrix)
        self.gathers += 1
        self._row = [0.0] * self.columns.width
        return matrix.cpu()
