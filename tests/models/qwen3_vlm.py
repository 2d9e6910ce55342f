"""A tiny random Qwen3-VL on disk (a 3-block vision tower with a 4 x 4 learned position table and
two DeepStack levels, its mergers, a 2-layer mrope language model), HF's image processor at its
patch size, and transformers' vision outputs: merged image features and DeepStack features.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.models.hf_vision import QWEN_PIXELS, qwen_hf_output, redraw

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
              deepstack_visual_indexes=[0, 1])
"""A tiny Qwen3-VL vision tower: a 4 x 4 position table (resampled up and down to the images'
grids), DeepStack levels from blocks 0 and 1."""
TEXT = dict(vocab_size=64, hidden_size=24, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=12, rms_norm_eps=1e-6,
            max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 2],
                             "mrope_interleaved": True, "rope_theta": 10000.0})
"""A tiny Qwen3-VL language model (2 layers: one per DeepStack level)."""
IMAGE_TOKEN = 50
"""The tiny checkpoint's ``<|image_pad|>`` id: inside the vocabulary, below its top."""


def save_tiny_qwen3_vl(folder: str | Path, seed: int = 0, vision_only: bool = False,
                       text: dict[str, Any] | None = None, **vision: Any) -> Path:
    """A tiny random ``Qwen3VLForConditionalGeneration`` (or, ``vision_only``, its
    ``Qwen3VLVisionModel``) saved to ``folder`` with a preprocessor_config.json, every weight
    redrawn; ``text`` / ``vision`` override :data:`TEXT` / :data:`VISION` fields (the merger maps
    to the text hidden size)."""
    import transformers

    text = {**TEXT, **(text or {})}
    config = transformers.Qwen3VLConfig(
        vision_config={**VISION, "out_hidden_size": text["hidden_size"], **vision},
        text_config=text, image_token_id=IMAGE_TOKEN, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = redraw(transformers.Qwen3VLForConditionalGeneration(config))
    (model.model.visual if vision_only else model).save_pretrained(folder)
    processor(**QWEN_PIXELS).save_pretrained(folder)
    return Path(folder)


def processor(folder: str | Path | None = None, **kwargs: Any) -> Any:
    """HF's (PIL) image processor of a Qwen3-VL folder, or the PIL Qwen2-VL
    processor at the tiny model's patch sizes with the released Qwen3-VL checkpoints' recipe
    (mean / std 0.5, 65536..16777216 pixels) unless ``kwargs`` say otherwise."""
    from transformers import Qwen2VLImageProcessorPil

    if folder is not None:
        return Qwen2VLImageProcessorPil.from_pretrained(folder)
    recipe = dict(size={"shortest_edge": 65536, "longest_edge": 16777216},
                  image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    return Qwen2VLImageProcessorPil(patch_size=VISION["patch_size"], merge_size=2,
                                    temporal_patch_size=2, **{**recipe, **kwargs})


def hf_features(folder: str | Path, images: list[np.ndarray]) -> list[np.ndarray]:
    """transformers' ``Qwen3VLVisionModel`` (fp32) on the images as the folder's processor makes
    them: the merged image features, then each DeepStack level's features."""
    output = qwen_hf_output(folder, images)
    return [output.pooler_output.numpy(), *(level.numpy() for level in output.deepstack_features)]


def vision_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """The folder's vision model tensors under the vision model's own names (a whole model's
    without its ``model.visual.`` prefix)."""
    from tests.models.hf import safetensors_of

    tensors = safetensors_of(folder)
    if any(name.startswith("model.visual.") for name in tensors):
        return {name.removeprefix("model.visual."): tensor for name, tensor in tensors.items()
                if name.startswith("model.visual.")}
    return tensors
