"""The ``qwen2_5_vl`` encoder reproduces transformers' Qwen2.5-VL vision model: merged image
features (tower + merger as our encoder + projection) from imported HF weights on one packed
microbatch of several image sizes, at encoder TP 1 and 2; preprocessing equal to HF's Qwen2-VL
image processor; one-line errors for folders it cannot use."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatron_plugins.encoders import EncoderPluginError
from megatron_plugins.weights.streaming import assemble
from tests.models.hf import pieces_from, safetensors_of
from tests.models.hf_vision import (
    QWEN_IMAGES,
    QWEN_PIXELS,
    plugin,
    preprocessed,
    qwen_hf_features,
    qwen_images,
    qwen_processor,
    qwen_rank,
    rel_diff,
    save_tiny,
    save_tiny_qwen,
    train_and_export,
)
from tests.harness.multiprocess import run_in_processes

TOLERANCE = 1e-5


@pytest.mark.multirank
def test_one_rank_reproduces_transformers_merged_features_of_a_packed_microbatch(tmp_path):
    """A whole Qwen2.5-VL folder (language tensors left out); five images of different sizes in
    one packed microbatch, window layers and a full-attention layer."""
    folder = save_tiny_qwen(tmp_path / "qwen")
    images = qwen_images()
    [result] = run_in_processes(qwen_rank, 1, args=(str(folder), 1, images), timeout=180,
                                simulated=True)
    want = qwen_hf_features(folder, images)
    assert result["family"] == "qwen2_5_vl_vision"
    grids = qwen_processor(folder)(images, return_tensors="pt")["image_grid_thw"]
    assert result["item_grids"] == [(1, h // 2, w // 2) for _, h, w in grids.tolist()]
    assert result["item_tokens"] == [h * w // 4 for _, h, w in grids.tolist()]
    assert sum(result["item_tokens"]) == want.shape[0]
    assert result["tokens_per_item"] == QWEN_PIXELS["max_pixels"] // 64
    assert result["output"].shape == want.shape
    assert rel_diff(result["output"], want) < TOLERANCE


@pytest.mark.multirank
def test_tp2_reproduces_transformers_and_streams_back_the_vision_tensors(tmp_path):
    """Encoder TP 2 over gloo: fused qkv, SwiGLU and the merger MLP sharded; the two ranks'
    streamed pieces reassemble to exactly the folder's vision tensors (merger included)."""
    folder = save_tiny_qwen(tmp_path / "qwen", seed=3)
    images = qwen_images(seed=4)
    results = run_in_processes(qwen_rank, 2, args=(str(folder), 2, images), timeout=240,
                               simulated=True)
    want = qwen_hf_features(folder, images)
    for result in results:
        assert rel_diff(result["output"], want) < TOLERANCE
    pieces = [piece for result in results for piece in pieces_from(result["pieces"])]
    # Each rank streams its half of q, of k and of v: three row blocks of the one fused tensor.
    assert sorted(p.offsets[0] for p in pieces if p.hf_name == "blocks.0.attn.qkv.weight") == [
        0, 16, 32, 48, 64, 80]
    assembled = assemble(pieces)
    # Streamed under the vision model's own names, as a CLIP tower is.
    original = {n.removeprefix("visual."): t for n, t in safetensors_of(folder).items()
                if n.startswith("visual.")}
    assert sorted(assembled) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(assembled[name], tensor), name


@pytest.mark.multirank
def test_vision_model_folder_loads_too(tmp_path):
    """A folder of just Qwen2_5_VisionTransformerPretrainedModel (names without ``visual.``)."""
    folder = save_tiny_qwen(tmp_path / "visual", seed=5, vision_only=True)
    images = qwen_images(QWEN_IMAGES[:3], seed=6)
    [result] = run_in_processes(qwen_rank, 1, args=(str(folder), 1, images), timeout=180,
                                simulated=True)
    assert rel_diff(result["output"], qwen_hf_features(folder, images)) < TOLERANCE


