"""A tiny random Qwen2.5-VL folder and its language model's logits under multimodal RoPE, on the
transformers side and on the Megatron side (the mrope tests).

The language model is the HF side's ``model.language_model`` fed ``inputs_embeds`` and 3D
``position_ids``, then ``lm_head``; the Megatron side is the stock GPT built from the folder's
config (``--position-embedding-type mrope`` implied) fed the same embeddings and positions.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.models.hf import SHAPE, build_stock_gpt, redraw_parameters

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MROPE_SECTION = [2, 1, 1]
"""Frequency pairs per axis (t, h, w) of the tiny model's head dim 8."""
MERGE = 2
"""The tiny vision tower's spatial merge: HF image grids are ``MERGE`` x the language grid."""
IMAGE_TOKEN = 99
"""The tiny model's image placeholder id (any id of its vocabulary: only positions read it)."""


def tiny_config(**text_overrides: Any) -> Any:
    """A Qwen2.5-VL config: the HF models' tiny text shape, a one-block vision tower."""
    import transformers

    text = {**SHAPE, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                         "mrope_section": MROPE_SECTION}, **text_overrides}
    tied = text.pop("tie_word_embeddings")
    return transformers.Qwen2_5_VLConfig(
        text_config=text, tie_word_embeddings=tied, image_token_id=IMAGE_TOKEN,
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2,
                           out_hidden_size=SHAPE["hidden_size"], spatial_merge_size=MERGE,
                           fullatt_block_indexes=[0]))


def save_tiny_qwen2_5_vl(folder: str | Path, seed: int = 0, **text_overrides: Any) -> Path:
    """A tiny random Qwen2.5-VL saved to ``folder``, every weight redrawn (norms around 1)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(tiny_config(**text_overrides))
    redraw_parameters(model)
    model.save_pretrained(folder)
    return Path(folder)


def _token_types(tokens: torch.Tensor, grids: list[tuple[int, int, int]],
                 seconds: list[float | None]) -> torch.Tensor:
    """HF's ``mm_token_type_ids``: each item's run (consumed in order, runs side by side told
    apart by their counts) 1 for an image, 2 for a video (an item with seconds per step)."""
    types = torch.zeros_like(tokens, dtype=torch.int)
    items = iter(zip(grids, seconds))
    for row in range(tokens.shape[0]):
        index = 0
        while index < tokens.shape[1]:
            if tokens[row, index] != IMAGE_TOKEN:
                index += 1
                continue
            (t, h, w), second = next(items)
            types[row, index:index + t * h * w] = 1 if second is None else 2
            index += t * h * w
    return types


def hf_rope_index(tokens: torch.Tensor, grids: list[tuple[int, int, int]],
                  attention_mask: torch.Tensor | None = None,
                  seconds: list[float | None] | None = None) -> torch.Tensor:
    """transformers' ``Qwen2_5_VLModel.get_rope_index`` of ``tokens`` ``[B, S]`` whose
    :data:`IMAGE_TOKEN` runs are items of language grids ``grids`` (in order): ``[3, B, S]``;
    ``seconds`` gives each video's seconds per temporal step (None: that item is an image)."""
    import transformers

    model = transformers.Qwen2_5_VLModel(tiny_config(num_hidden_layers=1))
    seconds = seconds or [None] * len(grids)
    thw = {kind: torch.tensor([[t, h * MERGE, w * MERGE] for (t, h, w), second
                               in zip(grids, seconds) if (second is None) == (kind == "image")],
                              dtype=torch.long).reshape(-1, 3) for kind in ("image", "video")}
    videos = [second for second in seconds if second is not None]
    positions, _ = model.get_rope_index(
        tokens, _token_types(tokens, grids, seconds),
        image_grid_thw=thw["image"] if len(thw["image"]) else None,
        video_grid_thw=thw["video"] if videos else None,
        second_per_grid_ts=torch.tensor(videos) if videos else None,
        attention_mask=attention_mask)
    return positions


def hf_language_logits(folder: str | Path, embeddings: torch.Tensor,
                       positions: torch.Tensor) -> np.ndarray:
    """transformers' language model of the folder on ``embeddings`` ``[B, S, H]`` at
    ``positions`` ``[3, B, S]``, then ``lm_head``: ``[B, S, vocab]``."""
    import transformers

    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32)
    with torch.no_grad():
        hidden = model.model.language_model(inputs_embeds=embeddings,
                                            position_ids=positions).last_hidden_state
        return model.lm_head(hidden).numpy()


def megatron_language_rank(folder: str, embeddings: torch.Tensor,
                           positions: torch.Tensor) -> dict[str, Any]:
    """One rank: the stock GPT built and imported from the folder (flags implied by its
    config.json), fed ``embeddings`` ``[B, S, H]`` at ``positions`` ``[3, B, S]``."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    from megatron.core import parallel_state
    from megatron.training.global_vars import unset_global_variables

    from megatron_plugins.weights.hf_import import load_hf_weights
    from megatron_plugins.weights.language_families import FAMILIES

    try:
        model, pgc, args = build_stock_gpt(folder, 1, 1, [])
        family = load_hf_weights(model, folder, "--language-hf-weights", pgc, FAMILIES)
        tokens = torch.zeros(embeddings.shape[:2], dtype=torch.long)
        with torch.no_grad():
            logits = model(tokens, positions, None,
                           decoder_input=embeddings.transpose(0, 1).contiguous())
        return {"family": family.name, "logits": logits.float().numpy(),
                "position_embedding_type": args.position_embedding_type,
                "mrope_section": list(args.mrope_section)}
    finally:
        parallel_state.destroy_model_parallel()
        unset_global_variables()
