"""What Qwen2.5-VL's and Qwen3-VL's vision towers share: the 2D rotary positions over merge
blocks, the packed transformer layers, and the encoder plugin reading a Qwen vision config
(:class:`QwenTowerEncoder`, whose subclasses :mod:`.qwen2_5_vision` and :mod:`.qwen3_vision` build
each generation's tower), with HF's Qwen2-VL image and video preprocessing
(:mod:`.qwen_preprocessing`).

A microbatch's items run as one packed sequence; the merger's MLP (or Qwen3-VL's mergers) is the
modality's input projection, loaded from the same folder.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from PIL import Image
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.encoders.base import EncoderPluginError, encoder_config, mlp_projection_spec
from megatron_plugins.encoders.hf_vision import ACTIVATIONS, HFVisionEncoder
from megatron_plugins.encoders.qwen_preprocessing import (
    DEFAULT_VIDEO_MAX_PIXELS,
    DEFAULT_VIDEO_MIN_PIXELS,
    QwenImagePreprocessor,
)
from megatron_plugins.flops.count import Work
from megatron_plugins.flops.encoder import projection
from megatron_plugins.ops.fast_attention import packed_layer_spec

__all__ = ["QwenTowerEncoder", "ThinkerVideoTime", "merge_block_positions", "packed_decoder",
           "rotary_angles", "vision_norm"]

TOWER_ACTIVATIONS = {**ACTIVATIONS, "silu": F.silu}
"""HF ``hidden_act`` of the tower's MLP and the Megatron activation equal to it."""