@pytest.mark.parametrize("config", [
    {},  # HF's defaults (CLIP mean / std, 3136..1003520 pixels: everything resized up)
    dict(QWEN_PIXELS),
    dict(size={"shortest_edge": 200, "longest_edge": 1000}, image_mean=[0.1, 0.2, 0.3],
         image_std=[0.9, 0.8, 0.7], resample=2, rescale_factor=1 / 127.5),
])
def test_preprocessing_equals_hf_qwen2_vl_image_processor(config, tmp_path):
    got, want = preprocessed("qwen2_5_vl", save_tiny_qwen(tmp_path / "qwen"), qwen_processor,
                             config, qwen_images())
    torch.testing.assert_close(got["grid_thw"], want["image_grid_thw"], rtol=0, atol=0)
    assert got["pixel_values"].dtype == torch.float32
    torch.testing.assert_close(got["pixel_values"], want["pixel_values"], rtol=0, atol=1e-6)


VIDEOS = ((3, 21, 30), (4, 16, 16), (5, 50, 30), (1, 7, 9), (2, 64, 8))
"""(frames, height, width) of packed videos: odd frame counts (last frame repeated), resized up,
down and not at all."""


@pytest.mark.parametrize("config", [
    {},  # the image processor's pixel range holds for videos (HF reads the same file)
    {"size": {"shortest_edge": 300, "longest_edge": 700}, "patch_size": 4,
     "temporal_patch_size": 2, "merge_size": 2},  # video_preprocessor_config.json's
])
def test_video_preprocessing_equals_hf_qwen2_vl_video_processor(config, tmp_path):
    """HF's video processor (its uint8 bicubic resize is torchvision's, in the test extra) on
    videos of several sizes and frame counts."""
    from transformers import AutoVideoProcessor

    from megatron_plugins.media.codec import Video

    folder = save_tiny_qwen(tmp_path / "qwen")
    if config:
        (folder / "video_preprocessor_config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(2)
    videos = [rng.integers(0, 256, (*shape, 3), np.uint8) for shape in VIDEOS]
    encoder = plugin("qwen2_5_vl", folder)
    preprocessor = encoder.preprocessor()
    got = preprocessor.collate([preprocessor(Video(video, 2.0)) for video in videos])
    want = AutoVideoProcessor.from_pretrained(folder)(videos=videos, return_tensors="pt",
                                                      cap_pixels_per_frame=False)
    torch.testing.assert_close(got["grid_thw"], want["video_grid_thw"], rtol=0, atol=0)
    torch.testing.assert_close(got["pixel_values"], want["pixel_values_videos"], rtol=0,
                               atol=1e-6)
    assert [encoder.item_tokens((*shape, 2.0)) for shape in VIDEOS] == [
        int(grid.prod()) // 4 for grid in want["video_grid_thw"]]


def test_a_video_at_grid_size_is_hf_image_processors_frames_paired(tmp_path):
    """Without a resize (frames already on the 8-pixel grid) a video's patches are HF's image
    processor's patches of its frames, frame ``2k`` and ``2k + 1`` in temporal step ``k``, the
    last frame repeated to fill the last step."""
    from megatron_plugins.media.codec import Video

    folder = save_tiny_qwen(tmp_path / "qwen")
    frames = np.random.default_rng(3).integers(0, 256, (3, 16, 24, 3), np.uint8)
    preprocessor = plugin("qwen2_5_vl", folder).preprocessor()
    got = preprocessor(Video(frames, 2.0))
    assert got["grid_thw"].tolist() == [2, 4, 6]
    stills = qwen_processor(folder)(list(frames), return_tensors="pt")["pixel_values"]
    stills = stills.view(3, 24, 3, 2, 16)[:, :, :, 0]  # each image's two equal copies: one
    paired = torch.stack([stills[[0, 2]], stills[[1, 2]]], dim=3)  # [step, patch, c, t, 16]
    torch.testing.assert_close(got["pixel_values"], paired.reshape(48, 96), rtol=0, atol=1e-6)


def test_errors_name_the_flag_and_both_sizes_or_types(tmp_path):
    from tests.models.hf_vision import language_config

    clip = save_tiny("clip", tmp_path / "clip", num_hidden_layers=1)
    with pytest.raises(EncoderPluginError, match=r"--encoder-hf-weights vision=.*clip: "
                                                 r"config.json is a 'clip_vision_model' model, "
                                                 r"not 'qwen2_5_vl' or 'qwen2_5_vl_vision'"):
        plugin("qwen2_5_vl", clip)
    qwen = save_tiny_qwen(tmp_path / "qwen")
    encoder = plugin("qwen2_5_vl", qwen)
    with pytest.raises(EncoderPluginError, match=r"out_hidden_size 24 is not the language "
                                                 r"model's hidden size 8"):
        encoder.transformer_config(language_config())
    (qwen / "preprocessor_config.json").write_text(json.dumps({"patch_size": 14}))
    with pytest.raises(EncoderPluginError, match=r"preprocessor_config.json patch_size 14 is "
                                                 r"not the model's 4"):
        plugin("qwen2_5_vl", qwen)


def test_item_tokens_follow_the_resized_grid(tmp_path):
    """Token counts are a pure function of the size, at most tokens_per_item, the (t, h, w)
    layout their product."""
    encoder = plugin("qwen2_5_vl", save_tiny_qwen(tmp_path / "qwen"))
    assert not encoder.fixed_item_tokens
    sizes = [(24, 40), (7, 9), (300, 120), (1000, 1000)]
    for size in sizes:
        t, h, w = encoder.item_grid(size)
        assert t == 1 and t * h * w == encoder.item_tokens(size) <= encoder.tokens_per_item
    hf = qwen_processor(**QWEN_PIXELS)
    assert [encoder.item_tokens(size) for size in sizes] == [
        hf.get_number_of_image_patches(*size) // 4 for size in sizes]
    assert encoder.tokens_per_item == 20


@pytest.mark.multirank
def test_trained_tower_and_merger_export_to_a_vision_folder_transformers_reproduces(tmp_path):
    """Round trip through a MiMo run: Qwen2.5-VL's tower at encoder TP 2 and its merger as the
    projection, loaded from a whole folder, trained 2 steps, saved, exported; the exported
    vision folder holds exactly the live tower + merger's streamed tensors (no projections file
    for it), and transformers on that folder gives our encoder + projection's features."""
    from tests.models.hf import SHAPE

    qwen = save_tiny_qwen(tmp_path / "qwen", text_hidden=SHAPE["hidden_size"])
    streamed, out = train_and_export(tmp_path, "qwen2_5_vl", qwen, seq_length=64)
    exported = safetensors_of(out / "vision")
    original = {n.removeprefix("visual."): t for n, t in safetensors_of(qwen).items()
                if n.startswith("visual.")}
    assert sorted(exported) == sorted(streamed) == sorted(original)
    for name, tensor in streamed.items():
        assert torch.equal(exported[name], tensor), name
    for name in ("blocks.0.attn.qkv.weight", "merger.mlp.0.weight"):
        assert not torch.equal(exported[name], original[name]), name  # it trained
    assert not (out / "projections.safetensors").exists()
    assert (out / "vision" / "preprocessor_config.json").read_bytes() == \
        (qwen / "preprocessor_config.json").read_bytes()
    images = qwen_images(QWEN_IMAGES[:3], seed=7)
    # The export carries the processor: HF's own from the exported folder, the source's values.
    torch.testing.assert_close(qwen_processor(out / "vision")(images, return_tensors="pt"),
                               qwen_processor(qwen)(images, return_tensors="pt"), rtol=0, atol=0)
    [ours] = run_in_processes(qwen_rank, 1, args=(str(out / "vision"), 1, images,
                                                   SHAPE["hidden_size"]),
                              timeout=180, simulated=True)
    assert rel_diff(ours["output"], qwen_hf_features(out / "vision", images)) < TOLERANCE
