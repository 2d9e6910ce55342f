"""``--use-audio-in-video``: each video's sound track feeds the audio encoder, its tokens
interleaved with the video's by time as the checkpoint's family lays them out and positions them.
Qwen2.5-Omni: per chunk of ``tokens_per_chunk`` temporal positions (2 s), the video's tokens then
its sound's, the whole between ``<|vision_bos|><|audio_bos|>`` and
``<|audio_eos|><|vision_eos|>``, each pair at one position. Qwen3-Omni (no chunks): token by
token in order of their temporal positions, a video token first on a tie, each id of the pairs
at a position of its own."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_plugins.data.positions import Grid, ItemLayout, WithSound, grid_times

__all__ = ["AudioInVideo", "chunk_bounds", "interleaving"]


@dataclass(frozen=True)
class AudioInVideo:
    """Which encoders share a video (the one taking videos, the audio one) and the chunk size."""

    vision: str
    audio: str
    tokens_per_chunk: int | None
    """Temporal positions per chunk: the checkpoint's ``position_id_per_seconds`` times its
    ``seconds_per_chunk`` (25 x 2 in the released Qwen2.5-Omni); None: merged by time, token by
    token (Qwen3-Omni)."""

    def with_sound(self, video: ItemLayout, sound_id: int, sound_tokens: int) -> WithSound:
        """A video's layout with its sound's ``sound_tokens`` (marked ``sound_id``) interleaved
        as the family does (the pairs share positions where it chunks)."""
        return WithSound(video, sound_id, sound_tokens,
                         interleaving(video[1], sound_tokens, self.tokens_per_chunk),
                         pairs_share=self.tokens_per_chunk is not None)


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


def _merged_by_time(times: Sequence[float], sound_tokens: int) -> list[tuple[bool, int]]:
    """Qwen3-Omni's order: the video's tokens (at ``times``) and the sound's (at 0, 1, ...)
    by temporal position, a video token first on a tie (its processor's
    ``replace_video_with_audio_token``, its ``get_rope_index``)."""
    order: list[tuple[bool, int]] = []
    video = sound = 0
    while video < len(times) or sound < sound_tokens:
        is_video = sound == sound_tokens or (video < len(times) and times[video] <= sound)
        if order and order[-1][0] == is_video:
            order[-1] = (is_video, order[-1][1] + 1)
        else:
            order.append((is_video, 1))
        video, sound = video + is_video, sound + (not is_video)
    return order


def interleaving(grid: Grid, sound_tokens: int, per_chunk: int | None
                 ) -> tuple[tuple[bool, int], ...]:
    """The order of a video's and its sound's tokens: ``(True, n)`` for ``n`` video tokens,
    ``(False, n)`` for ``n`` sound tokens, chunk by chunk (the video's first), or merged by
    time where ``per_chunk`` is None."""
    times = grid_times(grid).tolist()
    if per_chunk is None:
        return tuple(_merged_by_time(times, sound_tokens))
    video = chunk_bounds(times, per_chunk)
    sound = chunk_bounds(range(sound_tokens), per_chunk)
    order = []
    for chunk in range(max(len(video), len(sound))):
        for is_video, bounds in ((True, video), (False, sound)):
            if chunk < len(bounds):
                order.append((is_video, bounds[chunk][1] - bounds[chunk][0]))
    return tuple(order)
