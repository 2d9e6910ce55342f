"""The vit encoder at native resolution: Qwen2-VL's resize, packed patches, one attention segment
per image (a packed microbatch equals each image alone), token counts from the size alone."""

from __future__ import annotations

import argparse
import itertools
import pickle

import numpy as np
import pytest
import torch

from megatron_plugins.encoders.base import EncoderPluginError
from megatron_plugins.encoders.native_vit import (
    NativeImagePreprocessor,
    NativeViT,
    smart_resize,
)
from megatron_plugins.encoders.vit import ImagePreprocessor, ViTEncoder
from megatron_plugins.parallel.layout import ModulePlacement
from tests.harness.multiprocess import run_in_processes

SIZES = [(20, 30), (16, 16), (37, 11), (64, 80)]
"""Image heights x widths of one packed microbatch (three distinct grids, one repeated)."""


def plugin(*flags: str, tp: int = 1) -> ViTEncoder:
    parser = argparse.ArgumentParser()
    ViTEncoder.add_arguments(parser)
    grid = ModulePlacement(name="vision", tp=tp, pp=1, cp=1, dp=1, rank_offset=0, provider="vit")
    return ViTEncoder("vision", parser.parse_args(list(flags)), grid)


def native(*flags: str, tp: int = 1) -> ViTEncoder:
    return plugin("--vit-native-resolution", "--vit-num-layers", "2", *flags, tp=tp)


