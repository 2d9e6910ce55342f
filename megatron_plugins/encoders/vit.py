"""Built-in vision encoder (``--encoder NAME=vit``): Megatron's CLIP-style ViT on images.

Runs on the local spec (CPU simulation, no Transformer Engine) and on the TE spec
(``--transformer-impl transformer_engine``). Each image of ``--vit-img-size`` pixels is cut into
``--vit-patch-size`` patches; every patch becomes one language-model position.
"""

from __future__ import annotations

import argparse

import torch
from megatron.core.models.vision.clip_vit_model import CLIPViTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.encoders.base import (
    EncoderPlugin,
    EncoderPluginError,
    encoder_config,
    encoder_layer_spec,
    encoder_norm,
)


class ViTEncoder(EncoderPlugin):
    """A ViT over square RGB images, without a class token (all patch embeddings reach the LM)."""

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("megatron-plugins vit encoder")
        group.add_argument("--vit-num-layers", type=int, default=2)
        group.add_argument("--vit-hidden-size", type=int, default=64)
        group.add_argument("--vit-num-attention-heads", type=int, default=4)
        group.add_argument("--vit-img-size", type=int, default=16,
                           help="Image height and width in pixels.")
        group.add_argument("--vit-patch-size", type=int, default=8)

    def __init__(self, name, args, grid) -> None:
        super().__init__(name, args, grid)
        if args.vit_img_size % args.vit_patch_size != 0:
            raise EncoderPluginError(
                f"--vit-patch-size {args.vit_patch_size} does not divide --vit-img-size "
                f"{args.vit_img_size}; choose a patch size that tiles the image"
            )

    @property
    def num_attention_heads(self) -> int:
        return self.args.vit_num_attention_heads

    @property
    def tokens_per_sample(self) -> int:
        return (self.args.vit_img_size // self.args.vit_patch_size) ** 2

    def transformer_config(self, language: TransformerConfig) -> TransformerConfig:
        return encoder_config(language, self.grid, num_layers=self.args.vit_num_layers,
                              hidden_size=self.args.vit_hidden_size,
                              num_attention_heads=self.args.vit_num_attention_heads)

    def encoder_spec(self, config: TransformerConfig,
                     pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
        norm = encoder_norm(config)
        return ModuleSpec(
            module=CLIPViTModel,
            params={
                "transformer_config": config, "transformer_layer_spec": encoder_layer_spec(config),
                "ln_pre_impl": norm, "ln_post_impl": norm,
                "add_class_token": False, "class_token_len": 0,
                "patch_dim": self.args.vit_patch_size, "img_h": self.args.vit_img_size,
                "img_w": self.args.vit_img_size, "pg_collection": pg_collection,
            },
        )

    def sample_inputs(self, generator: torch.Generator, label: int) -> dict[str, torch.Tensor]:
        """A class-dependent pattern (a bright band whose row is the label) plus pixel noise."""
        size = self.args.vit_img_size
        image = 0.1 * torch.randn(3, size, size, generator=generator)
        image[:, label % size, :] += 1.0
        return {"x": image}
