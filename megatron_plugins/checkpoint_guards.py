"""Guards around stock ``--save``/``--load`` for heterogeneous runs.

Stock Megatron starts from random weights, with only a warning, when ``--load`` names a folder
without a checkpoint, and when a save was interrupted before it wrote
``latest_checkpointed_iteration.txt`` (the tracker); it then writes over the folder. On a
preemptible cluster that silently throws training away. Here, before any process group exists:

- a torch_dist iteration folder counts as complete only once it holds ``metadata.json``: stock
  ``dist_checkpointing.save`` writes it last, from global rank 0, after every rank's shards and
  the ``.metadata`` index are on disk; the tracker follows after a barrier;
- ``--load`` resumes from the newest complete iteration (the tracker's, or a newer complete one
  whose tracker update was cut off), saying so in one line when that is not simply the tracker's;
  stock load is pointed at it through ``args.ckpt_step`` in memory, so nothing is written into
  the user's folder;
- iteration folders without a complete one, or a missing folder, are refused in one line; only
  the auto-resume idiom (``--load`` equal to ``--save``) may start fresh, when no iteration was
  ever saved (stock ``--exit-on-missing-checkpoint`` then still exits);
- an explicit ``--ckpt-step`` must name a complete iteration.

The layout a checkpoint was written with is saved beside it (``mimo_layout.json``): resuming onto
another layout is refused, since per-module optimizer shards and RNG keys are laid out per grid;
the weights alone (``--no-load-optim --no-load-rng``) reshard and may load into any layout.
Saving a pipelined language model whose output layer shares the embedding is refused up front:
megatron-core 0.19.2 asks the uninitialized global ``parallel_state`` for its checkpoint replica id
(``LanguageModule.tie_embeddings_and_output_weights_state_dict``) and crashes at the first save.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_plugins.errors import UsageError
from megatron_plugins.layout import ParallelLayout

__all__ = [
    "CheckpointError", "DONE_FILE", "FolderFlags", "ResumePoint", "TRACKER_FILE",
    "check_checkpoint_flags", "is_complete", "layout_record", "resume_point", "write_layout"
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


def layout_record(layout: ParallelLayout) -> list[dict[str, Any]]:
    """What identifies a layout for resuming: every module's name, provider and split, and for a
    hosted (colocated) module the module it sits on; records of other modules do not mention it,
    so a layout written before colocation existed still compares equal."""
    return [{"name": m.name, "provider": m.provider, "tp": m.tp, "pp": m.pp, "cp": m.cp,
             "dp": m.dp, "ep": m.ep, "etp": m.etp, **({"on": m.host} if m.host else {})}
            for m in layout.modules]


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


def _tracker(load: Path) -> str | None:
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
    tracker = _tracker(load)
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


def check_checkpoint_flags(args: Any, layout: ParallelLayout) -> ResumePoint | None:
    """Before any process group: refuse an unsavable model, an unwritable ``--save`` and a
    missing, incomplete or other-layout checkpoint. With ``--load``, returns the ``--ckpt-step``
    to resume from and the one-line notice to show when resuming is not the stock choice."""
    if (args.save is not None and layout.language.pp > 1
            and not args.untie_embeddings_and_output_weights):
        raise CheckpointError(
            f"--save with {layout.language.source}: pp={layout.language.pp} and tied embeddings "
            "cannot be checkpointed on disjoint grids with megatron-core 0.19.2; add "
            "--untie-embeddings-and-output-weights (or train without --save)"
        )
    if args.save is not None:
        _check_writable(Path(args.save))
    if args.load is None:
        return None
    load = Path(args.load)
    auto_resume = args.save is not None and Path(args.save).resolve() == load.resolve()
    point = resume_point(load, getattr(args, "ckpt_step", None), auto_resume)
    if point.step is None and _tracker(load) is None:
        # Auto-resume before any save: stock starts fresh.
        return ResumePoint(getattr(args, "ckpt_step", None), point.notice)
    saved = load / LAYOUT_FILE
    if not saved.exists():
        raise CheckpointError(f"--load {args.load}: no {LAYOUT_FILE}; it was not written by a "
                          "heterogeneous MiMo run, whose per-module state this run needs")
    weights_only = getattr(args, "no_load_optim", False) and getattr(args, "no_load_rng", False)
    if json.loads(saved.read_text()) != layout_record(layout) and not weights_only:
        raise CheckpointError(
            f"--load {args.load} was saved with layout {saved.read_text().strip()}, this run has "
            f"{json.dumps(layout_record(layout))}; resuming onto another --grid layout is not "
            "supported: use the saved --grid flags, or load only the weights (--no-load-optim "
            "--no-load-rng, e.g. with --finetune)"
        )
    return point


def _check_writable(save: Path) -> None:
    """``--save`` (or the folder it would be created in) must be a writable directory."""
    existing = save
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        what = "is not a directory" if not existing.is_dir() else "is not writable"
        raise CheckpointError(f"--save {save}: {existing} {what}; give --save a folder this user "
                          "can create and write")


def write_layout(save: str | None, layout: ParallelLayout, rank: int) -> None:
    """Record the layout beside the checkpoints (global rank 0 only)."""
    if save is None or rank != 0:
        return
    folder = Path(save)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LAYOUT_FILE).write_text(json.dumps(layout_record(layout)) + "\n")
