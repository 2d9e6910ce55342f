"""Read scalars that stock Megatron logged to TensorBoard, the way functional tests compare runs."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def read_scalars(logdir: str | Path, tag: str) -> dict[int, float]:
    """``{iteration: value}`` for one tag across every event file under ``logdir``."""
    values: dict[int, float] = {}
    for events in sorted(Path(logdir).rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        if tag in accumulator.Tags()["scalars"]:
            values.update({event.step: event.value for event in accumulator.Scalars(tag)})
    if not values:
        raise AssertionError(f"no '{tag}' scalars under {logdir}")
    return dict(sorted(values.items()))
