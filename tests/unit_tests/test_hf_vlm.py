"""``--hf-model DIR``: a whole LLaVA folder placed on its grids (the CLIP tower at its feature
layer on the encoder grid, the projector as its MiMo projection, Llama on the language grid)
gives transformers' logits on a multi-image sample at one rank per module and at encoder TP 2 +
language PP 2; export writes back one folder ``LlavaForConditionalGeneration`` loads, the same
bytes from two saving layouts; bad input is one line before any process group."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_plugins.weights.streaming import assemble
from tests.models.hf import rel_diff, safetensors_of
from tests.models.hf_vlm import (
    IMAGE_TOKEN,
    LAYOUTS,
    PATCHES,
    bad_input,
    check_export,
    edited,
    hf_llava_logits,
    identical_exports,
    sample,
    save_tiny_llava,
    train_and_export,
    vlm_forward,
)

TOLERANCE = 1e-5
VOCAB = 100
UNTRAINED = ("vision_tower.encoder.layers.1.", "vision_tower.post_layernorm.")
"""The tower's last layer (vision_feature_layer -2 reads the one before) and post_layernorm."""


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    folder = save_tiny_llava(tmp_path_factory.mktemp("vlm") / "llava")
    ids, pixels = sample()
    return folder, ids, pixels, hf_llava_logits(folder, ids, pixels)


