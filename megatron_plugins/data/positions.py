"""Multimodal RoPE positions (``--position-embedding-type mrope``): a sample's ``[3, S]`` ids.

As Qwen2-VL / Qwen2.5-VL's ``get_rope_index`` lays them out: a text token advances the temporal,
height and width positions together by one; an item's placeholder run takes its ``(t, h, w)``
grid's positions (:meth:`EncoderPlugin.item_grid`, row-major, width fastest), each offset by the
position after the preceding text, and the text after it starts ``max(h, w)`` past that offset
(an image's largest position + 1). A video's grid carries a fourth entry, its steps' temporal
positions, which count seconds, not steps, and may pass the text after it, as transformers'
Qwen2.5-VL has them; the Omni thinkers' TMRoPE starts the text after a video past its last
temporal position too (its encoder's :attr:`EncoderPlugin.text_after_time`). An item without a
grid takes consecutive positions, as text does. Language ranks compute them from the tokens and
the items' sizes alone (no media decoded), on every pipeline stage, for the mock and Energon
sources alike.

Positions are float32, as transformers' Qwen3-Omni ``get_rope_index`` has them: its video
steps are not whole numbers at most frame rates (13 positions a second), nor is any position
after such a video. Whole positions are exact in float32 (below 2**24).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from megatron_plugins.encoders.base import EncoderPlugin, EncoderPluginError

__all__ = ["Grid", "ItemLayout", "WithSound", "grid_times", "item_layout", "mrope_position_ids",
           "text_after_time_ids"]

Grid = tuple[int, int, int] | tuple[int, int, int, tuple[float, ...]]
"""An item's ``(t, h, w)`` token layout, with a video's steps' temporal positions (from its
start, one per step, as its family computes them) as a fourth entry."""

ItemLayout = tuple[int, Grid | None]
"""An item's token count and its grid (None: consecutive positions)."""


@dataclass(frozen=True)
class WithSound:
    """A video whose sound track's tokens are interleaved with its own
    (:mod:`~megatron_plugins.data.audio_in_video`) between a bos pair and an eos pair, the
    sound's tokens counting on from where the video starts; the eos pair starts past the last
    run's largest position."""

    video: ItemLayout
    sound_id: int
    """The audio encoder's placeholder id, marking the sound's tokens."""
    sound_tokens: int
    order: tuple[tuple[bool, int], ...]
    """``(is_video, count)`` runs in sequence order
    (:func:`~megatron_plugins.data.audio_in_video.interleaving`)."""
    pairs_share: bool = True
    """Each of the bos and eos pairs at one position (Qwen2.5-Omni); else each id at its own,
    as text (Qwen3-Omni)."""


def item_layout(plugin: EncoderPlugin, size: tuple[int, ...]) -> ItemLayout:
    """One item's token count and grid; a grid that does not hold exactly the item's tokens is the
    plugin's error, named."""
    count = plugin.item_tokens(size)
    grid = plugin.item_grid(size)
    if grid is not None:
        sides = tuple(int(side) for side in grid[:3])
        times = tuple(float(time) for time in grid[3]) if len(grid) == 4 else None
        if (len(sides) != 3 or len(grid) > 4 or min(sides) < 1
                or sides[0] * sides[1] * sides[2] != count
                or times is not None and not _step_times(times, sides[0])):
            raise EncoderPluginError(
                f"--encoder {plugin.name}: item_grid({tuple(size)}) = {grid} is not three "
                f"positive sides whose product is item_tokens({tuple(size)}) = {count} (and a "
                "video's temporal positions, one per step, from 0, ascending); fix the "
                "plugin's item_grid")
        grid = sides if times is None else (*sides, times)
    return count, grid


def _step_times(times: tuple[float, ...], steps: int) -> bool:
    """Whether ``times`` are a video's ``steps`` temporal positions: from 0, ascending."""
    return (len(times) == steps and times[0] == 0
            and all(a <= b for a, b in zip(times, times[1:])))


def text_after_time_ids(plugins: Mapping[str, EncoderPlugin],
                        placeholder_ids: Mapping[str, int]) -> set[int]:
    """The placeholder ids of the encoders whose videos' text follows their last time step
    (:attr:`EncoderPlugin.text_after_time`), for :func:`mrope_position_ids`."""
    return {placeholder_ids[name] for name, plugin in plugins.items() if plugin.text_after_time}


def grid_times(grid: Grid) -> torch.Tensor:
    """Each token's temporal position of an item's grid (row-major, width fastest), from 0."""
    return _grid_positions(grid, torch.tensor(0.0))[0]


