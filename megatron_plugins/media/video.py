"""Video files (mp4, webm, mkv, mov, avi) read with PyAV, as transformers' ``load_video`` reads
them by default: the frames a Qwen2-VL-family video processor samples, their timestamps, and the
sound track. Plain values out (:mod:`megatron_plugins.media.codec` wraps them in its types);
a file that cannot be used raises ``ValueError`` with a one-line reason."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import av
import numpy as np
import torch

__all__ = ["VIDEO_CONTAINERS", "VideoHeader", "VideoSampling", "read_frames", "read_size",
           "read_sound"]

VIDEO_CONTAINERS = ("mp4", "webm", "mkv", "mov", "avi")
"""The container formats (file extensions) a video file may be stored as."""


@dataclass(frozen=True)
class VideoSampling:
    """How frames are drawn from a file: transformers 5.23's ``Qwen2VLVideoProcessor.
    sample_frames`` at ``fps`` (Qwen2.5-VL's 2 per second), the count clamped to
    ``[min_frames, max_frames]`` and the file's frames, then floored to ``temporal_patch_size``."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    temporal_patch_size: int = 2

    def indices(self, total: int, video_fps: float) -> np.ndarray:
        """The decode-order indices of the frames sampled from ``total`` at ``video_fps``."""
        span = self.temporal_patch_size
        most = math.floor(min(self.max_frames, total) / span) * span
        wanted = min(max(total / video_fps * self.fps, self.min_frames), most, total)
        count = math.floor(wanted / span) * span
        if count < 1:
            raise ValueError(f"has {total} frame{'s' * (total != 1)}, fewer than the "
                             f"{span} of one temporal patch")
        # torch's float32 arange, as transformers computes it, so the indices agree to the frame.
        return torch.arange(0, total, total / count).int().numpy()

    def draw(self, header: VideoHeader) -> tuple[np.ndarray, float]:
        """The indices sampled from a file and their rate (transformers' ``VideoMetadata.
        sampled_fps``: what Qwen's ``second_per_grid_ts`` divides the temporal patch by)."""
        indices = self.indices(header.frames, header.fps)
        return indices, len(indices) / header.frames * header.fps


@dataclass(frozen=True)
class VideoHeader:
    """A file's first video stream as its container describes it (no frame decoded)."""

    frames: int
    fps: float
    height: int
    width: int


def _reason(error: av.FFmpegError) -> str:
    return error.strerror or str(error)


def _open(data: bytes) -> av.container.InputContainer:
    try:
        return av.open(io.BytesIO(data), mode="r")
    except av.FFmpegError as error:
        raise ValueError(f"does not open ({_reason(error)})") from None


def _header(container: av.container.InputContainer) -> VideoHeader:
    if not container.streams.video:
        raise ValueError("has no video stream")
    stream = container.streams.video[0]
    if not stream.average_rate:
        raise ValueError("has no frame rate in its video stream")
    # webm / mkv store no frame count: count the stream's packets (demuxed, not decoded).
    frames = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
    if not frames:
        raise ValueError("has no frames")
    return VideoHeader(int(frames), float(stream.average_rate), stream.height, stream.width)


def read_size(data: bytes, sampling: VideoSampling) -> tuple[int, int, int, float]:
    """``(frames, height, width, fps)`` of what :func:`read_frames` returns, from the container's
    stream metadata (no frame decoded)."""
    with _open(data) as container:
        header = _header(container)
    indices, fps = sampling.draw(header)
    return len(indices), header.height, header.width, fps


def read_frames(data: bytes, sampling: VideoSampling) -> tuple[np.ndarray, float, np.ndarray]:
    """The sampled frames (uint8 ``[T, H, W, 3]`` RGB), their rate (:meth:`VideoSampling.draw`)
    and each one's presentation time in seconds; frames are decoded in order up to the last one
    sampled, as transformers' ``read_video_pyav``."""
    try:
        with _open(data) as container:
            header = _header(container)
            indices, fps = sampling.draw(header)
            wanted, frames, times = set(indices.tolist()), [], []
            container.seek(0)
            for index, frame in enumerate(container.decode(video=0)):
                if index > indices[-1]:
                    break
                if index in wanted:
                    frames.append(frame.to_ndarray(format="rgb24"))
                    times.append(float(frame.time or 0.0))
    except av.FFmpegError as error:
        raise ValueError(f"does not decode its frames ({_reason(error)})") from None
    if len(frames) != len(indices):
        raise ValueError(f"decodes to fewer frames than the {header.frames} its container "
                         f"declares (frame {indices[len(frames)]} is missing)")
    return np.stack(frames), fps, np.asarray(times)


def read_sound(data: bytes) -> tuple[np.ndarray, int] | None:
    """The first audio stream as mono float32 samples (channels averaged, as
    :func:`~megatron_plugins.media.codec.decode_audio` does) at the stream's own rate; None for a
    file without sound."""
    try:
        with _open(data) as container:
            if not container.streams.audio:
                return None
            rate = container.streams.audio[0].rate
            planar = av.AudioResampler(format="fltp")  # float planar; layout and rate kept
            chunks = [chunk.to_ndarray() for frame in [*container.decode(audio=0), None]
                      for chunk in planar.resample(frame)]  # None: flush
    except av.FFmpegError as error:
        raise ValueError(f"does not decode its sound track ({_reason(error)})") from None
    if not chunks:
        return None
    samples = np.concatenate(chunks, axis=1).mean(axis=0)
    return np.ascontiguousarray(samples, dtype=np.float32), int(rate)
