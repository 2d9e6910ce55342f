"""Megatron checkpoint folders on disk, as stock ``--save`` writes them and this project reads them.

A torch_dist iteration folder counts as complete only once it holds ``metadata.json``: stock
``dist_checkpointing.save`` writes it last, from global rank 0, after every rank's shards and the
``.metadata`` index are on disk; ``latest_checkpointed_iteration.txt`` (the tracker) follows after
a barrier. :func:`resume_point` chooses the newest complete iteration of a folder (the tracker's,
or a newer complete one whose tracker update was cut off) and says so when that is not simply the
tracker's; the launch's ``--load``, ``--language-megatron-checkpoint`` and ``tools/export_hf.py``
read folders through it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_plugins.errors import UsageError

__all__ = [
    "CheckpointError", "DONE_FILE", "FolderFlags", "LAYOUT_FILE", "ResumePoint", "TRACKER_FILE",
    "is_complete", "read_tracker", "resume_point"
]

LAYOUT_FILE = "mimo_layout.json"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
DONE_FILE = "metadata.json"
"""Written last by a torch_dist save (``dist_checkpointing.core.save_config``)."""
_ITERATION = re.compile(r"iter_(\d{7})")


class CheckpointError(UsageError):
    """A --load / --save setting that would lose or corrupt training; one line names the folder."""


FRESH = "to start fresh on purpose, give --load/--save a new folder (or remove this one)"


@dataclass(frozen=True)
class FolderFlags:
    """How a caller of :func:`resume_point` spells its folder and step flags in the one-line
    errors, and what it suggests for a folder without a checkpoint (``empty``) or without a
    complete one (``broken``); the defaults are training's ``--load``."""

    folder: str = "--load"
    step: str = "--ckpt-step"
    empty: str = ("point --load at a checkpoint folder (or give --load and --save the same folder "
                  "to start fresh and resume later)")
    broken: str = FRESH


def is_complete(iteration: Path) -> bool:
    """Whether a torch_dist iteration folder holds a finished save (see the module docstring)."""
    try:
        config = json.loads((iteration / DONE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "sharded_backend" in config and (
        iteration / ".metadata").is_file()


def _iterations(load: Path) -> dict[int, bool]:
    """Every ``iter_NNNNNNN`` folder in ``load``: iteration -> complete."""
    if not load.is_dir():
        return {}
    found = {}
    for child in load.iterdir():
        match = _ITERATION.fullmatch(child.name)
        if match and child.is_dir():
            found[int(match.group(1))] = is_complete(child)
    return found


@dataclass(frozen=True)
class ResumePoint:
    """What ``--load`` resumes from: ``step`` None means stock's own choice (the tracker's
    iteration or release, or a fresh start); ``notice`` is the line to show, if any."""

    step: int | None
    notice: str | None = None


def read_tracker(load: Path) -> str | None:
    try:
        return (load / TRACKER_FILE).read_text().strip()
    except OSError:
        return None


def resume_point(load: Path, ckpt_step: int | None, auto_resume: bool,
                 flags: FolderFlags = FolderFlags()) -> ResumePoint:
    """Choose the iteration ``--load`` resumes from, or raise :class:`CheckpointError` in one line
    naming ``flags``."""
    iterations = _iterations(load)
    given = f"{flags.folder} {load}"
    if ckpt_step:
        folder = load / f"iter_{ckpt_step:07d}"
        if ckpt_step not in iterations:
            raise CheckpointError(f"{given} {flags.step} {ckpt_step}: no checkpoint at {folder}")
        if not iterations[ckpt_step]:
            raise CheckpointError(f"{given} {flags.step} {ckpt_step}: {folder} is incomplete "
                              f"(no {DONE_FILE}: an interrupted save); pick another {flags.step}")
        return ResumePoint(ckpt_step)
    tracker = read_tracker(load)
    if tracker == "release":
        if not is_complete(load / "release"):
            raise CheckpointError(f"{given}: {TRACKER_FILE} names release, but {load}/release "
                              f"is not a complete checkpoint (no {DONE_FILE})")
        return ResumePoint(None)
    tracked = int(tracker) if tracker is not None and tracker.isdigit() else None
    complete = sorted(step for step, done in iterations.items() if done)
    if not complete:
        if iterations:
            raise CheckpointError(
                f"{given}: no complete checkpoint to resume from ({_names(iterations)} "
                f"lack {DONE_FILE}: an interrupted save; {TRACKER_FILE} is "
                f"{'absent' if tracker is None else 'stale'}); {flags.broken}")
        if tracker is not None:
            raise CheckpointError(f"{given}: {TRACKER_FILE} names iteration {tracker}, which is "
                              f"not in {load}; {flags.broken}")
        if auto_resume:
            earlier = (load / LAYOUT_FILE).exists()
            return ResumePoint(None, f"{given}: a previous launch saved no checkpoint here "
                                     "yet; starting from iteration 1" if earlier else None)
        raise CheckpointError(f"{given}: no checkpoint at {load / TRACKER_FILE}; {flags.empty}")
    newest = complete[-1]
    newer = [step for step in iterations if step > newest]
    reasons = [f"{_names(newer)} incomplete (an interrupted save; overwritten when training "
               "reaches it again)"] if newer else []
    if tracked is None:
        reasons.append(f"{TRACKER_FILE} is {'absent' if tracker is None else 'unreadable'}")
    elif tracked not in complete:
        reasons.append(f"{TRACKER_FILE} names {tracked}, which is not a complete checkpoint")
    elif tracked != newest:
        reasons.append(f"{TRACKER_FILE} says {tracked}: a newer save completed before the "
                       "tracker was updated")
    if not reasons:
        return ResumePoint(None)
    return ResumePoint(newest, f"{given}: resuming from iteration {newest}, the newest "
                               f"complete checkpoint; {'; '.join(reasons)}")


def _names(steps: Any) -> str:
    return ", ".join(f"iter_{step:07d}" for step in sorted(steps))
