"""Qwen2.5-Omni's audio tower (``--encoder NAME=qwen2_5_omni_audio``, or implied by a whole
Qwen2.5-Omni folder given as ``--hf-model``): transformers' ``Qwen2_5OmniAudioEncoder`` on
Megatron's tensor-parallel layers, so HF weights load into it exactly.

A clip's log-mel frames are Whisper's (:class:`~megatron_plugins.encoders.whisper.
WhisperFeatures` on the clip cut or padded to the 30-s chunk, as the Omni processor pads to
``max_length``) kept up to the clip's own length. The tower cuts them into ``2 * n_window``-frame
chunks (2 s), runs both convolutions and adds the sinusoidal positions per chunk, attends within
each chunk (packed, block-diagonal), averages frame pairs per clip (AvgPool 2) and hands that to
the projection, ``ln_post`` + ``proj``. So a clip of ``L`` mel frames fills
``((L - 1) // 2 + 1 - 2) // 2 + 1`` language positions.
"""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import dataclass
from typing import Any, ClassVar

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
)
from megatron_plugins.encoders.hf_source import HFSource
from megatron_plugins.encoders.whisper import (
    CONV_KERNEL,
    CONV_STRIDE,
    WhisperFeatures,
    drop_key_bias_grad,
    read_features,
    sinusoids,
)
from megatron_plugins.flops.count import EncoderFlops, Work, linear
from megatron_plugins.flops.encoder import embedding, stem, tower
from megatron_plugins.media.codec import Waveform
from megatron_plugins.ops.fast_attention import packed_layer_spec
from megatron_plugins.ops.packed_attention import packed_seq_params
from megatron_plugins.weights.audio_families import QWEN2_5_OMNI_AUDIO

__all__ = ["OmniAudioFeatures", "OmniAudioNetwork", "OmniAudioProjection",
           "Qwen2_5OmniAudioEncoder", "audio_tokens", "chunk_lengths", "mel_frames",
           "packed_whisper_block"]

MODEL_TYPES = ("qwen2_5_omni", "qwen2_5_omni_thinker")
"""A whole model's ``model_type`` (its ``thinker_config``) and a thinker-only save's."""


def mel_frames(samples: int, hop_length: int, n_samples: int) -> int:
    """Mel frames HF's feature attention mask keeps of a clip of ``samples`` samples at the
    encoder's rate: one per hop started, the clip cut at the chunk of ``n_samples``."""
    return math.ceil(min(samples, n_samples) / hop_length)


def audio_tokens(frames: int) -> int:
    """Language positions of a clip of ``frames`` mel frames: conv2 halves them, AvgPool(2)
    halves that (``_get_feat_extract_output_lengths``)."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def chunk_lengths(frames: int, window: int) -> list[int]:
    """A clip's attention chunks in mel frames: full ``window``-frame chunks, then the rest."""
    full, rest = divmod(frames, window)
    return [window] * full + ([rest] if rest else [])


def packed_whisper_block(config: TransformerConfig,
                         pg_collection: ProcessGroupCollection | None) -> TransformerBlock:
    """Whisper-style layers over packed segments, without a final norm (``ln_post`` is the
    projection's); the fused qkv bias's key part keeps its imported value
    (:func:`~megatron_plugins.encoders.whisper.drop_key_bias_grad`)."""
    block = TransformerBlock(config, packed_layer_spec(config), post_layer_norm=False,
                             pg_collection=pg_collection)
    for layer in block.layers:
        bias = layer.self_attention.linear_qkv.bias
        bias.register_hook(functools.partial(drop_key_bias_grad, config.kv_channels))
    return block


