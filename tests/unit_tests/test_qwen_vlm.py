"""``--hf-model DIR`` with a whole Qwen2.5-VL folder: its vision tower (windowed + full
attention blocks) on the encoder grid, its merger as the encoder's projection, its mrope language
model on the language grid give transformers' logits on a sample of several images of different
sizes at one rank per module and at encoder TP 2 + language PP 2; every tensor streams back
unchanged; a merger that does not meet the language model is one line."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_plugins.weights.streaming import assemble
from tests.hf_models import rel_diff, safetensors_of
from tests.qwen_vlm_models import IMAGE_TOKEN, VOCAB, forward, hf_logits, images, sample
from tests.qwen_vlm_models import save_tiny_qwen_vl

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = save_tiny_qwen_vl(tmp_path_factory.mktemp("qwen_vlm") / "qwen")
    pictures = images()
    ids = sample(folder, pictures)
    return folder, ids, pictures, hf_logits(folder, ids, pictures)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("grids, nproc", [
    (("image:dp=1", "language:dp=1"), 2),
    (("image:tp=2", "language:pp=2"), 4),
], ids=["one-rank-per-module", "encoder-tp2-language-pp2"])
def test_whole_qwen2_5_vl_reproduces_transformers_logits_on_three_images_and_streams_back(
        qwen, grids, nproc):
    folder, ids, pictures, want = qwen
    assert len({int(n) for n in (ids == IMAGE_TOKEN).sum(1)}) == 1 and want.shape[1] > 30
    results = forward(nproc, folder, grids, ids, pictures)
    [logits] = [r["logits"] for r in results if r["logits"] is not None]
    assert abs(logits[..., VOCAB:]).max() == 0  # padded vocabulary rows
    assert rel_diff(logits[..., :VOCAB], want) < TOLERANCE
    for result in results:  # the mock and the model mark images with the checkpoint's token
        assert result["special_token_ids"] == {"image": IMAGE_TOKEN}
    streamed = assemble(piece for result in results for piece in result["pieces"])
    original = safetensors_of(folder)
    assert sorted(streamed) == sorted(original)
    for name, tensor in streamed.items():
        assert torch.equal(tensor, original[name]), name
