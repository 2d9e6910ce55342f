"""Vision-encoder families: HF CLIP and SigLIP vision towers <-> Megatron's ``CLIPViTModel``, and
Qwen2.5-VL's vision tower + merger <-> :class:`~megatron_plugins.encoders.qwen2_5_vision.Qwen2_5ViT`
and its input projection (names of :class:`~megatron_plugins.weights.encoder_view.EncoderView`).

Megatron names are relative to the encoder network (``model_subtype="clip"`` / ``"siglip"``),
local spec first; the Transformer Engine spec fuses the pre-attention / pre-MLP LayerNorms into
``linear_qkv`` / ``linear_fc1`` (``layer_norm_weight`` / ``layer_norm_bias``), named here too.
HF names are those of a transformers 5 ``CLIPVisionModel`` / ``SiglipVisionModel``; a full
``CLIPModel`` / ``SiglipModel`` (or an older save) has them under ``vision_model.``.
"""

from __future__ import annotations

import dataclasses

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from megatron_plugins.parallel.module_values import module_values
from megatron_plugins.weights.hf_folder import HFCheckpoint
from megatron_plugins.weights.mapping import (
    PROJECTION,
    TOWER,
    Family,
    HFWeightsError,
    Rule,
    norm_rules,
)

__all__ = ["CLIP_VISION", "QWEN2_5_OMNI_VISION", "QWEN2_5_VL_VISION", "QWEN3_5_VISION",
           "QWEN3_OMNI_VISION", "QWEN3_VL_VISION", "SIGLIP2_VISION", "SIGLIP_VISION",
           "untrained_tensors"]

LAYER = "decoder.layers.{layer}."
HF_LAYER = "encoder.layers.{layer}."


def _norm(megatron: str, hf: str) -> tuple[Rule, ...]:
    return norm_rules(megatron, hf)


def _te_norm(megatron: str, hf: str) -> tuple[Rule, ...]:
    return norm_rules(megatron, hf, te=True)


LAYER_RULES = (
    *_norm(f"{LAYER}input_layernorm", f"{HF_LAYER}layer_norm1"),
    *_te_norm(f"{LAYER}self_attention.linear_qkv", f"{HF_LAYER}layer_norm1"),
    *(Rule(f"{LAYER}self_attention.linear_qkv.{p}",
           tuple(f"{HF_LAYER}self_attn.{x}_proj.{p}" for x in "qkv"), "qkv", tp_dim=0)
      for p in ("weight", "bias")),
    Rule(f"{LAYER}self_attention.linear_proj.weight", (f"{HF_LAYER}self_attn.out_proj.weight",),
         tp_dim=1),
    Rule(f"{LAYER}self_attention.linear_proj.bias", (f"{HF_LAYER}self_attn.out_proj.bias",)),
    *_norm(f"{LAYER}pre_mlp_layernorm", f"{HF_LAYER}layer_norm2"),
    *_te_norm(f"{LAYER}mlp.linear_fc1", f"{HF_LAYER}layer_norm2"),
    Rule(f"{LAYER}mlp.linear_fc1.weight", (f"{HF_LAYER}mlp.fc1.weight",), tp_dim=0),
    Rule(f"{LAYER}mlp.linear_fc1.bias", (f"{HF_LAYER}mlp.fc1.bias",), tp_dim=0),
    Rule(f"{LAYER}mlp.linear_fc2.weight", (f"{HF_LAYER}mlp.fc2.weight",), tp_dim=1),
    Rule(f"{LAYER}mlp.linear_fc2.bias", (f"{HF_LAYER}mlp.fc2.bias",)),
)

PATCHES = Rule("conv1.weight", ("embeddings.patch_embedding.weight",))
POSITIONS = Rule("position_embeddings.weight", ("embeddings.position_embedding.weight",))

PREFIXES = ("", "vision_model.")
"""A vision model's own save (transformers 5), then a full model's (or an older save)."""

OTHER_TOWER = (r"text_model\.", r"text_projection\.", r"visual_projection\.", r"logit_scale$",
               r"logit_bias$")
"""Tensors of a full CLIP / SigLIP model that are not the vision tower."""


