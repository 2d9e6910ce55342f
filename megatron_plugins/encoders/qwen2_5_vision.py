"""Qwen2.5-VL's vision tower (``--encoder NAME=qwen2_5_vl``): HF's
``Qwen2_5_VisionTransformerPretrainedModel`` as a tensor-parallel Megatron module.

The folder given as ``--encoder-hf-weights NAME=DIR`` (a whole Qwen2.5-VL folder, or one of just
its vision model) shapes the tower and holds its weights; images and videos are preprocessed as
:mod:`.qwen_preprocessing` describes. A microbatch's images and videos run as one packed sequence:
patches reordered by attention window, 2D rotary positions, window attention in most layers and
whole-image attention in ``fullatt_block_indexes``, RMSNorm, SwiGLU, then the merger's ``ln_q``
and 2x2 merge, back in image order. The merger's MLP is the modality's input projection
(:meth:`~.qwen_tower.QwenTowerEncoder.projection_spec`), loaded from the same folder, so the
projection's output is HF's merged image features.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.encoders.qwen_preprocessing import QwenImagePreprocessor
from megatron_plugins.encoders.qwen_tower import (
    QwenTowerEncoder,
    ThinkerVideoTime,
    packed_decoder,
    rotary_angles,
    vision_norm,
)
from megatron_plugins.encoders.vit import CLIP_MEAN, CLIP_STD
from megatron_plugins.flops.count import EncoderFlops
from megatron_plugins.flops.encoder import embedding, tower
from megatron_plugins.ops.packed_attention import packed_seq_params
from megatron_plugins.weights.vision_families import QWEN2_5_OMNI_VISION, QWEN2_5_VL_VISION

__all__ = ["Qwen2_5OmniVisionEncoder", "Qwen2_5ViT", "Qwen2_5VisionEncoder", "qwen2_5_vit_spec",
           "window_order"]

MODEL_TYPES = ("qwen2_5_vl", "qwen2_5_vl_vision")
"""A whole Qwen2.5-VL model's ``model_type`` and its vision config's."""

DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
"""Qwen2-VL's image processor's pixel range when preprocessor_config.json gives none."""


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


class Qwen2_5ViT(MegatronModule):
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
        :meth:`~.qwen_preprocessing.QwenImagePreprocessor.collate` packs them -> ``[patches /
        merge ** 2, hidden * merge ** 2]``."""
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


def qwen2_5_vit_spec(config: TransformerConfig, pg_collection: ProcessGroupCollection | None,
                  hf_config: Any) -> ModuleSpec:
    """:class:`Qwen2_5ViT` shaped by a HF ``Qwen2_5_VLVisionConfig``."""
    merge, patch = hf_config.spatial_merge_size, hf_config.patch_size
    return ModuleSpec(module=Qwen2_5ViT, params={
        "config": config, "patch_size": patch,
        "temporal_patch_size": hf_config.temporal_patch_size, "merge": merge,
        "window": hf_config.window_size // merge // patch,
        "full_layers": tuple(hf_config.fullatt_block_indexes),
        "rope_theta": float((hf_config.rope_parameters or {}).get("rope_theta", 10000.0)),
        "pg_collection": pg_collection})


class Qwen2_5VisionEncoder(QwenTowerEncoder):
    """Qwen2.5-VL's vision tower; its merger MLP is the projection to the language model."""

    provider = "qwen2_5_vl"
    model_type = "qwen2_5_vl_vision"
    hf_family = QWEN2_5_VL_VISION
    model_types = MODEL_TYPES
    config_class = "Qwen2_5_VLVisionConfig"
    default_mean, default_std = CLIP_MEAN, CLIP_STD
    default_pixels = (DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS)
    preprocessor_class = QwenImagePreprocessor
    gated = True
    normalization = "RMSNorm"

    def _unsupported(self, hf: Any) -> list[str]:
        """Also an attention window smaller than one merge block."""
        problems = super()._unsupported(hf)
        window = hf.window_size
        if window // hf.spatial_merge_size // hf.patch_size < 1:
            problems.append(f"window_size {window} below patch_size * spatial_merge_size")
        return problems

    def encoder_spec(self, config: TransformerConfig,
                     pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
        return qwen2_5_vit_spec(config, pg_collection, self.hf_config)

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
        first_full = 0 in hf.fullatt_block_indexes
        layers = (tower(config, [rows * columns] * steps, full, first=first_full)
                  + tower(config, windows, config.num_layers - full, first=not first_full))
        return EncoderFlops(stem + layers, self.projection_flops(
            patches // merge ** 2, config, language_hidden_size))


class Qwen2_5OmniVisionEncoder(ThinkerVideoTime, Qwen2_5VisionEncoder):
    """Qwen2.5-Omni's vision tower: Qwen2.5-VL's, its config under the thinker's and its
    attention's q, k, v saved apart (:data:`QWEN2_5_OMNI_VISION`)."""

    provider = "qwen2_5_omni_vision"
    model_type = "qwen2_5_omni_vision_encoder"
    hf_family = QWEN2_5_OMNI_VISION
    model_types = ("qwen2_5_omni", "qwen2_5_omni_thinker")
    config_class = "Qwen2_5OmniVisionEncoderConfig"
    sub_config = "thinker_config"
