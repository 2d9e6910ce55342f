"""LLaVA-NeXT's anyres images (``--encoder NAME=llava_next``, implied by ``--hf-model`` on a
``LlavaNextForConditionalGeneration`` folder): the CLIP tower of :mod:`.hf_vision` run on each
image's crops, and a projection that packs the crops' features as transformers does.

An image is resized into the grid pinpoint that keeps most of it (``image_grid_pinpoints``),
padded to it and cut into tiles of the tower's size; a squashed copy of the whole image comes
first. The tower sees every crop on its own (class token dropped), the projector MLP maps each
patch, then :class:`AnyresProjection` lays each image out as HF's ``pack_image_features`` does:
the base crop's patches, then the tiles' patches as one grid with the padding's rows or columns
removed and the trained ``image_newline`` after every row. The modality's forward hands the
projection each image's size (:class:`AnyresSubmodules`), which that layout depends on.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image
from megatron.core.models.mimo.submodules.vision import VisionModalitySubmodules
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.encoders.base import EncoderPluginError, MediaPreprocessor
from megatron_plugins.encoders.hf_vision import CLIPVisionEncoder, HFImagePreprocessor
from megatron_plugins.flops.count import EncoderFlops
from megatron_plugins.flops.encoder import embedding, tower
from megatron_plugins.weights.vlm_families import HF_MODEL_FLAG

__all__ = ["AnyresGeometry", "AnyresImagePreprocessor", "AnyresProjection", "AnyresSubmodules",
           "DEFAULT_PINPOINTS", "IMAGE_SIZES", "LlavaNextEncoder", "anyres_pack"]

DEFAULT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
"""transformers' ``LlavaNextConfig`` grid pinpoints (height, width) when config.json has none."""

IMAGE_SIZES = "image_sizes"
"""The preprocessor's key for an item's original (height, width), which the projection reads."""


@dataclass(frozen=True)
class AnyresGeometry:
    """How LLaVA-NeXT tiles an image and how many language positions its features fill; pure
    functions of the image's (height, width), as HF's processor and model compute them."""

    pinpoints: tuple[tuple[int, int], ...]
    """The (height, width) resolutions an image may be tiled at, multiples of ``side``."""
    side: int
    """Pixels per crop side (the tower's image size)."""
    cells: int
    """Patches per crop side."""

    def best(self, height: int, width: int) -> tuple[int, int]:
        """The pinpoint transformers' processor tiles the image at (its
        ``select_best_resolution``: most of the image's pixels kept, ties to least waste)."""
        from transformers.image_processing_utils import select_best_resolution

        return select_best_resolution((height, width), self.pinpoints)

    def tiles(self, height: int, width: int) -> tuple[int, int]:
        """Tile rows and columns of the image's pinpoint."""
        target_h, target_w = self.best(height, width)
        return target_h // self.side, target_w // self.side

    def window(self, height: int, width: int) -> tuple[int, int, int, int]:
        """(top, rows, left, columns) of the tiles' patch grid that HF's ``unpad_image`` keeps:
        the padding's rows or columns are cut, the same number from each side."""
        tile_rows, tile_columns = self.tiles(height, width)
        rows, columns = tile_rows * self.cells, tile_columns * self.cells
        if width / height > columns / rows:
            kept = int(round(height * (columns / width), 7))
            pad = (rows - kept) // 2
            return pad, rows - 2 * pad, 0, columns
        kept = int(round(width * (rows / height), 7))
        pad = (columns - kept) // 2
        return 0, rows, pad, columns - 2 * pad

    def crops(self, height: int, width: int) -> int:
        """Crops the tower sees: the whole image, then the tiles."""
        tile_rows, tile_columns = self.tiles(height, width)
        return 1 + tile_rows * tile_columns

    def tokens(self, height: int, width: int) -> int:
        """Language positions: the base crop's patches, the kept grid and a newline per row."""
        _, rows, _, columns = self.window(height, width)
        return self.cells ** 2 + rows * (columns + 1)

    @property
    def most_tokens(self) -> int:
        """The most positions any image fills (its pinpoint's whole grid kept)."""
        return max(self.cells ** 2 + h // self.side * self.cells * (w // self.side * self.cells + 1)
                   for h, w in self.pinpoints)


