"""Built-in audio encoder (``--encoder NAME=audio``): frames -> strided conv -> transformer.

A second, structurally different modality: inputs are ``[frames, features]`` log-mel frames
(:class:`LogMelPreprocessor`), downsampled 2x by a strided 1-D convolution as speech encoders do,
then a bidirectional transformer on Megatron's tensor-parallel layers. Every downsampled frame is
one LM position.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import ClassVar

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
    MediaPreprocessor,
    encoder_config,
    encoder_layer_spec,
)
from megatron_plugins.flops.count import EncoderFlops
from megatron_plugins.flops.encoder import embedding, tower
from megatron_plugins.media.codec import Waveform, resample

__all__ = ["AudioFrameEncoder", "LogMelPreprocessor", "hz_to_mel", "mel_filterbank", "mel_to_hz"]


DOWNSAMPLE = 2

LOG_FLOOR = 1e-6
"""Added to mel energies before the log, so silence is ``log(1e-6)``, not ``-inf``; padding
frames are that silence."""


def hz_to_mel(hz: torch.Tensor) -> torch.Tensor:
    """HTK mel scale."""
    return 2595.0 * torch.log10(1.0 + hz / 700.0)


def mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`hz_to_mel`."""
    return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)


def mel_filterbank(frequencies: torch.Tensor, num_mels: int, f_min: float,
                   f_max: float) -> torch.Tensor:
    """Triangular filters ``[num_mels, len(frequencies)]`` on the HTK mel scale.

    Filter ``i`` rises from mel point ``i`` to 1 at point ``i + 1`` and falls to 0 at point
    ``i + 2``, for ``num_mels + 2`` points evenly spaced in mel between ``f_min`` and ``f_max``;
    ``frequencies`` (Hz) are where it is evaluated, the STFT's bin centres in use.
    """
    low, high = hz_to_mel(torch.tensor([f_min, f_max], dtype=torch.float64)).tolist()
    edges = mel_to_hz(torch.linspace(low, high, num_mels + 2, dtype=torch.float64))
    left, centre, right = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    f = frequencies.to(torch.float64)[None, :]
    rising = (f - left) / (centre - left)
    falling = (right - f) / (right - centre)
    return torch.clamp(torch.minimum(rising, falling), min=0.0).to(torch.float32)


@dataclass(frozen=True)
class LogMelPreprocessor(MediaPreprocessor):
    """Waveform -> log-mel frames ``[num_frames, num_mels]``: hann-windowed STFT power, HTK mel
    filters up to Nyquist, ``log(mel + 1e-6)``; cut to ``num_frames`` or padded with silence."""

    media: ClassVar[str] = "audio"
    sample_rate: int = field()  # required, though MediaPreprocessor gives it a default
    n_fft: int
    hop_length: int
    num_mels: int
    num_frames: int

    def __call__(self, media: Waveform) -> dict[str, torch.Tensor]:
        """``{"frames": float32 [num_frames, num_mels]}`` of the clip resampled to
        ``sample_rate``."""
        clip = resample(media, self.sample_rate)
        samples = torch.as_tensor(clip.samples, dtype=torch.float32).reshape(-1)
        spectrum = torch.stft(samples, self.n_fft, hop_length=self.hop_length,
                              window=torch.hann_window(self.n_fft), center=True,
                              pad_mode="constant", return_complex=True)
        power = spectrum.abs() ** 2
        bins = torch.arange(self.n_fft // 2 + 1) * (self.sample_rate / self.n_fft)
        filters = mel_filterbank(bins, self.num_mels, 0.0, self.sample_rate / 2)
        frames = torch.log(filters @ power + LOG_FLOOR).T[:self.num_frames]
        silence = torch.log(torch.tensor(LOG_FLOOR, dtype=torch.float32))
        padding = silence.expand(self.num_frames - frames.shape[0], self.num_mels)
        return {"frames": torch.cat([frames, padding]).contiguous()}


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
        group.add_argument("--audio-num-features", type=int, default=16,
                           help="Mel bins per frame.")
        group.add_argument("--audio-sample-rate", type=int, default=16000,
                           help="Sample rate (Hz) the encoder hears: clips at other rates are "
                                "resampled to it.")
        group.add_argument("--audio-n-fft", type=int, default=400,
                           help="STFT window and FFT size in samples (25 ms at 16 kHz).")
        group.add_argument("--audio-hop-length", type=int, default=160,
                           help="Samples between frames (10 ms at 16 kHz).")

    def __init__(self, name, args, grid) -> None:
        super().__init__(name, args, grid)
        if args.audio_num_frames % DOWNSAMPLE != 0 or args.audio_num_frames < DOWNSAMPLE:
            raise EncoderPluginError(
                f"--audio-num-frames {args.audio_num_frames} must be a positive multiple of "
                f"{DOWNSAMPLE} (the encoder downsamples frames {DOWNSAMPLE}x)"
            )
        for flag in ("--audio-num-features", "--audio-sample-rate", "--audio-n-fft",
                     "--audio-hop-length"):
            value = getattr(args, flag[2:].replace("-", "_"))
            if value < 1:
                raise EncoderPluginError(f"{flag} {value}: must be a positive integer")

    @property
    def num_attention_heads(self) -> int:
        return self.args.audio_num_attention_heads

    @property
    def tokens_per_item(self) -> int:
        return self.args.audio_num_frames // DOWNSAMPLE

    def item_flops(self, size: tuple[int, ...], config: TransformerConfig,
                   language_hidden_size: int) -> EncoderFlops:
        """The strided convolution (``DOWNSAMPLE`` frames per token), the layers over the item's
        tokens and the projection; every clip is cut or padded to the same frames."""
        tokens = self.tokens_per_item
        stem = embedding(tokens, self.args.audio_num_features * DOWNSAMPLE, config.hidden_size)
        return EncoderFlops(stem + tower(config, [tokens]),
                            self.projection_flops(tokens, config, language_hidden_size))

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

    def preprocessor(self) -> LogMelPreprocessor:
        return LogMelPreprocessor(self.args.audio_sample_rate, self.args.audio_n_fft,
                                  self.args.audio_hop_length, self.args.audio_num_features,
                                  self.args.audio_num_frames)
