"""A user-defined encoder in its own file: sensor readings -> one LM token per window.

A sensor trace is a 1-D signal, so it is stored as a sample's audio (a WAV) and read as a
``Waveform``. Nothing in megatron_plugins changes to use it. Put this folder on PYTHONPATH and
launch with

    PYTHONPATH=examples/mimo/custom_encoder torchrun --nproc-per-node 3 \\
        examples/mimo/pretrain_mimo.py --cpu-simulation \\
        --encoder sensors=sensor_encoder:SensorEncoder --grid sensors:dp=1 \\
        --grid language:dp=2 --sensor-windows 4 <stock Megatron flags>
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.media.codec import Waveform
from megatron_plugins.encoders import EncoderPlugin, MediaPreprocessor, encoder_config
from megatron_plugins.flops.count import EncoderFlops, Work
from megatron_plugins.flops.encoder import embedding
from megatron_plugins.flops.transformer import linear


class WindowMLP(MegatronModule):
    """Embeds each window of readings on its own: ``[batch, windows, width] -> [.., hidden]``."""

    def __init__(self, config: TransformerConfig, width: int) -> None:
        super().__init__(config=config)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, config.hidden_size), torch.nn.GELU(),
            torch.nn.Linear(config.hidden_size, config.hidden_size),
        )

    def forward(self, readings: torch.Tensor) -> torch.Tensor:
        return self.mlp(readings)


@dataclass(frozen=True)
class SensorWindows(MediaPreprocessor):
    """The first ``windows * width`` readings (zeros after the end), as ``[windows, width]``."""

    media: ClassVar[str] = "audio"
    windows: int
    width: int

    def __call__(self, media: Waveform) -> dict[str, torch.Tensor]:
        readings = torch.zeros(self.windows * self.width)
        trace = torch.as_tensor(media.samples[:readings.numel()], dtype=torch.float32)
        readings[:trace.numel()] = trace
        return {"readings": readings.view(self.windows, self.width)}


class SensorEncoder(EncoderPlugin):
    """Fixed-rate sensor readings cut into windows."""

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("sensor encoder (examples/mimo/custom_encoder)")
        group.add_argument("--sensor-windows", type=int, default=4)
        group.add_argument("--sensor-window-width", type=int, default=12)
        group.add_argument("--sensor-hidden-size", type=int, default=32)

    @property
    def num_attention_heads(self) -> int:
        return self.grid.tp  # no attention: only the tp divisibility checks read it

    @property
    def tokens_per_item(self) -> int:
        return self.args.sensor_windows

    def item_flops(self, size: tuple[int, ...], config: TransformerConfig,
                   language_hidden_size: int) -> EncoderFlops:
        """Optional: the window MLP's two linears per window, then the default projection;
        throughput logging counts the encoder with it."""
        windows, hidden = self.args.sensor_windows, config.hidden_size
        network = (embedding(windows, self.args.sensor_window_width, hidden)
                   + Work(inner=linear(windows, hidden, hidden)))
        return EncoderFlops(network, self.projection_flops(windows, config, language_hidden_size))

    def transformer_config(self, language: TransformerConfig) -> TransformerConfig:
        return encoder_config(language, self.grid, num_layers=1,
                              hidden_size=self.args.sensor_hidden_size,
                              num_attention_heads=self.num_attention_heads)

    def encoder_spec(self, config: TransformerConfig,
                     pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
        return ModuleSpec(module=WindowMLP,
                          params={"config": config, "width": self.args.sensor_window_width})

    def preprocessor(self) -> SensorWindows:
        return SensorWindows(self.args.sensor_windows, self.args.sensor_window_width)
