"""``--hf-model DIR`` with a whole Qwen2.5-Omni folder: its audio tower (2-chunk windows, per-chunk
positions, pooled), its vision tower and its TMRoPE language model, each a module on its own
grid, give transformers' thinker logits on one sample of two images and two clips of different
lengths; every tensor of the three modules streams back unchanged, the talker and token2wav are
carried (no module's)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tests.models.qwen_omni import (
    AUDIO_TOKEN,
    IMAGE_TOKEN,
    VOCAB,
    forward,
    hf_thinker_logits,
    sample,
    save_tiny_omni,
)

TOLERANCE = 1e-5

LAYOUTS = {
    "one-rank-per-module": (("image:dp=1", "audio:dp=1", "language:dp=1"), 3),
    "audio-tp2-language-pp2": (("image:dp=1", "audio:tp=2", "language:pp=2"), 5),
    "both-encoders-tp2": (("image:tp=2", "audio:tp=2", "language:dp=1"), 5),
}


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    folder = save_tiny_omni(tmp_path_factory.mktemp("qwen_omni") / "omni")
    ids = sample(folder)
    return folder, ids, hf_thinker_logits(folder, ids)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("grids, nproc", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.multirank
def test_whole_qwen2_5_omni_reproduces_transformers_logits_on_images_and_clips(
        omni, grids, nproc):
    from megatron_plugins.weights.streaming import assemble
    from tests.models.hf import rel_diff, safetensors_of

    folder, ids, want = omni
    assert int((ids == AUDIO_TOKEN).sum()) == 20 + 33  # 82 and 132 mel frames
    results = forward(nproc, folder, grids, ids)
    logits, *others = [r["logits"] for r in results if r.get("logits") is not None]
    for other in others:
        np.testing.assert_array_equal(other, logits)
    assert rel_diff(logits[..., :VOCAB], want) < TOLERANCE
    for result in results:  # the checkpoint's own tokens mark each encoder's items
        assert result["special_token_ids"] == {"image": IMAGE_TOKEN, "audio": AUDIO_TOKEN}
    streamed = assemble(piece for result in results for piece in result["pieces"])
    original = safetensors_of(folder)
    carried = re.compile(r"talker\.|token2wav\.|thinker\.audio_tower\.audio_bos_eos_token\.")
    assert sorted(streamed) == sorted(n for n in original if not carried.match(n))
    for name, tensor in streamed.items():
        assert torch.equal(tensor, original[name]), name


def test_the_folder_splits_into_five_parts_and_carried_tensors(omni):
    """Every tensor belongs to exactly one of the towers, their projections and the language
    model, or is carried (talker, token2wav, the audio bos / eos embedding)."""
    from megatron_plugins.weights.audio_families import QWEN2_5_OMNI_AUDIO
    from megatron_plugins.weights.hf_folder import HFCheckpoint
    from megatron_plugins.weights.vision_families import QWEN2_5_OMNI_VISION
    from megatron_plugins.weights.vlm_families import part_families, read_vlm

    folder = omni[0]
    vlm, config = read_vlm(str(folder))
    names = HFCheckpoint(folder, "--hf-model").names()
    audio = part_families(vlm, config, QWEN2_5_OMNI_AUDIO, names)
    vision = part_families(vlm, config, QWEN2_5_OMNI_VISION, names)
    parts = (audio.tower, audio.projector, vision.tower, vision.projector, vision.language)

    def mapped(family):
        return {n.format(layer=layer) for rule in family.rules for n in rule.hf
                for layer in range(3)} & names

    owners = {name: [p.name for p in parts if name in mapped(p)] for name in names}
    carried = {name for name in names
               if any(re.match(pattern, name) for p in parts for pattern in p.untrained)}
    assert all(len(found) == 1 for name, found in owners.items() if name not in carried), owners
    assert {n.split(".")[0] for n in carried} == {"talker", "token2wav", "thinker"}
    assert [n for n in carried if n.startswith("thinker.")] == [
        "thinker.audio_tower.audio_bos_eos_token.weight"]