@dataclass(frozen=True)
class OmniAudioFeatures(WhisperFeatures):
    """Whisper's log-mel of the clip padded to the chunk, kept up to the clip's own frames;
    a microbatch's clips concatenated on the frame axis with their frame counts."""

    def __call__(self, media: Waveform) -> dict[str, torch.Tensor]:
        """``{"input_features": [num_mel_bins, frames]}`` of one clip."""
        features = super().__call__(media)["input_features"]
        samples = math.ceil(len(media.samples) * self.sample_rate / media.sample_rate)
        return {"input_features": features[:, :mel_frames(samples, self.hop_length,
                                                          self.n_samples)].contiguous()}

    def collate(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """``input_features`` ``[num_mel_bins, total frames]`` and ``feature_lens`` ``[clips]``."""
        features = [item["input_features"] for item in items]
        return {"input_features": torch.cat(features, dim=1),
                "feature_lens": torch.tensor([f.shape[1] for f in features])}


class OmniAudioNetwork(MegatronModule):
    """Per chunk: conv1 + GELU, conv2 (stride 2) + GELU, the sinusoidal positions from 0; the
    layers attending within each chunk; frame pairs averaged per clip: ``[tokens, d_model]``.

    The convolutions are replicated on the tp ranks (the first layer's column-parallel linear
    all-reduces their gradient); full chunks run batched, each clip's last chunk alone, so no
    frame is padded and the FLOPs are the chunks' own."""

    def __init__(self, config: TransformerConfig, num_mel_bins: int, window: int,
                 max_source_positions: int,
                 pg_collection: ProcessGroupCollection | None) -> None:
        super().__init__(config=config)
        if pg_collection is not None:
            self.tp_group = pg_collection.tp
        hidden, dtype = config.hidden_size, config.params_dtype
        self.window = window
        self.conv1 = torch.nn.Conv1d(num_mel_bins, hidden, kernel_size=CONV_KERNEL, padding=1,
                                     dtype=dtype)
        self.conv2 = torch.nn.Conv1d(hidden, hidden, kernel_size=CONV_KERNEL, stride=CONV_STRIDE,
                                     padding=1, dtype=dtype)
        # HF's positions are a buffer it does not save; float32 as HF computes them.
        self.register_buffer("positions", sinusoids(max_source_positions, hidden),
                             persistent=False)
        self.decoder = packed_whisper_block(config, pg_collection)

    def _chunk(self, frames: torch.Tensor) -> torch.Tensor:
        """``[chunks, mel, frames]`` of one length -> ``[chunks, positions, hidden]``."""
        hidden = F.gelu(self.conv1(frames.to(self.conv1.weight.dtype)))
        hidden = F.gelu(self.conv2(hidden)).transpose(1, 2)
        return hidden + self.positions[:hidden.shape[1]].to(hidden.dtype)

    def forward(self, input_features: torch.Tensor, feature_lens: torch.Tensor) -> torch.Tensor:
        """``[mel, total frames]`` of the clips of ``feature_lens`` frames -> ``[tokens, hidden]``
        (each clip's :func:`audio_tokens`, clips in order)."""
        clips = [chunk_lengths(int(n), self.window) for n in feature_lens.tolist()]
        lengths = [n for chunks in clips for n in chunks]
        pieces = input_features.split(lengths, dim=1)
        full = [i for i, n in enumerate(lengths) if n == self.window]
        outputs: list[torch.Tensor | None] = [None] * len(lengths)
        if full:
            for i, hidden in zip(full, self._chunk(torch.stack([pieces[i] for i in full]))):
                outputs[i] = hidden
        for i, n in enumerate(lengths):
            if n != self.window:
                outputs[i] = self._chunk(pieces[i].unsqueeze(0))[0]
        segments = torch.tensor([o.shape[0] for o in outputs], device=input_features.device)
        hidden = torch.cat(outputs).unsqueeze(1)
        hidden = self.decoder(hidden, attention_mask=None,
                              packed_seq_params=packed_seq_params(segments)).squeeze(1)
        pooled, start = [], 0
        for chunks in clips:
            frames = sum((n - 1) // 2 + 1 for n in chunks)
            pairs = frames // 2
            clip = hidden[start:start + 2 * pairs].view(pairs, 2, -1)
            pooled.append((clip[:, 0] + clip[:, 1]) / 2)
            start += frames
        return torch.cat(pooled)


class OmniAudioProjection(MegatronModule):
    """``ln_post`` then ``proj`` to the language width, replicated on the tp ranks (their input,
    the tower's output, is whole on each)."""

    def __init__(self, config: TransformerConfig, output_dim: int) -> None:
        super().__init__(config=config)
        hidden, dtype = config.hidden_size, config.params_dtype
        self.ln_post = torch.nn.LayerNorm(hidden, eps=1e-5, dtype=dtype)
        self.proj = torch.nn.Linear(hidden, output_dim, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln_post(hidden))


class Qwen2_5OmniAudioEncoder(EncoderPlugin):
    """Qwen2.5-Omni's audio tower and its ``ln_post`` + ``proj`` projection, from the whole
    (or thinker-only) folder's ``audio_config`` and ``preprocessor_config.json``."""

    submodules_class = AudioModalitySubmodules
    provider: ClassVar[str] = "qwen2_5_omni_audio"
    hf_family = QWEN2_5_OMNI_AUDIO
    """The weight mapping (the tower, and ``ln_post`` + ``proj`` as the projection)."""
    model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
    folder_kind: ClassVar[str] = "a Qwen2.5-Omni folder"
    features_class: ClassVar[type[OmniAudioFeatures]] = OmniAudioFeatures
    projection_class: ClassVar[type[MegatronModule]] = OmniAudioProjection
    """Built with ``config`` and ``output_dim``."""

    def __init__(self, name: str, args: argparse.Namespace, grid: Any) -> None:
        super().__init__(name, args, grid)
        source = HFSource.of(name, self.provider, args, self.folder_kind)
        self.folder, self.where, self.source = source.folder, source.where, source
        self.hf_config = self._read_config()
        self._preprocessor = self._read_preprocessor()

    def _read_config(self) -> Any:
        """transformers' audio config of the folder (``thinker_config.audio_config`` of a whole
        model, ``audio_config`` of a thinker-only save)."""
        config = self.source.read_json("config.json")
        if config is None or config.get("model_type") not in self.model_types:
            kind = None if config is None else config.get("model_type")
            raise EncoderPluginError(f"{self.where}: config.json is a {kind!r} model, not "
                                     f"{' or '.join(self.model_types)}; use the provider "
                                     "matching the model")
        audio = (config.get("thinker_config") or config).get("audio_config") or {}
        fields = {key: value for key, value in audio.items()
                  if key not in ("model_type", "architectures", "transformers_version")}
        hf = self.source.hf_config(self.hf_family.model_type, fields)
        self._check_config(hf)
        return hf

    def _check_config(self, hf: Any) -> None:
        """Refuse, in one line naming the field, what the network does not compute."""
        if hf.activation_function != "gelu" or hf.scale_embedding:
            raise EncoderPluginError(f"{self.where}: config.json audio_config activation_function "
                                     f"{hf.activation_function!r} / scale_embedding "
                                     f"{hf.scale_embedding} is not supported; supported: gelu, "
                                     "false")

    def _read_preprocessor(self) -> OmniAudioFeatures:
        """preprocessor_config.json's Whisper recipe (else the extractor's defaults), mel bins
        from the audio config as the Omni processor has them."""
        given = self.source.read_json("preprocessor_config.json") or {}
        return read_features(self.features_class, f"{self.where}: preprocessor_config.json",
                             given, self.hf_config.num_mel_bins)

    @property
    def window(self) -> int:
        """Mel frames of one attention chunk (``2 * n_window``)."""
        return 2 * self.hf_config.n_window

    @property
    def num_attention_heads(self) -> int:
        return self.hf_config.encoder_attention_heads

    @property
    def tokens_per_item(self) -> int:
        """A clip of the whole 30-s chunk."""
        return audio_tokens(self._preprocessor.num_frames)

    def _frames(self, size: tuple[int, ...]) -> int:
        """Mel frames of a clip of ``(samples, rate)`` once resampled to the encoder's rate."""
        samples = math.ceil(size[0] * self._preprocessor.sample_rate / size[1])
        return mel_frames(samples, self._preprocessor.hop_length, self._preprocessor.n_samples)

    def item_tokens(self, size: tuple[int, ...]) -> int:
        return audio_tokens(self._frames(size))

    @property
    def fixed_item_tokens(self) -> bool:
        return False

    def item_flops(self, size: tuple[int, ...], config: TransformerConfig,
                   language_hidden_size: int) -> EncoderFlops:
        """Both convolutions and the layers per chunk, the projection over the pooled tokens."""
        hidden, mel = config.hidden_size, self.hf_config.num_mel_bins
        frames = self._frames(size)
        chunks = chunk_lengths(frames, self.window)
        positions = [(n - 1) // 2 + 1 for n in chunks]
        work = (embedding(frames, CONV_KERNEL * mel, hidden)
                + stem(sum(positions), CONV_KERNEL * hidden, hidden) + tower(config, positions))
        return EncoderFlops(work, self.projection_flops(audio_tokens(frames), config,
                                                        language_hidden_size))

    def projection_flops(self, tokens: int, config: TransformerConfig,
                         language_hidden_size: int) -> Work:
        """``proj`` over the pooled tokens (``ln_post`` is no matmul)."""
        return Work(inner=linear(tokens, config.hidden_size, language_hidden_size)).leading()

    def transformer_config(self, language: TransformerConfig) -> TransformerConfig:
        hf = self.hf_config
        return encoder_config(
            language, self.grid, num_layers=hf.encoder_layers, hidden_size=hf.d_model,
            num_attention_heads=hf.encoder_attention_heads, ffn_hidden_size=hf.encoder_ffn_dim,
            activation_func=F.gelu, add_bias_linear=True, add_qkv_bias=True,
            layernorm_epsilon=1e-5)

    def encoder_spec(self, config: TransformerConfig,
                     pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
        return ModuleSpec(module=OmniAudioNetwork, params={
            "config": config, "num_mel_bins": self.hf_config.num_mel_bins, "window": self.window,
            "max_source_positions": self.hf_config.max_source_positions,
            "pg_collection": pg_collection})

    def projection_spec(self, config: TransformerConfig, language_hidden_size: int,
                        pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
        if self.hf_config.output_dim != language_hidden_size:
            raise EncoderPluginError(f"{self.where}: config.json audio_config output_dim "
                                     f"{self.hf_config.output_dim} is not the language model's "
                                     f"hidden size {language_hidden_size}")
        return ModuleSpec(module=self.projection_class, params={
            "config": config, "output_dim": self.hf_config.output_dim})

    def preprocessor(self) -> MediaPreprocessor:
        return self._preprocessor
