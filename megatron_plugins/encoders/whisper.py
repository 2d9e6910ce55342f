"""Pretrained Whisper audio encoder (``--encoder NAME=whisper``): transformers' ``WhisperEncoder``
on Megatron's tensor-parallel layers, so HF weights load into it exactly.

The network and the features come from the folder given as ``--encoder-hf-weights NAME=DIR`` (a
``WhisperModel`` / ``WhisperForConditionalGeneration`` folder, or an encoder-only save):
``config.json`` shapes it, ``preprocessor_config.json`` (else ``WhisperFeatureExtractor``'s
defaults) gives the log-mel recipe (:class:`WhisperFeatures`), and the same flag loads the weights
through :data:`~megatron_plugins.weights.audio_families.WHISPER_ENCODER`. A clip is padded (or,
as HF does, cut) to the chunk, so every item fills ``max_source_positions`` language positions:
the encoder's ``last_hidden_state``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
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
from megatron_plugins.encoders.hf_source import HFSource
from megatron_plugins.flops.count import EncoderFlops
from megatron_plugins.flops.encoder import embedding, stem, tower
from megatron_plugins.media.codec import Waveform, resample
from megatron_plugins.weights.audio_families import WHISPER_ENCODER, WHISPER_MODEL_TYPE


__all__ = ["CONV_KERNEL", "CONV_STRIDE", "EXTRACTOR_DEFAULTS", "WhisperEncoder", "WhisperFeatures",
           "WhisperNetwork", "drop_key_bias_grad",
           "read_features", "sinusoids", "whisper_mel_filters"]

MEL_MAX_HZ = 8000.0
"""Whisper's mel filters span 0 to 8 kHz whatever the sampling rate (HF's feature extractor)."""

CONV_STRIDE = 2
"""conv2 halves the frames: ``2 * max_source_positions`` mel frames per chunk."""

CONV_KERNEL = 3
"""Both convolutions' kernel size (padding 1)."""

EXTRACTOR_DEFAULTS = {"sampling_rate": 16000, "hop_length": 160, "chunk_length": 30,
                      "n_fft": 400, "padding_value": 0.0, "dither": 0.0}
"""``WhisperFeatureExtractor``'s defaults, for a folder without ``preprocessor_config.json``."""


@functools.lru_cache(maxsize=8)
def whisper_mel_filters(n_fft: int, num_mel_bins: int, sample_rate: int) -> np.ndarray:
    """``[n_fft // 2 + 1, num_mel_bins]`` Slaney mel filters, HF's (float64) exactly."""
    from transformers.audio_utils import mel_filter_bank

    return mel_filter_bank(num_frequency_bins=1 + n_fft // 2, num_mel_filters=num_mel_bins,
                           min_frequency=0.0, max_frequency=MEL_MAX_HZ,
                           sampling_rate=sample_rate, norm="slaney", mel_scale="slaney")


@dataclass(frozen=True)
class WhisperFeatures(MediaPreprocessor):
    """``WhisperFeatureExtractor`` on one clip, step for step (its torch path, as HF takes it when
    torch is installed): cut to the chunk, pad with ``padding_value``, hann STFT power without the
    last frame, mel filters, ``log10`` of at least 1e-10, clamped to within 8 of its max,
    ``(x + 4) / 4``."""

    media: ClassVar[str] = "audio"
    sample_rate: int = dataclasses.field()  # required, though MediaPreprocessor gives a default
    n_fft: int
    hop_length: int
    num_mel_bins: int
    n_samples: int
    padding_value: float = 0.0

    @property
    def num_frames(self) -> int:
        """Mel frames of one chunk."""
        return self.n_samples // self.hop_length

    def __call__(self, media: Waveform) -> dict[str, torch.Tensor]:
        """``{"input_features": float32 [num_mel_bins, num_frames]}`` of the clip resampled to
        ``sample_rate`` (HF's extractor refuses other rates; datasets mix them)."""
        samples = self.samples(media)[:self.n_samples]
        padded = np.full(self.n_samples, self.padding_value, dtype=np.float32)
        padded[:len(samples)] = samples
        return {"input_features": self.log_mel(padded)}

    def samples(self, media: Waveform) -> np.ndarray:
        """The clip's float32 samples at ``sample_rate``."""
        return np.asarray(resample(media, self.sample_rate).samples,
                          dtype=np.float32).reshape(-1)

    def log_mel(self, samples: np.ndarray) -> torch.Tensor:
        """float32 ``[num_mel_bins, len(samples) // hop_length]`` of the (already padded or
        cut) float32 ``samples``: the extractor's steps after its padding."""
        waveform = torch.from_numpy(samples).unsqueeze(0)
        stft = torch.stft(waveform, self.n_fft, self.hop_length,
                          window=torch.hann_window(self.n_fft), return_complex=True)
        magnitudes = (stft[..., :-1].abs() ** 2).contiguous()
        filters = torch.from_numpy(
            whisper_mel_filters(self.n_fft, self.num_mel_bins, self.sample_rate)).float()
        log_spec = torch.clamp(filters.T @ magnitudes, min=1e-10).log10()
        log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
        return ((log_spec + 4.0) / 4.0)[0].contiguous()


