"""A tiny random Qwen3-VL folder and its language model under interleaved multimodal RoPE and
DeepStack, on the transformers side and on the Megatron side (the Qwen3-VL language tests).

The HF side is ``model.language_model`` fed ``inputs_embeds``, 3D ``position_ids`` and optionally
``deepstack_visual_embeds`` at ``visual_pos_masks``, then ``lm_head``. The Megatron side is the
stock GPT built and imported from the folder (``--position-embedding-type mrope
--mrope-interleaved`` implied), its image positions' embeddings replaced by the main features and
the DeepStack levels added by :class:`megatron_plugins.model.deepstack.DeepStack`, as the first language
stage of a MiMo model does with an encoder's rows ``[main, level 0, ..., level L-1]``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.models.hf import build_stock_gpt, redraw_parameters

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 64
IMAGE_TOKEN = 50
HIDDEN = 24
MROPE_SECTION = [2, 2, 2]
"""Frequency pairs per axis of the tiny head dim 12, interleaved t h w t h w."""
LEVELS = 2
"""DeepStack levels of the tiny tower (``deepstack_visual_indexes`` [0, 1])."""
TEXT = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, head_dim=12,
            max_position_embeddings=256, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": MROPE_SECTION, "mrope_interleaved": True})
VISION = dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=HIDDEN,
              patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
              num_position_embeddings=16, deepstack_visual_indexes=list(range(LEVELS)))


def tiny_config(tied: bool = False, **text: Any) -> Any:
    import transformers

    return transformers.Qwen3VLConfig(text_config={**TEXT, **text}, vision_config=VISION,
                                      image_token_id=IMAGE_TOKEN, tie_word_embeddings=tied)


def save_tiny_qwen3_vl(folder: str | Path, seed: int = 0, tied: bool = False,
                       **text: Any) -> Path:
    """A tiny random ``Qwen3VLForConditionalGeneration`` saved to ``folder``, every weight
    redrawn (norms around 1)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3VLForConditionalGeneration(tiny_config(tied, **text))
    redraw_parameters(model)
    model.save_pretrained(folder)
    return Path(folder)


def hf_rope_index(tokens: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
    """transformers' ``Qwen3VLModel.get_rope_index`` of ``tokens`` ``[B, S]`` whose
    :data:`IMAGE_TOKEN` runs are images of language grids ``grids``: ``[3, B, S]``."""
    import transformers

    model = transformers.Qwen3VLModel(tiny_config(num_hidden_layers=1))
    merge = VISION["spatial_merge_size"]
    thw = torch.tensor([[t, h * merge, w * merge] for t, h, w in grids], dtype=torch.long)
    positions, _ = model.get_rope_index(tokens, (tokens == IMAGE_TOKEN).int(),
                                        image_grid_thw=thw if grids else None)
    return positions


def hf_language_logits(folder: str | Path, embeddings: torch.Tensor, positions: torch.Tensor,
                       mask: torch.Tensor | None = None,
                       levels: list[torch.Tensor] | None = None) -> np.ndarray:
    """transformers' language model of the folder on ``embeddings`` ``[B, S, H]`` at
    ``positions`` ``[3, B, S]`` (DeepStack ``levels`` added at ``mask``), then ``lm_head``."""
    import transformers

    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(folder,
                                                                          dtype=torch.float32)
    with torch.no_grad():
        hidden = model.model.language_model(
            inputs_embeds=embeddings, position_ids=positions, visual_pos_masks=mask,
            deepstack_visual_embeds=levels).last_hidden_state
        return model.lm_head(hidden).numpy()


class _Language(torch.nn.Module):
    """What :class:`~megatron_plugins.model.deepstack.DeepStack` reads of a ``MimoModel`` with no
    sequence or context parallelism: the received rows and the image token."""

    def __init__(self, rows: torch.Tensor) -> None:
        super().__init__()
        from megatron.core.models.mimo import MimoModel

        self.input_tensors = {"image": rows}
        self.special_token_ids = {"image": IMAGE_TOKEN}
        self.partition_adapter = None
        self._build_packed_seq_params = MimoModel._build_packed_seq_params.__get__(self)
        self._shard_language_inputs = MimoModel._shard_language_inputs.__get__(self)


def megatron_rank(folder: str, tokens: torch.Tensor, text: torch.Tensor, rows: torch.Tensor,
                  positions: torch.Tensor) -> dict[str, Any]:
    """One rank: the stock GPT imported from the folder, fed ``text`` ``[B, S, H]`` embeddings
    with the image positions' rows ``[N, (1 + L) * H]`` split by DeepStack, at ``positions``;
    the logits, those without DeepStack, and the gradient the rows get from the logits' sum."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    from megatron.core import parallel_state
    from megatron.training.global_vars import unset_global_variables

    from megatron_plugins.model.deepstack import DeepStack
    from megatron_plugins.weights.hf_import import load_hf_weights
    from megatron_plugins.weights.language_families import FAMILIES

    try:
        model, pgc, args = build_stock_gpt(folder, 1, 1, [])
        family = load_hf_weights(model, folder, "--language-hf-weights", pgc, FAMILIES)
        rows = rows.clone().requires_grad_(True)
        mimo = _Language(rows)
        deepstack = DeepStack({"image": LEVELS}, HIDDEN)
        deepstack.hook_layers(model)
        deepstack.split_received(mimo, tokens, None)
        mask = (tokens == IMAGE_TOKEN).unsqueeze(-1).expand_as(text)
        merged = text.masked_scatter(mask, mimo.input_tensors["image"])
        logits = model(tokens, positions, None, decoder_input=merged.transpose(0, 1).contiguous())
        logits.sum().backward()
        deepstack.additions = []
        with torch.no_grad():
            plain = model(tokens, positions, None,
                          decoder_input=merged.transpose(0, 1).contiguous())
        return {"family": family.name, "logits": logits.detach().float().numpy(),
                "plain": plain.float().numpy(), "rows_grad": rows.grad.numpy(),
                "position_embedding_type": args.position_embedding_type,
                "mrope_interleaved": args.mrope_interleaved,
                "rotary": type(model.rotary_pos_emb).__name__}
    finally:
        parallel_state.destroy_model_parallel()
        unset_global_variables()