def _vision_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The vision config of a vision model's ``config.json`` or a full model's."""
    return config.get("vision_config", config)


def _no_stock_flags(config: Mapping[str, Any]) -> dict[str, Any]:
    """Encoders are shaped by their provider from ``config.json``, not by stock flags."""
    return {}


def source_folder(args: Any, model_type: str) -> tuple[Path, dict[str, Any]]:
    """The one ``--encoder-hf-weights`` folder of this vision model type and its vision config:
    what an export of that encoder takes its config.json and untrained tensors from."""
    found = []
    folders = module_values(getattr(args, "encoder_hf_weights", None), "--encoder-hf-weights")
    for folder in map(Path, folders.values()):
        config = json.loads((folder / "config.json").read_text())
        vision = dict(_vision_config(config))
        if vision.get("model_type", model_type) == model_type:
            found.append((folder, {**vision, "model_type": model_type}))
    if len(found) != 1:
        raise HFWeightsError(f"--encoder-hf-weights: {len(found)} {model_type} folders "
                             "given; exporting its config.json needs exactly one")
    return found[0]


def _loaded_config(model_type: str):
    """``hf_config`` for export: the vision config the encoder was built from."""

    def hf_config(args: Any, vocab_size: int) -> dict[str, Any]:
        return source_folder(args, model_type)[1]

    return hf_config


def untrained_tensors(family: Family, args: Any) -> dict[str, torch.Tensor]:
    """The tower's tensors the Megatron encoder does not hold (``family.untrained``: CLIP's
    ``post_layernorm``, SigLIP's pooling head), read unchanged from the folder the run started
    from, so an exported folder is a whole HF vision model."""
    if not family.untrained:
        return {}
    folder = source_folder(args, family.model_type)[0]
    checkpoint = HFCheckpoint(folder, "--encoder-hf-weights")
    tensors = {}
    for name in sorted(checkpoint.names()):
        if any(re.match(pattern, name) for pattern in family.untrained):
            own = next((name[len(p):] for p in family.hf_prefixes if p and name.startswith(p)),
                       name)
            tensors[own] = checkpoint.read(name, 0, 0, -1)
    return tensors


CLIP_VISION = Family(
    name="clip_vision",
    architectures=("CLIPVisionModel", "CLIPModel", "CLIPVisionModelWithProjection"),
    model_type="clip_vision_model",
    rules=(
        PATCHES,
        POSITIONS,
        Rule("class_token", ("embeddings.class_embedding",), leading_ones=2),
        *_norm("ln_pre", "pre_layrnorm"),
        *LAYER_RULES,
    ),
    megatron_args=_no_stock_flags,
    hf_config=_loaded_config("clip_vision_model"),
    # HF applies post_layernorm only to the pooled class token; the encoder's output is the
    # last_hidden_state before it.
    unused=OTHER_TOWER,
    untrained=(r"(vision_model\.)?post_layernorm\.",),
    hf_prefixes=PREFIXES,
)

SIGLIP_VISION = Family(
    name="siglip_vision",
    architectures=("SiglipVisionModel", "SiglipModel"),
    model_type="siglip_vision_model",
    rules=(
        PATCHES,
        Rule("conv1.bias", ("embeddings.patch_embedding.bias",)),
        POSITIONS,
        *_norm("ln_post", "post_layernorm"),
        *LAYER_RULES,
    ),
    megatron_args=_no_stock_flags,
    hf_config=_loaded_config("siglip_vision_model"),
    # The attention-pooling head (vision_use_head) reads last_hidden_state; it is not the encoder.
    unused=OTHER_TOWER,
    untrained=(r"(vision_model\.)?head\.",),
    hf_prefixes=PREFIXES,
)


QWEN_LAYER = f"{TOWER}decoder.layers.{{layer}}."
QWEN_BLOCK = "blocks.{layer}."

QWEN_ATTENTION = (
    *(Rule(f"{QWEN_LAYER}self_attention.linear_qkv.{p}", (f"{QWEN_BLOCK}attn.qkv.{p}",),
           "fused_qkv", tp_dim=0) for p in ("weight", "bias")),
    Rule(f"{QWEN_LAYER}self_attention.linear_proj.weight", (f"{QWEN_BLOCK}attn.proj.weight",),
         tp_dim=1),
    Rule(f"{QWEN_LAYER}self_attention.linear_proj.bias", (f"{QWEN_BLOCK}attn.proj.bias",)),
)
"""A Qwen vision block's attention: one HF ``attn.qkv`` laid out [q; k; v], ``attn.proj``."""


def _qwen_norms(params: tuple[str, ...]) -> tuple[Rule, ...]:
    """A Qwen vision block's ``norm1`` / ``norm2`` (``params`` of each), local and TE names."""
    return tuple(Rule(f"{QWEN_LAYER}{megatron}{p}", (f"{QWEN_BLOCK}{hf}.{p}",))
                 for hf, local, fused in (("norm1", "input_layernorm", "self_attention.linear_qkv"),
                                          ("norm2", "pre_mlp_layernorm", "mlp.linear_fc1"))
                 for p in params
                 for megatron in (f"{local}.", f"{fused}.layer_norm_"))


