"""A tiny whole Qwen3.5-VL, dense or MoE (:func:`save_whole`): a Qwen3-VL-style vision tower
without DeepStack, its merger, and a hybrid language model interleaving Gated DeltaNet layers with
gated full-attention layers (partial rotary, interleaved multimodal RoPE); transformers' logits
on a sample of several images of different sizes; LoRA runs on it at two layouts, saved and
exported, shared by the tests that read them (:func:`lora_runs`). The sample and our run over the
grids are :mod:`tests.models.qwen_vlm`'s."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.harness.worker_cache import once_per_run
from tests.models.hf_vision import QWEN_PIXELS, redraw
from tests.models.qwen3_vlm import IMAGE_TOKEN, VISION, processor

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT = dict(vocab_size=64, hidden_size=24, intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
            max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
            layer_types=["linear_attention", "full_attention", "linear_attention",
                         "full_attention"],
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_num_key_heads=2, linear_num_value_heads=4,
            rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2],
                             "mrope_interleaved": True, "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.5})
"""A tiny Qwen3.5 language model: Gated DeltaNet, gated attention, twice (two value heads per key
head, so TP 2 splits both kinds of heads); partial rotary over half the head dim."""
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=20)
"""The MoE variant's experts: routed and a gated shared expert on every layer."""


def save_whole(folder: str | Path, seed: int = 0, moe: bool = False, **text: Any) -> Path:
    """A tiny random ``Qwen3_5ForConditionalGeneration`` (``moe``: ``Qwen3_5Moe...``) with its
    preprocessor_config.json, every weight redrawn (norm weights too, so a 1-centred norm read as
    plain would show; Gated DeltaNet's input projections and the experts at half scale, so fp32
    rounding stays under the comparisons' tolerances); ``text`` overrides :data:`TEXT` fields."""
    import transformers

    text = {**TEXT, **(MOE if moe else {}), **text}
    vision = {key: value for key, value in VISION.items() if key != "deepstack_visual_indexes"}
    kind = "Qwen3_5Moe" if moe else "Qwen3_5"
    config = getattr(transformers, f"{kind}Config")(
        vision_config={**vision, "out_hidden_size": text["hidden_size"]},
        text_config=text, image_token_id=IMAGE_TOKEN, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = redraw(getattr(transformers, f"{kind}ForConditionalGeneration")(config))
    with torch.no_grad():  # transformers' own fp32 is 1.3e-5 from fp64 at the full redraw
        for name, param in model.named_parameters():
            if "linear_attn.in_proj" in name or ".experts." in name or "shared_expert." in name:
                param.mul_(0.5)
    model.save_pretrained(folder)
    processor(**QWEN_PIXELS).save_pretrained(folder)
    return Path(folder)


def hf_logits(folder: str | Path, ids: torch.Tensor, pictures: list[np.ndarray]) -> np.ndarray:
    """transformers' own forward of the saved Qwen3.5-VL in float64 (experts looped: its
    grouped matmul has no float64; its Gated DeltaNet's float32 casts kept float64, which
    otherwise move the logits by 1.1e-6 (dense) to 2.3e-6 (MoE) of their largest magnitude), its
    processor's pixel values and grids, its own mrope positions: the exact reference. Its float32
    forward is itself 3e-6 (dense) to 2e-5 (MoE) from it, in other directions than ours, so fp32
    against fp32 would measure two roundings."""
    import transformers

    from tests.harness.gated_delta_net import float64_throughout
    from tests.models.qwen3_vlm import IMAGE_TOKEN

    kind = json.loads((Path(folder) / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, kind).from_pretrained(folder, dtype=torch.float64,
                                                         experts_implementation="eager")
    inputs = processor(folder)(pictures, return_tensors="pt")
    with torch.no_grad(), float64_throughout():
        return model(input_ids=ids, pixel_values=inputs["pixel_values"].double(),
                     image_grid_thw=inputs["image_grid_thw"],
                     mm_token_type_ids=(ids == IMAGE_TOKEN).int()).logits.numpy()


LORA_LAYOUTS = {"one-rank-per-module": (2, ("image:dp=1", "language:dp=1")),
                "language-tp2": (3, ("image:dp=1", "language:tp=2"))}
"""The LoRA runs of :func:`lora_runs`: (ranks, ``--grid`` values) by name."""
LORA = ("--lora", "language:rank=4,alpha=8", "--freeze-encoder", "image")
"""LoRA on every linear of the language model (Gated DeltaNet's ``in_proj`` / ``out_proj``,
attention's, the MLP's), the tower and its merger frozen."""


@once_per_run
def lora_runs() -> tuple[Path, list[list[Any]]]:
    """The dense tiny folder (``root/hf``) trained 3 SGD steps with :data:`LORA` at each of
    :data:`LORA_LAYOUTS`, saved (``root/NAME``, its losses in ``root/NAME-tensorboard``) and
    exported (``root/out_NAME``, the adapters in ``out_NAME/adapters``); with the language TP 2
    run's streamed pieces of its trained model (merged on each rank from its own shards). Once
    per pytest run: the LoRA layout and PEFT export tests read the same runs."""
    from tests.models.hf_vlm import SGD_TRAIN, export, vlm_train

    root = Path(tempfile.mkdtemp(prefix="mimo-qwen3_5-lora-"))
    folder = save_whole(root / "hf")
    pieces = {}
    for name, (nproc, grids) in LORA_LAYOUTS.items():
        pieces[name] = vlm_train(nproc, folder, grids, (
            *SGD_TRAIN, *LORA, "--save", str(root / name), "--save-interval", "3",
            "--tensorboard-dir", str(root / f"{name}-tensorboard")))
    export(root, tuple(LORA_LAYOUTS))
    return root, pieces["language-tp2"]
