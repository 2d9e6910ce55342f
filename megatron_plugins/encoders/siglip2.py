"""Pretrained SigLIP2 NaFlex vision tower (``--encoder NAME=siglip2``): transformers'
``Siglip2VisionModel`` on Megatron's tensor-parallel layers, images at their own aspect ratio.

The folder given as ``--encoder-hf-weights NAME=DIR`` (a ``Siglip2VisionModel`` folder, or a
``Siglip2Model`` folder whose ``vision_config`` is used) shapes the network, its
``preprocessor_config.json`` gives the resize (:func:`siglip2_image_size`), and the same flag loads
the weights through :data:`~megatron_plugins.weights.vision_families.SIGLIP2_VISION`. HF pads
every image to ``max_num_patches`` rows and masks the padding; here a microbatch's images are
packed without padding, one attention segment each, so an image fills exactly its patch count of
language positions: HF's ``last_hidden_state`` rows of that image (after ``post_layernorm``; the
attention-pooling head is not part of the encoder).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.encoders.base import EncoderPluginError, MediaPreprocessor
from megatron_plugins.encoders.hf_vision import HALF, HFVisionEncoder
from megatron_plugins.ops.fast_attention import packed_layer_spec
from megatron_plugins.ops.packed_attention import packed_seq_params
from megatron_plugins.weights.vision_families import SIGLIP2_VISION

__all__ = ["Siglip2ImagePreprocessor", "Siglip2Network", "Siglip2VisionEncoder",
           "siglip2_image_size"]

SEARCH_EPS = 1e-5
"""Width of the scale interval at which HF's binary search for the resize stops."""


def _scaled_side(scale: float, side: int, patch_size: int) -> int:
    """One side scaled, rounded up to a patch multiple, at least one patch (HF's arithmetic)."""
    return int(max(patch_size, math.ceil(side * scale / patch_size) * patch_size))


def siglip2_image_size(height: int, width: int, patch_size: int,
                       max_num_patches: int) -> tuple[int, int]:
    """The (height, width) HF's Siglip2 image processor resizes a ``height`` x ``width`` image
    to: the largest scale (binary search to ``SEARCH_EPS``) whose patch-multiple sides hold at most
    ``max_num_patches`` patches, aspect ratio kept as rounding up allows."""
    low, high = SEARCH_EPS / 10, 100.0
    while high - low >= SEARCH_EPS:
        scale = (low + high) / 2
        patches = (_scaled_side(scale, height, patch_size) / patch_size) * (
            _scaled_side(scale, width, patch_size) / patch_size)
        if patches <= max_num_patches:
            low = scale
        else:
            high = scale
    return _scaled_side(low, height, patch_size), _scaled_side(low, width, patch_size)


