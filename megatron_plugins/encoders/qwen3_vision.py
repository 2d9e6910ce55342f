"""Qwen3-VL's vision tower (``--encoder NAME=qwen3_vl``): HF's ``Qwen3VLVisionModel`` as a
tensor-parallel Megatron module, its merger and DeepStack mergers as the input projection.

The folder given as ``--encoder-hf-weights NAME=DIR`` (a whole Qwen3-VL folder, or one of just its
vision model) shapes the tower and holds its weights. Images are preprocessed as for Qwen2.5-VL
(HF's Qwen2-VL image processor, :class:`~megatron_plugins.encoders.qwen_preprocessing.
QwenImagePreprocessor`) and a microbatch's images run as one packed sequence: Conv3d patch
embedding with bias, the learned square position table bilinearly resampled to each image's grid
(HF's ``fast_pos_embed_interpolate``), 2D rotary positions, whole-image attention in every block,
LayerNorm, a GELU MLP.

DeepStack: the outputs of the blocks in ``deepstack_visual_indexes`` leave the tower with the last
block's, ``[patches, (1 + L) * hidden]`` (last block first, then the levels in block order); the
projection (:class:`Qwen3Mergers`) runs the merger (LayerNorm, 2x2 merge, MLP) on the first and
deepstack merger ``i`` (2x2 merge, LayerNorm, MLP) on level ``i``, giving ``[tokens, (1 + L) *
language hidden]``: HF's image embeddings, then its ``deepstack_features`` in order, which the
language model adds to its hidden states after its first L layers
(:attr:`~megatron_plugins.encoders.base.EncoderPlugin.deepstack_levels`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.encoders.hf_vision import HALF
from megatron_plugins.encoders.qwen_preprocessing import QwenImagePreprocessor
from megatron_plugins.encoders.qwen_tower import (
    QwenTowerEncoder,
    ThinkerVideoTime,
    merge_block_positions,
    packed_decoder,
    rotary_angles,
    vision_norm,
)
from megatron_plugins.flops.count import EncoderFlops, Work
from megatron_plugins.flops.encoder import embedding, tower
from megatron_plugins.ops.packed_attention import packed_seq_params
from megatron_plugins.weights.vision_families import QWEN3_OMNI_VISION, QWEN3_VL_VISION

__all__ = ["PatchMerger", "Qwen3ImagePreprocessor", "Qwen3Mergers", "Qwen3OmniVisionEncoder",
           "Qwen3ViT", "Qwen3VisionEncoder", "position_taps"]

MODEL_TYPES = ("qwen3_vl", "qwen3_vl_vision")
"""A whole Qwen3-VL model's ``model_type`` and its vision config's."""

DEFAULT_PIXELS = (65536, 16777216)
"""(min_pixels, max_pixels) of the released Qwen3-VL checkpoints' preprocessor_config.json,
used when a folder's gives none."""


