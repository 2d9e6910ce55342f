"""A tiny whole Qwen3-VL with more language layers than DeepStack levels (:func:`save_whole`) and
transformers' logits on a sample of several images of different sizes; the sample and our run
over the grids are :mod:`tests.models.qwen_vlm`' (``sample``, ``forward_diff``), which serve any
Qwen folder."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from tests.models.qwen3_vlm import IMAGE_TOKEN, processor, save_tiny_qwen3_vl

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LANGUAGE_LAYERS = 4
"""Two DeepStack levels: the language pipeline's first of two stages holds layers 0 and 1."""


def save_whole(folder: str | Path, seed: int = 0, **text: object) -> Path:
    """The tiny whole Qwen3-VL with :data:`LANGUAGE_LAYERS` language layers (``text``
    overrides text_config fields)."""
    return save_tiny_qwen3_vl(folder, seed, text={"num_hidden_layers": LANGUAGE_LAYERS, **text})


def hf_logits(folder: str | Path, ids: torch.Tensor, pictures: list[np.ndarray]) -> np.ndarray:
    """transformers' own forward of the saved Qwen3-VL, fp32: its processor's pixel values and
    grids, its own mrope positions, its DeepStack."""
    import transformers

    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(folder,
                                                                          dtype=torch.float32)
    inputs = processor(folder)(pictures, return_tensors="pt")
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=inputs["pixel_values"],
                     image_grid_thw=inputs["image_grid_thw"],
                     mm_token_type_ids=(ids == IMAGE_TOKEN).int()).logits.numpy()

