"""``--hf-model DIR`` with a whole Qwen2.5-VL folder: its vision tower (windowed + full
attention blocks) on the encoder grid, its merger as the encoder's projection, its mrope language
model on the language grid give transformers' logits on a sample of several images of different
sizes at one rank per module and at encoder TP 2 + language PP 2; every tensor streams back
unchanged; a trained run exports one folder transformers loads, the same bytes from two saving
layouts; the CPU-simulation recipe trains the folder from transformers' first loss; a merger that
does not meet the language model is one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatron_plugins.media.codec import Video
from tests.harness.multiprocess import REPO_ROOT
from tests.models.hf import rel_diff, safetensors_of
from tests.models.hf_vlm import LAYOUTS, check_export, identical_exports, train_and_export
from tests.models.qwen_vlm import (
    IMAGE_TOKEN,
    VOCAB,
    WRAPPING,
    forward,
    forward_diff,
    hf_logits,
    images,
    sample,
    save_tiny_qwen_vl,
    video_sample,
)

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = save_tiny_qwen_vl(tmp_path_factory.mktemp("qwen_vlm") / "qwen")
    pictures = images()
    ids = sample(folder, pictures)
    return folder, ids, pictures, hf_logits(folder, ids, pictures)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("grids, nproc", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.multirank
def test_whole_qwen2_5_vl_reproduces_transformers_logits_on_three_images_and_streams_back(
        qwen, grids, nproc):
    folder, ids, pictures, want = qwen
    assert len({int(n) for n in (ids == IMAGE_TOKEN).sum(1)}) == 1 and want.shape[1] > 30
    assert forward_diff(folder, grids, nproc, ids, pictures, want) < TOLERANCE


@pytest.fixture(scope="module")
def video(qwen):
    """A 5-frame video at 3 fps, then an image, with text; transformers' logits on it."""
    folder = qwen[0]
    rng = np.random.default_rng(7)
    items = [Video(rng.integers(0, 256, (5, 20, 28, 3), np.uint8), 3.0), images()[0]]
    ids = video_sample(folder, items)
    return ids, items, hf_logits(folder, ids, items)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("grids, nproc", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.multirank
def test_whole_qwen2_5_vl_reproduces_transformers_logits_on_a_video_an_image_and_text(
        qwen, video, grids, nproc):
    """A 5-frame video at 3 fps (three temporal steps, the last frame repeated; time positions
    2 2/3 apart) then an image: our video item of the image encoder, marked with the image
    token, gives the logits transformers gives with ``<|video_pad|>``, ``video_grid_thw`` and
    ``second_per_grid_ts``."""
    ids, items, want = video
    results = forward(nproc, qwen[0], grids, ids, items)
    [logits] = [r["logits"] for r in results if r["logits"] is not None]
    assert int((ids == IMAGE_TOKEN).sum()) == 3 * 8 + 15  # 16x32-pixel frames, 2x4 merged
    assert rel_diff(logits[..., :VOCAB], want) < TOLERANCE


@pytest.fixture(scope="module")
def exported(qwen, tmp_path_factory):
    """The folder trained, saved from two layouts and exported (:func:`train_and_export`)."""
    folder = qwen[0]
    root = tmp_path_factory.mktemp("qwen_export")
    return root, folder, train_and_export(folder, root)


@pytest.mark.timeout(600)
@pytest.mark.multirank
def test_two_saving_layouts_export_one_identical_qwen2_5_vl_folder(exported):
    # the processor's and generation files are carried from the source folder
    assert identical_exports(exported[0]) == ["config.json", "generation_config.json",
                                              "model.safetensors", "preprocessor_config.json"]


@pytest.mark.timeout(600)
@pytest.mark.multirank
def test_exported_folder_loads_as_qwen2_5_vl_with_the_trained_tensors(exported):
    import transformers

    root, folder, pieces = exported
    out = root / "out_first"
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        out, dtype=torch.float32)
    written, original = check_export(out, folder, pieces, ()), safetensors_of(folder)
    for name in ("visual.merger.mlp.0.weight", "visual.merger.ln_q.weight",
                 "visual.blocks.0.attn.qkv.weight", "model.layers.1.mlp.up_proj.weight",
                 "lm_head.weight"):
        assert not torch.equal(written[name], original[name]), name  # it trained
    loaded = {n: p.detach() for n, p in model.state_dict().items()}
    assert torch.equal(loaded["lm_head.weight"], written["lm_head.weight"])
    assert torch.equal(loaded["model.visual.merger.mlp.2.bias"],
                       written["visual.merger.mlp.2.bias"])
    assert torch.equal(loaded["model.language_model.layers.0.self_attn.q_proj.bias"],
                       written["model.layers.0.self_attn.q_proj.bias"])


