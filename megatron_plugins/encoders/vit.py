"""Built-in vision encoder (``--encoder NAME=vit``): Megatron's CLIP-style ViT on images.

Runs on the local spec (CPU simulation, no Transformer Engine) and on the TE spec
(``--transformer-impl transformer_engine``). Each image is resized and center-cropped to
``--vit-img-size`` pixels (:class:`ImagePreprocessor`) and cut into ``--vit-patch-size`` patches;
every patch becomes one language-model position. With ``--vit-native-resolution`` images keep
their aspect ratio and a size-dependent patch count instead
(:mod:`megatron_plugins.encoders.native_vit`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from PIL import Image
from megatron.core.models.vision.clip_vit_model import CLIPViTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.encoders.base import (
    EncoderPlugin,
    EncoderPluginError,
    MediaPreprocessor,
    encoder_config,
    encoder_layer_spec,
    encoder_norm,
)
from megatron_plugins.encoders.native_vit import (
    NativeImagePreprocessor,
    native_vit_spec,
    normalized_pixels,
    smart_resize,
)
from megatron_plugins.flops.count import EncoderFlops
from megatron_plugins.flops.encoder import embedding, tower

__all__ = ["CLIP_MEAN", "CLIP_STD", "ImagePreprocessor", "ViTEncoder", "clip_vit_spec"]


CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
"""CLIP's per-channel pixel statistics (RGB, on [0, 1]): the defaults of the normalization flags."""


@dataclass(frozen=True)
class ImagePreprocessor(MediaPreprocessor):
    """Resize the shorter side to ``size`` (bicubic), center-crop ``size`` x ``size``, scale to
    [0, 1] and normalize per channel: CLIP's recipe, so a square crop keeps the aspect ratio."""

    media: ClassVar[str] = "image"
    size: int
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD

    def __call__(self, media: np.ndarray) -> dict[str, torch.Tensor]:
        """uint8 ``[H, W, 3]`` -> ``{"x": float32 [3, size, size]}``."""
        height, width = media.shape[:2]
        scale = self.size / min(height, width)
        new_width = max(self.size, round(width * scale))
        new_height = max(self.size, round(height * scale))
        image = Image.fromarray(media).resize((new_width, new_height), Image.Resampling.BICUBIC)
        left, top = (new_width - self.size) // 2, (new_height - self.size) // 2
        image = image.crop((left, top, left + self.size, top + self.size))
        return {"x": normalized_pixels(image, self.mean, self.std)}


def _check_channels(flag: str, values: object, positive: bool) -> tuple[float, float, float]:
    values = tuple(values)
    if len(values) != 3 or (positive and min(values) <= 0):
        need = "3 positive values" if positive else "3 values"
        raise EncoderPluginError(f"{flag} {' '.join(map(str, values))}: give {need}, one per "
                                 "RGB channel")
    return values


def _check_pixel_range(patch_size: int, min_pixels: int, max_pixels: int) -> None:
    if max_pixels < patch_size ** 2 or not 0 < min_pixels <= max_pixels:
        raise EncoderPluginError(
            f"--vit-min-pixels {min_pixels} --vit-max-pixels {max_pixels}: need 0 < min <= max "
            f"and max >= one --vit-patch-size {patch_size} patch ({patch_size ** 2} pixels)"
        )


def clip_vit_spec(config: TransformerConfig, pg_collection: ProcessGroupCollection | None, *,
                  patch_size: int, image_size: int, subtype: str = "clip",
                  class_token: bool = False) -> ModuleSpec:
    """Megatron's ``CLIPViTModel`` on the config's layer spec and norm, for square images."""
    norm = encoder_norm(config)
    return ModuleSpec(
        module=CLIPViTModel,
        params={
            "transformer_config": config, "transformer_layer_spec": encoder_layer_spec(config),
            "ln_pre_impl": norm, "ln_post_impl": norm, "model_subtype": subtype,
            "add_class_token": class_token, "class_token_len": int(class_token),
            "patch_dim": patch_size, "img_h": image_size, "img_w": image_size,
            "pg_collection": pg_collection,
        },
    )


