"""Real video files for the tests, written with PyAV (the library training decodes them with):
tiny clips whose frames are distinct colours, with a sine-wave sound track or none."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np

SOUND = {"mp4": "aac", "webm": "libopus", "mkv": "libopus"}
"""The sound codec of each container's clips."""
PICTURE = {"mp4": "libx264", "webm": "libvpx-vp9", "mkv": "libx264"}
"""The picture codec of each container's clips."""


def frame(index: int, size: tuple[int, int]) -> np.ndarray:
    """Frame ``index``: one flat colour, far from its neighbours' (lossy codecs keep it apart)."""
    pixels = np.zeros((*size, 3), np.uint8)
    pixels[..., 0], pixels[..., 1], pixels[..., 2] = 20 * index % 256, 255 - 20 * index % 256, 90
    return pixels


def tone(rate: int, seconds: float, hz: float = 440.0) -> np.ndarray:
    """float32 ``[rate * seconds]`` sine at ``hz``, amplitude 0.5."""
    return (0.5 * np.sin(2 * np.pi * hz * np.arange(int(rate * seconds)) / rate)).astype(
        np.float32)


def write_video(path: Path, seconds: float = 1.5, fps: int | Fraction = 8,
                size: tuple[int, int] = (32, 32), sound_rate: int | None = 16000) -> Path:
    """A ``seconds`` clip of :func:`frame` pictures at ``fps`` in the container the suffix names,
    with a :func:`tone` sound track at ``sound_rate`` Hz (None: no audio stream)."""
    container = path.suffix[1:]
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as out:
        video = out.add_stream(PICTURE[container], rate=fps)
        video.height, video.width, video.pix_fmt = *size, "yuv420p"
        sound = None
        if sound_rate:
            sound = out.add_stream(SOUND[container], rate=sound_rate, layout="mono")
        for index in range(round(seconds * fps)):
            out.mux(video.encode(av.VideoFrame.from_ndarray(frame(index, size), format="rgb24")))
        out.mux(video.encode())
        if sound is not None:
            samples, step = tone(sound_rate, seconds), sound.codec_context.frame_size
            for start in range(0, len(samples), step):
                chunk = av.AudioFrame.from_ndarray(samples[None, start:start + step],
                                                   format="fltp", layout="mono")
                chunk.sample_rate, chunk.pts = sound_rate, start
                out.mux(sound.encode(chunk))
            out.mux(sound.encode())
    return path
