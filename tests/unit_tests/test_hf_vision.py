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
    encoder_rank,
    hf_hidden_states,
    pixel_values,
    plugin,
    rel_diff,
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
