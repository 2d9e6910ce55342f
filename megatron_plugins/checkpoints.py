"""Guards around stock ``--save``/``--load`` for heterogeneous runs.

Stock Megatron starts from random weights, with only a warning, when ``--load`` names a folder
without a checkpoint; on a cluster that silently throws training away. Here a missing or
unreadable checkpoint is an error naming the flag, except the auto-resume idiom
(``--load`` equal to ``--save``, whose first launch has nothing to load yet). The layout a
checkpoint was written with is saved beside it (``mimo_layout.json``): resuming onto another
layout is refused, since per-module optimizer shards and RNG keys are laid out per grid; the
weights alone (``--no-load-optim --no-load-rng``) reshard and may load into any layout.
Saving a pipelined language model whose output layer shares the embedding is refused up front:
megatron-core 0.19.2 asks the uninitialized global ``parallel_state`` for its checkpoint replica id
(``LanguageModule.tie_embeddings_and_output_weights_state_dict``) and crashes at the first save.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_plugins.layout import LayoutError, ParallelLayout

LAYOUT_FILE = "mimo_layout.json"
TRACKER_FILE = "latest_checkpointed_iteration.txt"


def layout_record(layout: ParallelLayout) -> list[dict[str, Any]]:
    """What identifies a layout for resuming: every module's name, provider and split."""
    return [{"name": m.name, "provider": m.provider, "tp": m.tp, "pp": m.pp, "cp": m.cp,
             "dp": m.dp, "ep": m.ep, "etp": m.etp} for m in layout.modules]


def _iteration_dir(load: Path, step: int | None) -> Path | None:
    if step is None:
        tracker = load / TRACKER_FILE
        if not tracker.exists():
            return None
        text = tracker.read_text().strip()
        if text == "release":
            return load / "release"
        step = int(text)
    return load / f"iter_{step:07d}"


def check_checkpoint_flags(args: Any, layout: ParallelLayout) -> None:
    """Before any process group: refuse an unsavable model and a missing, unreadable or
    other-layout checkpoint."""
    if (args.save is not None and layout.language.pp > 1
            and not args.untie_embeddings_and_output_weights):
        raise LayoutError(
            f"--save with {layout.language.source}: pp={layout.language.pp} and tied embeddings "
            "cannot be checkpointed on disjoint grids with megatron-core 0.19.2; add "
            "--untie-embeddings-and-output-weights (or train without --save)"
        )
    if args.load is None:
        return
    load = Path(args.load)
    auto_resume = args.save is not None and Path(args.save).resolve() == load.resolve()
    iteration = _iteration_dir(load, getattr(args, "ckpt_step", None))
    if iteration is None or not iteration.is_dir():
        if auto_resume and iteration is None:
            return
        where = iteration if iteration is not None else load / TRACKER_FILE
        raise LayoutError(
            f"--load {args.load}: no checkpoint at {where}; point --load at a checkpoint folder "
            "(or give --load and --save the same folder to start fresh and resume later)"
        )
    if not (iteration / ".metadata").is_file():
        raise LayoutError(
            f"--load {args.load}: {iteration} is not a readable distributed checkpoint (no "
            ".metadata: an interrupted or corrupted save); pick another --ckpt-step"
        )
    saved = load / LAYOUT_FILE
    if not saved.exists():
        raise LayoutError(f"--load {args.load}: no {LAYOUT_FILE}; it was not written by a "
                          "heterogeneous MiMo run, whose per-module state this run needs")
    weights_only = getattr(args, "no_load_optim", False) and getattr(args, "no_load_rng", False)
    if json.loads(saved.read_text()) != layout_record(layout) and not weights_only:
        raise LayoutError(
            f"--load {args.load} was saved with layout {saved.read_text().strip()}, this run has "
            f"{json.dumps(layout_record(layout))}; resuming onto another --grid layout is not "
            "supported: use the saved --grid flags, or load only the weights (--no-load-optim "
            "--no-load-rng, e.g. with --finetune)"
        )


def write_layout(save: str | None, layout: ParallelLayout, rank: int) -> None:
    """Record the layout beside the checkpoints (global rank 0 only)."""
    if save is None or rank != 0:
        return
    folder = Path(save)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LAYOUT_FILE).write_text(json.dumps(layout_record(layout)) + "\n")
