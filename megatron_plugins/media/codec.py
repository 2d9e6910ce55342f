"""Sample part bytes <-> decoded values: the one place that reads and writes images and audio
(reads WAV, FLAC, MP3 and whatever else libsndfile reads; writes WAV), reads video files (through
:mod:`megatron_plugins.media.video`), and reads text parts.

Decoded kinds (the contract with the data sources and the encoders' preprocessors): ``"image"`` is
a ``numpy.ndarray`` uint8 ``[H, W, 3]`` RGB, or a :class:`Video` (frames of one size, given in a
sample as a list of frame images or as a video file) for an encoder whose preprocessor takes
videos; ``"audio"`` is a :class:`Waveform`. The dataset tools write with the same module that
the loader reads with, so a round trip is exact by construction.
"""

from __future__ import annotations

import io
import math
import wave
from dataclasses import dataclass
from typing import Callable, TypeVar

import numpy as np
import soundfile
import soxr
from PIL import Image

from megatron_plugins.media.video import (
    VIDEO_CONTAINERS,
    VideoSampling,
    read_frames,
    read_size,
    read_sound,
)

__all__ = [
    "BadSampleError", "DECODERS", "DEFAULT_VIDEO_FPS", "MEDIA_KINDS", "VIDEO_SAMPLING", "Video",
    "Waveform",
    "decode_audio", "decode_image", "decode_item", "decode_sound", "decode_text", "decode_video",
    "encode_jpeg",
    "encode_png", "encode_wav", "is_video", "media_size", "probe_item", "probe_size", "resample"
]

T = TypeVar("T")

DEFAULT_VIDEO_FPS = 2.0
"""Frames per second of a video whose sample does not say (Qwen2.5-VL's recommended sampling)."""

VIDEO_SAMPLING = VideoSampling(fps=DEFAULT_VIDEO_FPS)
"""How frames are drawn from a video file: as the Qwen2-VL / Qwen2.5-VL video processor does."""


class BadSampleError(RuntimeError):
    """A sample that cannot be used mid-run; the message names the sample key and the field."""

    def __init__(self, key: str, field: str, problem: str) -> None:
        super().__init__(f"sample {key!r}: field {field!r} {problem}")
        self.key = key
        self.field = field


@dataclass(frozen=True)
class Waveform:
    """Mono audio: ``samples`` float32 ``[T]`` in [-1, 1] at ``sample_rate`` Hz."""

    samples: np.ndarray
    sample_rate: int


@dataclass(frozen=True)
class Video:
    """Frames sampled from a clip: ``frames`` uint8 ``[T, H, W, 3]`` RGB, ``fps`` of the sampled
    frames (what a model's temporal positions count time by). From a video file also each
    frame's ``timestamps`` (seconds). Its sound track is :func:`decode_sound`'s, read only where
    an audio encoder takes it (``--use-audio-in-video``)."""

    frames: np.ndarray
    fps: float = DEFAULT_VIDEO_FPS
    timestamps: np.ndarray | None = None


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def decode_text(data: bytes | str, key: str, field: str) -> str:
    """A text part as ``str``: Energon hands parts over as raw bytes with its decoder off (UTF-8 is
    read; a ``str``, already decoded by a sample loader, is kept)."""
    if isinstance(data, str):
        return data
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise BadSampleError(key, field, f"is {type(data).__name__}, not text")
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as error:
        raise BadSampleError(key, field, f"is not UTF-8 text ({error.reason} at byte "
                                         f"{error.start})") from None


