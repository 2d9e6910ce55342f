"""Each encoder's preprocessing turns decoded media into the inputs its network expects: CLIP-style
crops for the ViT, log-mel frames for the audio encoder, windows for the sensor example; bad
flags are one line naming the flag."""

from __future__ import annotations

import argparse
import math
import pickle
import sys

import numpy as np
import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.media.codec import Waveform
from megatron_plugins.encoders import EncoderPluginError, check_hooks
from megatron_plugins.encoders.audio import (
    AudioFrameEncoder,
    LogMelPreprocessor,
    hz_to_mel,
    mel_filterbank,
    mel_to_hz,
)
from megatron_plugins.encoders.vit import CLIP_MEAN, CLIP_STD, ImagePreprocessor, ViTEncoder
from megatron_plugins.parallel.layout import ModulePlacement
from tests.harness.multiprocess import REPO_ROOT

RED, BLUE = (255, 0, 0), (0, 0, 255)
RATE = 16000


def _plugin(plugin_class, flags: list[str]):
    parser = argparse.ArgumentParser()
    plugin_class.add_arguments(parser)
    grid = ModulePlacement(name="enc", tp=1, pp=1, cp=1, dp=1, rank_offset=0, provider="x")
    return plugin_class("enc", parser.parse_args(flags), grid)


# Images -------------------------------------------------------------------------------------------

def test_image_output_is_a_normalized_float_crop_for_the_vit():
    image = np.random.default_rng(0).integers(0, 256, size=(30, 50, 3), dtype=np.uint8)
    plugin = _plugin(ViTEncoder, ["--vit-img-size", "16"])
    inputs = plugin.preprocessor()(image)
    assert list(inputs) == ["x"]
    assert inputs["x"].dtype == torch.float32 and inputs["x"].shape == (3, 16, 16)


@pytest.mark.parametrize("wide", [True, False])
def test_a_non_square_image_is_resized_on_its_shorter_side_and_center_cropped(wide):
    # 40 x 80: the middle 56 columns red, the 12 on each side blue. Squashing the whole image to
    # a square would bring blue in; cropping the centre after resizing keeps only red.
    image = np.empty((40, 80, 3), dtype=np.uint8)
    image[:] = BLUE
    image[:, 12:68] = RED
    if not wide:
        image = image.transpose(1, 0, 2).copy()
    pixels = ImagePreprocessor(20, mean=(0, 0, 0), std=(1, 1, 1))(image)["x"]
    assert pixels.shape == (3, 20, 20)
    red = torch.tensor(RED, dtype=torch.float32).view(3, 1, 1) / 255
    assert (pixels - red).abs().max() < 0.02


def test_normalization_is_per_channel_mean_and_std_on_unit_range():
    image = np.empty((24, 24, 3), dtype=np.uint8)
    image[:] = (10, 128, 250)
    pixels = ImagePreprocessor(8)(image)["x"]
    for channel, value in enumerate((10, 128, 250)):
        expected = (value / 255 - CLIP_MEAN[channel]) / CLIP_STD[channel]
        torch.testing.assert_close(pixels[channel], torch.full((8, 8), expected))


def test_the_vit_flags_set_the_statistics():
    plugin = _plugin(ViTEncoder, ["--vit-img-size", "8", "--vit-image-mean", "0.5", "0.5", "0.5",
                                  "--vit-image-std", "0.25", "0.5", "1"])
    pixels = plugin.preprocessor()(np.full((8, 8, 3), 255, dtype=np.uint8))["x"]
    assert pixels[:, 0, 0].tolist() == [2.0, 1.0, 0.5]


# Audio --------------------------------------------------------------------------------------------

def _tone(hz: float, seconds: float = 0.5) -> Waveform:
    t = np.arange(int(RATE * seconds)) / RATE
    return Waveform((0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32), RATE)


def _log_mel(num_frames: int = 20, num_mels: int = 24) -> LogMelPreprocessor:
    return LogMelPreprocessor(RATE, 400, 160, num_mels, num_frames)


def test_log_mel_frames_have_the_encoder_shape():
    inputs = _log_mel()(_tone(440.0))
    assert list(inputs) == ["frames"]
    assert inputs["frames"].dtype == torch.float32 and inputs["frames"].shape == (20, 24)


def test_a_pure_tone_lands_in_the_mel_bin_of_its_frequency():
    bins = []
    for hz in (300.0, 3000.0):
        frames = _log_mel()(_tone(hz))["frames"]
        expected = mel_filterbank(torch.tensor([hz]), 24, 0.0, RATE / 2)[:, 0].argmax().item()
        assert frames.mean(dim=0).argmax().item() == expected
        bins.append(expected)
    assert bins[0] < bins[1]


def test_short_audio_is_padded_with_silence_and_long_audio_cut_from_the_start():
    silence = _log_mel(num_frames=1)(Waveform(np.zeros(RATE, np.float32), RATE))["frames"][0, 0]
    assert silence == pytest.approx(math.log(1e-6))
    short = _log_mel(num_frames=50)(_tone(440.0, seconds=0.1))["frames"]  # 1 + 1600 // 160 frames
    assert short.shape == (50, 24)
    assert (short[11:] == silence).all() and (short[:11] > silence).any(dim=1).all()
    long = _log_mel(num_frames=5)(_tone(440.0))["frames"]
    assert long.shape == (5, 24)
    torch.testing.assert_close(long, _log_mel(num_frames=40)(_tone(440.0))["frames"][:5])


