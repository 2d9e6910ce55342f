"""Qwen3.5-VL's vision tower: Qwen3-VL's (learned position table resampled to each image, 2D
rotary, full attention, the 2x2 patch merger as the projection) without DeepStack, read from a
whole Qwen3.5-VL folder, dense or MoE, or a vision model's own."""

from __future__ import annotations

from typing import Any

from megatron_plugins.encoders.qwen3_vision import Qwen3VisionEncoder
from megatron_plugins.weights.vision_families import QWEN3_5_VISION

__all__ = ["Qwen3_5VisionEncoder"]


class Qwen3_5VisionEncoder(Qwen3VisionEncoder):
    """Qwen3-VL's tower and merger, no DeepStack levels."""

    provider = "qwen3_5_vl"
    model_type = "qwen3_5_vision"
    hf_family = QWEN3_5_VISION
    model_types = ("qwen3_5", "qwen3_5_moe", "qwen3_5_vision", "qwen3_5_moe_vision")
    config_class = "Qwen3_5VisionConfig"

    def _deepstack_indexes(self, hf: Any) -> tuple[int, ...]:
        """None: the merger's features alone feed the language model."""
        return ()