def position_taps(grids: list[tuple[int, int, int]], merge: int, side: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's bilinear resampling (corners aligned) of a ``side`` x ``side`` position table to each
    image's patch grid, as row indices into the flattened table and weights, both ``[patches,
    4]`` (taps (top, left), (top, right), (bottom, left), (bottom, right)), patches in HF's
    merge-block order, every frame over again."""
    positions = merge_block_positions(grids, merge)
    sizes = torch.cat([torch.tensor([[rows, columns]]).expand(frames * rows * columns, 2)
                       for frames, rows, columns in grids])
    source = positions.float() * (side - 1) / torch.clamp(sizes - 1, min=1)
    floor = torch.floor(source)
    offsets = torch.arange(2)
    taps = (floor.long()[..., None] + offsets).clamp(0, side - 1)
    weights = (1 - (source[..., None] - floor[..., None] - offsets).abs()).clamp(min=0)
    indices = taps[:, 0, :, None] * side + taps[:, 1, None, :]
    return indices.reshape(-1, 4), (weights[:, 0, :, None] * weights[:, 1, None, :]).reshape(-1, 4)


class Qwen3ViT(MegatronModule):
    """Patch embedding plus the resampled position table, full-attention blocks with 2D rotary
    positions over the packed images: ``[patches, (1 + L) * hidden]``, the last block's output
    then the DeepStack blocks' (HF's merge-block patch order, images in order).

    ``patch_embed`` / ``patch_bias`` (HF's Conv3d, its weight kept in its shape) and
    ``pos_embed`` are replicated on the tp ranks (the first layer's column-parallel linear
    all-reduces their input gradient, so the copies stay equal); the checkpoint holds them once.
    """

    def __init__(self, config: TransformerConfig, patch_size: int, temporal_patch_size: int,
                 merge: int, position_side: int, deepstack_layers: tuple[int, ...],
                 rope_theta: float, pg_collection: ProcessGroupCollection | None) -> None:
        super().__init__(config=config)
        if pg_collection is not None:
            self.tp_group = pg_collection.tp
        hidden = config.hidden_size
        self.merge, self.side, self.rope_theta = merge, position_side, rope_theta
        self.deepstack_layers = deepstack_layers
        self.patch_embed = torch.nn.Parameter(torch.empty(
            hidden, 3, temporal_patch_size, patch_size, patch_size, dtype=config.params_dtype))
        config.init_method(self.patch_embed)
        self.patch_bias = torch.nn.Parameter(torch.zeros(hidden, dtype=config.params_dtype))
        self.pos_embed = torch.nn.Parameter(torch.empty(
            position_side * position_side, hidden, dtype=config.params_dtype))
        config.init_method(self.pos_embed)
        self.decoder = packed_decoder(config, pg_collection)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` ``[patches, 3 * T * p * p]`` and ``grid_thw`` ``[items, 3]`` as
        :meth:`~megatron_plugins.encoders.qwen_preprocessing.QwenImagePreprocessor.collate`
        packs them -> ``[patches, (1 + L) * hidden]``."""
        grids = [tuple(grid) for grid in grid_thw.tolist()]
        device = pixel_values.device
        weight = self.patch_embed
        hidden = F.linear(pixel_values.to(weight.dtype), weight.reshape(weight.shape[0], -1),
                          self.patch_bias)
        indices, weights = position_taps(grids, self.merge, self.side)
        table = (self.pos_embed[indices.to(device)] * weights.to(device)[..., None]).sum(1)
        hidden = (hidden + table.to(hidden.dtype)).unsqueeze(1)
        head_dim = self.config.kv_channels
        angles = rotary_angles(grids, self.merge, head_dim, self.rope_theta).to(device)
        images = torch.tensor([rows * columns for frames, rows, columns in grids
                               for _ in range(frames)], device=device)
        params = packed_seq_params(images)
        levels = []
        for layer in self.decoder.layers:
            hidden, _ = layer(hidden, attention_mask=None,
                              rotary_pos_emb=angles.view(-1, 1, 1, head_dim),
                              packed_seq_params=params)
            if layer.layer_number - 1 in self.deepstack_layers:
                levels.append(hidden)
        return torch.cat([hidden, *levels], dim=-1).squeeze(1)


class PatchMerger(MegatronModule):
    """HF's ``Qwen3VLVisionPatchMerger``: LayerNorm over each patch (the merger) or over each
    merged ``merge ** 2`` patch block (``postshuffle``: a DeepStack merger), the merge, then the
    MLP (``MultimodalProjector``, tensor parallel); the norm is replicated on the tp ranks."""

    def __init__(self, config: TransformerConfig, mlp: ModuleSpec, units: int,
                 postshuffle: bool) -> None:
        super().__init__(config=config)
        self.units, self.postshuffle = units, postshuffle
        width = config.hidden_size * (units if postshuffle else 1)
        # HF's merger eps is its blocks' (1e-6), the tower config's.
        self.norm = build_module(vision_norm(config), config=config, hidden_size=width,
                                 eps=config.layernorm_epsilon)
        self.mlp = build_module(mlp)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[patches, hidden]`` -> ``[patches / units, output]``."""
        if not self.postshuffle:
            hidden = self.norm(hidden)
        merged = hidden.reshape(-1, self.units * hidden.shape[-1])
        return self.mlp(self.norm(merged) if self.postshuffle else merged)


class Qwen3Mergers(MegatronModule):
    """The modality's input projection: the merger on the tower's first ``hidden`` columns and
    DeepStack merger ``i`` on level ``i``'s, outputs side by side, ``[tokens, (1 + L) *
    output]``."""

    def __init__(self, config: TransformerConfig, mlp: ModuleSpec, units: int,
                 levels: int) -> None:
        super().__init__(config=config)
        self.merger = PatchMerger(config, mlp, units, postshuffle=False)
        self.deepstack = torch.nn.ModuleList(
            [PatchMerger(config, mlp, units, postshuffle=True) for _ in range(levels)])

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """Each merger's own (tensor-parallel) sharded state: the stock default would save the
        DeepStack mergers, held in a plain ``ModuleList``, as replicated whole tensors."""
        state = self.merger.sharded_state_dict(f"{prefix}merger.", sharded_offsets, metadata)
        for index, merger in enumerate(self.deepstack):
            state.update(merger.sharded_state_dict(f"{prefix}deepstack.{index}.",
                                                   sharded_offsets, metadata))
        return state

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[patches, (1 + L) * hidden]`` -> ``[patches / units, (1 + L) * output]``."""
        parts = hidden.split(self.config.hidden_size, dim=-1)
        mergers = [self.merger, *self.deepstack]
        return torch.cat([merger(part) for merger, part in zip(mergers, parts)], dim=-1)


@dataclass(frozen=True)
class Qwen3ImagePreprocessor(QwenImagePreprocessor):
    """Qwen2-VL's image preprocessing at Qwen3-VL's sizes. Videos are refused: Qwen3-VL places
    their frames with timestamp text, which the data path does not write."""

    takes_video: ClassVar[bool] = False


