"""``--hf-model DIR`` on a whole LLaVA-NeXT folder: anyres crops equal to HF's image processor,
HF's token count per image size, transformers' logits on a sample of three images of different
sizes at one rank per module and at encoder TP 2 + language PP 2 (the projection packing the
crops with the trained ``image_newline``), an export ``LlavaNextForConditionalGeneration`` loads,
the same bytes from two saving layouts, and settings we cannot honour refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_plugins.weights.streaming import assemble
from tests.models.hf import rel_diff, safetensors_of
from tests.models.hf_vlm import (
    IMAGE_TOKEN,
    LAYOUTS,
    bad_input,
    check_export,
    edited,
    identical_exports,
    train_and_export,
    vlm_flags,
)
from tests.models.llava_next import (
    SEQ_LENGTH,
    forward,
    hf_sample_logits,
    images,
    processor,
    save_tiny_llava_next,
)

TOLERANCE = 1e-5
VOCAB = 100
UNTRAINED = ("vision_tower.encoder.layers.1.", "vision_tower.post_layernorm.")
"""The tower's last layer (vision_feature_layer -2 reads the one before) and post_layernorm."""
GRIDS = ("image:dp=1", "language:dp=1")


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory):
    folder = save_tiny_llava_next(tmp_path_factory.mktemp("vlm") / "llava_next")
    pictures = images()
    ids, want, counts = hf_sample_logits(folder, pictures)
    return folder, pictures, ids, want, counts


def test_crops_and_token_counts_equal_hf_for_sizes_and_aspect_ratios(llava_next):
    """Every crop bit for bit HF's (base image first, tiles of the padded pinpoint after), and
    each size's token count the length of transformers' packed features."""
    import transformers

    from tests.models.hf_vision import plugin

    folder = llava_next[0]
    encoder = plugin("llava_next", folder)
    ours, hf = encoder.preprocessor(), processor(folder)
    model = transformers.LlavaNextForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32)
    sizes = [(23, 37), (40, 17), (16, 16), (50, 13), (33, 64), (7, 9), (48, 48), (17, 100)]
    rng = np.random.default_rng(0)
    for height, width in sizes:
        image = rng.integers(0, 256, (height, width, 3), np.uint8)
        got, want = ours(image), hf(image, return_tensors="pt")
        assert got["image_sizes"].tolist() == want["image_sizes"][0].tolist()
        torch.testing.assert_close(got["x"], want["pixel_values"][0], rtol=0, atol=0)
        with torch.no_grad():
            [packed] = model.model.get_image_features(
                pixel_values=want["pixel_values"], image_sizes=want["image_sizes"]).pooler_output
        assert encoder.item_tokens((height, width)) == packed.shape[0], (height, width)
    # The largest pinpoint (32 x 32: 8 x 8 patches kept, 8 newlines) and the base crop's 16.
    assert encoder.tokens_per_item == 16 + 8 * 9 and not encoder.fixed_item_tokens


@pytest.mark.parametrize("grids, nproc", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.multirank
def test_whole_llava_next_reproduces_transformers_logits_on_three_images_and_streams_back(
        llava_next, grids, nproc):
    folder, pictures, ids, want, counts = llava_next
    assert len(set(counts)) == 3
    results = forward(nproc, folder, grids, ids, pictures)
    [logits] = [r["logits"] for r in results if r["logits"] is not None]
    assert abs(logits[..., VOCAB:]).max() == 0  # padded vocabulary rows
    assert rel_diff(logits[..., :VOCAB], want) < TOLERANCE
    for result in results:
        assert result["special_token_ids"] == {"image": IMAGE_TOKEN}
        assert result["item_tokens"] == counts  # transformers' packed lengths
    streamed = assemble(piece for result in results for piece in result["pieces"])
    original = safetensors_of(folder)
    carried = {n for n in original if n.startswith(UNTRAINED)}
    assert "image_newline" in streamed
    assert carried and sorted(streamed) == sorted(set(original) - carried)
    for name, tensor in streamed.items():
        assert torch.equal(tensor, original[name]), name


@pytest.fixture(scope="module")
def exported(llava_next, tmp_path_factory):
    """The folder trained on mock images of varied sizes, saved from two layouts and exported
    (:func:`tests.models.hf_vlm.train_and_export`)."""
    folder = llava_next[0]
    root = tmp_path_factory.mktemp("vlm_export")
    return root, folder, train_and_export(folder, root, SEQ_LENGTH)


@pytest.mark.multirank
def test_export_loads_as_llava_next_with_the_trained_newline_the_same_from_two_layouts(
        exported):
    import transformers

    root, folder, pieces = exported
    out = root / "out_first"
    assert identical_exports(root) == ["config.json", "generation_config.json",
                                       "model.safetensors", "preprocessor_config.json"]
    model = transformers.LlavaNextForConditionalGeneration.from_pretrained(out,
                                                                           dtype=torch.float32)
    assert type(model) is transformers.LlavaNextForConditionalGeneration
    written = check_export(out, folder, pieces, UNTRAINED)
    assert not torch.equal(written["image_newline"],
                           safetensors_of(folder)["image_newline"])  # it trained
    assert torch.equal(model.model.image_newline.detach(), written["image_newline"])


def test_settings_anyres_cannot_honour_are_one_line(llava_next, tmp_path, monkeypatch):
    from megatron_plugins.weights.vlm_families import HF_MODEL_FLAG

    folder = llava_next[0]
    full = edited(folder, tmp_path / "full", config={"vision_feature_select_strategy": "full"})
    assert bad_input(vlm_flags(full, GRIDS), monkeypatch) == (
        f"{HF_MODEL_FLAG} {full}: config.json vision_feature_select_strategy 'full' is not "
        "supported for LLaVA-NeXT (its anyres packing needs the class token dropped); use "
        "default")
    odd = edited(folder, tmp_path / "odd", config={"image_grid_pinpoints": [[16, 24]]})
    assert bad_input(vlm_flags(odd, GRIDS), monkeypatch) == (
        f"{HF_MODEL_FLAG} {odd}: config.json image_grid_pinpoints [[16, 24]] must be [height, "
        "width] pairs, multiples of the tower's image_size 16")
    other = edited(folder, tmp_path / "other", config={"image_grid_pinpoints": [[32, 32]]})
    assert bad_input(vlm_flags(other, GRIDS), monkeypatch) == (
        f"{HF_MODEL_FLAG} {other}: preprocessor_config.json image_grid_pinpoints [[16, 32], "
        "[32, 16], [32, 32], [48, 16], [16, 48]] differ from config.json's [[32, 32]]; make "
        "them equal")
    origin = f"{HF_MODEL_FLAG} {folder} (LlavaNextForConditionalGeneration)"
    assert bad_input([*vlm_flags(folder, GRIDS), "--encoder", "image=clip"], monkeypatch) == (
        f"--encoder image=clip contradicts {origin}, whose tower is built by provider "
        "llava_next; give exactly one --encoder NAME=llava_next or drop --encoder")