def test_a_merger_that_does_not_meet_the_language_model_is_one_line(qwen, tmp_path,
                                                                     monkeypatch):
    from megatron_plugins.weights.vlm_families import HF_MODEL_FLAG
    from tests.models.hf_vlm import bad_input, edited, vlm_flags

    folder = qwen[0]
    text = json.loads((folder / "config.json").read_text())["text_config"]
    other = edited(folder, tmp_path / "other", config={
        "text_config": {**text, "hidden_size": 32, "head_dim": 12}})
    assert bad_input(vlm_flags(other, ("image:dp=1", "language:dp=1")), monkeypatch) == (
        f"{HF_MODEL_FLAG} {other}: projector visual.merger.mlp.2.weight output size 24 does not "
        "meet the language model's hidden size (text_config), 32; the tower and language model "
        "are not this projector's pair")


def test_the_folder_splits_into_tower_merger_and_language_parts(qwen):
    """The tower family includes the merger's MLP; the whole folder splits it off as the
    projector (ln_q stays the tower's), and every tensor belongs to exactly one part."""
    from megatron_plugins.weights.vision_families import QWEN2_5_VL_VISION
    from megatron_plugins.weights.vlm_families import QWEN2_5_VL, part_families

    folder = qwen[0]
    config = json.loads((folder / "config.json").read_text())
    names = set(safetensors_of(folder))
    parts = part_families(QWEN2_5_VL, config, QWEN2_5_VL_VISION, names)
    assert parts.tower.bind("ln_q.weight").hf == ("visual.merger.ln_q.weight",)
    assert parts.projector.bind("0.encoder.linear_fc2.weight").hf == (
        "visual.merger.mlp.2.weight",)
    assert parts.language.bind("output_layer.weight").hf == ("lm_head.weight",)
    for name in names:
        assert sum(not part.is_unused(name) for part in parts.__dict__.values()) == 1, name


def test_the_mock_marks_images_with_the_checkpoints_token_and_keeps_text_off_it(qwen):
    from megatron_plugins.data.mock import MockSource
    from tests.models.hf_vision import plugin

    encoder = plugin("qwen2_5_vl", qwen[0])
    source = MockSource(seed=1, seq_length=64, vocab_size=VOCAB, plugins={"image": encoder},
                        items_per_sample=(0, 3), placeholder_ids={"image": IMAGE_TOKEN})
    assert source.special_token_ids == {"image": IMAGE_TOKEN}
    for index in range(20):
        sample = source.text("train", index)
        tokens = sample["tokens"][:int(sample["length"])]
        runs = int((tokens == IMAGE_TOKEN).sum())
        assert runs == sum(source.item_tokens("train", index)["image"])
        assert int(tokens[tokens != IMAGE_TOKEN].max()) < IMAGE_TOKEN


