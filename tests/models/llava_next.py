"""A tiny random whole LLaVA-NeXT on disk (a CLIP tower of 2 layers with anyres grid pinpoints,
its projector and trained ``image_newline``, a 2-layer Llama), transformers' logits on a sample
of images of different sizes, and the same sample through our MiMo model built with
``--hf-model`` (encoder and language on their grids).

The sample's placeholder runs are as long as transformers' own packed features of each image, so
a token count of ours that differs from HF's fails the forward.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.models.hf_vision import SHAPE as VISION
from tests.models.hf_vision import redraw
from tests.models.hf_vlm import (
    ENCODER,
    IMAGE_TOKEN,
    built_forward,
    cross_grid_forward,
    vlm_flags,
    whole_pieces,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT = dict(vocab_size=100, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6, tie_word_embeddings=False)
PINPOINTS = [[16, 32], [32, 16], [32, 32], [48, 16], [16, 48]]
"""Grid pinpoints (height, width) in tiles of the tower's 16-pixel image size."""
SEQ_LENGTH = ("--seq-length", "256")
"""Two images of up to 88 positions each and text fit."""
IMAGES = ((23, 37), (40, 17), (16, 16))
"""(height, width) of the sample's images: wide (rows of padding cut), tall (columns cut),
square (nothing cut)."""


def processor(folder: str | Path | None = None) -> Any:
    """HF's LLaVA-NeXT image processor (PIL): the folder's, or the tiny model's."""
    import transformers

    if folder is not None:
        return transformers.LlavaNextImageProcessorPil.from_pretrained(folder)
    return transformers.LlavaNextImageProcessorPil(
        size={"shortest_edge": VISION["image_size"]}, image_grid_pinpoints=PINPOINTS,
        crop_size={"height": VISION["image_size"], "width": VISION["image_size"]})


def save_tiny_llava_next(folder: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random ``LlavaNextForConditionalGeneration`` with its preprocessor_config.json,
    every weight (``image_newline`` too) redrawn; ``overrides`` are config fields."""
    import transformers

    config = transformers.LlavaNextConfig(
        vision_config=transformers.CLIPVisionConfig(**VISION),
        text_config=transformers.LlamaConfig(**TEXT), image_token_index=IMAGE_TOKEN,
        image_grid_pinpoints=PINPOINTS, **overrides)
    torch.manual_seed(seed)
    model = redraw(transformers.LlavaNextForConditionalGeneration(config))
    model.save_pretrained(folder)
    processor().save_pretrained(folder)
    return Path(folder)


def images(seed: int = 3) -> list[np.ndarray]:
    """The sample's uint8 RGB images (:data:`IMAGES`)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), np.uint8) for h, w in IMAGES]


def hf_sample_logits(folder: str | Path, pictures: list[np.ndarray]
                     ) -> tuple[torch.Tensor, np.ndarray, list[int]]:
    """``[1, S]`` ids (text around one image-token run per picture, each as long as
    transformers packs that picture's features), transformers' fp32 logits on them and the
    runs' lengths."""
    import transformers

    model = transformers.LlavaNextForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32)
    inputs = processor(folder)(pictures, return_tensors="pt")
    with torch.no_grad():
        features = model.model.get_image_features(
            pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"]).pooler_output
    text = ([5, 17], [42, 8, 61], [23, 3], [9, 30, 12])
    ids = [*text[0]]
    for feature, words in zip(features, text[1:]):
        ids += [IMAGE_TOKEN] * feature.shape[0] + words
    ids = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=inputs["pixel_values"],
                       image_sizes=inputs["image_sizes"]).logits
    return ids, logits.numpy(), [feature.shape[0] for feature in features]


def _forward_and_stream(session: Any, mimo: Any, ids: torch.Tensor,
                        pictures: list[np.ndarray]) -> dict[str, Any]:
    plugin, mimo = session.run.plugins[ENCODER], mimo.eval()
    crops = plugin.preprocessor()
    tokens = [plugin.item_tokens(picture.shape[:2]) for picture in pictures]
    logits = cross_grid_forward(mimo, *session.topology.active_modules, session.topology, ids,
                                crops.collate([crops(picture) for picture in pictures]),
                                sum(tokens))
    return {"logits": logits, "pieces": whole_pieces(mimo, session), "item_tokens": tokens,
            "special_token_ids": dict(mimo.special_token_ids)}


def forward(nproc: int, folder: str | Path, grids: tuple[str, ...], ids: torch.Tensor,
            pictures: list[np.ndarray]) -> list[dict[str, Any]]:
    """The MiMo model built from ``--hf-model`` (the entry point's code path) on ``nproc`` gloo
    ranks: each rank's logits (the language's last stage), token counts and streamed pieces."""
    after = functools.partial(_forward_and_stream, ids=ids, pictures=pictures)
    return built_forward(after, nproc, [*vlm_flags(folder, grids), *SEQ_LENGTH])