def decode_image(data: bytes, key: str, field: str = "image") -> np.ndarray:
    """Any image PIL reads -> uint8 ``[H, W, 3]`` RGB (grey, palette and alpha images converted)."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except Exception as error:  # noqa: BLE001 - PIL raises many types for corrupt files
        raise BadSampleError(key, field,
                             f"does not decode as an image ({_first_line(error)})") from error


def decode_audio(data: bytes, key: str, field: str = "audio") -> Waveform:
    """Any audio file libsndfile reads (WAV, FLAC, MP3, OGG, ...) -> mono :class:`Waveform` at
    the file's own rate, channels averaged: transformers' ``load_audio`` (soundfile backend) step
    for step. Encoders resample it to their rate (:func:`resample`)."""
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as reader:
            rate, channels = reader.samplerate, reader.read(dtype="float32", always_2d=True).T
    except Exception as error:  # noqa: BLE001 - libsndfile raises LibsndfileError, TypeError, ...
        raise BadSampleError(key, field,
                             f"does not decode as audio ({_first_line(error)})") from error
    if not channels.shape[1]:
        raise BadSampleError(key, field, "is audio without samples; give a clip of at least one "
                                         "sample")
    samples = channels.mean(axis=0) if len(channels) > 1 else channels[0]
    return Waveform(np.ascontiguousarray(samples, dtype=np.float32), int(rate))


def resample(waveform: Waveform, sample_rate: int) -> Waveform:
    """``waveform`` at ``sample_rate`` Hz as transformers' ``load_audio`` (and ``librosa.load``)
    resample: soxr's high quality, then ``ceil(n * sample_rate / rate)`` samples (zero-padded or
    cut); as it is when already at that rate."""
    if waveform.sample_rate == sample_rate:
        return waveform
    length = math.ceil(len(waveform.samples) * sample_rate / waveform.sample_rate)
    samples = soxr.resample(waveform.samples, waveform.sample_rate, sample_rate,
                            quality="soxr_hq")
    samples = np.pad(samples, (0, max(0, length - len(samples))))[:length]
    return Waveform(np.ascontiguousarray(samples, dtype=np.float32), sample_rate)


def _encode_image(image: np.ndarray, **save: object) -> bytes:
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected a uint8 [H, W, 3] RGB image, got {image.dtype} "
                         f"{list(image.shape)}")
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, **save)
    return buffer.getvalue()


def encode_png(image: np.ndarray) -> bytes:
    """uint8 ``[H, W, 3]`` RGB -> PNG bytes (lossless)."""
    return _encode_image(image, format="PNG")


def encode_jpeg(image: np.ndarray, quality: int = 90) -> bytes:
    """uint8 ``[H, W, 3]`` RGB -> JPEG bytes (lossy; smaller shards for photos)."""
    return _encode_image(image, format="JPEG", quality=quality)


def encode_wav(waveform: Waveform) -> bytes:
    """Mono :class:`Waveform` -> 16-bit PCM WAV bytes (full scale 32768, as :func:`decode_audio`
    reads it; 1.0 clips to 32767)."""
    pcm = np.clip(np.round(waveform.samples * 32768.0), -32768, 32767).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(waveform.sample_rate)
        writer.writeframes(pcm.tobytes())
    return buffer.getvalue()


def is_video(data: object) -> bool:
    """Whether a sample's undecoded item is a video: a list of frame images, a mapping
    ``{"frames": [...], "fps": number}``, or a video file ``{"file": bytes, "container": "mp4"}``
    (:data:`~megatron_plugins.media.video.VIDEO_CONTAINERS`)."""
    return isinstance(data, (list, tuple, dict))


def _video_file(data: object, key: str, field: str) -> bytes | None:
    """A video file item's bytes (None: the item is frames); an unknown container or an empty
    file stops naming the field."""
    if not (isinstance(data, dict) and "file" in data):
        return None
    container, file = data.get("container"), data["file"]
    if container not in VIDEO_CONTAINERS:
        raise BadSampleError(key, field, f"is a video file of container {container!r}, which is "
                             f"not read; give one of {', '.join(VIDEO_CONTAINERS)}")
    if not isinstance(file, (bytes, bytearray, memoryview)) or not file:
        raise BadSampleError(key, field, f"is an empty {container} video file")
    return bytes(file)


def _read_video(read: Callable[..., T], file: bytes, key: str, field: str, *args: object) -> T:
    """``read(file, *args)`` of :mod:`megatron_plugins.media.video`, its ``ValueError`` as a
    :class:`BadSampleError` naming the field."""
    try:
        return read(file, *args)
    except ValueError as error:
        raise BadSampleError(key, field, f"(a video file) {error}") from None


def _video_parts(data: object, key: str, field: str) -> tuple[list[bytes], float]:
    """A video item's frame parts and fps; a malformed one stops naming the field."""
    fps = DEFAULT_VIDEO_FPS
    if isinstance(data, dict):
        fps = data.get("fps", DEFAULT_VIDEO_FPS)
        data = data.get("frames")
        if not isinstance(fps, (int, float)) or isinstance(fps, bool) or not fps > 0:
            raise BadSampleError(key, field, f"has fps {fps!r}; give a positive number")
    if not isinstance(data, (list, tuple)) or not data:
        raise BadSampleError(key, field, "is a video without frames; give a non-empty list of "
                                         "frame images")
    for index, frame in enumerate(data):
        if not isinstance(frame, (bytes, bytearray, memoryview)) or not frame:
            raise BadSampleError(key, f"{field}[{index}]", "is not an encoded frame image")
    return list(data), float(fps)


