"""``--mimo-timeline DIR``: the recorded steps' phases of every rank, as a Chrome trace and a PNG.

Each rank keeps the phases of the steps ``--mimo-timeline-steps`` names (:class:`TimelineSink`);
at the end of training they are gathered to global rank 0 (with the profile, one gather), which
writes ``DIR/timeline.json`` (Chrome trace event format, :func:`chrome_trace`: one process per
module, one thread per rank, a complete event per phase with its microbatch, stage and step;
loads in Perfetto and ``chrome://tracing``) and ``DIR/timeline.png``
(:func:`megatron_plugins.performance.picture.draw`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_plugins.parallel.layout import ParallelLayout
from megatron_plugins.performance.picture import draw, lanes
from megatron_plugins.performance.recorder import Phase, StepRecord

__all__ = ["TIMELINE_JSON", "TIMELINE_PNG", "TimelineSink", "chrome_trace", "write_timeline"]

TIMELINE_JSON = "timeline.json"
TIMELINE_PNG = "timeline.png"


class TimelineSink:
    """The phases of this rank's steps in ``steps``, tagged with their step."""

    def __init__(self, steps: range) -> None:
        self.steps = steps
        self.phases: list[tuple[int, Phase]] = []

    def add_step(self, record: StepRecord) -> None:
        if record.iteration in self.steps:
            self.phases.extend((record.iteration, phase) for phase in record.phases)


def chrome_trace(phases: Sequence[tuple[int, Phase]], layout: ParallelLayout) -> dict[str, Any]:
    """Chrome trace events (microseconds from the first phase): a process per module in layout
    order, a thread per rank named with its pipeline stage, a complete (``X``) event per phase."""
    origin = min((phase.start for _, phase in phases), default=0.0)
    pids = {module.name: index for index, module in enumerate(layout.modules)}
    events: list[dict[str, Any]] = []
    for name, pid in pids.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid,
                       "args": {"sort_index": pid}})
    for module, rank, stage in lanes(layout):
        events.append({"ph": "M", "name": "thread_name", "pid": pids[module], "tid": rank,
                       "args": {"name": f"rank {rank} (stage {stage})"}})
    for step, phase in sorted(phases, key=lambda item: item[1].start):
        args = {"step": step, "stage": phase.stage}
        if phase.microbatch is not None:
            args["microbatch"] = phase.microbatch
        events.append({"ph": "X", "name": phase.kind, "cat": phase.kind,
                       "pid": pids[phase.module], "tid": phase.rank,
                       "ts": round((phase.start - origin) * 1e6, 3),
                       "dur": round(phase.seconds * 1e6, 3), "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_timeline(folder: str | Path, phases: Sequence[tuple[int, Phase]],
                   layout: ParallelLayout, steps: range) -> tuple[Path, Path]:
    """Write the trace and the picture into ``folder``; returns their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    trace, picture = folder / TIMELINE_JSON, folder / TIMELINE_PNG
    trace.write_text(json.dumps(chrome_trace(phases, layout)) + "\n")
    title = f"steps {steps.start}-{steps.stop - 1}"
    draw([phase for _, phase in phases], layout, title).save(picture)
    return trace, picture
