"""``--hf-model DIR`` with a whole Qwen3-Omni-MoE folder: its vision tower (Qwen3-VL-MoE's, with
DeepStack into the first language layers) and its Qwen3-MoE language model with interleaved
multimodal RoPE, each a module on its own grid (or the tower colocated), give transformers'
thinker logits on one sample of two images; every tensor of the modules streams back unchanged,
the talker and code2wav are carried (no module's)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tests.models.qwen3_omni_whole import (
    IMAGE_TOKEN,
    VOCAB,
    hf_thinker_logits,
    media,
    sample,
    save_tiny_qwen3_omni,
)

TOLERANCE = 1e-5
CARRIED = re.compile(r"talker\.|code2wav\.")

LAYOUTS = {
    "one-rank-per-module": (("image:dp=1", "language:dp=1"), 2),
    "vision-tp2-language-pp2-ep2": (("image:tp=2", "language:pp=2,dp=2,ep=2"), 6),
}


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    folder = save_tiny_qwen3_omni(tmp_path_factory.mktemp("qwen3_omni") / "omni")
    ids = sample(folder)
    return folder, ids, hf_thinker_logits(folder, ids)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("grids, nproc", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.multirank
def test_whole_qwen3_omni_reproduces_transformers_thinker_logits_and_streams_back(
        omni, grids, nproc):
    from megatron_plugins.weights.streaming import assemble
    from tests.models.hf import rel_diff, safetensors_of
    from tests.models.qwen_omni import forward

    folder, ids, want = omni
    results = forward(nproc, folder, grids, ids, media())
    logits, *others = [r["logits"] for r in results if r.get("logits") is not None]
    for other in others:
        np.testing.assert_array_equal(other, logits)
    assert rel_diff(logits[..., :VOCAB], want) < TOLERANCE
    for result in results:  # the checkpoint's own tokens mark each encoder's items
        assert result["special_token_ids"] == {"image": IMAGE_TOKEN}
    streamed = assemble(piece for result in results for piece in result["pieces"])
    original = safetensors_of(folder)
    assert sorted(streamed) == sorted(n for n in original
                                      if not CARRIED.match(n) and ".audio_tower." not in n)
    for name, tensor in streamed.items():
        assert torch.equal(tensor, original[name]), name