def test_the_checkpoints_vision_start_and_end_wrap_every_mock_run(qwen, tmp_path):
    """config.json's vision_start / vision_end ids, where the vocabulary holds them, go around
    each item's run in the mock (as Qwen's processor puts them), outside the loss."""
    import argparse

    from megatron_plugins.data.mock import MockSource
    from megatron_plugins.weights.flags import checkpoint_item_wrapping
    from tests.models.hf_vision import plugin

    def wrapping(folder):
        return checkpoint_item_wrapping(argparse.Namespace(
            hf_model=str(folder), encoder_hf_weights={"image": str(folder)}))

    assert wrapping(qwen[0]) == {"image": WRAPPING}
    config = json.loads((qwen[0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        {**config, "vision_start_token_id": 151652, "vision_end_token_id": 151653}))
    assert wrapping(tmp_path) == {}  # transformers' default ids, outside the tiny vocabulary
    source = MockSource(seed=1, seq_length=96, vocab_size=VOCAB,
                        plugins={"image": plugin("qwen2_5_vl", qwen[0])}, items_per_sample=(1, 3),
                        placeholder_ids={"image": IMAGE_TOKEN}, wrapping=wrapping(qwen[0]))
    start, end = WRAPPING
    for index in range(10):
        sample = source.text("train", index)
        tokens = sample["tokens"][:int(sample["length"])].tolist()
        wrapped = []
        for position, token in enumerate(tokens):
            if token == start:
                run = tokens[position + 1:tokens.index(end, position)]
                assert set(run) == {IMAGE_TOKEN}
                wrapped.append(len(run))
        counts = source.item_tokens("train", index)["image"]
        assert wrapped == list(counts) and tokens.count(end) == len(counts)
        assert not sample["loss_mask"][sample["labels"] >= IMAGE_TOKEN].any()


RECIPE = REPO_ROOT / "examples" / "mimo" / "recipes" / "qwen2_5_vl" / "cpu_simulation.sh"


@pytest.mark.timeout(600)
@pytest.mark.multirank
def test_cpu_simulation_recipe_trains_the_whole_folder_from_transformers_first_loss(
        qwen, tmp_path):
    """The recipe script trains the tiny folder whole (0 to 3 mock items a sample, images of
    native sizes and, with --mock-video-frames 3, videos; each run between the folder's vision
    start / end ids); its loss falls, and step 1's loss (weights still the folder's) is
    transformers' on the same first global batch, which the deterministic mock source
    regenerates here."""
    import os
    import subprocess

    from megatron_plugins.data.mock import MockSource
    from tests.harness.tensorboard_scalars import read_scalars
    from tests.models.hf_vision import plugin
    from tests.models.qwen_vlm import hf_first_batch_loss

    folder = qwen[0]
    result = subprocess.run(["bash", str(RECIPE), str(folder), "--mock-video-frames", "3",
                             "--seq-length", "160"], cwd=REPO_ROOT, text=True,
                            env={**os.environ, "MIMO_RUN_DIR": str(tmp_path)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=400)
    assert result.returncode == 0, result.stdout[-4000:]
    losses = read_scalars(tmp_path / "tensorboard", "lm loss")
    assert sorted(losses) == list(range(1, 9))
    assert losses[8] < losses[1] - 0.2, losses
    # The run's first global batch: 4 samples of seq-length 160, 0:3 items, seed 1234.
    source = MockSource(seed=1234, seq_length=160, vocab_size=VOCAB,
                        plugins={"image": plugin("qwen2_5_vl", folder)}, items_per_sample=(0, 3),
                        video_frames=3)
    sizes = [size for index in range(4) for size in source.item_sizes("image", "train", index)]
    assert len({size for size in sizes if len(size) == 2}) >= 3, sizes  # images of several sizes
    assert sum(len(size) == 4 for size in sizes) >= 2, sizes  # and videos
    want = hf_first_batch_loss(folder, 4, 160, (0, 3), 1234, video_frames=3)
    assert abs(losses[1] - want) / want < 1e-5, (losses[1], want)


def test_a_dataset_tokenizer_whose_image_token_is_not_the_checkpoints_is_one_line(qwen):
    """The mock takes the checkpoint's image token; a tokenizer's placeholder (Energon data) is
    still checked against it."""
    import argparse
    import types

    from megatron_plugins.errors import UsageError
    from megatron_plugins.launch.flag_checks import check_image_token
    from megatron_plugins.weights.vlm_families import HF_MODEL_FLAG

    folder = str(qwen[0])
    args = argparse.Namespace(hf_model=folder, encoder_hf_weights={"image": folder})
    check_image_token(args, types.SimpleNamespace(special_token_ids={"image": IMAGE_TOKEN}))
    with pytest.raises(UsageError) as error:
        check_image_token(args, types.SimpleNamespace(special_token_ids={"image": 63}))
    assert str(error.value) == (
        f"{HF_MODEL_FLAG} {folder}: its image token is id {IMAGE_TOKEN}, but the data marks "
        "encoder image's positions with id 63; give a tokenizer whose <image> token is id "
        f"{IMAGE_TOKEN} (the checkpoint's own tokenizer)")
