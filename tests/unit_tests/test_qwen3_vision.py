"""The ``qwen3_vl`` encoder reproduces transformers' ``Qwen3VLVisionModel``: merged image
features and every DeepStack level (tower + mergers as our encoder + projection) from imported HF
weights on one packed microbatch of several image sizes, at encoder TP 1 and 2; preprocessing
equal to HF's image processor; one-line errors for folders it cannot use."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_plugins.encoders import EncoderPluginError
from megatron_plugins.weights.streaming import assemble
from tests.models.hf import pieces_from, safetensors_of
from tests.models.hf_vision import (
    QWEN_IMAGES,
    QWEN_PIXELS,
    language_config,
    plugin,
    preprocessed,
    qwen_images,
    qwen_rank,
    rel_diff,
    save_tiny_qwen,
    train_and_export,
)
from tests.harness.multiprocess import run_in_processes
from tests.models.qwen3_vlm import (
    TEXT,
    hf_features,
    processor,
    save_tiny_qwen3_vl,
    vision_tensors,
)

TOLERANCE = 1e-5
LEVELS = 2
"""DeepStack levels of the tiny model (blocks 0 and 1)."""


def ours(folder, tp: int, images: list[np.ndarray], text_hidden: int = TEXT["hidden_size"]
         ) -> list[dict]:
    """Our encoder + projection on ``tp`` gloo ranks: each rank's result."""
    return run_in_processes(qwen_rank, tp, args=(str(folder), tp, images, text_hidden,
                                                 "qwen3_vl"), timeout=240, simulated=True)


