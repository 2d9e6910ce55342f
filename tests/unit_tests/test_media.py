"""Media bytes written by the dataset tools decode to the agreed kinds, and a corrupt sample is
reported with its key and field instead of a PIL or wave traceback."""

from __future__ import annotations

import io
import wave

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
)

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
    (decode_audio, "audio", "does not decode as WAV audio"),
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


@pytest.mark.parametrize("cut", [1, 2])
def test_a_wav_ending_inside_a_frame_is_a_bad_sample(cut):
    data = _wav(np.array([[1, 2], [3, 4]], "<i2"), 2, 2)[:-cut]
    with pytest.raises(BadSampleError, match=f"sample '{KEY}': field 'audio' is truncated"):
        decode_audio(data, KEY)


def test_24_bit_wav_is_refused_by_name():
    with pytest.raises(BadSampleError, match="field 'audio' is 24-bit WAV; only 8, 16 and 32-bit"):
        decode_audio(_wav(np.zeros(6, np.uint8), 3, 1), KEY)


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
