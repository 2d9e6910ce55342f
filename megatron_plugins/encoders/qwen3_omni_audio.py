"""Qwen3-Omni's audio tower, AuT (``--encoder NAME=qwen3_omni_audio --encoder-hf-weights
NAME=DIR``, DIR a Qwen3-Omni-MoE folder or its thinker-only save): transformers'
``Qwen3OmniMoeAudioEncoder`` on Megatron's tensor-parallel layers, so HF weights load into it
exactly.

Each clip is computed as transformers computes it given alone (the Qwen3-Omni processor, then the
tower, on that one clip). Its features are Whisper's log-mel of the whole clip, neither padded nor
cut (the processor pads a batch to its longest clip and does not truncate): ``samples //
hop_length`` frames. The tower cuts them into ``2 * n_window``-frame chunks (1 s), pads a clip's
chunks with zeros to its longest (its last one to a full chunk when it has a full one), runs three
stride-2 Conv2d + GELU over (mel bins, frames), ``conv_out`` over the channels and the mel bins
left, and adds the sinusoidal positions from 0 per chunk; the layers attend within windows of
``n_window_infer // (2 * n_window)`` chunks (packed, block-diagonal), and the projection is
``ln_post``, ``proj1``, GELU, ``proj2``. So a clip of ``L`` mel frames fills
:func:`audio_tokens` ``(L)`` language positions, about 13 a second.

Where transformers batches clips, a shorter clip is padded to the longest before the STFT, and a
batch with no full chunk pads chunks to its longest: that clip's last frames and positions then
differ from its own. The per-clip count keeps items independent of their microbatch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.encoders.base import EncoderPluginError
from megatron_plugins.encoders.qwen2_5_omni_audio import (
    OmniAudioFeatures,
    Qwen2_5OmniAudioEncoder,
    chunk_lengths,
    packed_whisper_block,
)
from megatron_plugins.encoders.whisper import sinusoids
from megatron_plugins.flops.count import EncoderFlops, Work, linear
from megatron_plugins.flops.encoder import embedding, stem, tower
from megatron_plugins.media.codec import Waveform
from megatron_plugins.ops.packed_attention import packed_seq_params
from megatron_plugins.weights.audio_families import QWEN3_OMNI_AUDIO

__all__ = ["AuTFeatures", "AuTNetwork", "AuTProjection", "CHUNK_TOKENS", "Qwen3OmniAudioEncoder",
           "audio_tokens", "conv_frames"]

MODEL_TYPES = ("qwen3_omni_moe", "qwen3_omni_moe_thinker")
"""A whole model's ``model_type`` (its ``thinker_config``) and a thinker-only save's."""

KERNEL = 3
"""Each Conv2d's kernel (3 x 3, stride 2, padding 1)."""

CHUNK_TOKENS = 13
"""Positions transformers counts per full chunk (fixed in ``_get_feat_extract_output_lengths``):
what three halvings leave of ``2 * n_window`` frames for ``n_window`` 49 to 52."""


def conv_frames(frames: int, convolutions: int = 3) -> int:
    """What ``convolutions`` stride-2 convolutions (kernel 3, padding 1) leave of ``frames``."""
    for _ in range(convolutions):
        frames = (frames - 1) // 2 + 1
    return frames


def audio_tokens(frames: int, window: int) -> int:
    """Language positions of a clip of ``frames`` mel frames in ``window``-frame chunks: each
    chunk's convolution output (``_get_feat_extract_output_lengths``)."""
    return sum(conv_frames(n) for n in chunk_lengths(frames, window))


@dataclass(frozen=True)
class AuTFeatures(OmniAudioFeatures):
    """Whisper's log-mel of the whole clip, neither padded nor cut; a microbatch's clips
    concatenated on the frame axis with their frame counts."""

    def __call__(self, media: Waveform) -> dict[str, torch.Tensor]:
        """``{"input_features": [num_mel_bins, samples // hop_length]}`` of one clip."""
        samples = self.samples(media)
        if len(samples) <= self.n_fft // 2:
            raise ValueError(f"a clip of {len(samples)} samples at {self.sample_rate} Hz is too "
                             f"short for the log-mel: it needs more than {self.n_fft // 2} (half "
                             "the FFT window, as transformers' extractor does)")
        return {"input_features": self.log_mel(samples)}


