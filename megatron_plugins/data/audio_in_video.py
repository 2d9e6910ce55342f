"""``--use-audio-in-video``: each video's sound track feeds the audio encoder, its tokens
interleaved with the video's by time, as Qwen2.5-Omni's processor lays them out and its TMRoPE
positions them: per chunk of ``tokens_per_chunk`` temporal positions (2 s), the video's tokens
then its sound's, the whole between ``<|vision_bos|><|audio_bos|>`` and
``<|audio_eos|><|vision_eos|>``, each pair at one position."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_plugins.data.positions import Grid, grid_times

__all__ = ["AudioInVideo", "chunk_bounds", "interleaving"]


@dataclass(frozen=True)
class AudioInVideo:
    """Which encoders share a video (the one taking videos, the audio one) and the chunk size."""

    vision: str
    audio: str
    tokens_per_chunk: int
    """Temporal positions per chunk: the checkpoint's ``position_id_per_seconds`` times its
    ``seconds_per_chunk`` (25 x 2 in the released Qwen2.5-Omni)."""


def chunk_bounds(values: Sequence[float], per_chunk: int) -> list[tuple[int, int]]:
    """``(start, end)`` slices of ``values`` (ascending temporal positions) cut where a value
    reaches the next multiple of ``per_chunk``, one chunk per crossing, as transformers'
    ``get_chunked_index``."""
    bounds, start, chunk = [], 0, 1
    for index, value in enumerate(values):
        if value >= chunk * per_chunk:
            bounds.append((start, index))
            start, chunk = index, chunk + 1
    bounds.append((start, len(values)))
    return bounds


def interleaving(grid: Grid, sound_tokens: int, per_chunk: int
                 ) -> tuple[tuple[bool, int], ...]:
    """The order of a video's and its sound's tokens: ``(True, n)`` for ``n`` video tokens,
    ``(False, n)`` for ``n`` sound tokens, chunk by chunk (the video's first)."""
    video = chunk_bounds(grid_times(grid).tolist(), per_chunk)
    sound = chunk_bounds(range(sound_tokens), per_chunk)
    order = []
    for chunk in range(max(len(video), len(sound))):
        for is_video, bounds in ((True, video), (False, sound)):
            if chunk < len(bounds):
                order.append((is_video, bounds[chunk][1] - bounds[chunk][0]))
    return tuple(order)