def _merger_mlp(megatron: str, fc1: str, fc2: str) -> tuple[Rule, ...]:
    """A merger MLP as a ``MultimodalProjector`` (``megatron`` + ``encoder.``): HF ``fc1`` column
    and ``fc2`` row parallel, with biases."""
    return (*(Rule(f"{megatron}encoder.linear_fc1.{p}", (f"{fc1}.{p}",), tp_dim=0)
              for p in ("weight", "bias")),
            Rule(f"{megatron}encoder.linear_fc2.weight", (f"{fc2}.weight",), tp_dim=1),
            Rule(f"{megatron}encoder.linear_fc2.bias", (f"{fc2}.bias",)))


QWEN2_5_VL_VISION = Family(
    name="qwen2_5_vl_vision",
    architectures=("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLModel",
                   "Qwen2_5_VisionTransformerPretrainedModel"),
    model_type="qwen2_5_vl_vision",
    rules=(
        Rule(f"{TOWER}patch_embed", ("patch_embed.proj.weight",)),
        *_qwen_norms(("weight",)),
        *QWEN_ATTENTION,
        *(Rule(f"{QWEN_LAYER}mlp.linear_fc1.{p}",
               (f"{QWEN_BLOCK}mlp.gate_proj.{p}", f"{QWEN_BLOCK}mlp.up_proj.{p}"), "gate_up",
               tp_dim=0) for p in ("weight", "bias")),
        Rule(f"{QWEN_LAYER}mlp.linear_fc2.weight", (f"{QWEN_BLOCK}mlp.down_proj.weight",),
             tp_dim=1),
        Rule(f"{QWEN_LAYER}mlp.linear_fc2.bias", (f"{QWEN_BLOCK}mlp.down_proj.bias",)),
        Rule(f"{TOWER}ln_q.weight", ("merger.ln_q.weight",)),
        # The merger's MLP is the encoder's input projection (EncoderPlugin.projection_spec).
        *_merger_mlp(PROJECTION, "merger.mlp.0", "merger.mlp.2"),
    ),
    megatron_args=_no_stock_flags,
    hf_config=_loaded_config("qwen2_5_vl_vision"),
    # A whole Qwen2.5-VL folder also holds the language model, another module's weights.
    unused=(r"model\.", r"lm_head\."),
    hf_prefixes=("", "visual."),
)

QWEN2_5_OMNI_VISION = dataclasses.replace(
    QWEN2_5_VL_VISION, name="qwen2_5_omni_vision",
    architectures=("Qwen2_5OmniForConditionalGeneration",
                   "Qwen2_5OmniThinkerForConditionalGeneration"),
    model_type="qwen2_5_omni_vision_encoder",
    # Qwen2.5-VL's tower with its attention's q, k and v as three HF linears.
    rules=tuple(rule for rule in QWEN2_5_VL_VISION.rules if rule.combine != "fused_qkv")[:1] + (
        *(Rule(f"{QWEN_LAYER}self_attention.linear_qkv.{p}",
               tuple(f"{QWEN_BLOCK}attn.{x}.{p}" for x in "qkv"), "qkv", tp_dim=0)
          for p in ("weight", "bias")),
        *(rule for rule in QWEN2_5_VL_VISION.rules[1:] if rule.combine != "fused_qkv")),
    hf_config=_loaded_config("qwen2_5_omni_vision_encoder"),
    unused=(r"(thinker\.)?(model|lm_head|audio_tower)\.", r"talker\.", r"token2wav\."),
)

DEEPSTACK = "deepstack_merger_list.{layer}."


def _qwen3_mergers(deepstack: str, norm: str, fc1: str, fc2: str) -> tuple[Rule, ...]:
    """Qwen3-VL's merger (HF ``merger.``) and DeepStack mergers (HF ``deepstack``, ``{layer}``
    the level) as the projection (:class:`~megatron_plugins.encoders.qwen3_vision.Qwen3Mergers`):
    each one's norm and MLP, by their HF names."""
    mergers = (("merger.", "merger."), ("deepstack.{layer}.", deepstack))
    return (*(Rule(f"{PROJECTION}{megatron}norm.{p}", (f"{hf}{norm}.{p}",))
              for megatron, hf in mergers for p in ("weight", "bias")),
            *(rule for megatron, hf in mergers
              for rule in _merger_mlp(f"{PROJECTION}{megatron}mlp.", hf + fc1, hf + fc2)))