def read_features(kind: type[WhisperFeatures], where: str, given: dict[str, Any],
                  num_mel_bins: int) -> WhisperFeatures:
    """``kind`` made by a feature extractor config's Whisper fields ``given`` (its defaults fill
    the rest; other fields are another processor's); ``where`` names the file in errors."""
    config = {**EXTRACTOR_DEFAULTS, "feature_size": num_mel_bins,
              **{key: given[key] for key in (*EXTRACTOR_DEFAULTS, "feature_size") if key in given}}
    if config["dither"]:
        raise EncoderPluginError(f"{where} dither {config['dither']} is not supported (it adds "
                                 "random noise); set it 0.0")
    if config["feature_size"] != num_mel_bins:
        raise EncoderPluginError(f"{where} feature_size {config['feature_size']} differs from "
                                 f"config.json num_mel_bins {num_mel_bins}")
    return kind(sample_rate=int(config["sampling_rate"]), n_fft=int(config["n_fft"]),
                hop_length=int(config["hop_length"]), num_mel_bins=int(config["feature_size"]),
                n_samples=int(config["chunk_length"] * config["sampling_rate"]),
                padding_value=float(config["padding_value"]))


def sinusoids(length: int, channels: int, max_timescale: float = 10000) -> torch.Tensor:
    """Whisper's fixed position table ``[length, channels]`` (HF's initialization of it)."""
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-increment * torch.arange(channels // 2))
    scaled_time = torch.arange(length).view(-1, 1) * inv_timescales.view(1, -1)
    return torch.cat([scaled_time.sin(), scaled_time.cos()], dim=1)


def drop_key_bias_grad(head_dim: int, grad: torch.Tensor) -> torch.Tensor:
    """The fused qkv bias gradient with its key part zeroed: the softmax makes that gradient zero
    up to rounding; exactly zero keeps the part as imported (zeros where HF has no key bias, as
    Whisper; Adam would turn rounding noise into steps)."""
    grad = grad.clone()
    grad.view(-1, 3, head_dim)[:, 1] = 0
    return grad


class WhisperNetwork(MegatronModule):
    """conv1 + GELU, conv2 (stride 2) + GELU, the stored position table, pre-LN transformer
    layers, final LayerNorm: ``[items, max_source_positions, hidden]``.

    The convolutions and the (frozen, as in HF) position table are replicated on the tp ranks;
    the first layer's column-parallel linear all-reduces their gradient, so the copies stay equal.
    """

    def __init__(self, config: TransformerConfig, num_mel_bins: int, max_source_positions: int,
                 pg_collection: ProcessGroupCollection | None) -> None:
        super().__init__(config=config)
        if pg_collection is not None:
            self.tp_group = pg_collection.tp
        hidden, dtype = config.hidden_size, config.params_dtype
        self.conv1 = torch.nn.Conv1d(num_mel_bins, hidden, kernel_size=CONV_KERNEL, padding=1,
                                     dtype=dtype)
        self.conv2 = torch.nn.Conv1d(hidden, hidden, kernel_size=CONV_KERNEL, stride=CONV_STRIDE,
                                     padding=1, dtype=dtype)
        self.embed_positions = torch.nn.Parameter(
            sinusoids(max_source_positions, hidden).to(dtype), requires_grad=False)
        self.decoder = TransformerBlock(config, encoder_layer_spec(config),
                                        pg_collection=pg_collection)
        for layer in self.decoder.layers:
            bias = layer.self_attention.linear_qkv.bias
            bias.register_hook(functools.partial(drop_key_bias_grad, config.kv_channels))

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        """``[items, num_mel_bins, 2 * max_source_positions]`` -> ``[items, positions, hidden]``."""
        hidden = F.gelu(self.conv1(input_features.to(self.conv1.weight.dtype)))
        hidden = F.gelu(self.conv2(hidden)).permute(0, 2, 1) + self.embed_positions
        hidden = self.decoder(hidden.transpose(0, 1).contiguous(), attention_mask=None)
        return hidden.transpose(0, 1)


class WhisperEncoder(EncoderPlugin):
    """HF Whisper's encoder, shaped, fed and initialized from one HF folder."""

    submodules_class = AudioModalitySubmodules
    provider: ClassVar[str] = "whisper"
    hf_family = WHISPER_ENCODER
    """The weight mapping ``--encoder-hf-weights`` imports through."""

    def __init__(self, name: str, args: argparse.Namespace, grid: Any) -> None:
        super().__init__(name, args, grid)
        source = HFSource.of(name, self.provider, args, "a HF Whisper folder")
        self.folder, self.where, self.source = source.folder, source.where, source
        self.hf_config = self._read_config()
        self._preprocessor = self._read_preprocessor()

    def _read_config(self) -> Any:
        """transformers' ``WhisperConfig`` of the folder (its defaults fill missing fields)."""
        config = self.source.read_json("config.json")
        if config is None:
            raise EncoderPluginError(f"{self.where}: no config.json; give a folder saved by "
                                     "save_pretrained")
        if config.get("model_type") != WHISPER_MODEL_TYPE:
            raise EncoderPluginError(f"{self.where}: config.json is a "
                                     f"{config.get('model_type')!r} model, not "
                                     f"{WHISPER_MODEL_TYPE!r}; use the provider matching the model")
        fields = {key: value for key, value in config.items() if key != "model_type"}
        hf_config = self.source.hf_config(WHISPER_MODEL_TYPE, fields)
        if hf_config.activation_function != "gelu":
            raise EncoderPluginError(f"{self.where}: activation_function "
                                     f"{hf_config.activation_function!r} is not supported; "
                                     "supported: gelu")
        return hf_config

    def _read_preprocessor(self) -> WhisperFeatures:
        """preprocessor_config.json's recipe (or the extractor's defaults); its chunk must make
        the frames the model takes."""
        where = f"{self.where}: preprocessor_config.json"
        given = self.source.read_json("preprocessor_config.json") or {}
        if given.get("do_normalize"):
            raise EncoderPluginError(f"{where} do_normalize is not supported; set it false")
        features = read_features(WhisperFeatures, where, given, self.hf_config.num_mel_bins)
        config = {**EXTRACTOR_DEFAULTS, **given}
        frames = CONV_STRIDE * self.hf_config.max_source_positions
        if features.num_frames != frames:
            raise EncoderPluginError(
                f"{where} chunk_length {config['chunk_length']} s makes {features.num_frames} mel "
                f"frames (at sampling_rate {features.sample_rate}, hop_length "
                f"{features.hop_length}); the model takes {frames} (config.json "
                f"max_source_positions {self.hf_config.max_source_positions} x {CONV_STRIDE})")
        return features

    @property
    def num_attention_heads(self) -> int:
        return self.hf_config.encoder_attention_heads

    @property
    def tokens_per_item(self) -> int:
        return self.hf_config.max_source_positions

    def item_flops(self, size: tuple[int, ...], config: TransformerConfig,
                   language_hidden_size: int) -> EncoderFlops:
        """conv1 over the chunk's mel frames, conv2 (stride 2) down to the positions, the layers
        over them and the projection; every clip is cut or padded to one chunk."""
        positions, hidden = self.hf_config.max_source_positions, config.hidden_size
        convolutions = (embedding(CONV_STRIDE * positions,
                                  CONV_KERNEL * self.hf_config.num_mel_bins, hidden)
                        + stem(positions, CONV_KERNEL * hidden, hidden))
        return EncoderFlops(convolutions + tower(config, [positions]),
                            self.projection_flops(positions, config, language_hidden_size))

    def transformer_config(self, language: TransformerConfig) -> TransformerConfig:
        hf = self.hf_config
        # HF's nn.LayerNorm default eps (given here: dataclasses.replace would drop the
        # --reference-attention choice); encoder_config keeps the exact GELU unfused.
        return encoder_config(
            language, self.grid, num_layers=hf.encoder_layers, hidden_size=hf.d_model,
            num_attention_heads=hf.encoder_attention_heads, ffn_hidden_size=hf.encoder_ffn_dim,
            activation_func=F.gelu, add_bias_linear=True, add_qkv_bias=True,
            layernorm_epsilon=1e-5)

    def encoder_spec(self, config: TransformerConfig,
                     pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
        return ModuleSpec(module=WhisperNetwork, params={
            "config": config, "num_mel_bins": self.hf_config.num_mel_bins,
            "max_source_positions": self.hf_config.max_source_positions,
            "pg_collection": pg_collection})

    def preprocessor(self) -> WhisperFeatures:
        return self._preprocessor
