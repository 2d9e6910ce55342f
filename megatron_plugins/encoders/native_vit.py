"""Native-resolution ViT (``--vit-native-resolution``): each image keeps its aspect ratio.

An image is resized to the nearest patch multiples with its pixel count clamped into
``[--vit-min-pixels, --vit-max-pixels]`` (Qwen2-VL's :func:`smart_resize`), cut into patches row
by row, and a microbatch's images run as one packed sequence: one attention segment per image
(:mod:`megatron_plugins.ops.packed_attention`), a learned position table bilinearly resized
to each image's patch grid (as SigLIP2 NaFlex and Qwen3-VL do). An image fills as many language
positions as it has patches, so small or wide images cost less than a fixed square crop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from PIL import Image
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.encoders.base import MediaPreprocessor, encoder_norm
from megatron_plugins.ops.fast_attention import packed_layer_spec
from megatron_plugins.ops.packed_attention import packed_seq_params

__all__ = [
    "MAX_ASPECT_RATIO", "NativeImagePreprocessor", "NativeViT", "native_vit_spec", "nearest_grid",
    "normalized_pixels", "position_grid_side", "smart_resize",
]

MAX_ASPECT_RATIO = 200
"""Longest over shortest side beyond which :func:`smart_resize` refuses an image (Qwen2-VL's)."""


def nearest_grid(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's rounding of a ``height`` x ``width`` image to multiples of ``factor`` with its
    pixel count moved into ``[min_pixels, max_pixels]`` (transformers' ``smart_resize`` without
    its checks); the ceiling that reaches ``min_pixels`` may overshoot ``max_pixels``."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize target for a ``height`` x ``width`` image: sides that are multiples of
    ``factor`` (the patch size), aspect ratio kept as closely as rounding allows, pixel count
    within ``[min_pixels, max_pixels]``; transformers' rounding exactly.

    Raises ValueError, naming the size and the flag to change, for an image whose shorter side is
    below ``factor`` or whose aspect ratio leaves no such grid within ``max_pixels``.
    """
    size = f"image {height}x{width} (height x width)"
    if min(height, width) < factor:
        raise ValueError(f"{size}: its shorter side is below the patch size {factor}; lower "
                         "--vit-patch-size or drop such images from the dataset")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"{size}: aspect ratio above {MAX_ASPECT_RATIO}; crop or drop such "
                         "images from the dataset")
    h_bar, w_bar = nearest_grid(height, width, factor, min_pixels, max_pixels)
    if h_bar * w_bar > max_pixels:
        raise ValueError(f"{size}: at its aspect ratio the nearest {factor}-pixel patch grid is "
                         f"{h_bar}x{w_bar} pixels, above --vit-max-pixels {max_pixels} (or "
                         "forced there by --vit-min-pixels); raise --vit-max-pixels or crop such "
                         "images")
    return h_bar, w_bar


def position_grid_side(max_patches: int) -> int:
    """Side of the learned square position table: the smallest square holding an image's most
    patches, so a square image at the largest size uses the table as is."""
    return math.isqrt(max_patches - 1) + 1


def normalized_pixels(image: Image.Image, mean: tuple[float, float, float],
                      std: tuple[float, float, float]) -> torch.Tensor:
    """An RGB image as float32 ``[3, H, W]`` scaled to [0, 1] and normalized per channel."""
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
    mean_ = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
    std_ = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
    return ((pixels - mean_) / std_).contiguous()


@dataclass(frozen=True)
class NativeImagePreprocessor(MediaPreprocessor):
    """Resize (bicubic) to :func:`smart_resize`'s size, normalize, cut into ``patch_size``
    patches in row-major order; a microbatch's images are packed, not stacked."""

    media: ClassVar[str] = "image"
    patch_size: int
    min_pixels: int
    max_pixels: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """The patch grid (rows, columns) of a ``height`` x ``width`` image."""
        new_height, new_width = smart_resize(height, width, self.patch_size, self.min_pixels,
                                             self.max_pixels)
        return new_height // self.patch_size, new_width // self.patch_size

    def __call__(self, media: np.ndarray) -> dict[str, torch.Tensor]:
        """uint8 ``[H, W, 3]`` -> ``{"patches": float32 [rows * columns, 3 * p * p],
        "grid": int64 [2] (rows, columns)}``; a patch is flattened channel, row, column."""
        rows, columns = self.grid(*media.shape[:2])
        p = self.patch_size
        image = Image.fromarray(media).resize((columns * p, rows * p), Image.Resampling.BICUBIC)
        pixels = normalized_pixels(image, self.mean, self.std)
        patches = pixels.reshape(3, rows, p, columns, p).permute(1, 3, 0, 2, 4)
        return {"patches": patches.reshape(rows * columns, 3 * p * p).contiguous(),
                "grid": torch.tensor([rows, columns], dtype=torch.int64)}

    def collate(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """``{"patches": [total patches, 3 * p * p], "grid": [items, 2]}``, items in order."""
        return {"patches": torch.cat([item["patches"] for item in items]),
                "grid": torch.stack([item["grid"] for item in items])}


class NativeViT(MegatronModule):
    """Patch embedding + resized position table, pre-norm, a transformer block over the packed
    images (one attention segment each), final norm: ``[total patches, hidden]``.

    The patch embedding, position table and pre-norm are replicated on the tp ranks (the first
    layer's column-parallel linear all-reduces their gradient, so the copies stay equal); the
    checkpoint holds them once, replicated over ``pg_collection.tp``.
    """

    def __init__(self, config: TransformerConfig, patch_size: int, position_side: int,
                 pg_collection: ProcessGroupCollection | None) -> None:
        super().__init__(config=config)
        if pg_collection is not None:
            self.tp_group = pg_collection.tp
        hidden = config.hidden_size
        self.patch_embedding = torch.nn.Linear(3 * patch_size * patch_size, hidden,
                                               dtype=config.params_dtype)
        self.position = torch.nn.Parameter(
            torch.empty(position_side, position_side, hidden, dtype=config.params_dtype))
        config.init_method(self.position)
        self.ln_pre = build_module(encoder_norm(config), config=config, hidden_size=hidden,
                                   eps=config.layernorm_epsilon)
        self.transformer = TransformerBlock(config, packed_layer_spec(config),
                                            pg_collection=pg_collection)

    def positions(self, grid: torch.Tensor) -> torch.Tensor:
        """The position table bilinearly resized to each ``(rows, columns)`` of ``grid`` and
        flattened row-major: ``[sum of rows * columns, hidden]``."""
        table = self.position.permute(2, 0, 1).unsqueeze(0).float()
        resized: dict[tuple[int, int], torch.Tensor] = {}
        pieces = []
        for rows, columns in grid.tolist():
            if (rows, columns) not in resized:
                grid_table = torch.nn.functional.interpolate(
                    table, size=(rows, columns), mode="bilinear", align_corners=False)
                resized[rows, columns] = grid_table[0].permute(1, 2, 0).reshape(rows * columns, -1)
            pieces.append(resized[rows, columns])
        return torch.cat(pieces).to(self.position.dtype)

    def forward(self, patches: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """``patches`` ``[total, 3 * p * p]`` and ``grid`` ``[items, 2]`` as
        :meth:`NativeImagePreprocessor.collate` packs them -> ``[total, hidden]``."""
        hidden = self.patch_embedding(patches.to(self.patch_embedding.weight.dtype))
        hidden = self.ln_pre(hidden + self.positions(grid))
        params = packed_seq_params(grid.prod(dim=1).to(hidden.device))
        hidden = self.transformer(hidden.unsqueeze(1), attention_mask=None,
                                  packed_seq_params=params)
        return hidden.squeeze(1)


def native_vit_spec(config: TransformerConfig, pg_collection: ProcessGroupCollection | None, *,
                    patch_size: int, max_pixels: int) -> ModuleSpec:
    """:class:`NativeViT` for images of at most ``max_pixels`` pixels after resizing."""
    return ModuleSpec(module=NativeViT, params={
        "config": config, "patch_size": patch_size,
        "position_side": position_grid_side(max_pixels // patch_size ** 2),
        "pg_collection": pg_collection})