@dataclass(frozen=True)
class Siglip2ImagePreprocessor(MediaPreprocessor):
    """HF's PIL ``Siglip2ImageProcessor`` on one image, step for step: resize to
    :func:`siglip2_image_size`, rescale in float64 then float32, normalize in float32, cut into
    patches flattened (row, column, channel) as HF does; no padding rows."""

    media: ClassVar[str] = "image"
    patch_size: int
    max_num_patches: int
    resample: int
    rescale_factor: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """The patch grid (rows, columns) of a ``height`` x ``width`` image."""
        new_height, new_width = siglip2_image_size(height, width, self.patch_size,
                                                   self.max_num_patches)
        return new_height // self.patch_size, new_width // self.patch_size

    def __call__(self, media: np.ndarray) -> dict[str, torch.Tensor]:
        """uint8 ``[H, W, 3]`` -> ``{"patches": float32 [rows * columns, p * p * 3],
        "grid": int64 [2] (rows, columns)}``: HF's ``pixel_values`` rows its mask keeps."""
        rows, columns = self.grid(*media.shape[:2])
        p = self.patch_size
        image = Image.fromarray(media).resize((columns * p, rows * p),
                                              resample=Image.Resampling(self.resample))
        scaled = (np.asarray(image).astype(np.float64) * self.rescale_factor).astype(np.float32)
        pixels = (scaled - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        patches = pixels.reshape(rows, p, columns, p, 3).transpose(0, 2, 1, 3, 4)
        return {"patches": torch.from_numpy(np.ascontiguousarray(
                    patches.reshape(rows * columns, p * p * 3))),
                "grid": torch.tensor([rows, columns], dtype=torch.int64)}

    def collate(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """``{"patches": [total patches, p * p * 3], "grid": [items, 2]}``, items in order."""
        return {"patches": torch.cat([item["patches"] for item in items]),
                "grid": torch.stack([item["grid"] for item in items])}


class Siglip2Network(MegatronModule):
    """Linear patch embedding + the learned square position table resized to each image's grid,
    pre-LN transformer layers over the packed images (one attention segment each), the block's
    final LayerNorm (HF's ``post_layernorm``): ``[total patches, hidden]``.

    The patch embedding and position table are replicated on the tp ranks (the first layer's
    column-parallel linear all-reduces their gradient, so the copies stay equal).
    """

    def __init__(self, config: TransformerConfig, patch_size: int, num_patches: int,
                 pg_collection: ProcessGroupCollection | None) -> None:
        super().__init__(config=config)
        if pg_collection is not None:
            self.tp_group = pg_collection.tp
        hidden, dtype = config.hidden_size, config.params_dtype
        self.position_side = math.isqrt(num_patches)
        self.patch_embedding = torch.nn.Linear(3 * patch_size * patch_size, hidden, dtype=dtype)
        self.position_embedding = torch.nn.Embedding(num_patches, hidden, dtype=dtype)
        config.init_method(self.position_embedding.weight)
        self.decoder = TransformerBlock(config, packed_layer_spec(config),
                                        pg_collection=pg_collection)

    def positions(self, grid: torch.Tensor) -> torch.Tensor:
        """The position table resized to each ``(rows, columns)`` of ``grid`` as HF does (bilinear,
        antialiased, in float32), flattened row-major: ``[sum of rows * columns, hidden]``."""
        side = self.position_side
        weight = self.position_embedding.weight
        table = weight.reshape(side, side, -1).permute(2, 0, 1).unsqueeze(0).float()
        resized: dict[tuple[int, int], torch.Tensor] = {}
        pieces = []
        for rows, columns in grid.tolist():
            if (rows, columns) not in resized:
                grid_table = F.interpolate(table, size=(rows, columns), mode="bilinear",
                                           align_corners=False, antialias=True)
                resized[rows, columns] = grid_table.reshape(-1, rows * columns).transpose(0, 1)
            pieces.append(resized[rows, columns])
        return torch.cat(pieces).to(weight.dtype)

    def forward(self, patches: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """``patches`` ``[total, p * p * 3]`` and ``grid`` ``[items, 2]`` as
        :meth:`Siglip2ImagePreprocessor.collate` packs them -> ``[total, hidden]``."""
        hidden = self.patch_embedding(patches.to(self.patch_embedding.weight.dtype))
        hidden = hidden + self.positions(grid)
        params = packed_seq_params(grid.prod(dim=1).to(hidden.device))
        hidden = self.decoder(hidden.unsqueeze(1), attention_mask=None, packed_seq_params=params)
        return hidden.squeeze(1)


class Siglip2VisionEncoder(HFVisionEncoder):
    """HF ``Siglip2VisionModel`` (NaFlex): an image fills as many positions as it has patches after
    HF's resize, at most ``max_num_patches``. The folder, config and TransformerConfig reading are
    :class:`HFVisionEncoder`'s; preprocessing, token counts and the network are its own."""

    provider = "siglip2"
    model_type = "siglip2_vision_model"
    hf_family = SIGLIP2_VISION
    class_token = False

    def _check_shape(self, hf_config: Any) -> None:
        num_patches = hf_config.num_patches
        if hf_config.num_channels != 3 or math.isqrt(num_patches) ** 2 != num_patches:
            raise EncoderPluginError(
                f"{self.where}: need num_channels 3 and a square num_patches (the position table "
                f"is square; got {hf_config.num_channels}, {num_patches})")

    def _read_preprocessor(self) -> Siglip2ImagePreprocessor:
        """preprocessor_config.json's recipe; without one, HF's defaults at the model's own patch
        size and ``num_patches``."""
        where = f"{self.where}: preprocessor_config.json"
        config = self.source.read_json("preprocessor_config.json") or {}
        if not config.get("do_resize", True) or not config.get("do_rescale", True):
            raise EncoderPluginError(f"{where} do_resize and do_rescale false are not supported")
        patch_size = config.get("patch_size", self.hf_config.patch_size)
        if patch_size != self.hf_config.patch_size:
            raise EncoderPluginError(f"{where} patch_size {patch_size} differs from config.json "
                                     f"patch_size {self.hf_config.patch_size}; fix one of them")
        max_num_patches = config.get("max_num_patches", self.hf_config.num_patches)
        if not isinstance(max_num_patches, int) or max_num_patches < 1:
            raise EncoderPluginError(f"{where} max_num_patches {max_num_patches!r} is not a "
                                     "positive integer")
        mean, std = config.get("image_mean", HALF), config.get("image_std", HALF)
        if not config.get("do_normalize", True):
            mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
        return Siglip2ImagePreprocessor(
            patch_size=patch_size, max_num_patches=max_num_patches,
            resample=int(config.get("resample", Image.Resampling.BILINEAR)),
            rescale_factor=float(config.get("rescale_factor", 1 / 255)),
            mean=tuple(float(v) for v in mean), std=tuple(float(v) for v in std))

    @property
    def tokens_per_item(self) -> int:
        return self._preprocessor.max_num_patches

    @property
    def fixed_item_tokens(self) -> bool:
        return False

    def item_tokens(self, size: tuple[int, ...]) -> int:
        rows, columns = self._preprocessor.grid(size[0], size[1])
        return rows * columns

    def item_grid(self, size: tuple[int, ...]) -> tuple[int, int, int]:
        return (1, *self._preprocessor.grid(size[0], size[1]))

    def encoder_spec(self, config: TransformerConfig,
                     pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
        return ModuleSpec(module=Siglip2Network, params={
            "config": config, "patch_size": self.hf_config.patch_size,
            "num_patches": self.hf_config.num_patches, "pg_collection": pg_collection})