def image(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def test_smart_resize_matches_qwen2_vl() -> None:
    # The PIL image processor carries the same function without needing torchvision.
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as qwen

    sides = [8, 9, 13, 16, 23, 31, 40, 57, 64, 100, 129, 333, 640, 1000, 1999]
    for (height, width), (factor, low, high) in itertools.product(
            itertools.product(sides, sides), [(8, 8 * 8 * 4, 8 * 8 * 64), (14, 56 * 56, 28 * 28 * 1280),
                                              (16, 16 * 16, 16 * 16 * 256)]):
        if max(height, width) / min(height, width) > 200 or min(height, width) < factor:
            continue
        expected = qwen(height, width, factor, low, high)
        if expected[0] * expected[1] > high:  # an aspect ratio Qwen2-VL lets overflow the cap
            with pytest.raises(ValueError, match="--vit-max-pixels"):
                smart_resize(height, width, factor, low, high)
            continue
        assert smart_resize(height, width, factor, low, high) == expected, (height, width, factor)


@pytest.mark.parametrize("size, flag", [((5, 40), "--vit-patch-size"),
                                        ((8, 1000), "--vit-max-pixels"),
                                        ((8, 2000), "aspect ratio above 200")])
def test_unusable_sizes_name_the_size_and_the_fix(size: tuple[int, int], flag: str) -> None:
    encoder = native()
    with pytest.raises(ValueError, match=f"{size[0]}x{size[1]}.*{flag}"):
        encoder.item_tokens(size)
    with pytest.raises(ValueError, match=f"{size[0]}x{size[1]}.*{flag}"):
        encoder.preprocessor()(image(*size))


@pytest.mark.parametrize("flags", [("--vit-max-pixels", "32"),
                                   ("--vit-min-pixels", "5000"), ("--vit-min-pixels", "0")])
def test_bad_pixel_range_names_the_flags(flags: tuple[str, str]) -> None:
    with pytest.raises(EncoderPluginError, match="--vit-min-pixels .* --vit-max-pixels"):
        native(*flags)


def test_preprocessor_patches_follow_the_size_alone() -> None:
    encoder = native()
    preprocessor = encoder.preprocessor()
    assert pickle.loads(pickle.dumps(preprocessor)) == preprocessor
    assert encoder.tokens_per_item == 64
    items = [preprocessor(image(*size)) for size in SIZES]
    for size, item in zip(SIZES, items):
        rows, columns = item["grid"].tolist()
        assert item["patches"].shape == (rows * columns, 3 * 8 * 8)
        assert item["patches"].dtype == torch.float32 and item["grid"].dtype == torch.int64
        assert encoder.item_tokens(size) == rows * columns <= encoder.tokens_per_item
    assert [item["grid"].tolist() for item in items] == [[2, 4], [2, 2], [5, 1], [7, 8]]
    packed = preprocessor.collate(items)
    assert packed["patches"].shape == (sum(encoder.item_tokens(s) for s in SIZES), 192)
    assert torch.equal(packed["grid"], torch.stack([item["grid"] for item in items]))


def test_patches_are_row_major_normalized_pixels() -> None:
    """An image already at a patch multiple is not resampled; patch (r, c) is its block r, c."""
    pixels = image(16, 24, seed=3)
    preprocessor = NativeImagePreprocessor(8, 64, 4096, (0.5, 0.25, 0.0), (0.5, 0.5, 1.0))
    item = preprocessor(pixels)
    assert item["grid"].tolist() == [2, 3]
    normalized = (pixels / 255.0 - np.array([0.5, 0.25, 0.0])) / np.array([0.5, 0.5, 1.0])
    for index, (row, column) in enumerate(itertools.product(range(2), range(3))):
        block = normalized[row * 8:row * 8 + 8, column * 8:column * 8 + 8].transpose(2, 0, 1)
        np.testing.assert_allclose(item["patches"][index].numpy(), block.reshape(-1), atol=1e-6)


def test_fixed_mode_is_unchanged() -> None:
    encoder = plugin()
    assert encoder.tokens_per_item == 4 and encoder.item_tokens((300, 17)) == 4
    assert isinstance(encoder.preprocessor(), ImagePreprocessor)
    assert encoder.preprocessor()(image(20, 30))["x"].shape == (3, 16, 16)


def packed_and_alone(tp: int) -> dict[str, object]:
    """One simulated rank of a tp group: the native ViT on the SIZES images packed, each image
    alone, the token counts, input gradients of the packed forward, and checkpoint replication."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from tests.models.hf_vision import language_config

    parallel_state.initialize_model_parallel(tp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    encoder = native(tp=tp)
    network = build_module(encoder.encoder_spec(encoder.transformer_config(language_config()),
                                                groups))
    assert isinstance(network, NativeViT)
    preprocessor = encoder.preprocessor()
    items = [preprocessor(image(*size, seed=i)) for i, size in enumerate(SIZES)]
    packed = preprocessor.collate(items)
    patches_in = packed["patches"].requires_grad_()
    output = network(patches_in, packed["grid"])
    output.square().sum().backward()
    alone = [network(**preprocessor.collate([item])).detach().numpy() for item in items]
    replicated = {key: value.replica_id for key, value in network.sharded_state_dict().items()
                  if key.endswith(("position", "patch_embedding.weight", "ln_pre.weight"))}
    # Numpy, not tensors: a tensor crosses the result queue as shared memory that dies with us.
    return {"packed": output.detach().numpy(), "alone": alone, "grad": patches_in.grad.numpy(),
            "tokens": [encoder.item_tokens(size) for size in SIZES], "replicated": replicated}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.multirank
def test_packed_microbatch_equals_each_image_alone(tp: int) -> None:
    results = run_in_processes(packed_and_alone, tp, args=(tp,), simulated=True, timeout=180)
    for rank, result in enumerate(results):
        assert result["packed"].shape == (sum(result["tokens"]), 64)
        pieces = np.split(result["packed"], np.cumsum(result["tokens"])[:-1])
        for piece, alone in zip(pieces, result["alone"]):
            np.testing.assert_allclose(piece, alone, rtol=1e-6, atol=1e-6)
        assert np.isfinite(result["grad"]).all() and np.abs(result["grad"]).sum() > 0
        # Replicated parameters are saved by tp rank 0 only (replica id (0, tp rank, dp)).
        assert set(result["replicated"]) == {"position", "patch_embedding.weight",
                                             "ln_pre.weight"}
        assert all(replica[1] == rank for replica in result["replicated"].values())
    for other in results[1:]:
        np.testing.assert_array_equal(other["packed"], results[0]["packed"])
