"""Guards around stock ``--save``/``--load`` for heterogeneous runs.

Stock Megatron starts from random weights, with only a warning, when ``--load`` names a folder
without a checkpoint, and when a save was interrupted before it wrote
``latest_checkpointed_iteration.txt`` (the tracker); it then writes over the folder. On a
preemptible cluster that silently throws training away. Here, before any process group exists:

- ``--load`` resumes from the newest complete iteration
  (:func:`~megatron_plugins.weights.megatron_folder.resume_point`), saying so in one line when
  that is not simply the tracker's; stock load is pointed at it through ``args.ckpt_step`` in
  memory, so nothing is written into the user's folder;
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
from pathlib import Path
from typing import Any

from megatron_plugins.parallel.layout import ParallelLayout, layout_record
from megatron_plugins.weights.megatron_folder import (
    LAYOUT_FILE,
    CheckpointError,
    ResumePoint,
    resume_point,
    read_tracker,
)

__all__ = ["check_checkpoint_flags", "layout_record", "write_layout"]


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
    if point.step is None and read_tracker(load) is None:
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
