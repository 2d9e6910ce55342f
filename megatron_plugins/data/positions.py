"""Multimodal RoPE positions (``--position-embedding-type mrope``): a sample's ``[3, S]`` ids.

As Qwen2-VL / Qwen2.5-VL's ``get_rope_index`` lays them out: a text token advances the temporal,
height and width positions together by one; an item's placeholder run takes its ``(t, h, w)``
grid's positions (:meth:`EncoderPlugin.item_grid`, row-major, width fastest), each offset by the
position after the preceding text, and the text after it starts ``max(h, w)`` past that offset
(an image's largest position + 1). A video's grid carries a fourth entry, the time interval:
its temporal positions are ``floor(index * interval)`` (float32), so they count seconds, not
steps, and may pass the text after it, as transformers' Qwen2.5-VL has them; Qwen2.5-Omni's
TMRoPE starts the text after a video past its last temporal position too (its encoder's
:attr:`EncoderPlugin.text_after_time`). An item without a grid takes
consecutive positions, as text does. Language ranks compute them from the tokens and the items'
sizes alone (no media decoded), on every pipeline stage, for the mock and Energon sources alike.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch

from megatron_plugins.encoders.base import EncoderPlugin, EncoderPluginError

__all__ = ["Grid", "ItemLayout", "item_layout", "mrope_position_ids", "text_after_time_ids"]

Grid = tuple[int, int, int] | tuple[int, int, int, float]
"""An item's ``(t, h, w)`` token layout, with a video's time interval (temporal positions per
step) as a fourth entry."""

ItemLayout = tuple[int, Grid | None]
"""An item's token count and its grid (None: consecutive positions)."""


def item_layout(plugin: EncoderPlugin, size: tuple[int, ...]) -> ItemLayout:
    """One item's token count and grid; a grid that does not hold exactly the item's tokens is the
    plugin's error, named."""
    count = plugin.item_tokens(size)
    grid = plugin.item_grid(size)
    if grid is not None:
        sides = tuple(int(side) for side in grid[:3])
        interval = tuple(float(step) for step in grid[3:])
        if (len(sides) != 3 or len(interval) > 1 or min(sides) < 1 or min(interval, default=0) < 0
                or sides[0] * sides[1] * sides[2] != count):
            raise EncoderPluginError(
                f"--encoder {plugin.name}: item_grid({tuple(size)}) = {grid} is not three "
                f"positive sides whose product is item_tokens({tuple(size)}) = {count} (and a "
                "video's time interval >= 0); fix the plugin's item_grid")
        grid = sides + interval
    return count, grid


def text_after_time_ids(plugins: Mapping[str, EncoderPlugin],
                        placeholder_ids: Mapping[str, int]) -> set[int]:
    """The placeholder ids of the encoders whose videos' text follows their last time step
    (:attr:`EncoderPlugin.text_after_time`), for :func:`mrope_position_ids`."""
    return {placeholder_ids[name] for name, plugin in plugins.items() if plugin.text_after_time}


def _grid_positions(grid: Grid, start: int) -> torch.Tensor:
    """``[3, t * h * w]``: each axis' index offset by ``start``, width fastest; a video's
    temporal index scaled by its time interval first."""
    steps = torch.arange(grid[0])
    if len(grid) == 4:
        steps = (steps * grid[3]).long()
    axes = torch.meshgrid(steps, torch.arange(grid[1]), torch.arange(grid[2]), indexing="ij")
    return torch.stack(axes).reshape(3, -1) + start


def mrope_position_ids(tokens: torch.Tensor, items: Mapping[int, Sequence[ItemLayout]],
                       after_time: Collection[int] = ()) -> torch.Tensor:
    """``[3, len(tokens)]`` position ids of one sample's tokens (padding included, positioned as
    text). ``items`` maps each encoder's placeholder id to its items in order; each run of that
    id is consumed item by item (runs side by side are told apart by the items' counts). The
    text after a run of a placeholder id in ``after_time`` starts past its largest position on
    any axis (Qwen2.5-Omni), else past its rows and columns.

    Raises ``ValueError`` when the runs do not hold exactly the items' tokens.
    """
    ids = tokens.tolist()
    pending = {token: list(layouts) for token, layouts in items.items()}
    pieces: list[torch.Tensor] = []
    text_start, current, index = 0, 0, 0
    while index < len(ids):
        token = ids[index]
        if token not in pending:
            index += 1
            continue
        if not pending[token]:
            raise ValueError(f"placeholder token {token} at position {index} has no item left "
                             "to fill it")
        count, grid = pending[token].pop(0)
        run = ids[index:index + count]
        if len(run) != count or any(other != token for other in run):
            raise ValueError(f"placeholder token {token}: the run at position {index} is shorter "
                             f"than its item's {count} tokens")
        text = index - text_start
        pieces.append(torch.arange(current, current + text).expand(3, -1))
        current += text
        if grid is None:
            pieces.append(torch.arange(current, current + count).expand(3, -1))
            current += count
        else:
            pieces.append(_grid_positions(grid, current))
            current = (int(pieces[-1].max()) + 1 if token in after_time
                       else current + max(grid[1], grid[2]))
        index += count
        text_start = index
    left = {token: len(layouts) for token, layouts in pending.items() if layouts}
    if left:
        raise ValueError(f"items without a placeholder run: {left} (placeholder id: items)")
    pieces.append(torch.arange(current, current + len(ids) - text_start).expand(3, -1))
    return torch.cat(pieces, dim=1).to(torch.long)
