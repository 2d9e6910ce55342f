"""The mock data's media: a decoded image or waveform with a sample's class in it.

Kept apart from :mod:`.mock` so the encoder interface can make an example input from it without
importing the mock source, which imports the encoders.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_plugins.data.media import Waveform

__all__ = ["MOCK_MEDIA", "NUM_CLASSES"]

NUM_CLASSES = 8
"""Mock samples belong to one of these classes; encoders see it, text depends on it."""

IMAGE_SIZE = 32
"""Mock images are square RGB of this size; encoders resize them as they would a real image."""

AUDIO_RATE = 16000
AUDIO_SAMPLES = 1600
"""Mock audio: 1600 samples (0.1 s at 16 kHz), a tone of ``400 x (class + 1)`` Hz in noise."""


def mock_image(generator: torch.Generator, label: int, rate: int | None = None) -> np.ndarray:
    """A dim noisy RGB image with a bright horizontal band whose row is the class."""
    pixels = 40 + 20 * torch.rand(IMAGE_SIZE, IMAGE_SIZE, 3, generator=generator)
    band = (label % NUM_CLASSES) * (IMAGE_SIZE // NUM_CLASSES)
    pixels[band:band + IMAGE_SIZE // NUM_CLASSES] += 180
    return pixels.clamp(0, 255).to(torch.uint8).numpy()


def mock_audio(generator: torch.Generator, label: int, rate: int | None = None) -> Waveform:
    """A tone whose pitch is the class, in noise, at the rate the encoder expects."""
    rate = rate or AUDIO_RATE
    t = torch.arange(AUDIO_SAMPLES, dtype=torch.float64) / rate
    tone = 0.5 * torch.sin(2 * torch.pi * 400 * (label + 1) * t)
    noise = 0.05 * torch.randn(AUDIO_SAMPLES, generator=generator, dtype=torch.float64)
    return Waveform((tone + noise).float().numpy(), rate)


MOCK_MEDIA = {"image": mock_image, "audio": mock_audio}
"""Decoded media the mock can make, by the kind an encoder's preprocessor reads."""
