"""A whole tiny VLM folder (LLaVA, Qwen2.5-VL, Qwen3-VL) in transformers, with or without a
PEFT adapters folder on it, and its logits on a sample with images: what a user of an exported
folder or of its adapters gets."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _architecture(folder: Path) -> str:
    return json.loads((folder / "config.json").read_text())["architectures"][0]


def model_inputs(folder: Path) -> dict[str, torch.Tensor]:
    """transformers' inputs of a sample with images for the folder's VLM (the tiny families'
    samples: :mod:`tests.models.hf_vlm`'s for LLaVA, :mod:`tests.models.qwen_vlm`'s for Qwen)."""
    if _architecture(folder).startswith("Llava"):
        from tests.models.hf_vlm import sample as llava_sample

        ids, pixels = llava_sample()
        return {"input_ids": ids, "pixel_values": torch.from_numpy(pixels)}
    from tests.models.hf_vision import qwen_processor
    from tests.models.qwen_vlm import IMAGE_TOKEN, images, sample

    pictures = images()
    ids = sample(folder, pictures)
    inputs = qwen_processor(folder)(pictures, return_tensors="pt")
    return {"input_ids": ids, "pixel_values": inputs["pixel_values"],
            "image_grid_thw": inputs["image_grid_thw"],
            "mm_token_type_ids": (ids == IMAGE_TOKEN).int()}


def load(folder: Path, adapters: Path | None = None) -> Any:
    """transformers' model of the folder's VLM (fp32), with ``adapters`` (a PEFT folder) on it
    through ``peft.PeftModel.from_pretrained``."""
    import transformers

    model = getattr(transformers, _architecture(folder)).from_pretrained(folder,
                                                                         dtype=torch.float32)
    if adapters is None:
        return model
    import peft

    return peft.PeftModel.from_pretrained(model, adapters)


def logits(model: Any, inputs: dict[str, torch.Tensor]) -> np.ndarray:
    """The model's logits on the sample."""
    with torch.no_grad():
        return model(**inputs).logits.numpy()
