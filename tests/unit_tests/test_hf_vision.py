"""The ``clip`` / ``siglip`` encoders reproduce transformers' vision models: hidden states from
imported HF weights (one rank and encoder TP 2), preprocessing equal to HF's image processors, and
one-line errors for folders that cannot be used."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatron_plugins.encoders import EncoderPluginError
from tests.models.hf_vision import (
    assert_streams_back,
    drop_tensor,
    encoder_rank,
    full_clip_hidden_states,
    hf_hidden_states,
    import_error,
    pixel_values,
    plugin,
    rel_diff,
    save_full_clip,
    save_tiny,
    train_and_export,
)
from tests.harness.multiprocess import run_in_processes
from tests.models.hf import safetensors_of

TOLERANCE = 1e-5
PATCHES = (16 // 4) ** 2


@pytest.mark.parametrize("provider, tokens, family", [
    ("clip", PATCHES + 1, "clip_vision"),  # class token + patches, before post_layernorm
    ("siglip", PATCHES, "siglip_vision"),  # patches after post_layernorm; the head is left out
])
@pytest.mark.multirank
def test_one_rank_encoder_reproduces_transformers_last_hidden_state(provider, tokens, family,
                                                                     tmp_path):
    folder = save_tiny(provider, tmp_path / provider)
    pixels = pixel_values()
    [result] = run_in_processes(encoder_rank, 1, args=(provider, str(folder), 1, pixels),
                                timeout=120, simulated=True)
    want = hf_hidden_states(provider, folder, pixels)
    assert result["family"] == family
    assert result["tokens_per_item"] == tokens == want.shape[1]
    assert result["output"].shape == want.shape
    assert rel_diff(result["output"], want) < TOLERANCE


@pytest.mark.parametrize("provider", ["clip", "siglip"])
@pytest.mark.multirank
def test_encoder_tp2_reproduces_transformers_and_streams_back(provider, tmp_path):
    folder = save_tiny(provider, tmp_path / provider, seed=3)
    pixels = pixel_values(seed=4)
    results = run_in_processes(encoder_rank, 2, args=(provider, str(folder), 2, pixels),
                               timeout=150, simulated=True)
    want = hf_hidden_states(provider, folder, pixels)
    for result in results:
        assert rel_diff(result["output"], want) < TOLERANCE
    assert_streams_back(provider, folder, results)


@pytest.mark.multirank
def test_full_clip_model_folder_loads_its_vision_tower(tmp_path):
    """A CLIPModel save: tensors under vision_model., plus a text tower the encoder leaves out."""
    folder = save_full_clip(tmp_path / "clip")
    pixels = pixel_values(batch=1)
    [result] = run_in_processes(encoder_rank, 1, args=("clip", str(folder), 1, pixels),
                                timeout=120, simulated=True)
    assert rel_diff(result["output"], full_clip_hidden_states(folder, pixels)) < TOLERANCE


@pytest.mark.multirank
def test_missing_hf_tensor_is_one_line_naming_it(tmp_path):
    whole = save_tiny("clip", tmp_path / "clip")
    broken = drop_tensor(whole, tmp_path / "broken", "encoder.layers.1.mlp.fc2.bias")
    [message] = run_in_processes(import_error, 1, args=("clip", str(broken)), timeout=120,
                                 simulated=True)
    assert "\n" not in message
    assert "missing HF tensors encoder.layers.1.mlp.fc2.bias" in message
    assert "decoder.layers.1.mlp.linear_fc2.bias" in message


def _image(height: int, width: int) -> np.ndarray:
    return np.random.default_rng(height * width).integers(0, 256, (height, width, 3), np.uint8)


def _hf_processor(provider: str, folder=None, **kwargs):
    from transformers import CLIPImageProcessorPil, SiglipImageProcessorPil

    cls = CLIPImageProcessorPil if provider == "clip" else SiglipImageProcessorPil
    return cls.from_pretrained(folder) if folder else cls(**kwargs)


HF_DEFAULTS = {  # HF's processors at the tiny model's image size (16)
    "clip": dict(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}),
    "siglip": dict(size={"height": 16, "width": 16}),
}


@pytest.mark.parametrize("provider", ["clip", "siglip"])
@pytest.mark.parametrize("height, width", [(23, 37), (40, 17), (16, 16)])
def test_default_preprocessing_equals_hf_image_processor(provider, height, width, tmp_path):
    """No preprocessor_config.json: the model's defaults (CLIP: shortest edge + center crop, CLIP
    mean/std; SigLIP: square resize, mean/std 0.5), bit for bit HF's PIL processor."""
    folder = save_tiny(provider, tmp_path / provider, num_hidden_layers=1)
    image = _image(height, width)
    got = plugin(provider, folder).preprocessor()(image)["x"]
    want = _hf_processor(provider, **HF_DEFAULTS[provider])(image, return_tensors="pt")
    assert got.dtype == torch.float32 and got.shape == (3, 16, 16)
    torch.testing.assert_close(got, want["pixel_values"][0], rtol=0, atol=0)