class Qwen3VisionEncoder(QwenTowerEncoder):
    """Qwen3-VL's vision tower; its merger and DeepStack mergers are the projection to the
    language model, which adds the :attr:`deepstack_levels` extra feature levels."""

    provider = "qwen3_vl"
    model_type = "qwen3_vl_vision"
    hf_family = QWEN3_VL_VISION
    model_types = MODEL_TYPES
    config_class = "Qwen3VLVisionConfig"
    default_mean, default_std = HALF, HALF
    default_pixels: ClassVar[tuple[int, int]] = DEFAULT_PIXELS
    preprocessor_class = Qwen3ImagePreprocessor
    gated = False
    normalization = "LayerNorm"

    def _unsupported(self, hf: Any) -> list[str]:
        """Also a position table that is not a square grid, DeepStack indexes out of order or
        past the last block."""
        problems = super()._unsupported(hf)
        side = math.isqrt(hf.num_position_embeddings)
        if side * side != hf.num_position_embeddings:
            problems.append(f"num_position_embeddings {hf.num_position_embeddings} (not a "
                            "square grid)")
        indexes = list(self._deepstack_indexes(hf))
        if indexes != sorted(set(indexes)) or any(not 0 <= i < hf.depth for i in indexes):
            problems.append(f"deepstack_visual_indexes {indexes} (need increasing block indexes "
                            f"below depth {hf.depth})")
        return problems

    def _deepstack_indexes(self, hf: Any) -> tuple[int, ...]:
        """The blocks whose outputs are DeepStack levels (``deepstack_visual_indexes``)."""
        return tuple(hf.deepstack_visual_indexes)

    @property
    def deepstack_levels(self) -> int:
        """One level per ``deepstack_visual_indexes`` entry."""
        return len(self._deepstack_indexes(self.hf_config))

    def encoder_spec(self, config: TransformerConfig,
                     pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
        hf = self.hf_config
        return ModuleSpec(module=Qwen3ViT, params={
            "config": config, "patch_size": hf.patch_size,
            "temporal_patch_size": hf.temporal_patch_size, "merge": hf.spatial_merge_size,
            "position_side": math.isqrt(hf.num_position_embeddings),
            "deepstack_layers": self._deepstack_indexes(hf),
            "rope_theta": float(hf.rope_parameters["rope_theta"]),
            "pg_collection": pg_collection})

    def item_flops(self, size: tuple[int | float, ...], config: TransformerConfig,
                   language_hidden_size: int) -> EncoderFlops:
        """The patch embedding, whole-image attention in every layer, the merger and the
        DeepStack mergers over the merged tokens."""
        hf = self.hf_config
        steps, rows, columns = self._preprocessor.item_grid(size)
        patches = steps * rows * columns
        stem = embedding(patches, 3 * hf.temporal_patch_size * hf.patch_size ** 2,
                         config.hidden_size)
        return EncoderFlops(stem + tower(config, [rows * columns] * steps), self.projection_flops(
            patches // hf.spatial_merge_size ** 2, config, language_hidden_size))

    def projection_flops(self, tokens: int, config: TransformerConfig,
                         language_hidden_size: int) -> Work:
        """The merger's MLP and each DeepStack merger's over ``tokens`` merged tokens."""
        return super().projection_flops(tokens, config, language_hidden_size) * (
            1 + self.deepstack_levels)

    def projection_spec(self, config: TransformerConfig, language_hidden_size: int,
                        pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
        """The merger and DeepStack mergers, each MLP ``linear_fc1`` (4h -> 4h), exact GELU,
        ``linear_fc2`` (4h -> out_hidden_size)."""
        mlp = super().projection_spec(config, language_hidden_size, pg_collection)
        return ModuleSpec(module=Qwen3Mergers, params={
            "config": config, "mlp": mlp, "units": self.hf_config.spatial_merge_size ** 2,
            "levels": self.deepstack_levels})


class Qwen3OmniVisionEncoder(ThinkerVideoTime, Qwen3VisionEncoder):
    """Qwen3-Omni's vision tower (``--encoder NAME=qwen3_omni_vision``): Qwen3-VL-MoE's, its
    config under the thinker's and its mergers named as :data:`QWEN3_OMNI_VISION` maps them.
    It takes videos as Qwen2-VL's video processor makes them (no timestamp text, unlike
    Qwen3-VL), at TMRoPE's temporal positions (:attr:`whole_times`)."""

    provider = "qwen3_omni_vision"
    model_type = "qwen3_omni_moe_vision_encoder"
    hf_family = QWEN3_OMNI_VISION
    model_types = ("qwen3_omni_moe", "qwen3_omni_moe_thinker")
    config_class = "Qwen3OmniMoeVisionEncoderConfig"
    sub_config = "thinker_config"
    preprocessor_class = QwenImagePreprocessor

    whole_times = False
    """A video's temporal positions stay float32 (``step * temporal_patch_size / fps *
    position_id_per_seconds``, not truncated, as transformers' ``get_rope_index``): at most
    frame rates they are not whole numbers, nor is any position after the video."""