def _check_frame_sizes(sizes: list[tuple[int, ...]], key: str, field: str) -> None:
    for index, size in enumerate(sizes):
        if size != sizes[0]:
            raise BadSampleError(key, f"{field}[{index}]", f"is {size[0]}x{size[1]} (height x "
                                 f"width), not the {sizes[0][0]}x{sizes[0][1]} of the video's "
                                 "first frame; give frames of one size")


def decode_video(data: object, key: str, field: str) -> Video:
    """A video item (:func:`is_video`) -> :class:`Video`, a file's frames sampled as
    :data:`VIDEO_SAMPLING` says with its sound track; an unreadable file or frame, or frames of
    different sizes, stop naming the field."""
    if (file := _video_file(data, key, field)) is not None:
        frames, fps, timestamps = _read_video(read_frames, file, key, field, VIDEO_SAMPLING)
        return Video(frames, fps, timestamps)
    parts, fps = _video_parts(data, key, field)
    frames = [decode_image(part, key, f"{field}[{index}]") for index, part in enumerate(parts)]
    _check_frame_sizes([frame.shape[:2] for frame in frames], key, field)
    return Video(np.stack(frames), fps)


def decode_sound(data: object, key: str, field: str) -> Waveform | None:
    """A video item's sound track (:func:`~megatron_plugins.media.video.read_sound`: mono, at
    its own rate); None for a file without one or a video given as frames."""
    file = _video_file(data, key, field)
    sound = None if file is None else _read_video(read_sound, file, key, field)
    return None if sound is None else Waveform(*sound)


DECODERS = {"image": decode_image, "audio": decode_audio}
"""The decoder of each media kind a sample can carry."""

MEDIA_KINDS = tuple(DECODERS)
"""The media kinds a sample can carry and a preprocessor can read."""


def decode_item(kind: str, data: object, key: str, field: str) -> np.ndarray | Video | Waveform:
    """One undecoded item of a sample's ``kind`` media: a video where the item is one
    (:func:`is_video`), else the kind's decoder."""
    if kind == "image" and is_video(data):
        return decode_video(data, key, field)
    return DECODERS[kind](data, key, field)


def media_size(media: np.ndarray | Video | Waveform) -> tuple[int | float, ...]:
    """A decoded item's size, what an encoder's token count follows: ``(height, width)`` of an
    image, ``(frames, height, width, fps)`` of a video, ``(samples, sample_rate)`` of audio."""
    if isinstance(media, Waveform):
        return (len(media.samples), media.sample_rate)
    if isinstance(media, Video):
        frames, height, width = (int(n) for n in media.frames.shape[:3])
        return (frames, height, width, media.fps)
    return tuple(int(n) for n in media.shape[:2])


def probe_size(kind: str, data: bytes, key: str, field: str) -> tuple[int, ...]:
    """:func:`media_size` of an undecoded part, from its header alone (language ranks lay out an
    item's placeholder run from it without decoding the pixels or samples)."""
    try:
        if kind == "image":
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
            return (height, width)
        info = soundfile.info(io.BytesIO(data))
        return (int(info.frames), int(info.samplerate))
    except Exception as error:  # noqa: BLE001 - PIL and libsndfile raise many types
        what = "an image" if kind == "image" else "audio"
        raise BadSampleError(key, field, f"does not decode as {what} "
                                         f"({_first_line(error)})") from error


def probe_item(kind: str, data: object, key: str, field: str) -> tuple[int | float, ...]:
    """:func:`probe_size` of any undecoded item, a video's from its frames' headers (which must
    agree) or its file's stream metadata (the frames :data:`VIDEO_SAMPLING` draws)."""
    if not (kind == "image" and is_video(data)):
        return probe_size(kind, data, key, field)
    if (file := _video_file(data, key, field)) is not None:
        return _read_video(read_size, file, key, field, VIDEO_SAMPLING)
    parts, fps = _video_parts(data, key, field)
    sizes = [probe_size(kind, part, key, f"{field}[{index}]") for index, part in enumerate(parts)]
    _check_frame_sizes(sizes, key, field)
    return (len(parts), *sizes[0], fps)
