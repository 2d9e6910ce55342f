"""Media bytes written by the dataset tools decode to the agreed kinds (audio: WAV, FLAC and MP3
at any rate, mono or stereo, resampled to an encoder's rate), and a corrupt sample is reported
with its key and field instead of a PIL or libsndfile traceback."""

from __future__ import annotations

import io
import math
import wave
from pathlib import Path

import numpy as np
import pytest

from megatron_plugins.media.codec import (
    DEFAULT_VIDEO_FPS,
    BadSampleError,
    Video,
    Waveform,
    decode_audio,
    decode_image,
    decode_item,
    encode_jpeg,
    encode_png,
    encode_wav,
    media_size,
    probe_item,
    resample,
)
from tests.harness.audio_files import CLIPS, tone, write_clip
from transformers.audio_utils import load_audio

KEY = "shard_000/00042"


def _image(height: int = 12, width: int = 20) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def test_png_round_trip_is_exact():
    image = _image()
    decoded = decode_image(encode_png(image), KEY)
    assert decoded.dtype == np.uint8 and decoded.shape == (12, 20, 3)
    np.testing.assert_array_equal(decoded, image)


def test_jpeg_decodes_to_rgb_close_to_the_original():
    image = np.full((16, 16, 3), (200, 40, 90), dtype=np.uint8)
    decoded = decode_image(encode_jpeg(image), KEY)
    assert decoded.shape == (16, 16, 3)
    assert np.abs(decoded.astype(int) - image).max() <= 4


def test_grey_and_alpha_images_become_rgb():
    from PIL import Image

    for mode in ("L", "RGBA", "P"):
        buffer = io.BytesIO()
        Image.new(mode, (5, 3)).save(buffer, format="PNG")
        assert decode_image(buffer.getvalue(), KEY).shape == (3, 5, 3)


def test_wav_round_trip_within_one_step_of_16_bit():
    samples = np.random.default_rng(0).uniform(-1, 1, 4000).astype(np.float32)
    samples[:3] = (1.0, -1.0, 0.0)
    decoded = decode_audio(encode_wav(Waveform(samples, 22050)), KEY)
    assert decoded.sample_rate == 22050 and decoded.samples.dtype == np.float32
    assert np.abs(decoded.samples - samples).max() <= 1 / 32768


def _wav(pcm: np.ndarray, width: int, channels: int) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as writer:
        writer.setnchannels(channels)
        writer.setsampwidth(width)
        writer.setframerate(8000)
        writer.writeframes(pcm.tobytes())
    return buffer.getvalue()


def test_stereo_is_averaged_to_mono():
    left, right = np.array([16384, -32768, 0], "<i2"), np.array([0, 0, 16384], "<i2")
    decoded = decode_audio(_wav(np.stack([left, right], axis=1), 2, 2), KEY)
    np.testing.assert_allclose(decoded.samples, [0.25, -0.5, 0.25])


@pytest.mark.parametrize("pcm, width", [
    (np.array([0, 128, 255], np.uint8), 1),
    (np.array([-2**31, 0, 2**30], "<i4"), 4),
])
def test_8_and_32_bit_pcm_are_scaled_to_unit_range(pcm, width):
    decoded = decode_audio(_wav(pcm, width, 1), KEY).samples
    expected = [-1.0, 0.0, 127 / 128] if width == 1 else [-1.0, 0.0, 0.5]
    np.testing.assert_allclose(decoded, expected)


@pytest.mark.parametrize("decode, field, what", [
    (decode_image, "image", "does not decode as an image"),
    (decode_audio, "audio", "does not decode as audio"),
])
def test_corrupt_bytes_name_the_sample_and_field(decode, field, what):
    with pytest.raises(BadSampleError) as error:
        decode(b"\x89PNG not really", KEY)
    message = str(error.value)
    assert message.startswith(f"sample {KEY!r}: field {field!r} {what} (")
    assert "\n" not in message


def test_the_field_name_is_the_callers():
    with pytest.raises(BadSampleError, match="field 'jpg'"):
        decode_image(encode_png(_image())[:40], KEY, field="jpg")


def test_24_bit_wav_decodes_to_unit_range():
    pcm = np.array([0, 0, 0x80, 0, 0, 0x40], np.uint8)  # -2**23 and 2**22, little-endian
    np.testing.assert_allclose(decode_audio(_wav(pcm, 3, 1), KEY).samples, [-1.0, 0.5])


def test_a_header_without_samples_is_a_bad_sample():
    with pytest.raises(BadSampleError, match=f"^sample '{KEY}': field 'audios\\[0\\]' is audio "
                                             "without samples"):
        decode_audio(_wav(np.zeros(0, "<i2"), 2, 1), KEY, "audios[0]")


