"""The ``clip`` / ``siglip`` encoders reproduce transformers' vision models: hidden states from
imported HF weights (one rank and encoder TP 2), preprocessing equal to HF's image processors, and
one-line errors for folders that cannot be used."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatron_plugins.encoders import EncoderPluginError
from tests.hf_vision_models import (
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
)
from tests.multiprocess import run_in_processes

TOLERANCE = 1e-5
PATCHES = (16 // 4) ** 2


@pytest.mark.parametrize("provider, tokens, family", [
    ("clip", PATCHES + 1, "clip_vision"),  # class token + patches, before post_layernorm
    ("siglip", PATCHES, "siglip_vision"),  # patches after post_layernorm; the head is left out
])
def test_one_rank_encoder_reproduces_transformers_last_hidden_state(provider, tokens, family,
                                                                     tmp_path):
    folder = save_tiny(provider, tmp_path / provider)
    pixels = pixel_values()
    [result] = run_in_processes(encoder_rank, 1, args=(provider, str(folder), 1, pixels),
                                timeout=120)
    want = hf_hidden_states(provider, folder, pixels)
    assert result["family"] == family
    assert result["tokens_per_sample"] == tokens == want.shape[1]
    assert result["output"].shape == want.shape
    assert rel_diff(result["output"], want) < TOLERANCE


@pytest.mark.parametrize("provider", ["clip", "siglip"])
def test_encoder_tp2_reproduces_transformers(provider, tmp_path):
    folder = save_tiny(provider, tmp_path / provider, seed=3)
    pixels = pixel_values(seed=4)
    results = run_in_processes(encoder_rank, 2, args=(provider, str(folder), 2, pixels),
                               timeout=150)
    want = hf_hidden_states(provider, folder, pixels)
    for result in results:
        assert rel_diff(result["output"], want) < TOLERANCE


def test_full_clip_model_folder_loads_its_vision_tower(tmp_path):
    """A CLIPModel save: tensors under vision_model., plus a text tower the encoder leaves out."""
    folder = save_full_clip(tmp_path / "clip")
    pixels = pixel_values(batch=1)
    [result] = run_in_processes(encoder_rank, 1, args=("clip", str(folder), 1, pixels),
                                timeout=120)
    assert rel_diff(result["output"], full_clip_hidden_states(folder, pixels)) < TOLERANCE


def test_missing_hf_tensor_is_one_line_naming_it(tmp_path):
    whole = save_tiny("clip", tmp_path / "clip")
    broken = drop_tensor(whole, tmp_path / "broken", "encoder.layers.1.mlp.fc2.bias")
    [message] = run_in_processes(import_error, 1, args=("clip", str(broken)), timeout=120)
    assert "\n" not in message
    assert "missing HF tensors encoder.layers.1.mlp.fc2.bias" in message
    assert "decoder.layers.1.mlp.linear_fc2.bias" in message
