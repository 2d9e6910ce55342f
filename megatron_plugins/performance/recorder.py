"""The per-process phase recorder: one mechanism behind the log's busy shares, the timeline and
the profile.

A phase is (rank, module, kind, microbatch, stage, start, end) (:class:`Phase`). The recorder
keeps those of the training step in progress (from :meth:`Recorder.begin_step` to
:meth:`Recorder.end_step`, which the probe around stock ``train_step`` calls), with what each
module consumed in it (:class:`Consumed`, counted by :class:`~.batches.BatchCounter`), and hands
each finished step (:class:`StepRecord`) to its sinks: the interval meter, the profile, the
timeline. Outside a training step (evaluation) nothing is recorded. On a real GPU every phase
boundary synchronizes the device first, so a phase holds its kernels, not their launches.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ContextManager, Protocol

from megatron_plugins.step.phases import COMPUTE_KINDS, STEP, WAIT_KINDS

__all__ = ["Consumed", "Phase", "Recorder", "StepRecord", "StepSink"]


@dataclass(frozen=True)
class Phase:
    """One timed phase of one rank; ``start`` and ``end`` are wall-clock seconds."""

    rank: int
    module: str
    kind: str
    microbatch: int | None
    stage: int
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Consumed:
    """What one module consumed on this rank in a step (its witness rank counts for its
    replica; other ranks add nothing): model FLOPs, tokens, items (encoders)."""

    flops: float = 0.0
    tokens: float = 0.0
    items: float = 0.0

    def add(self, other: Consumed) -> None:
        self.flops += other.flops
        self.tokens += other.tokens
        self.items += other.items


@dataclass
class StepRecord:
    """One finished training step of this rank (``iteration`` as stock logs it, from 1)."""

    iteration: int
    phases: list[Phase]
    consumed: dict[str, Consumed] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        """The step's own duration on this rank."""
        return sum(p.seconds for p in self.phases if p.kind == STEP)

    def compute_seconds(self, module: str) -> float:
        """Time ``module`` computed on this rank (forward and backward phases)."""
        return sum(p.seconds for p in self.phases if p.module == module
                   and p.kind in COMPUTE_KINDS)

    def wait_seconds(self, module: str) -> float:
        """Time ``module`` waited on this rank for another grid or stage."""
        return sum(p.seconds for p in self.phases if p.module == module and p.kind in WAIT_KINDS)


class StepSink(Protocol):
    """What receives each finished step."""

    def add_step(self, record: StepRecord) -> None: ...


class Recorder:
    """Times the phases of this rank's training steps (see the module docstring).

    ``stages``: the pipeline stage of each module this rank runs; ``schedule_module``: the one
    the stock schedule runs here (the language model on a rank hosting encoders), which a phase
    marked without a module belongs to. ``count`` turns a consumed batch into a
    :class:`Consumed`; ``synchronize`` waits for the device (None: nothing to wait for).
    """

    def __init__(self, rank: int, stages: Mapping[str, int], schedule_module: str,
                 count: Callable[[str, Mapping[str, Any]], Consumed],
                 synchronize: Callable[[], None] | None = None,
                 sinks: Sequence[StepSink] = ()) -> None:
        self.rank = rank
        self.stages = dict(stages)
        self.schedule_module = schedule_module
        self.sinks = list(sinks)
        self._count = count
        self._synchronize = synchronize
        # perf_counter is monotonic; the offset puts it on the wall clock other ranks share.
        self._wall_offset = time.time() - time.perf_counter()
        self._step: StepRecord | None = None
        self._step_start = 0.0
        self.last_iteration: int | None = None

    def _now(self) -> float:
        if self._synchronize is not None:
            self._synchronize()
        return time.perf_counter() + self._wall_offset

    @property
    def in_step(self) -> bool:
        return self._step is not None

    def begin_step(self, iteration: int) -> None:
        """A training step starts (``iteration``: its number as stock logs it)."""
        self._step = StepRecord(iteration, [])
        self._step_start = self._now()

    def end_step(self) -> StepRecord | None:
        """The step ends: its record goes to every sink, and is returned."""
        record, self._step = self._step, None
        if record is None:
            return None
        record.phases.append(self._phase(STEP, None, None, self._step_start, self._now()))
        self.last_iteration = record.iteration
        for sink in self.sinks:
            sink.add_step(record)
        return record

    def _phase(self, kind: str, module: str | None, microbatch: int | None, start: float,
               end: float) -> Phase:
        module = module or self.schedule_module
        return Phase(self.rank, module, kind, microbatch, self.stages.get(module, 0), start, end)

    def span(self, kind: str, module: str | None = None,
             microbatch: int | None = None) -> ContextManager:
        """Time the block as one phase (nothing outside a training step)."""
        if self._step is None:
            return contextlib.nullcontext()
        return self._timed(kind, module, microbatch)

    @contextlib.contextmanager
    def _timed(self, kind: str, module: str | None, microbatch: int | None) -> Iterator[None]:
        step = self._step
        start = self._now()
        try:
            yield
        finally:
            step.phases.append(self._phase(kind, module, microbatch, start, self._now()))

    def consumed(self, module: str | None, batch: Mapping[str, Any]) -> None:
        """Count a microbatch ``module`` (None: the schedule's module) ran its forward over."""
        if self._step is None:
            return
        module = module or self.schedule_module
        self._step.consumed.setdefault(module, Consumed()).add(self._count(module, batch))
