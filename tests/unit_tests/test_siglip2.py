"""The ``siglip2`` encoder reproduces transformers' SigLIP2 NaFlex vision tower: HF's resize and
pixel values, the hidden states of several image sizes packed into one microbatch (one rank and
encoder TP 2) equal to HF's unpadded rows, weights streamed back, one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatron_plugins.encoders import EncoderPluginError
from megatron_plugins.encoders.siglip2 import siglip2_image_size
from tests.models.hf import safetensors_of
from tests.models.hf_vision import (
    assert_streams_back,
    SIGLIP2_MAX_PATCHES,
    plugin,
    rel_diff,
    save_tiny,
    save_tiny_siglip2,
    siglip2_hf,
    siglip2_rank,
    train_and_export,
    uint8_image,
)
from tests.harness.multiprocess import run_in_processes

TOLERANCE = 1e-5
SIZES = [(16, 16), (12, 40), (44, 10), (90, 70), (3, 5), (16, 16)]
"""One microbatch: square, wide, tall, one HF scales down, a tiny one it scales up, and a
repeated size."""


def images(seed: int = 0) -> list[np.ndarray]:
    return [uint8_image(h, w, seed) for h, w in SIZES]


def test_resize_equals_hf_for_many_sizes() -> None:
    from transformers.models.siglip2.image_processing_pil_siglip2 import (
        get_image_size_for_max_num_patches as hf,
    )

    sides = [1, 3, 4, 7, 16, 23, 40, 64, 100, 257, 640, 1999]
    for height in sides:
        for width in sides:
            for patch, most in ((4, 24), (16, 256), (14, 1024)):
                assert siglip2_image_size(height, width, patch, most) == hf(
                    height, width, patch, most), (height, width, patch, most)


def test_preprocessing_equals_hf_valid_rows_and_token_counts(tmp_path) -> None:
    """Each image's packed patches are HF's pixel_values rows its mask keeps; item_tokens and
    item_grid follow from the size alone; the microbatch is packed without padding."""
    folder = save_tiny_siglip2(tmp_path / "siglip2", num_hidden_layers=1)
    encoder = plugin("siglip2", folder)
    preprocessor = encoder.preprocessor()
    batch = images()
    hf = siglip2_hf(folder, batch)
    items = [preprocessor(image) for image in batch]
    for item, image, count, shape, values in zip(items, batch, hf["counts"],
                                                 hf["inputs"]["spatial_shapes"],
                                                 hf["inputs"]["pixel_values"]):
        size = image.shape[:2]
        assert item["grid"].tolist() == shape.tolist()
        assert encoder.item_tokens(size) == count == int(shape.prod())
        assert encoder.item_grid(size) == (1, *shape.tolist())
        assert item["patches"].dtype == torch.float32
        torch.testing.assert_close(item["patches"], values[:count], rtol=0, atol=0)
    assert [tuple(shape) for shape in hf["inputs"]["spatial_shapes"].tolist()] == [
        (4, 4), (3, 8), (9, 2), (6, 4), (4, 6), (4, 4)]  # five grids, several at the cap
    packed = preprocessor.collate(items)
    assert packed["patches"].shape == (sum(hf["counts"]), 4 * 4 * 3)
    assert packed["grid"].tolist() == hf["inputs"]["spatial_shapes"].tolist()
    assert encoder.tokens_per_item == SIGLIP2_MAX_PATCHES and not encoder.fixed_item_tokens


def test_preprocessor_config_json_is_followed_like_hf(tmp_path) -> None:
    from transformers import Siglip2ImageProcessorPil

    folder = save_tiny_siglip2(tmp_path / "siglip2", num_hidden_layers=1)
    Siglip2ImageProcessorPil(patch_size=4, max_num_patches=9, resample=3,
                             rescale_factor=1 / 127.5, image_mean=[1.0, 0.9, 0.8],
                             image_std=[0.7, 1.1, 1.0]).save_pretrained(folder)
    image = uint8_image(31, 22)
    want = Siglip2ImageProcessorPil.from_pretrained(folder)(image, return_tensors="pt")
    got = plugin("siglip2", folder).preprocessor()(image)
    count = int(want["pixel_attention_mask"].sum())
    assert count == got["patches"].shape[0] <= 9
    torch.testing.assert_close(got["patches"], want["pixel_values"][0, :count], rtol=0, atol=0)


@pytest.mark.multirank
def test_one_rank_packed_microbatch_reproduces_transformers(tmp_path) -> None:
    folder = save_tiny_siglip2(tmp_path / "siglip2")
    batch = images(seed=1)
    [result] = run_in_processes(siglip2_rank, 1, args=(str(folder), 1, batch), timeout=120,
                                simulated=True)
    hf = siglip2_hf(folder, batch)
    assert result["family"] == "siglip2_vision"
    assert result["item_tokens"] == hf["counts"]
    assert result["output"].shape == (sum(hf["counts"]), 32)
    want = np.concatenate(hf["hidden"])
    assert rel_diff(result["output"], want) < TOLERANCE


@pytest.mark.multirank
def test_tp2_reproduces_transformers_and_streams_the_folder_back(tmp_path) -> None:
    folder = save_tiny_siglip2(tmp_path / "siglip2", seed=3)
    batch = images(seed=4)
    results = run_in_processes(siglip2_rank, 2, args=(str(folder), 2, batch), timeout=150,
                               simulated=True)
    want = np.concatenate(siglip2_hf(folder, batch)["hidden"])
    for result in results:
        assert rel_diff(result["output"], want) < TOLERANCE
    assert_streams_back("siglip2", folder, results)


@pytest.mark.multirank
def test_full_siglip2_model_folder_loads_its_vision_tower(tmp_path) -> None:
    """A Siglip2Model save: tower under vision_model., text tower and pooling head left out."""
    folder = save_tiny_siglip2(tmp_path / "full", full=True)
    batch = images(seed=2)[:3]
    [result] = run_in_processes(siglip2_rank, 1, args=(str(folder), 1, batch), timeout=120,
                                simulated=True)
    want = np.concatenate(siglip2_hf(folder, batch)["hidden"])
    assert rel_diff(result["output"], want) < TOLERANCE


def test_export_config_is_the_loaded_vision_config(tmp_path) -> None:
    import argparse

    from megatron_plugins.weights.vision_families import SIGLIP2_VISION, untrained_tensors

    full = save_tiny_siglip2(tmp_path / "full", full=True, num_hidden_layers=1)
    args = argparse.Namespace(encoder_hf_weights=[f"vision={full}"])
    written = SIGLIP2_VISION.hf_config(args, 0)
    assert written["model_type"] == "siglip2_vision_model"
    assert (written["hidden_size"], written["num_patches"]) == (32, 16)
    head = untrained_tensors(SIGLIP2_VISION, args)
    assert head and all(name.startswith("head.") for name in head)


def test_errors_name_the_flag_and_both_model_types(tmp_path) -> None:
    siglip = save_tiny("siglip", tmp_path / "siglip", num_hidden_layers=1)
    with pytest.raises(EncoderPluginError, match=r"needs --encoder-hf-weights vision=DIR"):
        plugin("siglip2", None)
    with pytest.raises(EncoderPluginError, match=r"--encoder-hf-weights vision=.*siglip: "
                                                 r"config.json is a 'siglip_vision_model' model, "
                                                 r"not 'siglip2_vision_model'"):
        plugin("siglip2", siglip)
    siglip2 = save_tiny_siglip2(tmp_path / "siglip2", num_hidden_layers=1)
    with pytest.raises(EncoderPluginError, match=r"config.json is a 'siglip2_vision_model' "
                                                 r"model, not 'siglip_vision_model'"):
        plugin("siglip", siglip2)
    config = json.loads((siglip2 / "preprocessor_config.json").read_text())
    (siglip2 / "preprocessor_config.json").write_text(json.dumps({**config, "patch_size": 8}))
    with pytest.raises(EncoderPluginError, match=r"preprocessor_config.json patch_size 8 differs "
                                                 r"from config.json patch_size 4"):
        plugin("siglip2", siglip2)
    odd = save_tiny_siglip2(tmp_path / "odd", num_hidden_layers=1, num_patches=15)
    with pytest.raises(EncoderPluginError, match=r"square num_patches"):
        plugin("siglip2", odd)


@pytest.mark.multirank
def test_trained_tower_exports_what_it_streams_and_transformers_reproduces_it(tmp_path) -> None:
    """Round trip: the siglip2 tower imported at encoder TP 2, trained 2 steps by pretrain() on
    mock images, saved, exported; the exported folder holds the live tower's streamed tensors plus
    the untrained pooling head, and transformers on it gives our encoder's hidden states."""
    siglip2 = save_tiny_siglip2(tmp_path / "siglip2")
    streamed, out = train_and_export(tmp_path, "siglip2", siglip2, seq_length=64)
    folder = out / "vision"
    exported = safetensors_of(folder)
    original = safetensors_of(siglip2)
    head = {n: t for n, t in original.items() if n.startswith("head.")}
    assert head
    assert sorted(exported) == sorted({**streamed, **head}) == sorted(original)
    for name, tensor in {**streamed, **head}.items():
        assert torch.equal(exported[name], tensor), name
    assert not torch.equal(exported["encoder.layers.0.mlp.fc1.weight"],
                           original["encoder.layers.0.mlp.fc1.weight"])  # it trained
    batch = images(seed=5)
    from transformers import AutoImageProcessor

    exported_inputs = AutoImageProcessor.from_pretrained(folder)(batch, return_tensors="pt")
    source_inputs = AutoImageProcessor.from_pretrained(siglip2)(batch, return_tensors="pt")
    assert sorted(exported_inputs) == sorted(source_inputs)
    for key, value in source_inputs.items():  # the export carries the processor
        assert torch.equal(exported_inputs[key], value), key
    [ours] = run_in_processes(siglip2_rank, 1, args=(str(folder), 1, batch), timeout=120,
                              simulated=True)
    want = np.concatenate(siglip2_hf(folder, batch)["hidden"])
    assert rel_diff(ours["output"], want) < TOLERANCE