class ViTEncoder(EncoderPlugin):
    """A ViT over RGB images, without a class token (all patch embeddings reach the LM): square
    crops of ``--vit-img-size``, or each image at its own aspect ratio with
    ``--vit-native-resolution``."""

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("megatron-plugins vit encoder")
        group.add_argument("--vit-num-layers", type=int, default=2)
        group.add_argument("--vit-hidden-size", type=int, default=64)
        group.add_argument("--vit-num-attention-heads", type=int, default=4)
        group.add_argument("--vit-img-size", type=int, default=16,
                           help="Image height and width in pixels.")
        group.add_argument("--vit-patch-size", type=int, default=8)
        group.add_argument("--vit-image-mean", type=float, nargs=3, default=CLIP_MEAN,
                           metavar=("R", "G", "B"),
                           help="Per-channel pixel mean (on [0, 1]) subtracted before the ViT; "
                                "default CLIP's.")
        group.add_argument("--vit-image-std", type=float, nargs=3, default=CLIP_STD,
                           metavar=("R", "G", "B"),
                           help="Per-channel pixel std (on [0, 1]) divided by; default CLIP's.")
        group.add_argument("--vit-native-resolution", action="store_true",
                           help="Keep each image's aspect ratio: resize to the nearest patch "
                                "multiples within --vit-min-pixels..--vit-max-pixels (Qwen2-VL's "
                                "smart_resize) and pack a microbatch's images, one attention "
                                "segment each; --vit-img-size is then unused.")
        group.add_argument("--vit-min-pixels", type=int, default=8 * 8 * 4,
                           help="Native resolution: smaller images are upscaled to at least this "
                                "many pixels.")
        group.add_argument("--vit-max-pixels", type=int, default=8 * 8 * 64,
                           help="Native resolution: larger images are downscaled to at most this "
                                "many pixels; max patches per image = this / patch size^2.")

    def __init__(self, name, args, grid) -> None:
        super().__init__(name, args, grid)
        if args.vit_native_resolution:
            _check_pixel_range(args.vit_patch_size, args.vit_min_pixels, args.vit_max_pixels)
        elif args.vit_img_size % args.vit_patch_size != 0:
            raise EncoderPluginError(
                f"--vit-patch-size {args.vit_patch_size} does not divide --vit-img-size "
                f"{args.vit_img_size}; choose a patch size that tiles the image"
            )
        self.image_mean = _check_channels("--vit-image-mean", args.vit_image_mean, positive=False)
        self.image_std = _check_channels("--vit-image-std", args.vit_image_std, positive=True)

    @property
    def num_attention_heads(self) -> int:
        return self.args.vit_num_attention_heads

    @property
    def tokens_per_item(self) -> int:
        if self.args.vit_native_resolution:
            return self.args.vit_max_pixels // self.args.vit_patch_size ** 2
        return (self.args.vit_img_size // self.args.vit_patch_size) ** 2

    @property
    def fixed_item_tokens(self) -> bool:
        return not self.args.vit_native_resolution

    def item_tokens(self, size: tuple[int, ...]) -> int:
        """Native resolution: the patches of the image's resized grid (ValueError naming the flag
        for an image it cannot take); else :attr:`tokens_per_item`."""
        if not self.args.vit_native_resolution:
            return self.tokens_per_item
        height, width = smart_resize(size[0], size[1], self.args.vit_patch_size,
                                     self.args.vit_min_pixels, self.args.vit_max_pixels)
        return height * width // self.args.vit_patch_size ** 2

    def item_grid(self, size: tuple[int, ...]) -> tuple[int, int, int] | None:
        """Native resolution: ``(1, rows, columns)`` of the resized patch grid, the row-major
        order the tower's output has; a fixed-size crop has no grid (consecutive positions)."""
        if not self.args.vit_native_resolution:
            return None
        height, width = smart_resize(size[0], size[1], self.args.vit_patch_size,
                                     self.args.vit_min_pixels, self.args.vit_max_pixels)
        return 1, height // self.args.vit_patch_size, width // self.args.vit_patch_size

    def item_flops(self, size: tuple[int, ...], config: TransformerConfig,
                   language_hidden_size: int) -> EncoderFlops:
        """The patch embedding, the layers over the item's patches (one attention segment) and
        the projection, each patch one token."""
        tokens, patch = self.item_tokens(size), self.args.vit_patch_size
        return EncoderFlops(
            embedding(tokens, 3 * patch * patch, config.hidden_size) + tower(config, [tokens]),
            self.projection_flops(tokens, config, language_hidden_size))

    def transformer_config(self, language: TransformerConfig) -> TransformerConfig:
        return encoder_config(language, self.grid, num_layers=self.args.vit_num_layers,
                              hidden_size=self.args.vit_hidden_size,
                              num_attention_heads=self.args.vit_num_attention_heads)

    def encoder_spec(self, config: TransformerConfig,
                     pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
        if self.args.vit_native_resolution:
            return native_vit_spec(config, pg_collection, patch_size=self.args.vit_patch_size,
                                   max_pixels=self.args.vit_max_pixels)
        return clip_vit_spec(config, pg_collection, patch_size=self.args.vit_patch_size,
                             image_size=self.args.vit_img_size)

    def preprocessor(self) -> ImagePreprocessor | NativeImagePreprocessor:
        if self.args.vit_native_resolution:
            return NativeImagePreprocessor(self.args.vit_patch_size, self.args.vit_min_pixels,
                                           self.args.vit_max_pixels, self.image_mean,
                                           self.image_std)
        return ImagePreprocessor(self.args.vit_img_size, self.image_mean, self.image_std)