QWEN3_VL_VISION = Family(
    name="qwen3_vl_vision",
    architectures=("Qwen3VLForConditionalGeneration", "Qwen3VLModel", "Qwen3VLVisionModel"),
    model_type="qwen3_vl_vision",
    # Names of encoders.qwen3_vision.Qwen3ViT and its projection Qwen3Mergers: the merger and
    # the deepstack mergers ({layer}: the deepstack level) are the input projection.
    rules=(
        Rule(f"{TOWER}patch_embed", ("patch_embed.proj.weight",)),
        Rule(f"{TOWER}patch_bias", ("patch_embed.proj.bias",)),
        Rule(f"{TOWER}pos_embed", ("pos_embed.weight",)),
        *_qwen_norms(("weight", "bias")),
        *QWEN_ATTENTION,
        *(Rule(f"{QWEN_LAYER}mlp.linear_fc1.{p}", (f"{QWEN_BLOCK}mlp.linear_fc1.{p}",), tp_dim=0)
          for p in ("weight", "bias")),
        Rule(f"{QWEN_LAYER}mlp.linear_fc2.weight", (f"{QWEN_BLOCK}mlp.linear_fc2.weight",),
             tp_dim=1),
        Rule(f"{QWEN_LAYER}mlp.linear_fc2.bias", (f"{QWEN_BLOCK}mlp.linear_fc2.bias",)),
        *_qwen3_mergers(DEEPSTACK, "norm", "linear_fc1", "linear_fc2"),
    ),
    megatron_args=_no_stock_flags,
    hf_config=_loaded_config("qwen3_vl_vision"),
    # A whole Qwen3-VL folder also holds the language model, another module's weights.
    unused=(r"model\.language_model\.", r"lm_head\."),
    hf_prefixes=("", "visual.", "model.visual."),
)

QWEN3_OMNI_VISION = dataclasses.replace(
    QWEN3_VL_VISION, name="qwen3_omni_vision",
    architectures=("Qwen3OmniMoeForConditionalGeneration",
                   "Qwen3OmniMoeThinkerForConditionalGeneration"),
    model_type="qwen3_omni_moe_vision_encoder",
    # Qwen3-VL's tower; its mergers name their norm ln_q and their MLP mlp.0 / mlp.2, the
    # DeepStack mergers sit in merger_list.
    rules=(*(rule for rule in QWEN3_VL_VISION.rules if not rule.megatron.startswith(PROJECTION)),
           *_qwen3_mergers("merger_list.{layer}.", "ln_q", "mlp.0", "mlp.2")),
    hf_config=_loaded_config("qwen3_omni_moe_vision_encoder"),
    # A whole Qwen3-Omni-MoE folder's (thinker.visual.*) or a thinker-only save's (visual.*).
    unused=(r"(?!(thinker\.)?visual\.)",),
    hf_prefixes=("", "thinker.visual.", "visual."),
)

QWEN3_5_VISION = dataclasses.replace(
    QWEN3_VL_VISION, name="qwen3_5_vision",
    architectures=("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                   "Qwen3_5VisionModel"),
    model_type="qwen3_5_vision",
    # Qwen3-VL's tower without DeepStack: the merger alone is the projection.
    rules=tuple(rule for rule in QWEN3_VL_VISION.rules if "deepstack" not in rule.megatron),
    hf_config=_loaded_config("qwen3_5_vision"),
)

SIGLIP2_VISION = Family(
    name="siglip2_vision",
    architectures=("Siglip2VisionModel", "Siglip2Model"),
    model_type="siglip2_vision_model",
    # Names of encoders.siglip2.Siglip2Network: HF's Linear patch embedding, its square position
    # table as the [num_patches, hidden] rows HF stores, post_layernorm as the block's final norm.
    rules=(
        Rule("patch_embedding.weight", ("embeddings.patch_embedding.weight",)),
        Rule("patch_embedding.bias", ("embeddings.patch_embedding.bias",)),
        Rule("position_embedding.weight", ("embeddings.position_embedding.weight",)),
        *_norm("decoder.final_layernorm", "post_layernorm"),
        *LAYER_RULES,
    ),
    megatron_args=_no_stock_flags,
    hf_config=_loaded_config("siglip2_vision_model"),
    # The attention-pooling head reads last_hidden_state; it is not the encoder.
    unused=OTHER_TOWER,
    untrained=(r"(vision_model\.)?head\.",),
    hf_prefixes=PREFIXES,
)
