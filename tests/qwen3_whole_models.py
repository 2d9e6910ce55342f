"""A tiny whole Qwen3-VL with one language layer per DeepStack level and more
(:func:`save_whole`), a sample of several images of different sizes, and transformers' logits on
it: the whole-folder (``--hf-model``) tests compare our MiMo model with them
(:func:`tests.qwen_vlm_models.forward` runs it over the grids)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from tests.qwen3_vlm_models import IMAGE_TOKEN, processor, save_tiny_qwen3_vl

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LANGUAGE_LAYERS = 4
"""Two DeepStack levels: the language pipeline's first of two stages holds layers 0 and 1."""


def save_whole(folder: str | Path, seed: int = 0, **text: object) -> Path:
    """The tiny whole Qwen3-VL with :data:`LANGUAGE_LAYERS` language layers (``text``
    overrides text_config fields)."""
    return save_tiny_qwen3_vl(folder, seed, text={"num_hidden_layers": LANGUAGE_LAYERS, **text})


def sample(folder: str | Path, pictures: list[np.ndarray]) -> torch.Tensor:
    """``[1, S]`` ids: text with one ``<|image_pad|>`` run per image, as long as the folder's
    processor makes that image's merged tokens."""
    grids = processor(folder)(pictures, return_tensors="pt")["image_grid_thw"]
    runs = [[IMAGE_TOKEN] * (int(grid.prod()) // 4) for grid in grids]
    text = ([5, 17], [42, 8, 61], [23, 3], [9, 30, 12])
    ids = [*text[0], *runs[0], *text[1], *runs[1], *text[2], *runs[2], *text[3]]
    return torch.tensor([ids])


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