@pytest.mark.parametrize("provider, config", [
    ("clip", dict(size={"shortest_edge": 20}, crop_size={"height": 16, "width": 16},
                  resample=2, image_mean=[0.1, 0.2, 0.3], image_std=[0.9, 0.8, 0.7])),
    ("siglip", dict(size={"height": 16, "width": 16}, resample=3, rescale_factor=1 / 127.5,
                    image_mean=[1.0, 1.0, 1.0], image_std=[1.0, 1.0, 1.0])),
])
def test_preprocessor_config_json_is_followed_like_hf(provider, config, tmp_path):
    folder = save_tiny(provider, tmp_path / provider, num_hidden_layers=1)
    _hf_processor(provider, **config).save_pretrained(folder)
    image = _image(31, 22)
    got = plugin(provider, folder).preprocessor()(image)["x"]
    want = _hf_processor(provider, folder)(image, return_tensors="pt")["pixel_values"][0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_errors_name_the_flag_and_what_to_fix(tmp_path):
    siglip = save_tiny("siglip", tmp_path / "siglip", num_hidden_layers=1)
    with pytest.raises(EncoderPluginError, match=r"needs --encoder-hf-weights vision=DIR"):
        plugin("clip", None)
    with pytest.raises(EncoderPluginError, match=r"vision=.*siglip: config.json is a "
                                                 r"'siglip_vision_model' model, not "
                                                 r"'clip_vision_model'"):
        plugin("clip", siglip)
    relu = save_tiny("clip", tmp_path / "relu", num_hidden_layers=1, hidden_act="relu")
    with pytest.raises(EncoderPluginError, match=r"hidden_act 'relu' is not supported; "
                                                 r"supported: quick_gelu"):
        plugin("clip", relu)
    (siglip / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"height": 32, "width": 32}}))
    with pytest.raises(EncoderPluginError, match=r"preprocessor_config.json makes \(32, 32\) "
                                                 r"images but the model's image_size is 16"):
        plugin("siglip", siglip)


def test_export_config_is_the_loaded_vision_config(tmp_path):
    """What the export writes as the encoder's config.json: the vision config it was built from
    (a full model's vision_config too), refused when two folders of the family make it ambiguous."""
    import argparse

    from megatron_plugins.weights.mapping import HFWeightsError
    from megatron_plugins.weights.vision_families import CLIP_VISION

    full = save_full_clip(tmp_path / "full")
    args = argparse.Namespace(encoder_hf_weights=[f"vision={full}"])
    written = CLIP_VISION.hf_config(args, 0)
    assert written["model_type"] == "clip_vision_model"
    assert (written["hidden_size"], written["image_size"]) == (32, 16)
    other = save_tiny("clip", tmp_path / "other", num_hidden_layers=1)
    args.encoder_hf_weights.append(f"second={other}")
    with pytest.raises(HFWeightsError, match="2 clip_vision_model folders given"):
        CLIP_VISION.hf_config(args, 0)


@pytest.mark.multirank
def test_trained_clip_tower_exports_what_it_streams_and_transformers_reproduces_it(tmp_path):
    """Round trip of an encoder: CLIP imported at encoder TP 2, trained 2 steps, saved, exported;
    the exported vision folder holds exactly the live tower's streamed tensors plus the untrained
    post_layernorm from the folder the run started from, and transformers on that folder gives
    our encoder's hidden states."""
    clip = save_tiny("clip", tmp_path / "clip")
    streamed, out = train_and_export(tmp_path, "clip", clip)
    exported = safetensors_of(out / "vision")
    original = safetensors_of(clip)
    untrained = {n: t for n, t in original.items() if n.startswith("post_layernorm.")}
    assert sorted(untrained) == ["post_layernorm.bias", "post_layernorm.weight"]
    assert sorted(exported) == sorted({**streamed, **untrained}) == sorted(original)  # a whole
    # CLIPVisionModel
    for name, tensor in {**streamed, **untrained}.items():
        assert torch.equal(exported[name], tensor), name
    assert not torch.equal(exported["encoder.layers.0.mlp.fc1.weight"],
                           original["encoder.layers.0.mlp.fc1.weight"])  # it trained
    pixels = pixel_values(seed=5)
    [ours] = run_in_processes(encoder_rank, 1, args=("clip", str(out / "vision"), 1, pixels),
                              timeout=120, simulated=True)
    assert rel_diff(ours["output"], hf_hidden_states("clip", out / "vision", pixels)) < TOLERANCE
