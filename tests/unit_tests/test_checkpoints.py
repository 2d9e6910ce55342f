"""Resume guards: a missing, unreadable or other-layout checkpoint is refused before any group."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_plugins.checkpoints import check_checkpoint_flags, layout_record, write_layout
from megatron_plugins.layout import LayoutError, ModuleGrid, ParallelLayout

LAYOUT = ParallelLayout((
    ModuleGrid(name="vision", tp=1, pp=1, cp=1, dp=2, rank_offset=0, provider="vit"),
    ModuleGrid(name="language", tp=1, pp=1, cp=1, dp=1, rank_offset=2),
))
OTHER = ParallelLayout((
    ModuleGrid(name="vision", tp=1, pp=1, cp=1, dp=1, rank_offset=0, provider="vit"),
    ModuleGrid(name="language", tp=1, pp=1, cp=1, dp=2, rank_offset=1),
))


def _checkpoint(folder: Path, step: int = 5, layout: ParallelLayout = LAYOUT) -> Path:
    iteration = folder / f"iter_{step:07d}"
    iteration.mkdir(parents=True)
    (iteration / ".metadata").write_bytes(b"metadata")
    (folder / "latest_checkpointed_iteration.txt").write_text(str(step))
    write_layout(str(folder), layout, rank=0)
    return iteration


def _args(load, save=None, ckpt_step=None, untie=False, weights_only=False):
    return SimpleNamespace(load=None if load is None else str(load),
                           save=None if save is None else str(save), ckpt_step=ckpt_step,
                           untie_embeddings_and_output_weights=untie,
                           no_load_optim=weights_only, no_load_rng=weights_only)


def test_a_good_checkpoint_of_the_same_layout_passes(tmp_path):
    _checkpoint(tmp_path)
    check_checkpoint_flags(_args(tmp_path), LAYOUT)
    check_checkpoint_flags(_args(tmp_path, ckpt_step=5), LAYOUT)
    check_checkpoint_flags(_args(None), LAYOUT)


def test_missing_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    with pytest.raises(LayoutError, match=r"--load .*: no checkpoint at .*latest_checkpointed"):
        check_checkpoint_flags(_args(tmp_path / "typo"), LAYOUT)
    _checkpoint(tmp_path)
    with pytest.raises(LayoutError, match="no checkpoint at .*iter_0000009"):
        check_checkpoint_flags(_args(tmp_path, ckpt_step=9), LAYOUT)


def test_auto_resume_idiom_starts_fresh_only_when_nothing_was_saved(tmp_path):
    check_checkpoint_flags(_args(tmp_path / "run", save=tmp_path / "run"), LAYOUT)


def test_an_interrupted_save_is_refused(tmp_path):
    iteration = _checkpoint(tmp_path)
    (iteration / ".metadata").unlink()
    with pytest.raises(LayoutError, match="not a readable distributed checkpoint"):
        check_checkpoint_flags(_args(tmp_path), LAYOUT)


def test_another_layout_is_refused_with_both_layouts_named(tmp_path):
    _checkpoint(tmp_path, layout=OTHER)
    with pytest.raises(LayoutError, match="resuming onto another --grid layout is not supported"):
        check_checkpoint_flags(_args(tmp_path), LAYOUT)
    check_checkpoint_flags(_args(tmp_path, weights_only=True), LAYOUT)  # weights reshard
    (tmp_path / "mimo_layout.json").unlink()
    with pytest.raises(LayoutError, match="no mimo_layout.json"):
        check_checkpoint_flags(_args(tmp_path), LAYOUT)


def test_only_global_rank_zero_writes_the_layout(tmp_path):
    write_layout(str(tmp_path / "a"), LAYOUT, rank=1)
    assert not (tmp_path / "a").exists()
    write_layout(str(tmp_path / "a"), LAYOUT, rank=0)
    assert layout_record(LAYOUT)[0] == {"name": "vision", "provider": "vit", "tp": 1, "pp": 1,
                                        "cp": 1, "dp": 2, "ep": 1, "etp": 1}


def test_saving_a_pipelined_language_model_needs_untied_embeddings(tmp_path):
    pipelined = ParallelLayout((
        ModuleGrid(name="vision", tp=1, pp=1, cp=1, dp=1, rank_offset=0, provider="vit"),
        ModuleGrid(name="language", tp=1, pp=2, cp=1, dp=1, rank_offset=1),
    ))
    with pytest.raises(LayoutError, match="add --untie-embeddings-and-output-weights"):
        check_checkpoint_flags(_args(None, save=tmp_path), pipelined)
    check_checkpoint_flags(_args(None, save=tmp_path, untie=True), pipelined)
    check_checkpoint_flags(_args(None), pipelined)