class AuTNetwork(MegatronModule):
    """Per chunk: three Conv2d (stride 2) + GELU over (mel, frames), ``conv_out`` on each
    position's channels x mel bins, the sinusoidal positions from 0; the layers attending within
    each clip's windows of ``window_tokens`` positions: ``[tokens, d_model]``.

    The convolutions and ``conv_out`` are replicated on the tp ranks (the first layer's
    column-parallel linear all-reduces their gradient). Chunks run batched by padded length; the padded positions are
    dropped before ``conv_out``, whose output there transformers drops too."""

    def __init__(self, config: TransformerConfig, num_mel_bins: int, channels: int, window: int,
                 window_tokens: int, max_source_positions: int,
                 pg_collection: ProcessGroupCollection | None) -> None:
        super().__init__(config=config)
        if pg_collection is not None:
            self.tp_group = pg_collection.tp
        hidden, dtype = config.hidden_size, config.params_dtype
        self.window, self.window_tokens = window, window_tokens
        self.conv2d1 = torch.nn.Conv2d(1, channels, KERNEL, 2, padding=1, dtype=dtype)
        self.conv2d2 = torch.nn.Conv2d(channels, channels, KERNEL, 2, padding=1, dtype=dtype)
        self.conv2d3 = torch.nn.Conv2d(channels, channels, KERNEL, 2, padding=1, dtype=dtype)
        self.conv_out = torch.nn.Linear(channels * conv_frames(num_mel_bins), hidden, bias=False,
                                        dtype=dtype)
        # HF's positions are a buffer it does not save; float32 as HF computes them.
        self.register_buffer("positions", sinusoids(max_source_positions, hidden),
                             persistent=False)
        self.decoder = packed_whisper_block(config, pg_collection)

    def _convolve(self, chunks: torch.Tensor) -> torch.Tensor:
        """``[chunks, mel, frames]`` -> ``[chunks, positions, channels * mel left]``."""
        hidden = chunks.unsqueeze(1).to(self.conv2d1.weight.dtype)
        for conv in (self.conv2d1, self.conv2d2, self.conv2d3):
            hidden = F.gelu(conv(hidden))
        return hidden.permute(0, 3, 1, 2).flatten(2)

    def forward(self, input_features: torch.Tensor, feature_lens: torch.Tensor) -> torch.Tensor:
        """``[mel, total frames]`` of the clips of ``feature_lens`` frames -> ``[tokens, hidden]``
        (each clip's :func:`audio_tokens`, clips in order)."""
        clips = [chunk_lengths(int(n), self.window) for n in feature_lens.tolist()]
        lengths = [n for chunks in clips for n in chunks]
        pieces = input_features.split(lengths, dim=1)
        by_width: dict[int, list[int]] = {}  # chunk indices by padded length: their clip's longest
        start = 0
        for chunks in clips:
            by_width.setdefault(max(chunks), []).extend(range(start, start + len(chunks)))
            start += len(chunks)
        outputs: list[torch.Tensor | None] = [None] * len(lengths)
        for width, indices in by_width.items():
            batch = torch.stack([F.pad(pieces[i], (0, width - lengths[i])) for i in indices])
            for i, hidden in zip(indices, self._convolve(batch)):
                outputs[i] = hidden[:conv_frames(lengths[i])]
        positions = torch.cat([self.positions[:len(o)] for o in outputs])
        hidden = self.conv_out(torch.cat(outputs)) + positions.to(self.conv_out.weight.dtype)
        windows = [n for chunks in clips
                   for n in chunk_lengths(sum(map(conv_frames, chunks)), self.window_tokens)]
        hidden = self.decoder(hidden.unsqueeze(1), attention_mask=None,
                              packed_seq_params=packed_seq_params(
                                  torch.tensor(windows, device=hidden.device)))
        return hidden.squeeze(1)