def _grid_positions(grid: Grid, start: torch.Tensor) -> torch.Tensor:
    """``[3, t * h * w]`` float32: each axis' index (a video's steps at their temporal
    positions), width fastest, plus ``start``."""
    steps = torch.tensor(grid[3]) if len(grid) == 4 else torch.arange(grid[0], dtype=torch.float)
    axes = torch.meshgrid(steps, torch.arange(grid[1], dtype=torch.float),
                          torch.arange(grid[2], dtype=torch.float), indexing="ij")
    return torch.stack(axes).reshape(3, -1) + start


def _run(current: torch.Tensor, count: int) -> torch.Tensor:
    """``[3, count]`` consecutive positions from ``current`` (float32), as text has them."""
    return (torch.arange(count) + current).expand(3, -1)


def _with_sound(ids: list[int], index: int, token: int, layout: WithSound,
                current: torch.Tensor, pieces: list[torch.Tensor]) -> tuple[int, torch.Tensor]:
    """The positions of a video with its sound (its runs from ``index``, starting at
    ``current``, after its bos pair) and of its eos pair; returns the index and the position
    after that pair."""
    count, grid = layout.video
    runs = {True: (token, _grid_positions(grid, current)),
            False: (layout.sound_id, _run(current, layout.sound_tokens))}
    taken = {True: 0, False: 0}
    for is_video, size in layout.order:
        want, positions = runs[is_video]
        if ids[index:index + size] != [want] * size:
            raise ValueError(f"the video with sound at position {index} does not hold {size} "
                             f"{'video' if is_video else 'sound'} tokens ({want}) there")
        if size:
            pieces.append(positions[:, taken[is_video]:taken[is_video] + size])
        taken[is_video] += size
        index += size
    if taken != {True: count, False: layout.sound_tokens} or index + 2 > len(ids):
        raise ValueError(f"the video with sound ending at position {index} is not its "
                         f"{count} + {layout.sound_tokens} tokens and an eos pair")
    end = pieces[-1].max() + 1
    pieces.append(torch.full((3, 2), float(end)) if layout.pairs_share else _run(end, 2))
    return index + 2, pieces[-1].max() + 1


def mrope_position_ids(tokens: torch.Tensor,
                       items: Mapping[int, Sequence[ItemLayout | WithSound]],
                       after_time: Collection[int] = ()) -> torch.Tensor:
    """``[3, len(tokens)]`` float32 position ids of one sample's tokens (padding included,
    positioned as text). ``items`` maps each encoder's placeholder id to its items in order;
    each run of that id is consumed item by item (runs side by side are told apart by the items'
    counts). The text after a run of a placeholder id in ``after_time`` starts past its largest
    position on any axis (the Omni thinkers), else past its rows and columns.

    Raises ``ValueError`` when the runs do not hold exactly the items' tokens.
    """
    ids = tokens.tolist()
    pending = {token: list(layouts) for token, layouts in items.items()}
    pieces: list[torch.Tensor] = []
    current = torch.tensor(0.0)
    text_start, index = 0, 0
    while index < len(ids):
        token = ids[index]
        if token not in pending:
            index += 1
            continue
        if not pending[token]:
            raise ValueError(f"placeholder token {token} at position {index} has no item left "
                             "to fill it")
        layout = pending[token].pop(0)
        if isinstance(layout, WithSound):  # text ends with its bos pair
            text = index - text_start
            if text < 2:
                raise ValueError(f"the video with sound at position {index} has no bos pair "
                                 "before it")
            shared = int(layout.pairs_share)  # the pair's second id at the first's position
            pieces.append(_run(current, text - shared))
            if layout.pairs_share:
                pieces.append(torch.full((3, 1), float(current + text - 2)))
            index, current = _with_sound(ids, index, token, layout, current + text - shared,
                                         pieces)
            text_start = index
            continue
        count, grid = layout
        run = ids[index:index + count]
        if len(run) != count or any(other != token for other in run):
            raise ValueError(f"placeholder token {token}: the run at position {index} is shorter "
                             f"than its item's {count} tokens")
        text = index - text_start
        pieces.append(_run(current, text))
        current = current + text
        if grid is None:
            pieces.append(_run(current, count))
            current = current + count
        else:
            pieces.append(_grid_positions(grid, current))
            current = (pieces[-1].max() + 1 if token in after_time
                       else current + max(grid[1], grid[2]))
        index += count
        text_start = index
    left = {token: len(layouts) for token, layouts in pending.items() if layouts}
    if left:
        raise ValueError(f"items without a placeholder run: {left} (placeholder id: items)")
    pieces.append(_run(current, len(ids) - text_start))
    return torch.cat(pieces, dim=1)
