"""Qwen2.5-VL's vision tower (``--encoder NAME=qwen2_5_vl``): HF's
``Qwen2_5_VisionTransformerPretrainedModel`` as a tensor-parallel Megatron module.

The folder given as ``--encoder-hf-weights NAME=DIR`` (a whole Qwen2.5-VL folder, or one of just
its vision model) shapes the tower and holds its weights. Each image is resized to multiples of
``patch_size * spatial_merge_size`` within the processor's pixel range (Qwen2-VL's
``smart_resize``), cut into patches with each 2x2 merge block contiguous; a video (a
:class:`~megatron_plugins.media.codec.Video`, an item of the same encoder) is resized frame by
frame as HF's video processor does, its frames paired by ``temporal_patch_size``. A microbatch's
images and videos run as one packed sequence: patches reordered by attention window, 2D rotary positions, window
attention in most layers and whole-image attention in ``fullatt_block_indexes``, RMSNorm, SwiGLU,
then the merger's ``ln_q`` and 2x2 merge, back in image order. The merger's MLP is the modality's
input projection (:meth:`QwenVisionEncoder.projection_spec`), loaded from the same folder, so the
projection's output is HF's merged image features.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.media.codec import Video
from megatron_plugins.encoders.base import (
    EncoderPluginError,
    MediaPreprocessor,
    encoder_config,
    mlp_projection_spec,
)
from megatron_plugins.encoders.hf_vision import ACTIVATIONS, HFVisionEncoder, hf_normalized
from megatron_plugins.encoders.native_vit import MAX_ASPECT_RATIO, nearest_grid
from megatron_plugins.ops.packed_attention import packed_layer_spec, packed_seq_params
from megatron_plugins.encoders.vit import CLIP_MEAN, CLIP_STD
from megatron_plugins.flops.count import EncoderFlops, Work
from megatron_plugins.flops.encoder import embedding, projection, tower
from megatron_plugins.weights.vision_families import QWEN2_5_VL_VISION

__all__ = ["QwenImagePreprocessor", "QwenViT", "QwenVisionEncoder", "merge_block_positions",
           "packed_decoder", "qwen_smart_resize", "qwen_vit_spec", "rotary_angles", "vision_norm",
           "window_order"]

MODEL_TYPES = ("qwen2_5_vl", "qwen2_5_vl_vision")
"""A whole Qwen2.5-VL model's ``model_type`` and its vision config's."""

TOWER_ACTIVATIONS = {**ACTIVATIONS, "silu": F.silu}
"""HF ``hidden_act`` of the tower's gated MLP and the Megatron activation equal to it."""

DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
"""Qwen2-VL's image processor's pixel range when preprocessor_config.json gives none."""
DEFAULT_VIDEO_MIN_PIXELS = 128 * 28 * 28
DEFAULT_VIDEO_MAX_PIXELS = 28 * 28 * 768
"""Qwen2-VL's video processor's per-frame pixel range when its config gives none."""


