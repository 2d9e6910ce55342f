"""The mock data's media: a decoded image or waveform with a sample's class in it, at a size.

Kept apart from :mod:`.mock` so the encoder interface can make an example input from it without
importing the mock source, which imports the encoders.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_plugins.media.codec import DEFAULT_VIDEO_FPS, Video, Waveform

__all__ = ["MOCK_KINDS", "MOCK_VIDEO_FPS", "NUM_CLASSES", "example_size", "largest_video_size",
           "longest_clip_size", "mock_media", "mock_size"]

NUM_CLASSES = 8
"""Mock samples belong to one of these classes; encoders see it, text depends on it."""

IMAGE_SIDES = (16, 24, 32, 48)
"""Mock image heights and widths, drawn independently: sizes and aspect ratios vary (1:3 to 3:1)
as in real data, and encoders resize them as they would a real image."""

AUDIO_RATE = 16000
AUDIO_SAMPLES = 1600
"""Mock audio: 1600 samples (0.1 s at 16 kHz), a tone of ``400 x (class + 1)`` Hz in noise."""
AUDIO_SECONDS = (0.1, 0.3, 0.7, 1.3)
"""Mock clip lengths drawn for encoders whose tokens follow a clip's length (Qwen2.5-Omni's
audio tower), so their runs, chunks and pooling vary as real clips make them; others get
:data:`AUDIO_SAMPLES`."""

MOCK_VIDEO_FPS = DEFAULT_VIDEO_FPS
"""Mock videos' frames per second."""

MOCK_KINDS = ("image", "audio")
"""Decoded media the mock can make, by the kind an encoder's preprocessor reads."""


def mock_size(kind: str, generator: torch.Generator, rate: int | None,
              video_frames: int = 0, varied_clips: bool = False,
              video_fps: float = MOCK_VIDEO_FPS) -> tuple[int | float, ...]:
    """One item's size (:func:`~megatron_plugins.media.codec.media_size`), drawn from
    ``generator``: the language ranks draw it too, to lay out the item's placeholder run. With
    ``video_frames``, an image item is, one time in two, a video of that many frames at
    ``video_fps``; with ``varied_clips``, a clip's length is one of :data:`AUDIO_SECONDS`."""
    if kind == "image":
        sides = torch.randint(len(IMAGE_SIDES), (2,), generator=generator).tolist()
        size = (IMAGE_SIDES[sides[0]], IMAGE_SIDES[sides[1]])
        if video_frames and int(torch.randint(2, (1,), generator=generator)):
            return (video_frames, *size, video_fps)
        return size
    rate = rate or AUDIO_RATE
    if varied_clips:
        seconds = AUDIO_SECONDS[int(torch.randint(len(AUDIO_SECONDS), (1,), generator=generator))]
        return (round(seconds * rate), rate)
    return (AUDIO_SAMPLES, rate)


def longest_clip_size(rate: int | None) -> tuple[int, int]:
    """The mock's longest clip with ``varied_clips`` (:data:`AUDIO_SECONDS`) at ``rate``."""
    rate = rate or AUDIO_RATE
    return (round(AUDIO_SECONDS[-1] * rate), rate)


def largest_video_size(video_frames: int) -> tuple[int | float, ...]:
    """The mock's largest video of ``video_frames`` frames (its frames the largest image)."""
    return (video_frames, IMAGE_SIDES[-1], IMAGE_SIDES[-1], MOCK_VIDEO_FPS)


def example_size(kind: str, rate: int | None) -> tuple[int, ...]:
    """A typical item's size: the largest square image, or the mock clip."""
    return (IMAGE_SIDES[-1], IMAGE_SIDES[-1]) if kind == "image" else (AUDIO_SAMPLES,
                                                                      rate or AUDIO_RATE)


def _image(generator: torch.Generator, label: int, size: tuple[int, ...]) -> np.ndarray:
    """A dim noisy RGB image with a bright horizontal band whose height (an eighth of the image,
    from the top) is the class."""
    height, width = size
    pixels = 40 + 20 * torch.rand(height, width, 3, generator=generator)
    band = height // NUM_CLASSES
    top = (label % NUM_CLASSES) * band
    pixels[top:top + band] += 180
    return pixels.clamp(0, 255).to(torch.uint8).numpy()


def _audio(generator: torch.Generator, label: int, size: tuple[int, ...]) -> Waveform:
    """A tone whose pitch is the class, in noise, at the size's rate."""
    samples, rate = size
    t = torch.arange(samples, dtype=torch.float64) / rate
    tone = 0.5 * torch.sin(2 * torch.pi * 400 * (label + 1) * t)
    noise = 0.05 * torch.randn(samples, generator=generator, dtype=torch.float64)
    return Waveform((tone + noise).float().numpy(), rate)


def mock_media(kind: str, generator: torch.Generator, label: int,
               size: tuple[int | float, ...]) -> np.ndarray | Video | Waveform:
    """One decoded item of ``kind`` and ``size`` showing class ``label`` (in every frame of a
    video)."""
    if kind == "image" and len(size) == 4:
        frames = [_image(generator, label, size[1:3]) for _ in range(int(size[0]))]
        return Video(np.stack(frames), float(size[3]))
    return (_image if kind == "image" else _audio)(generator, label, size)
