"""The ``qwen3_omni_audio`` encoder reproduces transformers' Qwen3-Omni audio tower (AuT) with its
projection: the processor's features and token count, the output on a clip of three chunks in
two attention windows and a clip shorter than a chunk (imported from a whole folder at tp 1 and a
thinker-only save at tp 2), every tensor streamed back unchanged, FLOPs exactly as
FlopCounterMode counts them, and one-line errors for folders it cannot honour."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from megatron_plugins.encoders import EncoderPluginError, check_hooks
from megatron_plugins.encoders.qwen3_omni_audio import audio_tokens
from megatron_plugins.media.codec import Waveform
from tests.harness.multiprocess import run_in_processes
from tests.models.hf_vision import language_config, rel_diff
from tests.models import qwen3_omni as tiny
from tests.models.qwen3_omni import AUDIO, RATE, clips, hf_features, plugin

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(whole folder, thinker-only save) of one tiny model."""
    return tiny.save_tiny(tmp_path_factory.mktemp("qwen3_omni"))


@pytest.fixture(scope="module")
def want(folders):
    return tiny.hf_output(folders[0], clips())


def test_token_count_is_transformers():
    """Both of transformers' ``_get_feat_extract_output_lengths`` (model and processor), on every
    length up to 50 s and a few longer."""
    from transformers.models.qwen3_omni_moe import (
        modeling_qwen3_omni_moe,
        processing_qwen3_omni_moe,
    )

    lengths = torch.cat([torch.arange(5001), torch.tensor([29999, 30000, 30001, 123457])])
    got = [audio_tokens(n, 2 * AUDIO["n_window"]) for n in lengths.tolist()]
    for module in (modeling_qwen3_omni_moe, processing_qwen3_omni_moe):
        assert got == module._get_feat_extract_output_lengths(lengths, AUDIO["n_window"]).tolist()