def merge_block_positions(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(row, column) of every patch of the packed images in HF's patch order, ``[patches, 2]``:
    each ``merge`` x ``merge`` block contiguous, blocks row-major, every frame over again."""
    pieces = []
    for frames, rows, columns in grids:
        row, column = torch.meshgrid(torch.arange(rows), torch.arange(columns), indexing="ij")
        shape = (rows // merge, merge, columns // merge, merge)
        positions = torch.stack([row.reshape(shape).transpose(1, 2).flatten(),
                                 column.reshape(shape).transpose(1, 2).flatten()], dim=-1)
        pieces.append(positions.repeat(frames, 1))
    return torch.cat(pieces)


def rotary_angles(grids: list[tuple[int, int, int]], merge: int, head_dim: int,
                  theta: float) -> torch.Tensor:
    """HF's axial 2D rotary angles of every patch in merge-block order, ``[patches, head_dim]``:
    [row * f, column * f] twice over, ``f`` the ``head_dim // 4`` inverse frequencies."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
    angles = merge_block_positions(grids, merge)[..., None].float() * inv_freq
    angles = angles.flatten(1)
    return torch.cat([angles, angles], dim=-1)


def vision_norm(config: TransformerConfig) -> type:
    """The norm class of the tower's layer spec (``config.normalization``): TE's when the config
    uses TE, else torch's."""
    if config.transformer_impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    return WrappedTorchNorm


def packed_decoder(config: TransformerConfig,
                   pg_collection: ProcessGroupCollection | None) -> TransformerBlock:
    """The tower's transformer layers over packed images (:func:`packed_layer_spec`, torch's
    norms of ``config.normalization`` on the local path), no final norm."""
    spec = packed_layer_spec(config)
    if config.transformer_impl != "transformer_engine":
        spec.submodules.input_layernorm = WrappedTorchNorm
        spec.submodules.pre_mlp_layernorm = WrappedTorchNorm
    return TransformerBlock(config, spec, post_layer_norm=False, pg_collection=pg_collection)


class QwenTowerEncoder(HFVisionEncoder):
    """A Qwen vision tower read from a HF folder: its config checked, its preprocessing, its item
    grids and token counts, its transformer config and merger MLP; a subclass names the model
    (``provider``, ``model_types``, ``config_class``, preprocessing defaults, MLP and norm kind)
    and builds the tower (:meth:`encoder_spec`)."""

    model_types: ClassVar[tuple[str, ...]]
    """A whole model's ``model_type`` and its vision config's."""
    config_class: ClassVar[str]
    """The transformers vision config class validating ``config.json``."""
    default_pixels: ClassVar[tuple[int, int]]
    """(min_pixels, max_pixels) when preprocessor_config.json gives none."""
    preprocessor_class: ClassVar[type[QwenImagePreprocessor]]
    """The preprocessing; a tower whose videos are laid out otherwise gives one without them."""
    activations: ClassVar[dict[str, Any]] = TOWER_ACTIVATIONS
    gated: ClassVar[bool]
    """The blocks' MLP is gated (SwiGLU)."""
    normalization: ClassVar[str]
    """The blocks' norm (eps 1e-6)."""
    sub_config: ClassVar[str] = ""
    """The config.json field nesting a whole model's ``vision_config`` (Qwen2.5-Omni's
    ``thinker_config``); empty: the top level."""

    def _read_config(self) -> Any:
        """The HF vision config of a whole model's folder (``vision_config``) or of a vision
        model's own folder; shapes the tower cannot take are one line naming the field."""
        import transformers
        from huggingface_hub.errors import StrictDataclassError

        config = self._read_json("config.json")
        name = " or ".join(map(repr, self.model_types))
        if config is None:
            raise EncoderPluginError(f"{self.where}: no config.json; give a {name} folder "
                                     "saved by save_pretrained")
        if config.get("model_type") not in self.model_types:
            raise EncoderPluginError(
                f"{self.where}: config.json is a {config.get('model_type')!r} model, not "
                f"{name}; use the provider matching the model")
        root = config.get(self.sub_config) if self.sub_config else None
        vision = (root or config).get("vision_config", config)
        fields = {key: value for key, value in vision.items()
                  if key not in ("model_type", "architectures", "transformers_version")}
        try:
            hf = getattr(transformers, self.config_class)(**fields)
        except (TypeError, ValueError, StrictDataclassError) as error:
            reason = " ".join(str(error).split())
            raise EncoderPluginError(f"{self.where}: config.json rejected by "
                                     f"transformers: {reason}") from None
        problems = self._unsupported(hf)
        if problems:
            raise EncoderPluginError(f"{self.where}: config.json {'; '.join(problems)} is not "
                                     "supported")
        return hf

    def _unsupported(self, hf: Any) -> list[str]:
        """The vision config's fields the tower cannot build, each as "field value (why)"."""
        problems = []
        if hf.hidden_act not in self.activations:
            problems.append(f"hidden_act {hf.hidden_act!r} (supported: "
                            f"{', '.join(self.activations)})")
        if hf.in_channels != 3:
            problems.append(f"in_channels {hf.in_channels} (need 3)")
        if hf.hidden_size % hf.num_heads:
            problems.append(f"hidden_size {hf.hidden_size} not divisible by num_heads "
                            f"{hf.num_heads}")
        return problems

    def _video_config(self) -> tuple[str, dict]:
        """The video processor's settings as HF finds them: ``processor_config.json``'s
        ``video_processor``, else video_preprocessor_config.json, else preprocessor_config.json
        (whose image pixel range then holds for videos too)."""
        nested = (self._read_json("processor_config.json") or {}).get("video_processor")
        if nested is not None:
            return "processor_config.json video_processor", nested
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            config = self._read_json(name)
            if config is not None:
                return name, config
        return "", {}

    def _pixel_range(self, where: str, config: dict, least: int, most: int) -> tuple[int, int]:
        """``min_pixels`` / ``max_pixels`` (or ``size``'s shortest / longest edge) of a processor
        config, refused in one line when they leave no merge block."""
        size = config.get("size") or {}
        min_pixels = config.get("min_pixels", size.get("shortest_edge", least))
        max_pixels = config.get("max_pixels", size.get("longest_edge", most))
        factor = self.hf_config.patch_size * self.hf_config.spatial_merge_size
        if not 0 < min_pixels <= max_pixels or max_pixels < factor * factor:
            raise EncoderPluginError(f"{where} min_pixels {min_pixels} / max_pixels {max_pixels} "
                                     f"leave no {factor}x{factor}-pixel grid; fix them")
        return int(min_pixels), int(max_pixels)

    def _read_preprocessor(self) -> QwenImagePreprocessor:
        """preprocessor_config.json's recipe (HF's Qwen2-VL defaults where it is silent), the
        video pixel range from the video processor's config; its patch, merge and temporal sizes
        must be the model's."""
        where = f"{self.where}: preprocessor_config.json"
        hf = self.hf_config
        config = self._read_json("preprocessor_config.json") or {}
        video_file, video = self._video_config()
        for file, settings in ((where, config), (f"{self.where}: {video_file}", video)):
            for key, value in (("patch_size", hf.patch_size),
                               ("merge_size", hf.spatial_merge_size),
                               ("temporal_patch_size", hf.temporal_patch_size)):
                if settings.get(key, value) != value:
                    raise EncoderPluginError(f"{file} {key} {settings[key]} is not the model's "
                                             f"{value}; fix {key}")
            for flag in ("do_resize", "do_rescale", "do_normalize"):
                if not settings.get(flag, True):
                    raise EncoderPluginError(f"{file} {flag} false is not supported")
        min_pixels, max_pixels = self._pixel_range(where, config, *self.default_pixels)
        video_pixels = self._pixel_range(f"{self.where}: {video_file}", video,
                                         DEFAULT_VIDEO_MIN_PIXELS, DEFAULT_VIDEO_MAX_PIXELS)
        return self.preprocessor_class(
            patch_size=hf.patch_size, merge_size=hf.spatial_merge_size,
            temporal_patch_size=hf.temporal_patch_size, min_pixels=min_pixels,
            max_pixels=max_pixels,
            resample=int(config.get("resample", Image.Resampling.BICUBIC)),
            rescale_factor=float(config.get("rescale_factor", 1 / 255)),
            mean=tuple(float(v) for v in config.get("image_mean", self.default_mean)),
            std=tuple(float(v) for v in config.get("image_std", self.default_std)),
            video_min_pixels=video_pixels[0], video_max_pixels=video_pixels[1])

    @property
    def tokens_per_item(self) -> int:
        """Merged tokens of the largest image grid within max_pixels (a video's count grows with
        its frames: :meth:`item_tokens`)."""
        factor = self.hf_config.patch_size * self.hf_config.spatial_merge_size
        return self._preprocessor.max_pixels // (factor * factor)

    def item_tokens(self, size: tuple[int | float, ...]) -> int:
        """Merged tokens (language positions) of an image of this (height, width), or of a video
        of this (frames, height, width, fps)."""
        steps, rows, columns = self.item_grid(size)[:3]
        return steps * rows * columns

    def item_grid(self, size: tuple[int | float, ...]) -> tuple[Any, ...]:
        """(1, merged rows, merged columns) of an image; a video's (temporal steps, merged rows,
        merged columns, the steps' temporal positions: :meth:`step_times`)."""
        steps, rows, columns = self._preprocessor.item_grid(size)
        merge = self.hf_config.spatial_merge_size
        if len(size) == 2:
            return 1, rows // merge, columns // merge
        seconds = torch.tensor(self.hf_config.temporal_patch_size / size[3], dtype=torch.float32)
        return steps, rows // merge, columns // merge, self.step_times(steps, seconds)

    def step_times(self, steps: int, seconds: torch.Tensor) -> tuple[float, ...]:
        """A video's steps' temporal positions, ``seconds`` (float32) apart: ``floor(step *
        (tokens_per_second * seconds))`` in float32, as transformers' Qwen2.5-VL computes them."""
        return tuple((torch.arange(steps) * (self.tokens_per_second * seconds)).long().tolist())

    @property
    def tokens_per_second(self) -> float:
        """The vision config's ``tokens_per_second``: temporal positions per second of video."""
        return self.hf_config.tokens_per_second

    def _check_language(self, language_hidden_size: int) -> None:
        out = self.hf_config.out_hidden_size
        if out != language_hidden_size:
            raise EncoderPluginError(
                f"{self.where}: the merger's out_hidden_size {out} is not the language model's "
                f"hidden size {language_hidden_size}; pair the tower with its own language model")

    def transformer_config(self, language: TransformerConfig) -> TransformerConfig:
        self._check_language(language.hidden_size)
        hf = self.hf_config
        return encoder_config(
            language, self.grid, num_layers=hf.depth, hidden_size=hf.hidden_size,
            num_attention_heads=hf.num_heads, ffn_hidden_size=hf.intermediate_size,
            activation_func=self.activations[hf.hidden_act], gated_linear_unit=self.gated,
            add_bias_linear=True, add_qkv_bias=True, normalization=self.normalization,
            # encoder_config keeps stock's bias-activation fusion for SwiGLU only (exact).
            # HF's norm eps; torch's norms do not persist. Given here, not by
            # dataclasses.replace, which would drop the --reference-attention choice.
            layernorm_epsilon=1e-6, persist_layer_norm=False)

    @abc.abstractmethod
    def encoder_spec(self, config: TransformerConfig,
                     pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
        """The tower of this Qwen generation."""

    def projection_flops(self, tokens: int, config: TransformerConfig,
                         language_hidden_size: int) -> Work:
        """The merger's MLP (:meth:`projection_spec`) over ``tokens`` merged tokens."""
        merged = config.hidden_size * self.hf_config.spatial_merge_size ** 2
        return projection(tokens, merged, merged, language_hidden_size, config.transformer_impl)

    def projection_spec(self, config: TransformerConfig, language_hidden_size: int,
                        pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
        """The merger's MLP: ``linear_fc1`` (``mlp.0``, 4h -> 4h), exact GELU, ``linear_fc2``
        (``mlp.2``, 4h -> out_hidden_size)."""
        self._check_language(language_hidden_size)
        merged = config.hidden_size * self.hf_config.spatial_merge_size ** 2
        return mlp_projection_spec(config, merged, merged, language_hidden_size, pg_collection,
                                   activation_func=F.gelu,
                                   add_bias_linear=True)


class ThinkerVideoTime:
    """An Omni thinker's tower (mixed in before its :class:`QwenTowerEncoder`): a video's
    temporal positions at the thinker config's ``position_id_per_seconds`` (the vision config
    has none), the text after a video past its last one, as TMRoPE has them."""

    text_after_time = True

    whole_times = True
    """Temporal positions truncated to whole numbers (Qwen2.5-Omni); Qwen3-Omni keeps them
    float32."""

    def step_times(self, steps: int, seconds: torch.Tensor) -> tuple[float, ...]:
        """``step * seconds * position_id_per_seconds`` in float32, in transformers' order,
        truncated where :attr:`whole_times` (its ``get_rope_index``)."""
        times = torch.arange(steps) * seconds * self.tokens_per_second
        return tuple((times.long() if self.whole_times else times).tolist())

    @property
    def tokens_per_second(self) -> float:
        """The thinker config's ``position_id_per_seconds`` (25 in the released Qwen2.5-Omni,
        13 in Qwen3-Omni; transformers' class default 25 where the folder has none)."""
        config = self._read_json("config.json") or {}
        return float((config.get(self.sub_config) or config).get("position_id_per_seconds", 25))