def qwen_smart_resize(height: int, width: int, factor: int, min_pixels: int,
                      max_pixels: int) -> tuple[int, int]:
    """HF Qwen2-VL's ``smart_resize``, rounding for rounding; ValueError (naming the image) for an
    aspect ratio above 200 or a size whose grid lies above ``max_pixels``."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image {height}x{width} (height x width): aspect ratio above "
                         f"{MAX_ASPECT_RATIO}; crop or drop such images")
    h_bar, w_bar = nearest_grid(height, width, factor, min_pixels, max_pixels)
    if h_bar * w_bar > max_pixels:
        raise ValueError(f"image {height}x{width} (height x width): its {factor}-pixel grid "
                         f"{h_bar}x{w_bar} is above max_pixels {max_pixels}; crop such images")
    return h_bar, w_bar


@dataclass(frozen=True)
class QwenImagePreprocessor(MediaPreprocessor):
    """HF's ``Qwen2VLImageProcessor`` (PIL) for one still image: resize to
    :func:`qwen_smart_resize`, rescale, normalize, repeat over ``temporal_patch_size`` frames,
    flatten patches with each ``merge_size`` x ``merge_size`` block contiguous; HF's
    ``Qwen2VLVideoProcessor`` for a :class:`Video` (torch's antialiased bicubic resize within the
    video pixel range, the last frame repeated up to a multiple of ``temporal_patch_size``); a
    microbatch's items are packed."""

    media: ClassVar[str] = "image"
    takes_video: ClassVar[bool] = True
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    resample: int
    rescale_factor: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    video_min_pixels: int = DEFAULT_VIDEO_MIN_PIXELS
    video_max_pixels: int = DEFAULT_VIDEO_MAX_PIXELS

    def grid(self, height: int, width: int, video: bool = False) -> tuple[int, int]:
        """The patch grid (rows, columns) of a ``height`` x ``width`` image (or video frame)."""
        pixels = ((self.video_min_pixels, self.video_max_pixels) if video
                  else (self.min_pixels, self.max_pixels))
        new_height, new_width = qwen_smart_resize(height, width, self.patch_size * self.merge_size,
                                                  *pixels)
        return new_height // self.patch_size, new_width // self.patch_size

    def item_grid(self, size: tuple[int | float, ...]) -> tuple[int, int, int]:
        """(temporal, rows, columns) patches of an item of this
        :func:`~megatron_plugins.media.codec.media_size`: ``(height, width)`` or a video's
        ``(frames, height, width, fps)``."""
        if len(size) == 2:
            return (1, *self.grid(int(size[0]), int(size[1])))
        frames = int(size[0])
        return (-(-frames // self.temporal_patch_size),
                *self.grid(int(size[1]), int(size[2]), video=True))

    def _video(self, video: Video) -> dict[str, torch.Tensor]:
        """As HF's ``Qwen2VLVideoProcessor`` (``pixel_values_videos`` / ``video_grid_thw``)."""
        frames = video.frames
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise ValueError(f"video frames {frames.dtype} {list(frames.shape)}: expected uint8 "
                             "[frames, height, width, 3]")
        _, rows, columns = self.item_grid(frames.shape[:3] + (video.fps,))
        p, m, span = self.patch_size, self.merge_size, self.temporal_patch_size
        pixels = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
        if (rows * p, columns * p) != tuple(pixels.shape[-2:]):
            # torchvision's uint8 bicubic resize on CPU, which HF's video processor calls.
            pixels = F.interpolate(pixels, size=(rows * p, columns * p), mode="bicubic",
                                   align_corners=False, antialias=True)
        scale = 1.0 / self.rescale_factor
        mean = (torch.tensor(self.mean) * scale)[:, None, None]
        std = (torch.tensor(self.std) * scale)[:, None, None]
        pixels = (pixels.to(torch.float32) - mean) / std
        if pad := -len(pixels) % span:
            pixels = torch.cat([pixels, pixels[-1:].expand(pad, -1, -1, -1)])
        steps = len(pixels) // span
        # (step, block row, block column, row in block, column in block, channel, frame, y, x).
        patches = pixels.reshape(steps, span, 3, rows // m, m, p, columns // m, m, p)
        patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return {"pixel_values": patches.reshape(steps * rows * columns,
                                                3 * span * p * p).contiguous(),
                "grid_thw": torch.tensor([steps, rows, columns], dtype=torch.int64)}

    def __call__(self, media: np.ndarray | Video) -> dict[str, torch.Tensor]:
        """uint8 ``[H, W, 3]`` -> ``{"pixel_values": float32 [rows * columns, 3 * T * p * p],
        "grid_thw": int64 [3] (1, rows, columns)}``, as HF's ``pixel_values`` /
        ``image_grid_thw``; a :class:`Video` -> its ``[steps * rows * columns, ...]`` patches
        and ``(steps, rows, columns)``."""
        if isinstance(media, Video):
            return self._video(media)
        rows, columns = self.grid(*media.shape[:2])
        p, m, frames = self.patch_size, self.merge_size, self.temporal_patch_size
        image = Image.fromarray(media).resize((columns * p, rows * p),
                                              resample=Image.Resampling(self.resample))
        pixels = torch.from_numpy(hf_normalized(np.asarray(image), self.rescale_factor, self.mean,
                                                self.std)).permute(2, 0, 1)
        # (block row, block column, row in block, column in block, channel, y, x), as HF.
        patches = pixels.reshape(3, rows // m, m, p, columns // m, m, p)
        patches = patches.permute(1, 4, 2, 5, 0, 3, 6)
        patches = patches.unsqueeze(5).expand(*patches.shape[:5], frames, p, p)
        return {"pixel_values": patches.reshape(rows * columns, 3 * frames * p * p).contiguous(),
                "grid_thw": torch.tensor([1, rows, columns], dtype=torch.int64)}

    def collate(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """``{"pixel_values": [total patches, 3 * T * p * p], "grid_thw": [items, 3]}``."""
        return {"pixel_values": torch.cat([item["pixel_values"] for item in items]),
                "grid_thw": torch.stack([item["grid_thw"] for item in items])}


def window_order(grids: list[tuple[int, int, int]], merge: int, window: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's window reordering of packed images: merge blocks (indices into the packed images'
    blocks) window by window, each frame's ``window`` x ``window``-block windows row-major, and
    the windows' lengths in patches."""
    order, lengths, offset = [], [], 0
    for frames, rows, columns in grids:
        blocks_h, blocks_w = rows // merge, columns // merge
        index = torch.arange(frames * blocks_h * blocks_w).view(frames, blocks_h, blocks_w)
        for frame in index:
            for top in range(0, blocks_h, window):
                for left in range(0, blocks_w, window):
                    blocks = frame[top:top + window, left:left + window].reshape(-1)
                    order.append(blocks + offset)
                    lengths.append(blocks.numel() * merge * merge)
        offset += frames * blocks_h * blocks_w
    return torch.cat(order), torch.tensor(lengths, dtype=torch.int64)


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


class QwenViT(MegatronModule):
    """Patch embedding, window / full attention blocks with 2D rotary positions over the packed
    images, ``ln_q`` and the spatial merge: ``[sum of merged tokens, hidden * merge ** 2]`` in
    image order.

    ``patch_embed`` (HF's Conv3d weight, kept in its shape) and ``ln_q`` are replicated on the tp
    ranks (the first layer's column-parallel linear all-reduces their input gradient, so the
    copies stay equal); the checkpoint holds them once.
    """

    def __init__(self, config: TransformerConfig, patch_size: int, temporal_patch_size: int,
                 merge: int, window: int, full_layers: tuple[int, ...], rope_theta: float,
                 pg_collection: ProcessGroupCollection | None) -> None:
        super().__init__(config=config)
        if pg_collection is not None:
            self.tp_group = pg_collection.tp
        hidden = config.hidden_size
        self.merge, self.window, self.full_layers = merge, window, frozenset(full_layers)
        self.rope_theta = rope_theta
        self.patch_embed = torch.nn.Parameter(torch.empty(
            hidden, 3, temporal_patch_size, patch_size, patch_size, dtype=config.params_dtype))
        config.init_method(self.patch_embed)
        self.decoder = packed_decoder(config, pg_collection)
        self.ln_q = build_module(vision_norm(config), config=config, hidden_size=hidden,
                                 eps=config.layernorm_epsilon)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` ``[patches, 3 * T * p * p]`` and ``grid_thw`` ``[items, 3]`` as
        :meth:`QwenImagePreprocessor.collate` packs them -> ``[patches / merge ** 2,
        hidden * merge ** 2]``."""
        grids = [tuple(grid) for grid in grid_thw.tolist()]
        device = pixel_values.device
        weight = self.patch_embed
        hidden = F.linear(pixel_values.to(weight.dtype), weight.reshape(weight.shape[0], -1))
        units, width = self.merge ** 2, hidden.shape[-1]
        order, window_lengths = window_order(grids, self.merge, self.window)
        order = order.to(device)
        hidden = hidden.view(-1, units, width)[order].reshape(-1, 1, width)
        head_dim = self.config.kv_channels
        angles = rotary_angles(grids, self.merge, head_dim, self.rope_theta).to(device)
        angles = angles.view(-1, units, head_dim)[order].reshape(-1, 1, 1, head_dim)
        images = torch.tensor([rows * columns for frames, rows, columns in grids
                               for _ in range(frames)], device=device)
        full, windows = packed_seq_params(images), packed_seq_params(window_lengths.to(device))
        for layer in self.decoder.layers:
            params = full if layer.layer_number - 1 in self.full_layers else windows
            hidden, _ = layer(hidden, attention_mask=None, rotary_pos_emb=angles,
                              packed_seq_params=params)
        merged = self.ln_q(hidden.squeeze(1)).reshape(-1, units * width)
        return merged[torch.argsort(order)]


def qwen_vit_spec(config: TransformerConfig, pg_collection: ProcessGroupCollection | None,
                  hf_config: Any) -> ModuleSpec:
    """:class:`QwenViT` shaped by a HF ``Qwen2_5_VLVisionConfig``."""
    merge, patch = hf_config.spatial_merge_size, hf_config.patch_size
    return ModuleSpec(module=QwenViT, params={
        "config": config, "patch_size": patch,
        "temporal_patch_size": hf_config.temporal_patch_size, "merge": merge,
        "window": hf_config.window_size // merge // patch,
        "full_layers": tuple(hf_config.fullatt_block_indexes),
        "rope_theta": float((hf_config.rope_parameters or {}).get("rope_theta", 10000.0)),
        "pg_collection": pg_collection})


class QwenVisionEncoder(HFVisionEncoder):
    """Qwen2.5-VL's vision tower; its merger MLP is the projection to the language model."""

    provider = "qwen2_5_vl"
    model_type = "qwen2_5_vl_vision"
    hf_family = QWEN2_5_VL_VISION
    model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
    """A whole model's ``model_type`` and its vision config's."""
    config_class: ClassVar[str] = "Qwen2_5_VLVisionConfig"
    """The transformers vision config class validating ``config.json``."""
    default_mean, default_std = CLIP_MEAN, CLIP_STD
    default_pixels: ClassVar[tuple[int, int]] = (DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS)
    preprocessor_class: ClassVar[type[QwenImagePreprocessor]] = QwenImagePreprocessor
    """The preprocessing; a tower whose videos are laid out otherwise gives one without them."""
    """(min_pixels, max_pixels) when preprocessor_config.json gives none."""
    activations: ClassVar[dict[str, Any]] = TOWER_ACTIVATIONS
    gated: ClassVar[bool] = True
    """The blocks' MLP is gated (SwiGLU)."""
    normalization: ClassVar[str] = "RMSNorm"
    """The blocks' norm (eps 1e-6)."""

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
        vision = config.get("vision_config", config)
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
        window = getattr(hf, "window_size", None)
        if window is not None and window // hf.spatial_merge_size // hf.patch_size < 1:
            problems.append(f"window_size {window} below patch_size * spatial_merge_size")
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

    def item_grid(self, size: tuple[int | float, ...]) -> tuple[int, ...]:
        """(1, merged rows, merged columns) of an image; a video's (temporal steps, merged rows,
        merged columns, time interval): its steps' temporal positions lie ``tokens_per_second *
        temporal_patch_size / fps`` apart, in float32 as transformers computes them."""
        steps, rows, columns = self._preprocessor.item_grid(size)
        merge = self.hf_config.spatial_merge_size
        if len(size) == 2:
            return 1, rows // merge, columns // merge
        seconds = torch.tensor(self.hf_config.temporal_patch_size / size[3], dtype=torch.float32)
        return steps, rows // merge, columns // merge, float(seconds * self.tokens_per_second)

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
        config = encoder_config(
            language, self.grid, num_layers=hf.depth, hidden_size=hf.hidden_size,
            num_attention_heads=hf.num_heads, ffn_hidden_size=hf.intermediate_size,
            activation_func=self.activations[hf.hidden_act], gated_linear_unit=self.gated,
            add_bias_linear=True, add_qkv_bias=True, normalization=self.normalization)
        # HF's norm eps; Megatron's fused bias-activation is not HF's function, torch's norms
        # do not persist.
        return dataclasses.replace(config, layernorm_epsilon=1e-6, bias_activation_fusion=False,
                                   persist_layer_norm=False)

    def encoder_spec(self, config: TransformerConfig,
                     pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
        return qwen_vit_spec(config, pg_collection, self.hf_config)

    def item_flops(self, size: tuple[int | float, ...], config: TransformerConfig,
                   language_hidden_size: int) -> EncoderFlops:
        """The patch embedding, window attention (the item's windows, frame by frame) in all
        but the ``fullatt_block_indexes`` layers, whole-frame attention in those, the merger's
        MLP over the merged tokens."""
        hf = self.hf_config
        steps, rows, columns = self._preprocessor.item_grid(size)
        patches, merge = steps * rows * columns, hf.spatial_merge_size
        windows = window_order([(steps, rows, columns)], merge,
                               hf.window_size // merge // hf.patch_size)[1].tolist()
        full = len(set(hf.fullatt_block_indexes) & set(range(config.num_layers)))
        stem = embedding(patches, 3 * hf.temporal_patch_size * hf.patch_size ** 2,
                         config.hidden_size)
        layers = (tower(config, [rows * columns] * steps, full)
                  + tower(config, windows, config.num_layers - full))
        return EncoderFlops(stem + layers, self.projection_flops(
            patches // merge ** 2, config, language_hidden_size))

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
                                   activation_func=F.gelu, bias_activation_fusion=False,
                                   add_bias_linear=True)
