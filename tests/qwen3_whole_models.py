"""A tiny whole Qwen3-VL with more language layers than DeepStack levels (:func:`save_whole`),
transformers' logits on a sample of several images of different sizes, and the same sample through
our MiMo model built with ``--hf-model`` over the grids (:func:`forward_diff`; the sample and the
run are :mod:`tests.qwen_vlm_models`', which serve any Qwen folder)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from tests.hf_models import rel_diff, safetensors_of
from tests.qwen3_vlm_models import IMAGE_TOKEN, TEXT, processor, save_tiny_qwen3_vl
from tests.qwen_vlm_models import forward

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


def forward_diff(folder: Path, grids: tuple[str, ...], nproc: int, ids: torch.Tensor,
                 pictures: list[np.ndarray], want: np.ndarray) -> float:
    """Our logits' max relative difference from ``want`` over the grids, after checking what
    every layout must give: zero padded-vocabulary rows, the checkpoint's image token, and every
    tensor of the folder streamed back unchanged."""
    from megatron_plugins.weights.streaming import assemble

    vocab = TEXT["vocab_size"]
    results = forward(nproc, folder, grids, ids, pictures)
    [logits] = [r["logits"] for r in results if r["logits"] is not None]
    assert abs(logits[..., vocab:]).max() == 0  # padded vocabulary rows
    for result in results:
        assert result["special_token_ids"] == {"image": IMAGE_TOKEN}
    streamed = assemble(piece for result in results for piece in result["pieces"])
    original = safetensors_of(folder)
    assert sorted(streamed) == sorted(original)
    for name, tensor in streamed.items():
        assert torch.equal(tensor, original[name]), name
    return rel_diff(logits[..., :vocab], want)