@dataclass(frozen=True)
class AnyresImagePreprocessor(MediaPreprocessor):
    """HF's ``LlavaNextImageProcessor`` (PIL) for one image: resized into its pinpoint keeping
    the aspect ratio, padded with black to it, cut into tiles; the whole image squashed to one
    crop first; each crop then through the CLIP recipe (``crop``) the processor applies."""

    media: ClassVar[str] = "image"
    geometry: AnyresGeometry
    crop: HFImagePreprocessor

    def __call__(self, media: np.ndarray) -> dict[str, torch.Tensor]:
        """uint8 ``[H, W, 3]`` -> ``{"x": float32 [crops, 3, side, side], "image_sizes": int64
        [2]}`` (as HF's ``pixel_values`` without its batch padding, and ``image_sizes``)."""
        height, width = media.shape[:2]
        target_h, target_w = self.geometry.best(height, width)
        # HF's get_patch_output_size (in floats, as HF): fit the limiting side, round the other up.
        scale_w, scale_h = target_w / width, target_h / height
        if scale_w < scale_h:
            new_w, new_h = target_w, min(math.ceil(height * scale_w), target_h)
        else:
            new_w, new_h = min(math.ceil(width * scale_h), target_w), target_h
        image = Image.fromarray(media)
        resample = Image.Resampling(self.crop.resample)
        padded = np.zeros((target_h, target_w, 3), np.uint8)
        top, left = (target_h - new_h) // 2, (target_w - new_w) // 2
        padded[top:top + new_h, left:left + new_w] = np.asarray(
            image.resize((new_w, new_h), resample=resample))
        # The base crop: squashed to the processor's size, then the crop recipe as a tile.
        edge = self.crop.shortest_edge
        base = (edge, edge) if edge is not None else (self.crop.width, self.crop.height)
        side = self.geometry.side
        crops = [np.asarray(image.resize(base, resample=resample))]
        crops += [padded[y:y + side, x:x + side] for y in range(0, target_h, side)
                  for x in range(0, target_w, side)]
        return {"x": torch.stack([self.crop(crop)["x"] for crop in crops]),
                IMAGE_SIZES: torch.tensor([height, width], dtype=torch.int64)}

    def collate(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """``{"x": [all crops, 3, side, side], "image_sizes": [items, 2]}``."""
        return {"x": torch.cat([item["x"] for item in items]),
                IMAGE_SIZES: torch.stack([item[IMAGE_SIZES] for item in items])}


def anyres_pack(features: torch.Tensor, sizes: list[tuple[int, int]], geometry: AnyresGeometry,
                newline: torch.Tensor) -> torch.Tensor:
    """Projected crop features ``[crops * cells ** 2, hidden]`` of images of ``sizes``
    (height, width) -> ``[sum of tokens, hidden]``, each image as HF's
    ``pack_image_features``: base crop, then the kept grid row by row, ``newline`` after each."""
    cells, hidden = geometry.cells, features.shape[-1]
    per_crop = cells * cells
    packed, start = [], 0
    for height, width in sizes:
        tile_rows, tile_columns = geometry.tiles(height, width)
        end = start + geometry.crops(height, width) * per_crop
        grid = features[start + per_crop:end].view(tile_rows, tile_columns, cells, cells, hidden)
        grid = grid.permute(0, 2, 1, 3, 4).reshape(tile_rows * cells, tile_columns * cells, hidden)
        top, rows, left, columns = geometry.window(height, width)
        grid = grid[top:top + rows, left:left + columns]
        grid = torch.cat([grid, newline.to(grid.dtype).expand(rows, 1, hidden)], dim=1)
        packed += [features[start:start + per_crop], grid.reshape(-1, hidden)]
        start = end
    return torch.cat(packed)


class AnyresProjection(MultimodalProjector):
    """The projector MLP on every crop's patches, then :func:`anyres_pack` with the trained
    ``image_newline`` (replicated on the TP ranks, after the row-parallel output, as its bias)."""

    def __init__(self, config: TransformerConfig, submodules: MLPSubmodules, projector_type: str,
                 input_size: int, geometry: AnyresGeometry,
                 pg_collection: ProcessGroupCollection | None = None) -> None:
        super().__init__(config, submodules, projector_type, input_size,
                         pg_collection=pg_collection)
        self.geometry = geometry
        self.image_newline = torch.nn.Parameter(torch.empty(config.hidden_size,
                                                            dtype=config.params_dtype))
        config.init_method(self.image_newline)

    def forward(self, hidden_states: torch.Tensor, image_sizes: torch.Tensor) -> torch.Tensor:
        """``[crops * cells ** 2, tower hidden]`` and ``[images, 2]`` -> one row per language
        position, images in order."""
        projected = super().forward(hidden_states)
        sizes = [tuple(size) for size in image_sizes.tolist()]
        return anyres_pack(projected, sizes, self.geometry, self.image_newline)


class AnyresSubmodules(VisionModalitySubmodules):
    """The vision modality whose projection is told each image's size: the encoder gets the
    crops, the projection the sizes the anyres packing follows."""

    def forward(self, encoder_inputs: dict[str, Any] | None = None,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor | None:
        if encoder_inputs is None or hidden_states is not None:
            return super().forward(encoder_inputs=encoder_inputs, hidden_states=hidden_states)
        inputs = {name: dict(kwargs) for name, kwargs in encoder_inputs.items()}
        sizes = torch.cat([kwargs.pop(IMAGE_SIZES) for kwargs in inputs.values()])
        combined = self.combine_embeddings(self.encode(inputs))
        return self.input_projections[0](combined, sizes)


class LlavaNextEncoder(CLIPVisionEncoder):
    """LLaVA-NeXT's CLIP tower on anyres crops; the projection packs them with
    ``image_newline``. Only a whole ``LlavaNextForConditionalGeneration`` folder shapes it."""

    provider = "llava_next"
    submodules_class = AnyresSubmodules
    # The processor's do_pad pads each image's crop count for a batch tensor; crops are packed.
    unsupported_preprocessing = ("do_image_splitting",)

    def __init__(self, name: str, args: argparse.Namespace, grid: Any) -> None:
        super().__init__(name, args, grid)
        if self.projector_act is None:
            raise EncoderPluginError(f"{self.where}: the llava_next provider needs a whole "
                                     f"LlavaNextForConditionalGeneration folder ({HF_MODEL_FLAG})")
        self.geometry = self._read_geometry()

    def _read_geometry(self) -> AnyresGeometry:
        """config.json's grid pinpoints, multiples of the tower's image size (HF counts a
        pinpoint's crops rounding up but lays its grid out rounding down), and the processor's
        pinpoints the same (its token counts follow its own)."""
        side = self.hf_config.image_size
        where = f"{HF_MODEL_FLAG} {self.folder}"
        given = (self._read_json("config.json") or {}).get("image_grid_pinpoints")
        points = DEFAULT_PINPOINTS if given is None else given
        if not (isinstance(points, (list, tuple)) and points and all(
                isinstance(point, (list, tuple)) and len(point) == 2 and all(
                    isinstance(v, int) and v > 0 and v % side == 0 for v in point)
                for point in points)):
            raise EncoderPluginError(f"{where}: config.json image_grid_pinpoints {given!r} must "
                                     f"be [height, width] pairs, multiples of the tower's "
                                     f"image_size {side}")
        pinpoints = tuple(tuple(point) for point in points)
        processor = self._read_json("preprocessor_config.json") or {}
        points = processor.get("image_grid_pinpoints")
        if points is not None and tuple(tuple(point) for point in points) != pinpoints:
            raise EncoderPluginError(f"{where}: preprocessor_config.json image_grid_pinpoints "
                                     f"{points!r} differ from config.json's {given!r}; make "
                                     "them equal")
        crop = processor.get("crop_size")
        tile = crop.get("height", side) if isinstance(crop, dict) else (crop or side)
        if tile != side:
            raise EncoderPluginError(f"{where}: preprocessor_config.json crop_size height {tile} "
                                     f"(the tile side) is not the tower's image_size {side}")
        return AnyresGeometry(pinpoints, side, side // self.hf_config.patch_size)

    @property
    def tokens_per_item(self) -> int:
        return self.geometry.most_tokens

    def item_tokens(self, size: tuple[int, ...]) -> int:
        """HF's image token count for an image of this (height, width)."""
        return self.geometry.tokens(size[0], size[1])

    def item_flops(self, size: tuple[int, ...], config: TransformerConfig,
                   language_hidden_size: int) -> EncoderFlops:
        """Every crop (the base, then the tiles) through the tower with its class token, the
        projector MLP on every crop's patches (the anyres packing then only moves rows)."""
        crops, patch = self.geometry.crops(size[0], size[1]), self.hf_config.patch_size
        patches = self.geometry.cells ** 2
        return EncoderFlops(embedding(crops * patches, 3 * patch * patch, config.hidden_size)
                            + tower(config, [patches + 1] * crops),
                            self.projection_flops(crops * patches, config, language_hidden_size))

    def projection_spec(self, config: TransformerConfig, language_hidden_size: int,
                        pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
        """The projector MLP with the anyres packing after it."""
        spec = super().projection_spec(config, language_hidden_size, pg_collection)
        return dataclasses.replace(spec, module=AnyresProjection,
                                   params={**spec.params, "geometry": self.geometry})

    def preprocessor(self) -> AnyresImagePreprocessor:
        return AnyresImagePreprocessor(self.geometry, self._preprocessor)
