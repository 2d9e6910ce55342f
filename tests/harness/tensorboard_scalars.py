"""Read scalars that stock Megatron logged to TensorBoard, the way functional tests compare runs."""

from __future__ import annotations

from pathlib import Path

from tools.functional_tests.runner import read_metrics


def read_scalars(logdir: str | Path, tag: str) -> dict[int, float]:
    """``{iteration: value}`` for one tag across every event file under ``logdir``."""
    values = read_metrics(Path(logdir), [tag]).get(tag)
    if not values:
        raise AssertionError(f"no '{tag}' scalars under {logdir}")
    return values
