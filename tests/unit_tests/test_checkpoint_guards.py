"""Resume guards: a missing, incomplete or other-layout checkpoint is refused before any group;
an interrupted save resumes from the newest complete checkpoint, never silently from iteration 1."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_plugins.launch.checkpoint_guards import (
    check_checkpoint_flags,
    layout_record,
    write_layout,
)
from megatron_plugins.weights.megatron_folder import CheckpointError, is_complete
from megatron_plugins.parallel.layout import ModulePlacement, ParallelLayout

LAYOUT = ParallelLayout((
    ModulePlacement(name="vision", tp=1, pp=1, cp=1, dp=2, rank_offset=0, provider="vit"),
    ModulePlacement(name="language", tp=1, pp=1, cp=1, dp=1, rank_offset=2),
))
OTHER = ParallelLayout((
    ModulePlacement(name="vision", tp=1, pp=1, cp=1, dp=1, rank_offset=0, provider="vit"),
    ModulePlacement(name="language", tp=1, pp=1, cp=1, dp=2, rank_offset=1),
))


def _iteration(folder: Path, step: int, complete: bool = True) -> Path:
    """An iteration folder as stock leaves it: shards and index, then metadata.json when done."""
    iteration = folder / f"iter_{step:07d}"
    iteration.mkdir(parents=True)
    (iteration / "__0_0.distcp").write_bytes(b"shard")
    (iteration / ".metadata").write_bytes(b"metadata")
    if complete:
        (iteration / "metadata.json").write_text(
            '{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    return iteration


def _checkpoint(folder: Path, step: int = 5, layout: ParallelLayout = LAYOUT) -> Path:
    iteration = _iteration(folder, step)
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
    with pytest.raises(CheckpointError, match=r"--load .*: no checkpoint at .*latest_checkpointed"):
        check_checkpoint_flags(_args(tmp_path / "typo"), LAYOUT)
    _checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint at .*iter_0000009"):
        check_checkpoint_flags(_args(tmp_path, ckpt_step=9), LAYOUT)


def test_auto_resume_idiom_starts_fresh_only_when_nothing_was_saved(tmp_path):
    check_checkpoint_flags(_args(tmp_path / "run", save=tmp_path / "run"), LAYOUT)


def test_completeness_is_the_metadata_json_stock_writes_last(tmp_path):
    assert is_complete(_iteration(tmp_path, 1))
    assert not is_complete(_iteration(tmp_path, 2, complete=False))
    no_index = _iteration(tmp_path, 3)
    (no_index / ".metadata").unlink()
    assert not is_complete(no_index)
    torn = _iteration(tmp_path, 4)
    (torn / "metadata.json").write_text('{"sharded_')
    assert not is_complete(torn)


@pytest.mark.parametrize("save", [False, True], ids=["load-only", "auto-resume"])
def test_an_interrupted_first_save_is_refused_not_restarted(tmp_path, save):
    _iteration(tmp_path, 2, complete=False)
    write_layout(str(tmp_path), LAYOUT, rank=0)
    args = _args(tmp_path, save=tmp_path if save else None)
    with pytest.raises(CheckpointError) as error:
        check_checkpoint_flags(args, LAYOUT)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"--load {tmp_path}: no complete checkpoint to resume from")
    assert "iter_0000002 lack metadata.json" in message and "give --load/--save a new folder" in message


def test_a_later_interrupted_save_resumes_from_the_complete_one(tmp_path):
    _checkpoint(tmp_path, step=2)
    _iteration(tmp_path, 4, complete=False)
    args = _args(tmp_path, save=tmp_path)
    point = check_checkpoint_flags(args, LAYOUT)
    assert point.step == 2
    assert point.notice == (f"--load {tmp_path}: resuming from iteration 2, the newest complete "
                      "checkpoint; iter_0000004 incomplete (an interrupted save; overwritten when "
                      "training reaches it again)")


@pytest.mark.parametrize("tracker", [None, "2", "6", "garbage"])
def test_complete_checkpoints_without_a_current_tracker_resume_from_the_newest(tmp_path, tracker):
    """The issue's case: complete iterations 2 and 4, tracker gone; stock trained from 1."""
    write_layout(str(tmp_path), LAYOUT, rank=0)
    _iteration(tmp_path, 2)
    _iteration(tmp_path, 4)
    _iteration(tmp_path, 6, complete=False)
    if tracker is not None:
        (tmp_path / "latest_checkpointed_iteration.txt").write_text(tracker)
    args = _args(tmp_path, save=tmp_path)
    point = check_checkpoint_flags(args, LAYOUT)
    notice = point.notice
    assert point.step == 4
    assert notice.startswith(f"--load {tmp_path}: resuming from iteration 4")
    assert "iter_0000006 incomplete" in notice
    assert {None: "is absent", "2": "says 2: a newer save completed", "6": "names 6, which is not",
            "garbage": "is unreadable"}[tracker] in notice


def test_the_tracked_newest_checkpoint_is_stocks_choice_and_silent(tmp_path):
    _iteration(tmp_path, 2)
    _checkpoint(tmp_path, step=4)
    args = _args(tmp_path, save=tmp_path)
    point = check_checkpoint_flags(args, LAYOUT)
    assert point.notice is None
    assert point.step is None


