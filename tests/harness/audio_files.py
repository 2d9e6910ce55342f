"""Real audio files for the tests, written with the library training decodes them with
(soundfile, libsndfile: WAV, FLAC and MP3), at the rates and channel counts datasets have."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile

CLIPS = {  # file name: (sample rate, channels, seconds)
    "stereo_8k.wav": (8000, 2, 0.5),
    "mono_44k.flac": (44100, 1, 0.37),
    "mono_22k.mp3": (22050, 1, 0.37),
}
"""The three clips the README's audio conversations are tested with."""


def tone(rate: int, channels: int, seconds: float, hz: float = 440.0) -> np.ndarray:
    """``[frames, channels]`` float64 sines, channel ``c`` at ``hz * (c + 1)``, amplitude 0.5."""
    t = np.arange(int(rate * seconds)) / rate
    return np.stack([0.5 * np.sin(2 * np.pi * hz * (c + 1) * t) for c in range(channels)], 1)


def write_clip(path: Path, rate: int, channels: int, seconds: float,
               hz: float = 440.0) -> np.ndarray:
    """Write a :func:`tone` in the format the suffix names (16-bit PCM for WAV and FLAC, MPEG
    layer III for .mp3) and return the samples written."""
    samples = tone(rate, channels, seconds, hz)
    path.parent.mkdir(parents=True, exist_ok=True)
    soundfile.write(path, samples, rate)
    return samples


def write_clips(folder: Path, hz: float = 440.0) -> dict[str, np.ndarray]:
    """Every clip of :data:`CLIPS` in ``folder``; the samples written, by file name."""
    return {name: write_clip(folder / name, *spec, hz=hz) for name, spec in CLIPS.items()}
