"""The ``whisper`` encoder reproduces transformers' Whisper encoder: features equal to
``WhisperFeatureExtractor``, hidden states from imported HF weights (one rank and encoder TP 2),
the key bias HF lacks held at zero and left out on export, and one-line errors for folders and
clips that cannot be used."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from megatron_plugins.media.codec import Waveform
from megatron_plugins.encoders import EncoderPluginError
from megatron_plugins.weights.streaming import assemble
from tests.models.hf import pieces_from, safetensors_of
from tests.models.hf_vision import drop_tensor, rel_diff
from tests.models.hf_whisper import (
    RATE,
    SHAPE,
    encoder_rank,
    hf_features,
    hf_hidden_states,
    import_error,
    plugin,
    save_tiny,
    waveforms,
)
from tests.harness.multiprocess import run_in_processes

TOLERANCE = 1e-5
POSITIONS = SHAPE["max_source_positions"]


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("whisper") / "model")


def _features(folder, names=("full", "short")) -> np.ndarray:
    clips = waveforms()
    return np.stack([hf_features(folder, clips[name]) for name in names])


@pytest.mark.parametrize("name", sorted(waveforms()))
def test_features_equal_whisper_feature_extractor(whisper, name):
    """Short (padded), one chunk, longer (cut, as HF does), silence, a loud tone: bit for bit."""
    samples = waveforms()[name]
    got = plugin(whisper).preprocessor()(Waveform(samples, RATE))["input_features"]
    want = hf_features(whisper, samples)
    assert got.dtype == torch.float32 and tuple(got.shape) == (SHAPE["num_mel_bins"],
                                                                2 * POSITIONS)
    np.testing.assert_array_equal(got.numpy(), want)


def test_a_long_clip_at_44_1_khz_gets_the_features_hf_gives_it_resampled(whisper):
    """transformers' ``load_audio`` (soundfile fallback) resamples with soxr to the extractor's
    rate; the encoder's preprocessor does the same, then cuts the clip (1.5 s) to the chunk (1 s
    here, 30 s in released checkpoints) as the extractor does: HF's features bit for bit."""
    import soxr

    samples = (0.3 * np.random.default_rng(1).standard_normal(44100 * 3 // 2)).astype(np.float32)
    got = plugin(whisper).preprocessor()(Waveform(samples, 44100))["input_features"]
    np.testing.assert_array_equal(got.numpy(),
                                  hf_features(whisper, soxr.resample(samples, 44100, RATE)))


def test_features_follow_preprocessor_config_json(tmp_path):
    """Another hop, FFT size, chunk and padding value from preprocessor_config.json (2 s at hop
    320: 100 frames), as the extractor loaded from the same folder computes them."""
    from transformers import WhisperFeatureExtractor

    folder = save_tiny(tmp_path / "whisper", encoder_layers=1)
    WhisperFeatureExtractor(feature_size=16, sampling_rate=RATE, hop_length=320, n_fft=512,
                            chunk_length=2, padding_value=0.1).save_pretrained(folder)
    samples = waveforms()["long"]
    got = plugin(folder).preprocessor()(Waveform(samples, RATE))["input_features"]
    want = WhisperFeatureExtractor.from_pretrained(folder)(samples, sampling_rate=RATE)
    np.testing.assert_array_equal(got.numpy(), want["input_features"][0])


@pytest.mark.multirank
def test_one_rank_encoder_reproduces_transformers_and_keeps_key_bias_out(whisper):
    features = _features(whisper)
    [result] = run_in_processes(encoder_rank, 1, args=(str(whisper), 1, features), timeout=120,
                                simulated=True)
    want = hf_hidden_states(whisper, features)
    assert result["family"] == "whisper_encoder"
    assert result["tokens_per_item"] == POSITIONS == want.shape[1]
    assert result["output"].shape == want.shape == (2, POSITIONS, SHAPE["d_model"])
    assert rel_diff(result["output"], want) < TOLERANCE
    # The fused qkv bias's key part gets exactly no gradient (HF has no key bias), q and v do.
    assert result["key_bias_grad"] == 0.0 and result["qv_bias_grad"] > 0.0


@pytest.mark.parametrize("model", ["WhisperModel", "WhisperEncoder"])
@pytest.mark.multirank
def test_other_whisper_folders_load_their_encoder(model, tmp_path):
    """A WhisperModel (encoder. prefix, a decoder left out) and an encoder-only save."""
    folder = save_tiny(tmp_path / model, seed=5, model=model)
    features = _features(folder, ("tone",))
    [result] = run_in_processes(encoder_rank, 1, args=(str(folder), 1, features), timeout=120,
                                simulated=True)
    assert rel_diff(result["output"], hf_hidden_states(folder, features)) < TOLERANCE


@pytest.mark.multirank
def test_encoder_tp2_reproduces_transformers_and_streams_back(tmp_path):
    folder = save_tiny(tmp_path / "whisper", seed=3)
    features = _features(folder, ("long", "silence", "short"))
    results = run_in_processes(encoder_rank, 2, args=(str(folder), 2, features), timeout=150,
                               simulated=True)
    want = hf_hidden_states(folder, features)
    for result in results:
        assert rel_diff(result["output"], want) < TOLERANCE
        assert result["key_bias_grad"] == 0.0
    # The two TP ranks' streamed pieces reassemble to exactly the folder's encoder tensors.
    family = plugin(folder).hf_family
    pieces = [piece for result in results for piece in pieces_from(result["pieces"])]
    assert {p.hf_name for p in pieces if "fc1.weight" in p.hf_name and p.tensor.shape[0] < 48}
    assembled = assemble(pieces)
    original = {n.removeprefix("model.encoder."): t for n, t in safetensors_of(folder).items()
                if not family.is_unused(n)}
    assert sorted(assembled) == sorted(original)
    assert not any("k_proj.bias" in name for name in assembled)
    for name, tensor in original.items():
        assert torch.equal(assembled[name], tensor), name


def test_export_refuses_a_nonzero_key_bias():
    """Streaming drops the key part of the fused qkv bias only while it is zero."""
    from megatron_plugins.weights.local_view import LocalParam
    from megatron_plugins.weights.mapping import Heads, HFWeightsError
    from megatron_plugins.weights.streaming import pieces_of
    from megatron_plugins.weights.audio_families import WHISPER_ENCODER

    name = "decoder.layers.0.self_attention.linear_qkv.bias"
    bound = WHISPER_ENCODER.bind(name)
    heads = Heads(2, 2, 4)
    bias = torch.arange(1.0, 25.0).view(2, 3, 4)
    bias[:, 1] = 0
    hf = {p.hf_name: p.tensor for p in pieces_of(LocalParam(name, bias, bound, 0, 1),
                                                 bias.view(-1), heads, None)}
    assert sorted(hf) == ["layers.0.self_attn.q_proj.bias", "layers.0.self_attn.v_proj.bias"]
    bias[1, 1, 2] = 0.5
    with pytest.raises(HFWeightsError, match=r"linear_qkv.bias: its layers.0.self_attn.k_proj."
                                             r"bias part is nonzero \(max \|x\| 0.5\)"):
        list(pieces_of(LocalParam(name, bias, bound, 0, 1), bias.view(-1), heads, None))


@pytest.mark.multirank
def test_missing_hf_tensor_is_one_line_naming_it(whisper, tmp_path):
    broken = drop_tensor(whisper, tmp_path / "broken", "model.encoder.layers.1.fc2.bias")
    shutil.copy(whisper / "preprocessor_config.json", broken)
    [message] = run_in_processes(import_error, 1, args=(str(broken),), timeout=120,
                                 simulated=True)
    assert "\n" not in message
    assert "missing HF tensors model.encoder.layers.1.fc2.bias" in message
    assert "decoder.layers.1.mlp.linear_fc2.bias" in message


def test_errors_name_the_flag_file_and_sample_field(whisper, tmp_path):
    from tests.models.hf_vision import save_tiny as save_vision

    with pytest.raises(EncoderPluginError, match=r"needs --encoder-hf-weights audio=DIR"):
        plugin(None)
    clip = save_vision("clip", tmp_path / "clip", num_hidden_layers=1)
    with pytest.raises(EncoderPluginError, match=r"audio=.*clip: config.json is a "
                                                 r"'clip_vision_model' model, not 'whisper'"):
        plugin(clip)
    config = tmp_path / "chunk"
    save_tiny(config, encoder_layers=1)
    extractor = json.loads((config / "preprocessor_config.json").read_text())
    (config / "preprocessor_config.json").write_text(json.dumps({**extractor,
                                                                 "chunk_length": 2}))
    with pytest.raises(EncoderPluginError, match=r"chunk_length 2 s makes 200 mel frames .* the "
                                                 r"model takes 100 \(config.json "
                                                 r"max_source_positions 50 x 2\)"):
        plugin(config)


@pytest.mark.multirank
def test_trained_whisper_encoder_exports_what_it_streams_and_transformers_loads_it(tmp_path):
    """Round trip through stock pretrain(): Whisper imported at encoder TP 2 behind a language
    model, trained 2 steps, saved, exported; the key bias stayed zero (streaming refuses it
    otherwise), the exported encoder folder holds exactly the live encoder's streamed tensors, and
    transformers' WhisperEncoder loads it with no tensor missing or left over."""
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    from tests.models import hf as hf_models

    language = hf_models.save_tiny("llama", tmp_path / "llama")
    whisper = save_tiny(tmp_path / "whisper", seed=7)
    checkpoint, out = tmp_path / "ckpt", tmp_path / "out"
    encoder = ("--encoder", "audio=whisper", "--grid", "audio:tp=2",
               "--encoder-hf-weights", f"audio={whisper}")
    pieces, _ = hf_models.train_from_hf(
        3, str(language), "language:", ("--seq-length", "64", "--mock-items-per-sample", "1",
                                        "--train-iters", "2",
                                        "--save", str(checkpoint), "--save-interval", "2"),
        module="audio", encoder=encoder)
    hf_models.export_checkpoints([(str(checkpoint), str(out), {"progress": False})])
    streamed = assemble(piece for rank in pieces for piece in rank)
    exported = safetensors_of(out / "audio")
    original = {n.removeprefix("model.encoder."): t for n, t in safetensors_of(whisper).items()
                if n.startswith("model.encoder.")}
    assert sorted(exported) == sorted(streamed) == sorted(original)
    for name, tensor in streamed.items():
        assert torch.equal(exported[name], tensor), name
    trained = [n for n in original if not torch.equal(original[n], streamed[n])]
    assert "layers.0.fc1.weight" in trained and "embed_positions.weight" not in trained
    model, info = WhisperEncoder.from_pretrained(out / "audio", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    from transformers import WhisperFeatureExtractor

    sound = waveforms()["short"]
    features = [WhisperFeatureExtractor.from_pretrained(folder)(sound, sampling_rate=RATE,
                                                                return_tensors="np")
                for folder in (out / "audio", whisper)]  # the export carries the extractor
    assert np.array_equal(features[0]["input_features"], features[1]["input_features"])