def test_an_explicit_ckpt_step_must_be_complete(tmp_path):
    _checkpoint(tmp_path, step=2)
    _iteration(tmp_path, 4, complete=False)
    with pytest.raises(CheckpointError, match="--ckpt-step 4: .*iter_0000004 is incomplete"):
        check_checkpoint_flags(_args(tmp_path, ckpt_step=4), LAYOUT)


def test_a_launch_killed_before_its_first_save_starts_fresh_with_a_notice(tmp_path):
    write_layout(str(tmp_path), LAYOUT, rank=0)
    notice = check_checkpoint_flags(_args(tmp_path, save=tmp_path), LAYOUT).notice
    assert notice == f"--load {tmp_path}: a previous launch saved no checkpoint here yet; " \
                     "starting from iteration 1"
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        check_checkpoint_flags(_args(tmp_path), LAYOUT)


def test_an_unwritable_save_folder_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(CheckpointError, match=f"--save {blocker}/ckpt: {blocker} is not a directory"):
        check_checkpoint_flags(_args(None, save=blocker / "ckpt"), LAYOUT)
    check_checkpoint_flags(_args(None, save=tmp_path / "new" / "ckpt"), LAYOUT)


def test_another_layout_is_refused_with_both_layouts_named(tmp_path):
    _checkpoint(tmp_path, layout=OTHER)
    with pytest.raises(CheckpointError, match="resuming onto another --grid layout is not supported"):
        check_checkpoint_flags(_args(tmp_path), LAYOUT)
    check_checkpoint_flags(_args(tmp_path, weights_only=True), LAYOUT)  # weights reshard
    (tmp_path / "mimo_layout.json").unlink()
    with pytest.raises(CheckpointError, match="no mimo_layout.json"):
        check_checkpoint_flags(_args(tmp_path), LAYOUT)


def test_only_global_rank_zero_writes_the_layout(tmp_path):
    write_layout(str(tmp_path / "a"), LAYOUT, rank=1)
    assert not (tmp_path / "a").exists()
    write_layout(str(tmp_path / "a"), LAYOUT, rank=0)
    assert layout_record(LAYOUT)[0] == {"name": "vision", "provider": "vit", "tp": 1, "pp": 1,
                                        "cp": 1, "dp": 2, "ep": 1, "etp": 1}


def test_saving_a_pipelined_language_model_needs_untied_embeddings(tmp_path):
    pipelined = ParallelLayout((
        ModulePlacement(name="vision", tp=1, pp=1, cp=1, dp=1, rank_offset=0, provider="vit"),
        ModulePlacement(name="language", tp=1, pp=2, cp=1, dp=1, rank_offset=1),
    ))
    with pytest.raises(CheckpointError, match="add --untie-embeddings-and-output-weights"):
        check_checkpoint_flags(_args(None, save=tmp_path), pipelined)
    check_checkpoint_flags(_args(None, save=tmp_path, untie=True), pipelined)
    check_checkpoint_flags(_args(None), pipelined)


def test_layout_files_written_before_colocation_still_resume(tmp_path):
    """Records of modules on their own ranks did not change: old checkpoints compare equal."""
    _checkpoint(tmp_path)
    old = ('[{"name": "vision", "provider": "vit", "tp": 1, "pp": 1, "cp": 1, "dp": 2, "ep": 1, '
           '"etp": 1}, {"name": "language", "provider": null, "tp": 1, "pp": 1, "cp": 1, "dp": 1, '
           '"ep": 1, "etp": 1}]\n')
    assert (tmp_path / "mimo_layout.json").read_text() == old
    check_checkpoint_flags(_args(tmp_path), LAYOUT)


COLOCATED = ParallelLayout((
    ModulePlacement(name="vision", tp=1, pp=1, cp=1, dp=2, rank_offset=0, provider="vit",
                    host="language"),
    ModulePlacement(name="language", tp=1, pp=1, cp=1, dp=2, rank_offset=0),
))
SEPARATE = ParallelLayout((
    ModulePlacement(name="vision", tp=1, pp=1, cp=1, dp=2, rank_offset=0, provider="vit"),
    ModulePlacement(name="language", tp=1, pp=1, cp=1, dp=2, rank_offset=2),
))


@pytest.mark.parametrize("saved, resumed", [(COLOCATED, SEPARATE), (SEPARATE, COLOCATED)],
                         ids=["colocated-to-separate", "separate-to-colocated"])
def test_switching_between_colocated_and_separate_encoders_is_refused(tmp_path, saved, resumed):
    _checkpoint(tmp_path, layout=saved)
    with pytest.raises(CheckpointError) as error:
        check_checkpoint_flags(_args(tmp_path), resumed)
    message = str(error.value)
    assert "resuming onto another --grid layout is not supported" in message
    assert '"on": "language"' in message and "\n" not in message
    check_checkpoint_flags(_args(tmp_path), saved)
    check_checkpoint_flags(_args(tmp_path, weights_only=True), resumed)  # weights reshard


def test_only_hosted_modules_record_their_host():
    assert [record.get("on") for record in layout_record(COLOCATED)] == ["language", None]
    assert "on" not in layout_record(COLOCATED)[1]