class AuTProjection(MegatronModule):
    """``ln_post``, ``proj1``, GELU, ``proj2`` to the language width, replicated on the tp ranks
    (their input, the tower's output, is whole on each)."""

    def __init__(self, config: TransformerConfig, output_dim: int) -> None:
        super().__init__(config=config)
        hidden, dtype = config.hidden_size, config.params_dtype
        self.ln_post = torch.nn.LayerNorm(hidden, eps=1e-5, dtype=dtype)
        self.proj1 = torch.nn.Linear(hidden, hidden, dtype=dtype)
        self.proj2 = torch.nn.Linear(hidden, output_dim, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj2(F.gelu(self.proj1(self.ln_post(hidden))))


class Qwen3OmniAudioEncoder(Qwen2_5OmniAudioEncoder):
    """Qwen3-Omni's audio tower and its ``ln_post`` + ``proj1`` + ``proj2`` projection, from the
    whole (or thinker-only) folder's ``audio_config`` (its config.json, never the class defaults,
    which differ from the released checkpoints') and ``preprocessor_config.json``."""

    provider: ClassVar[str] = "qwen3_omni_audio"
    hf_family = QWEN3_OMNI_AUDIO
    """The weight mapping (the tower, and ``ln_post`` + ``proj1`` + ``proj2`` as the
    projection)."""
    model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
    folder_kind: ClassVar[str] = "a Qwen3-Omni-MoE folder"
    features_class: ClassVar[type[OmniAudioFeatures]] = AuTFeatures
    projection_class: ClassVar[type[MegatronModule]] = AuTProjection

    def _check_config(self, hf: Any) -> None:
        """Refuse, in one line naming the field, what transformers' own count does not fit."""
        where = f"{self.where}: config.json audio_config"
        if hf.activation_function != "gelu":
            raise EncoderPluginError(f"{where} activation_function {hf.activation_function!r} "
                                     "is not supported; supported: gelu")
        if conv_frames(2 * hf.n_window) != CHUNK_TOKENS:
            raise EncoderPluginError(
                f"{where} n_window {hf.n_window} is not supported: its {2 * hf.n_window}-frame "
                f"chunk leaves {conv_frames(2 * hf.n_window)} positions, transformers counts "
                f"{CHUNK_TOKENS} (n_window 49 to 52)")
        if hf.n_window_infer < 2 * hf.n_window:
            raise EncoderPluginError(f"{where} n_window_infer {hf.n_window_infer} is shorter than "
                                     f"one chunk (2 x n_window = {2 * hf.n_window} frames)")

    @property
    def window(self) -> int:
        """Mel frames of one convolution chunk (``2 * n_window``)."""
        return 2 * self.hf_config.n_window

    @property
    def window_tokens(self) -> int:
        """Positions of one attention window: ``n_window_infer // (2 * n_window)`` chunks."""
        return CHUNK_TOKENS * (self.hf_config.n_window_infer // self.window)

    @property
    def tokens_per_item(self) -> int:
        """A clip of the feature extractor's chunk (``chunk_length``, 30 s by default): the
        size advice assumes; longer clips are not cut, :meth:`item_tokens` counts them."""
        return audio_tokens(self._preprocessor.num_frames, self.window)

    def _frames(self, size: tuple[int, ...]) -> int:
        """Mel frames of a clip of ``(samples, rate)`` once resampled to the encoder's rate."""
        samples = math.ceil(size[0] * self._preprocessor.sample_rate / size[1])  # as resample
        return samples // self._preprocessor.hop_length

    def item_tokens(self, size: tuple[int, ...]) -> int:
        return audio_tokens(self._frames(size), self.window)

    def item_flops(self, size: tuple[int, ...], config: TransformerConfig,
                   language_hidden_size: int) -> EncoderFlops:
        """The convolutions over the clip's chunks padded to its longest, ``conv_out`` and the
        layers over its positions, the projection over them."""
        channels, hidden = self.hf_config.downsample_hidden_size, config.hidden_size
        chunks = chunk_lengths(self._frames(size), self.window)
        tokens = sum(map(conv_frames, chunks))
        mel, width = self.hf_config.num_mel_bins, max(chunks)
        work = Work()
        for n, fan_in in enumerate((KERNEL * KERNEL, *[KERNEL * KERNEL * channels] * 2), 1):
            positions = len(chunks) * conv_frames(mel, n) * conv_frames(width, n)
            work += (embedding if n == 1 else stem)(positions, fan_in, channels)
        work += stem(tokens, channels * conv_frames(mel), hidden)
        work += tower(config, chunk_lengths(tokens, self.window_tokens))
        return EncoderFlops(work, self.projection_flops(tokens, config, language_hidden_size))

    def projection_flops(self, tokens: int, config: TransformerConfig,
                         language_hidden_size: int) -> Work:
        """``proj1`` and ``proj2``: both pass a gradient back whenever one flows (``ln_post``,
        no matmul, has weights before ``proj1``)."""
        hidden = config.hidden_size
        return Work(inner=linear(tokens, hidden, hidden)
                    + linear(tokens, hidden, language_hidden_size)).leading()

    def encoder_spec(self, config: TransformerConfig,
                     pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
        return ModuleSpec(module=AuTNetwork, params=dict(
            config=config, num_mel_bins=self.hf_config.num_mel_bins,
            channels=self.hf_config.downsample_hidden_size, window=self.window,
            window_tokens=self.window_tokens,
            max_source_positions=self.hf_config.max_source_positions,
            pg_collection=pg_collection))
