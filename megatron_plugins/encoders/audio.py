"""Built-in audio encoder (``--encoder NAME=audio``): frames -> strided conv -> transformer.

A second, structurally different modality: inputs are ``[frames, features]`` sequences (log-mel
style), downsampled 2x by a strided 1-D convolution as speech encoders do, then a bidirectional
transformer on Megatron's tensor-parallel layers. Every downsampled frame is one LM position.
"""

from __future__ import annotations

import argparse

import torch
from megatron.core.models.mimo.submodules.audio import AudioModalitySubmodules
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.encoders.base import (
    EncoderPlugin,
    EncoderPluginError,
    encoder_config,
    encoder_layer_spec,
)

DOWNSAMPLE = 2


class FrameTransformer(MegatronModule):
    """Strided conv over frames, learned positions, then a Megatron transformer block."""

    def __init__(self, config: TransformerConfig, layer_spec: ModuleSpec, num_features: int,
                 num_frames: int, pg_collection: ProcessGroupCollection) -> None:
        super().__init__(config=config)
        self.conv = torch.nn.Conv1d(num_features, config.hidden_size, kernel_size=DOWNSAMPLE,
                                    stride=DOWNSAMPLE)
        self.position = torch.nn.Parameter(
            torch.zeros(num_frames // DOWNSAMPLE, config.hidden_size)
        )
        config.init_method(self.position)
        self.transformer = TransformerBlock(config, layer_spec, pg_collection=pg_collection)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        """``[batch, frames, features]`` -> ``[batch, frames // 2, hidden]``."""
        hidden = self.conv(frames.transpose(1, 2)).transpose(1, 2) + self.position
        hidden = self.transformer(hidden.transpose(0, 1).contiguous(), attention_mask=None)
        return hidden.transpose(0, 1)


class AudioFrameEncoder(EncoderPlugin):
    """Audio as fixed-length feature frames."""

    submodules_class = AudioModalitySubmodules

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("megatron-plugins audio encoder")
        group.add_argument("--audio-num-layers", type=int, default=1)
        group.add_argument("--audio-hidden-size", type=int, default=48)
        group.add_argument("--audio-num-attention-heads", type=int, default=4)
        group.add_argument("--audio-num-frames", type=int, default=8,
                           help=f"Input frames per sample (a multiple of {DOWNSAMPLE}).")
        group.add_argument("--audio-num-features", type=int, default=16)

    def __init__(self, name, args, grid) -> None:
        super().__init__(name, args, grid)
        if args.audio_num_frames % DOWNSAMPLE != 0 or args.audio_num_frames < DOWNSAMPLE:
            raise EncoderPluginError(
                f"--audio-num-frames {args.audio_num_frames} must be a positive multiple of "
                f"{DOWNSAMPLE} (the encoder downsamples frames {DOWNSAMPLE}x)"
            )

    @property
    def num_attention_heads(self) -> int:
        return self.args.audio_num_attention_heads

    @property
    def tokens_per_sample(self) -> int:
        return self.args.audio_num_frames // DOWNSAMPLE

    def transformer_config(self, language: TransformerConfig) -> TransformerConfig:
        return encoder_config(language, self.grid, num_layers=self.args.audio_num_layers,
                              hidden_size=self.args.audio_hidden_size,
                              num_attention_heads=self.args.audio_num_attention_heads)

    def encoder_spec(self, config: TransformerConfig,
                     pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
        return ModuleSpec(
            module=FrameTransformer,
            params={"config": config, "layer_spec": encoder_layer_spec(config),
                    "num_features": self.args.audio_num_features,
                    "num_frames": self.args.audio_num_frames, "pg_collection": pg_collection},
        )

    def sample_inputs(self, generator: torch.Generator, label: int) -> dict[str, torch.Tensor]:
        """Noise frames with a tone: the feature bin ``label`` is loud in every frame."""
        frames = 0.1 * torch.randn(self.args.audio_num_frames, self.args.audio_num_features,
                                   generator=generator)
        frames[:, label % self.args.audio_num_features] += 1.0
        return {"frames": frames}