def assert_matches(output: np.ndarray, want: list[np.ndarray]) -> list[float]:
    """Our ``[tokens, (1 + L) * hidden]`` output is HF's merged features then its DeepStack
    levels, each within the tolerance; their relative differences."""
    assert output.shape == (want[0].shape[0], len(want) * want[0].shape[1])
    diffs = [rel_diff(got, level) for got, level in zip(np.split(output, len(want), axis=-1),
                                                        want)]
    assert max(diffs) < TOLERANCE, diffs
    return diffs


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """The same names and bit-identical tensors."""
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.multirank
def test_one_rank_reproduces_merged_features_and_deepstack_levels(tmp_path):
    """A whole Qwen3-VL folder (language tensors left out); five images of different sizes in one
    packed microbatch, grids above and below the 4 x 4 position table."""
    folder = save_tiny_qwen3_vl(tmp_path / "qwen3")
    images = qwen_images()
    [result] = ours(folder, 1, images)
    want = hf_features(folder, images)
    assert len(want) == 1 + LEVELS
    assert result["family"] == "qwen3_vl_vision"
    grids = processor(folder)(images, return_tensors="pt")["image_grid_thw"]
    assert result["item_grids"] == [(1, h // 2, w // 2) for _, h, w in grids.tolist()]
    assert result["item_tokens"] == [h * w // 4 for _, h, w in grids.tolist()]
    assert result["tokens_per_item"] == QWEN_PIXELS["max_pixels"] // 64
    assert_matches(result["output"], want)
    encoder = plugin("qwen3_vl", folder)
    assert encoder.deepstack_levels == LEVELS and not encoder.fixed_item_tokens


@pytest.mark.multirank
def test_tp2_reproduces_transformers_and_streams_back_the_vision_tensors(tmp_path):
    """Encoder TP 2 over gloo: fused qkv, the MLPs and every merger MLP sharded; the ranks'
    streamed pieces reassemble to exactly the folder's vision tensors (mergers included)."""
    folder = save_tiny_qwen3_vl(tmp_path / "qwen3", seed=3)
    images = qwen_images(seed=4)
    results = ours(folder, 2, images)
    want = hf_features(folder, images)
    for result in results:
        assert_matches(result["output"], want)
    pieces = [piece for result in results for piece in pieces_from(result["pieces"])]
    assert sorted(p.offsets[0] for p in pieces
                  if p.hf_name == "deepstack_merger_list.1.linear_fc1.weight") == [0, 64]
    assert_same_tensors(assemble(pieces), vision_tensors(folder))


@pytest.mark.multirank
def test_vision_model_folder_without_deepstack(tmp_path):
    """A ``Qwen3VLVisionModel`` folder (names without a prefix) whose config has no DeepStack
    indexes: the projection is the merger alone, language-hidden wide."""
    folder = save_tiny_qwen3_vl(tmp_path / "visual", seed=5, vision_only=True,
                                deepstack_visual_indexes=[])
    images = qwen_images(QWEN_IMAGES[:3], seed=6)
    [result] = ours(folder, 1, images)
    assert plugin("qwen3_vl", folder).deepstack_levels == 0
    assert_matches(result["output"], hf_features(folder, images))


@pytest.mark.parametrize("config", [
    {},  # the released Qwen3-VL recipe (mean / std 0.5, 65536..16777216 pixels)
    dict(QWEN_PIXELS, image_mean=[0.1, 0.2, 0.3], image_std=[0.9, 0.8, 0.7], resample=2),
])
def test_preprocessing_equals_hf_image_processor(config, tmp_path):
    """Bit-exact pixel values and grids; the folder's preprocessor_config.json or, without one,
    the released checkpoints' recipe."""
    got, want = preprocessed("qwen3_vl", save_tiny_qwen3_vl(tmp_path / "qwen3"), processor,
                             config, qwen_images())
    torch.testing.assert_close(got["grid_thw"], want["image_grid_thw"], rtol=0, atol=0)
    assert got["pixel_values"].dtype == torch.float32
    torch.testing.assert_close(got["pixel_values"], want["pixel_values"], rtol=0, atol=0)


def test_errors_name_the_flag_and_the_field(tmp_path):
    qwen2_5 = save_tiny_qwen(tmp_path / "qwen2_5")
    with pytest.raises(EncoderPluginError, match=r"--encoder-hf-weights vision=.*qwen2_5: "
                                                 r"config.json is a 'qwen2_5_vl' model, not "
                                                 r"'qwen3_vl' or 'qwen3_vl_vision'"):
        plugin("qwen3_vl", qwen2_5)
    assert plugin("qwen2_5_vl", qwen2_5).deepstack_levels == 0
    bad = save_tiny_qwen3_vl(tmp_path / "bad", vision_only=True, deepstack_visual_indexes=[1, 0],
                             num_position_embeddings=12)
    with pytest.raises(EncoderPluginError, match=r"config.json num_position_embeddings 12 \(not "
                                                 r"a square grid\); deepstack_visual_indexes "
                                                 r"\[1, 0\] \(need increasing"):
        plugin("qwen3_vl", bad)
    with pytest.raises(EncoderPluginError, match=r"out_hidden_size 24 is not the language "
                                                 r"model's hidden size 8"):
        plugin("qwen3_vl", save_tiny_qwen3_vl(tmp_path / "qwen3")).transformer_config(
            language_config())


@pytest.mark.multirank
def test_trained_tower_and_mergers_export_to_a_vision_folder_transformers_reproduces(tmp_path):
    """Round trip through a MiMo run (a checkpoint without DeepStack: the language model here has
    no DeepStack input): the tower at encoder TP 2 and its merger as the projection, trained 2
    steps, saved, exported; the exported vision folder holds exactly the live tensors and
    transformers on it gives our encoder + projection's features."""
    from tests.models.hf import SHAPE

    qwen = save_tiny_qwen3_vl(tmp_path / "qwen3", text={"hidden_size": SHAPE["hidden_size"]},
                              deepstack_visual_indexes=[])
    streamed, out = train_and_export(tmp_path, "qwen3_vl", qwen, seq_length=64)
    exported, original = safetensors_of(out / "vision"), vision_tensors(qwen)
    assert sorted(exported) == sorted(original)
    assert_same_tensors(exported, streamed)
    for name in ("blocks.0.attn.qkv.weight", "pos_embed.weight", "merger.linear_fc1.weight"):
        assert not torch.equal(exported[name], original[name]), name  # it trained
    (out / "vision" / "preprocessor_config.json").write_text(
        (qwen / "preprocessor_config.json").read_text())
    images = qwen_images(QWEN_IMAGES[:3], seed=7)
    [result] = ours(out / "vision", 1, images, SHAPE["hidden_size"])
    assert_matches(result["output"], hf_features(out / "vision", images))