def test_audio_at_another_rate_is_heard_at_the_encoders_rate():
    """A tone recorded at 8 kHz gives the frames of the same tone at 16 kHz (the band above
    4 kHz, which 8 kHz cannot hold, is silent in both)."""
    t = np.arange(4000) / 8000
    low = Waveform((0.5 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32), 8000)
    frames, expected = _log_mel()(low)["frames"], _log_mel()(_tone(440.0))["frames"]
    loud = expected > expected.max() - 3.0  # the tone's bins, far above the resampling's noise
    torch.testing.assert_close(frames[2:-2][loud[2:-2]], expected[2:-2][loud[2:-2]], atol=0.05,
                               rtol=0)


def test_a_single_mel_filter_by_hand():
    # One filter from 0 Hz to 2100 Hz peaks at 700 Hz, the HTK mel midpoint: mel(2100) is twice
    # mel(700) because 1 + 2100/700 = (1 + 700/700)^2.
    weights = mel_filterbank(torch.tensor([0.0, 350.0, 700.0, 1400.0, 2100.0, 3000.0]), 1, 0.0,
                             2100.0)
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.5, 1.0, 0.5, 0.0, 0.0]]))


def test_mel_filters_are_triangles_peaking_at_rising_centres():
    num_mels, f_max = 16, 8000.0
    centres = mel_to_hz(torch.linspace(0.0, hz_to_mel(torch.tensor(f_max)).item(),
                                       num_mels + 2, dtype=torch.float64))[1:-1]
    assert (centres.diff() > 0).all()
    at_centres = mel_filterbank(centres, num_mels, 0.0, f_max)
    torch.testing.assert_close(at_centres, torch.eye(num_mels))
    dense = mel_filterbank(torch.linspace(0.0, f_max, 4001), num_mels, 0.0, f_max)
    assert dense.min() >= 0 and dense.max() <= 1
    peaks = dense.argmax(dim=1)
    assert (peaks.diff() > 0).all()


def test_the_audio_flags_reach_the_preprocessor():
    plugin = _plugin(AudioFrameEncoder, ["--audio-sample-rate", "8000", "--audio-n-fft", "200",
                                         "--audio-hop-length", "80", "--audio-num-frames", "6",
                                         "--audio-num-features", "10"])
    preprocessor = plugin.preprocessor()
    assert preprocessor == LogMelPreprocessor(8000, 200, 80, 10, 6)
    assert preprocessor(Waveform(np.zeros(8000, np.float32), 8000))["frames"].shape == (6, 10)


# The sensor example -------------------------------------------------------------------------------

def _sensor_encoder(monkeypatch) -> type:
    monkeypatch.syspath_prepend(str(REPO_ROOT / "examples" / "mimo" / "custom_encoder"))
    sys.modules.pop("sensor_encoder", None)
    from sensor_encoder import SensorEncoder

    return SensorEncoder


def test_the_sensor_example_cuts_a_trace_into_windows(monkeypatch):
    preprocessor = _plugin(_sensor_encoder(monkeypatch), ["--sensor-windows", "3",
                                           "--sensor-window-width", "4"]).preprocessor()
    trace = np.arange(1, 100, dtype=np.float32)
    readings = preprocessor(Waveform(trace, 100))["readings"]
    assert readings.shape == (3, 4) and readings[1].tolist() == [5, 6, 7, 8]
    short = preprocessor(Waveform(trace[:5], 100))["readings"]
    assert short.shape == (3, 4) and short.flatten().tolist() == [1, 2, 3, 4, 5] + [0] * 7


# Shared -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["vit", "audio", "sensor"])
def test_the_shipped_encoders_pass_the_build_time_checks(which, monkeypatch):
    plugin_class = {"vit": ViTEncoder, "audio": AudioFrameEncoder}.get(which) or _sensor_encoder(
        monkeypatch)
    language = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4)
    assert check_hooks(_plugin(plugin_class, []), language) is None


@pytest.mark.parametrize("plugin_class, key, shape", [
    (ViTEncoder, "x", (3, 16, 16)), (AudioFrameEncoder, "frames", (8, 16)),
])
def test_preprocessors_pickle_and_give_example_inputs_of_the_encoder_shape(plugin_class, key,
                                                                          shape):
    preprocessor = _plugin(plugin_class, []).preprocessor()
    copy = pickle.loads(pickle.dumps(preprocessor))
    assert copy == preprocessor
    assert copy.example_inputs()[key].shape == shape


@pytest.mark.parametrize("plugin_class, flags, message", [
    (ViTEncoder, ["--vit-image-std", "0.2", "0", "0.2"],
     "--vit-image-std 0.2 0.0 0.2: give 3 positive values, one per RGB channel"),
    (AudioFrameEncoder, ["--audio-sample-rate", "0"],
     "--audio-sample-rate 0: must be a positive integer"),
    (AudioFrameEncoder, ["--audio-n-fft", "-4"], "--audio-n-fft -4: must be a positive integer"),
    (AudioFrameEncoder, ["--audio-hop-length", "0"],
     "--audio-hop-length 0: must be a positive integer"),
    (AudioFrameEncoder, ["--audio-num-features", "0"],
     "--audio-num-features 0: must be a positive integer"),
])
def test_bad_preprocessing_flags_name_the_flag(plugin_class, flags, message):
    with pytest.raises(EncoderPluginError) as error:
        _plugin(plugin_class, flags)
    assert str(error.value) == message


def test_a_mean_without_three_channels_names_the_flag():
    parser = argparse.ArgumentParser()
    ViTEncoder.add_arguments(parser)
    args = parser.parse_args([])
    args.vit_image_mean = (0.5, 0.5)
    grid = ModulePlacement(name="enc", tp=1, pp=1, cp=1, dp=1, rank_offset=0, provider="vit")
    with pytest.raises(EncoderPluginError, match=r"^--vit-image-mean 0.5 0.5: give 3 values, one "
                                                 "per RGB channel$"):
        ViTEncoder("enc", args, grid)