def test_features_are_the_processors_of_each_clip(folders):
    """Each clip given alone: the processor's features bit for bit, as many frames as its mask;
    in the processor's batch the longest clip's too, while the shorter one is followed by zeros
    (one more frame here): why each clip is its own. A 44.1 kHz clip: resampled as
    transformers' ``load_audio``, then the same."""
    import soxr

    encoder = plugin(folders[0])
    assert check_hooks(encoder, language_config(hidden_size=tiny.TEXT_HIDDEN)) is None
    preprocessor = encoder.preprocessor()
    got = [preprocessor(Waveform(clip, RATE))["input_features"].numpy() for clip in clips()]
    for clip, features in zip(clips(), got):
        [alone] = hf_features(folders[0], [clip])
        assert features.shape == alone.shape == (AUDIO["num_mel_bins"], len(clip) // 160)
        np.testing.assert_array_equal(features, alone)
    longest, shorter = hf_features(folders[0], clips())
    np.testing.assert_array_equal(got[0], longest)
    assert shorter.shape[1] == got[1].shape[1] + 1
    samples = (0.3 * np.random.default_rng(1).standard_normal(44100 * 3 // 2)).astype(np.float32)
    features = preprocessor(Waveform(samples, 44100))["input_features"].numpy()
    [resampled] = hf_features(folders[0], [soxr.resample(samples, 44100, RATE)])
    np.testing.assert_array_equal(features, resampled)
    assert encoder.item_tokens((len(samples), 44100)) == audio_tokens(150, 100) == 20
    with pytest.raises(ValueError, match="a clip of 200 samples at 16000 Hz is too short"):
        preprocessor(Waveform(np.zeros(200, np.float32), RATE))
    with pytest.raises(RuntimeError):  # transformers' extractor cannot take it either
        hf_features(folders[0], [np.zeros(200, np.float32)])


def _assert_streams_back(folder, results, prefix: str) -> None:
    """The ranks' streamed pieces reassemble to exactly the folder's audio tower tensors (fc1
    split over the ranks when there are two)."""
    from megatron_plugins.weights.streaming import assemble
    from tests.models.hf import pieces_from, safetensors_of

    pieces = [piece for result in results for piece in pieces_from(result["pieces"])]
    split = {p.hf_name for p in pieces if p.hf_name.endswith("fc1.weight")
             and p.tensor.shape[0] < AUDIO["encoder_ffn_dim"]}
    assert bool(split) == (len(results) > 1)
    assembled = assemble(pieces)
    original = {n.removeprefix(prefix): t for n, t in safetensors_of(folder).items()
                if n.startswith(prefix)}
    assert sorted(assembled) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(assembled[name], tensor), name


def _assert_reproduces(results, want) -> None:
    for result in results:
        assert result["family"] == "qwen3_omni_audio"
        assert result["item_tokens"] == [34, 10]
        assert result["output"].shape == want.shape == (44, tiny.TEXT_HIDDEN)
        assert rel_diff(result["output"], want) < TOLERANCE
        # The fused qkv bias's key part (imported: it streams back) gets exactly no gradient, as
        # the softmax makes it; q and v do.
        assert result["key_bias_grad"] == 0.0 and result["qv_bias_grad"] > 0.0


@pytest.mark.multirank
def test_whole_folder_at_tp1_reproduces_transformers_streams_back_and_counts_flops(folders,
                                                                                    want):
    [result] = run_in_processes(tiny.audio_rank, 1, args=(str(folders[0]), 1, clips()),
                                timeout=150, simulated=True)
    _assert_reproduces([result], want)
    _assert_streams_back(folders[0], [result], "thinker.audio_tower.")
    rows = result["flops"]
    assert [row.case for row in rows] == [case for case, _, _ in tiny.FLOPS_CASES]
    assert [(row.case, row.formula - row.counted) for row in rows
            if row.formula != row.counted] == []


@pytest.mark.multirank
def test_thinker_save_at_tp2_reproduces_transformers_and_streams_back(folders, want):
    results = run_in_processes(tiny.audio_rank, 2, args=(str(folders[1]), 2, clips()),
                               timeout=150, simulated=True)
    _assert_reproduces(results, want)
    np.testing.assert_array_equal(results[0]["output"], results[1]["output"])
    _assert_streams_back(folders[1], results, "audio_tower.")


@pytest.mark.parametrize("field, value, message", [
    ("n_window", 40, r"config.json audio_config n_window 40 is not supported: its 80-frame "
                     r"chunk leaves 10 positions, transformers counts 13 \(n_window 49 to 52\)"),
    ("n_window_infer", 50, r"config.json audio_config n_window_infer 50 is shorter than one "
                           r"chunk \(2 x n_window = 100 frames\)"),
    ("activation_function", "relu", r"config.json audio_config activation_function 'relu' is "
                                     r"not supported; supported: gelu"),
], ids=["n_window", "n_window_infer", "activation_function"])
def test_a_field_it_cannot_honour_is_one_line(folders, tmp_path, field, value, message):
    folder = tmp_path / "edited"
    folder.mkdir()
    config = json.loads((folders[0] / "config.json").read_text())
    config["thinker_config"]["audio_config"][field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(EncoderPluginError, match=rf"^--encoder-hf-weights audio=.*edited: "
                                                 rf"{message}$"):
        plugin(folder)


def test_errors_name_the_flag_and_the_model(folders, tmp_path):
    with pytest.raises(EncoderPluginError, match=r"--encoder audio=qwen3_omni_audio needs "
                                                 r"--encoder-hf-weights audio=DIR, a "
                                                 r"Qwen3-Omni-MoE folder"):
        plugin(None)
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(folders[0] / "config.json", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "qwen2_5_omni"}))
    with pytest.raises(EncoderPluginError, match=r"config.json is a 'qwen2_5_omni' model, not "
                                                 r"qwen3_omni_moe or qwen3_omni_moe_thinker"):
        plugin(other)