@pytest.mark.parametrize("name", list(CLIPS))
def test_wav_flac_and_mp3_decode_to_mono_at_their_own_rate(tmp_path: Path, name: str):
    rate, channels, seconds = CLIPS[name]
    written = write_clip(tmp_path / name, rate, channels, seconds)
    data = (tmp_path / name).read_bytes()
    decoded = decode_audio(data, KEY)
    assert decoded.sample_rate == rate
    assert decoded.samples.dtype == np.float32 and decoded.samples.ndim == 1
    # Language ranks size an item from its header alone: it must agree with the decoded clip.
    assert probe_item("audio", data, KEY, "audios[0]") == media_size(decoded)
    mono = written.mean(axis=1)
    if name.endswith(".mp3"):  # lossy: the same length within a frame, the same loudness
        assert abs(len(decoded.samples) - len(mono)) <= 1
        assert np.sqrt(np.mean(decoded.samples ** 2)) == pytest.approx(0.5 / math.sqrt(2),
                                                                        rel=0.05)
    else:  # 16-bit PCM: within one step of each channel
        np.testing.assert_allclose(decoded.samples, mono, atol=1 / 32768)


@pytest.mark.parametrize("name", list(CLIPS))
def test_clips_resample_to_the_encoders_rate(tmp_path: Path, name: str):
    rate, channels, seconds = CLIPS[name]
    write_clip(tmp_path / name, rate, channels, seconds)
    decoded = decode_audio((tmp_path / name).read_bytes(), KEY)
    heard = resample(decoded, 16000)
    assert heard.sample_rate == 16000 and heard.samples.dtype == np.float32
    assert len(heard.samples) == math.ceil(len(decoded.samples) * 16000 / rate)
    # What a transformers user gets for the same file (its soundfile + soxr path), bit for bit.
    np.testing.assert_array_equal(heard.samples, load_audio(str(tmp_path / name), 16000,
                                                            backend="soundfile"))
    spectrum = np.abs(np.fft.rfft(heard.samples))
    peak_hz = np.argmax(spectrum) * 16000 / len(heard.samples)
    assert abs(peak_hz - 440.0) <= 16000 / len(heard.samples)  # the tone keeps its pitch
    if not name.endswith(".mp3"):  # the same tone made at 16 kHz, away from the clip's ends
        expected = tone(16000, channels, seconds).mean(axis=1)
        np.testing.assert_allclose(heard.samples[200:-200], expected[200:-200], atol=2e-3)
    assert resample(heard, 16000) is heard


@pytest.mark.parametrize("samples, rate", [(1000, 48000), (1, 44100), (3000, 44100)])
def test_a_resampled_clip_holds_its_duration_in_samples_rounded_up(samples, rate):
    """As transformers' load_audio and librosa.load: ceil, not round (334, 1 and 1089 here)."""
    heard = resample(Waveform(np.ones(samples, np.float32), rate), 16000)
    assert len(heard.samples) == math.ceil(samples * 16000 / rate)


def test_a_list_of_frame_images_is_a_video_whose_size_its_headers_give():
    frames = [_image(12, 20) + index for index in range(3)]
    parts = [encode_png(frame) for frame in frames]
    video = decode_item("image", parts, KEY, "images[1]")
    assert isinstance(video, Video) and video.fps == DEFAULT_VIDEO_FPS
    assert np.array_equal(video.frames, np.stack(frames))
    timed = decode_item("image", {"frames": parts, "fps": 4}, KEY, "images[1]")
    assert media_size(timed) == probe_item("image", {"frames": parts, "fps": 4}, KEY,
                                           "images[1]") == (3, 12, 20, 4.0)
    assert probe_item("image", parts[0], KEY, "images[0]") == (12, 20)


@pytest.mark.parametrize("read", [decode_item, probe_item], ids=["decode", "probe"])
def test_unreadable_or_inconsistent_frames_name_the_sample_and_frame(read):
    good = encode_png(_image(12, 20))
    with pytest.raises(BadSampleError, match=r"^sample 'shard_000/00042': field "
                                             r"'images\[1\]\[2\]' does not decode as an image"):
        read("image", [good, good, b"not an image"], KEY, "images[1]")
    with pytest.raises(BadSampleError, match=r"field 'images\[1\]\[1\]' is 8x20 \(height x "
                                             r"width\), not the 12x20 of the video's first frame"):
        read("image", [good, encode_png(_image(8, 20))], KEY, "images[1]")
    with pytest.raises(BadSampleError, match=r"field 'images\[1\]' is a video without frames"):
        read("image", [], KEY, "images[1]")
    with pytest.raises(BadSampleError, match=r"field 'images\[1\]' has fps -1"):
        read("image", {"frames": [good], "fps": -1}, KEY, "images[1]")