@pytest.mark.parametrize("grids, nproc", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.multirank
def test_whole_llava_reproduces_transformers_logits_on_two_images_and_streams_back(
        llava, grids, nproc):
    folder, ids, pixels, want = llava
    results = vlm_forward(nproc, folder, grids, ids, pixels)
    [logits] = [r["logits"] for r in results if r["logits"] is not None]
    assert abs(logits[..., VOCAB:]).max() == 0  # padded vocabulary rows
    assert rel_diff(logits[..., :VOCAB], want) < TOLERANCE
    for result in results:  # the model reads image features at HF's image token
        assert result["special_token_ids"] == {"image": IMAGE_TOKEN}
        assert result["tokens_per_item"] == PATCHES  # class token dropped ("default")
        assert result["layers"] == 1  # hidden_states[-2] of 2 layers: one layer built
    streamed = assemble(piece for result in results for piece in result["pieces"])
    original = safetensors_of(folder)
    carried = {n for n in original if n.startswith(UNTRAINED)}
    assert carried and sorted(streamed) == sorted(set(original) - carried)
    for name, tensor in streamed.items():
        assert torch.equal(tensor, original[name]), name


@pytest.fixture(scope="module")
def exported(llava, tmp_path_factory):
    """The folder trained, saved from two layouts and exported (:func:`train_and_export`)."""
    folder = llava[0]
    root = tmp_path_factory.mktemp("vlm_export")
    return root, folder, train_and_export(folder, root)


@pytest.mark.multirank
def test_two_saving_layouts_export_one_identical_llava_folder(exported):
    # generation_config.json: the source folder's other files are copied unchanged
    assert identical_exports(exported[0]) == ["config.json", "generation_config.json",
                                              "model.safetensors"]


@pytest.mark.multirank
def test_exported_folder_loads_as_llava_with_the_trained_and_carried_tensors(exported):
    import transformers

    root, folder, pieces = exported
    out = root / "out_first"
    model = transformers.LlavaForConditionalGeneration.from_pretrained(out, dtype=torch.float32)
    assert type(model) is transformers.LlavaForConditionalGeneration
    written, original = check_export(out, folder, pieces, UNTRAINED), safetensors_of(folder)
    assert not torch.equal(written["multi_modal_projector.linear_1.weight"],
                           original["multi_modal_projector.linear_1.weight"])  # it trained
    loaded = {n: p.detach() for n, p in model.state_dict().items()}
    assert torch.equal(loaded["lm_head.weight"], written["language_model.lm_head.weight"])
    assert torch.equal(loaded["model.multi_modal_projector.linear_2.bias"],
                       written["multi_modal_projector.linear_2.bias"])


def test_bad_whole_vlm_input_is_one_line_naming_the_flag(llava, tmp_path, monkeypatch):
    from megatron_plugins.weights.vlm_families import HF_MODEL_FLAG
    from tests.models.hf import save_tiny
    from tests.models.hf_vlm import vlm_flags

    folder = llava[0]
    grids = ("image:dp=1", "language:dp=1")
    llama = save_tiny("llama", tmp_path / "llama")
    assert bad_input(vlm_flags(llama, grids), monkeypatch) == (
        f"{HF_MODEL_FLAG} {llama}/config.json: architecture LlamaForCausalLM is not a supported "
        "whole VLM; supported: LlavaForConditionalGeneration, "
        "Qwen2_5_VLForConditionalGeneration, LlavaNextForConditionalGeneration, "
        "Qwen3VLForConditionalGeneration, Qwen3_5ForConditionalGeneration, "
        "Qwen3_5MoeForConditionalGeneration, Qwen2_5OmniForConditionalGeneration, "
        "Qwen2_5OmniThinkerForConditionalGeneration, Qwen3OmniMoeForConditionalGeneration, "
        "Qwen3OmniMoeThinkerForConditionalGeneration")
    origin = f"{HF_MODEL_FLAG} {folder} (LlavaForConditionalGeneration)"
    flags = vlm_flags(folder, grids)
    assert bad_input([*flags, "--encoder", "image=siglip"], monkeypatch) == (
        f"--encoder image=siglip contradicts {origin}, whose tower is built by provider clip; "
        "give exactly one --encoder NAME=clip or drop --encoder")
    assert bad_input([*flags, "--language-hf-weights", str(llama)], monkeypatch) == (
        f"--language-hf-weights {llama} contradicts {origin}, which holds the language model; "
        "drop --language-hf-weights")
    assert bad_input([*flags, "--encoder-hf-weights", f"image={llama}"], monkeypatch) == (
        f"--encoder-hf-weights image={llama} contradicts {origin}, which holds encoder image's "
        "tower; drop --encoder-hf-weights image=")
    assert bad_input([*flags, "--num-layers", "3"], monkeypatch) == (
        f"--num-layers 3 contradicts {HF_MODEL_FLAG} {folder}/config.json text_config, which "
        "gives 2; drop --num-layers")
    # A named encoder of the tower's provider is the one --grid addresses.
    renamed = bad_input([*vlm_flags(folder, ("pixels:dp=1", "language:dp=1")), "--encoder",
                          "pixels=clip", "--num-layers", "3"], monkeypatch)
    assert renamed.startswith("--num-layers 3 contradicts")


def test_a_projector_that_does_not_meet_its_tower_or_language_model_is_one_line(
        llava, tmp_path, monkeypatch):
    from megatron_plugins.weights.vlm_families import HF_MODEL_FLAG
    from tests.models.hf_vlm import vlm_flags

    folder = llava[0]
    grids = ("image:dp=1", "language:dp=1")
    wide = edited(folder, tmp_path / "wide", tensors={
        "multi_modal_projector.linear_1.weight": torch.zeros(48, 40)})
    assert bad_input(vlm_flags(wide, grids), monkeypatch) == (
        f"{HF_MODEL_FLAG} {wide}: projector multi_modal_projector.linear_1.weight input size 40 "
        "does not meet the width the tower (vision_config) hands it, 32; the tower and language "
        "model are not this projector's pair")
    text = json.loads((folder / "config.json").read_text())["text_config"]
    other = edited(folder, tmp_path / "other", config={
        "text_config": {**text, "hidden_size": 64, "head_dim": 16}})
    assert bad_input(vlm_flags(other, grids), monkeypatch) == (
        f"{HF_MODEL_FLAG} {other}: projector multi_modal_projector.linear_2.weight output size "
        "48 does not meet the language model's hidden size (text_config), 64; the tower and "
        "language model are not this projector's pair")
    qwen2 = edited(folder, tmp_path / "qwen2", config={
        "text_config": {**text, "model_type": "qwen2"}})
    assert bad_input(vlm_flags(qwen2, grids), monkeypatch) == (
        f"{HF_MODEL_FLAG} {qwen2}/config.json text_config.model_type 'qwen2' is not mapped for "
        "llava; supported: llama, mistral")
    windowed = edited(folder, tmp_path / "windowed", config={
        "text_config": {**text, "model_type": "mistral", "sliding_window": 4096}})
    assert bad_input(vlm_flags(windowed, grids), monkeypatch).endswith(
        "config.json sliding_window = 4096 is not supported (Megatron attention here is full "
        "causal); only None can be imported")
    layers = edited(folder, tmp_path / "layers", config={"vision_feature_layer": [-2, -1]})
    assert bad_input(vlm_flags(layers, grids), monkeypatch) == (
        f"{HF_MODEL_FLAG} {layers}: config.json vision_feature_layer [-2, -1] is not supported; "
        "give one layer index (an int)")


@pytest.mark.parametrize("selection, tokens, layers", [
    ({}, PATCHES, 1),  # defaults: hidden_states[-2], class token dropped
    ({"vision_feature_select_strategy": "full"}, PATCHES + 1, 1),
    ({"vision_feature_layer": -1}, PATCHES, 2),
    ({"vision_feature_layer": 1}, PATCHES, 1),
], ids=["default", "full", "last-layer", "layer-1"])
def test_feature_selection_shapes_the_clip_encoder(llava, selection, tokens, layers, tmp_path):
    from tests.models.hf_vision import plugin

    folder = edited(llava[0], tmp_path / "llava", config=selection)
    encoder = plugin("clip", folder)
    assert (encoder.tokens_per_item, encoder.layers) == (tokens, layers)


def test_either_tower_naming_maps_and_carries_the_unfed_layers(llava):
    """A transformers 5 save names the tower vision_tower.embeddings.*, an older one
    vision_tower.vision_model.embeddings.*; both map, the unfed last layer and post_layernorm
    are carried, and the language and projector tensors belong to their own parts."""
    from megatron_plugins.weights.vision_families import CLIP_VISION
    from megatron_plugins.weights.vlm_families import LLAVA, part_families

    config = json.loads((llava[0] / "config.json").read_text())
    names = set(safetensors_of(llava[0]))
    old = {n.replace("vision_tower.", "vision_tower.vision_model.", 1) for n in names}
    for held, prefix in ((names, "vision_tower."), (old, "vision_tower.vision_model.")):
        parts = part_families(LLAVA, config, CLIP_VISION, held)
        assert parts.tower.bind("conv1.weight").hf == (f"{prefix}embeddings.patch_embedding.weight",)
        assert parts.tower.bind("decoder.layers.1.mlp.linear_fc1.weight") is not None  # a rule
        carried = {n for n in held if parts.tower.is_unused(n) and n.startswith("vision_tower.")}
        assert carried == {n for n in held if n.startswith(
            (f"{prefix}encoder.layers.1.", f"{prefix}post_layernorm."))}
    assert parts.language.bind("output_layer.weight").hf == ("language_model.lm_head.weight",)
    assert parts.projector.bind("0.encoder.linear_fc2.weight").hf == (
        "multi_modal_projector.linear_2.weight",)
    assert all(parts.projector.is_unused(n) for n in names if not n.startswith("multi_modal"))
