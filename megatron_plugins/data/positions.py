"""Multimodal RoPE positions (``--position-embedding-type mrope``): a sample's ``[3, S]`` ids.

As Qwen2-VL / Qwen2.5-VL's ``get_rope_index`` lays them out for images: a text token advances the
temporal, height and width positions together by one; an item's placeholder run takes its
``(t, h, w)`` grid's positions (:meth:`EncoderPlugin.item_grid`, row-major, width fastest), each
offset by the position after the preceding text, and the text after it starts at the run's
largest position + 1. An item without a grid takes consecutive positions, as text does. Language
ranks compute them from the tokens and the items' sizes alone (no media decoded), on every
pipeline stage, for the mock and Energon sources alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from megatron_plugins.encoders.base import EncoderPlugin, EncoderPluginError

__all__ = ["Grid", "ItemLayout", "item_layout", "mrope_position_ids"]

Grid = tuple[int, int, int]
"""An item's ``(t, h, w)`` token layout."""

ItemLayout = tuple[int, Grid | None]
"""An item's token count and its grid (None: consecutive positions)."""


def item_layout(plugin: EncoderPlugin, size: tuple[int, ...]) -> ItemLayout:
    """One item's token count and grid; a grid that does not hold exactly the item's tokens is the
    plugin's error, named."""
    count = plugin.item_tokens(size)
    grid = plugin.item_grid(size)
    if grid is not None:
        grid = tuple(int(side) for side in grid)
        if len(grid) != 3 or min(grid) < 1 or grid[0] * grid[1] * grid[2] != count:
            raise EncoderPluginError(
                f"--encoder {plugin.name}: item_grid({tuple(size)}) = {grid} is not three "
                f"positive sides whose product is item_tokens({tuple(size)}) = {count}; fix the "
                "plugin's item_grid")
    return count, grid


def _grid_positions(grid: Grid, start: int) -> torch.Tensor:
    """``[3, t * h * w]``: each axis' index offset by ``start``, width fastest."""
    axes = torch.meshgrid(*(torch.arange(side) for side in grid), indexing="ij")
    return torch.stack(axes).reshape(3, -1) + start


def mrope_position_ids(tokens: torch.Tensor,
                       items: Mapping[int, Sequence[ItemLayout]]) -> torch.Tensor:
    """``[3, len(tokens)]`` position ids of one sample's tokens (padding included, positioned as
    text). ``items`` maps each encoder's placeholder id to its items in order; each run of that
    id is consumed item by item (runs side by side are told apart by the items' counts).

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
        positions = (_grid_positions(grid, current) if grid is not None
                     else torch.arange(current, current + count).expand(3, -1))
        pieces.append(positions)
        current = int(positions.max()) + 1
        index += count
        text_start = index
    left = {token: len(layouts) for token, layouts in pending.items() if layouts}
    if left:
        raise ValueError(f"items without a placeholder run: {left} (placeholder id: items)")
    pieces.append(torch.arange(current, current + len(ids) - text_start).expand(3, -1))
    return torch.cat(pieces, dim=1).to(torch.long)
