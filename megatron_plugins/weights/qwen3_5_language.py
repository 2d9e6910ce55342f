"""Qwen3.5-VL's language models, dense and MoE: Gated DeltaNet and gated full-attention layers
as ``layer_types`` says, 1-centred RMSNorms, partial interleaved multimodal RoPE, and for MoE a
softmax router with routed experts and one sigmoid-gated shared expert. Built from
:mod:`~megatron_plugins.weights.language_families`' pieces (Qwen3's attention and MLP rules,
Qwen3-VL's naming inside the whole folder).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from megatron_plugins.weights.language_families import (
    DENSE_MLP,
    ENDS,
    HF_LAYER,
    LAYER,
    MOE_MLP,
    TIED,
    attention_rules,
    mrope_section,
    qwen3_args,
    qwen3_vl_name,
    swiglu_rules,
    text_config,
    vlm_config,
)
from megatron_plugins.weights.mapping import Family, HFWeightsError, Rule

__all__ = ["FAMILIES", "GATED_DELTA_NET", "QWEN3_5", "QWEN3_5_MOE"]


def _gated_attention() -> tuple[Rule, ...]:
    """Qwen3-Next-style attention: Qwen3's, its q_proj holding an output gate per head."""
    return tuple(dataclasses.replace(rule, combine="gated_qkv") if rule.combine == "qkv" else rule
                 for rule in attention_rules(False, True))


GDN, HF_GDN = f"{LAYER}self_attention.", f"{HF_LAYER}linear_attn."
GATED_DELTA_NET = (
    Rule(f"{GDN}in_proj.layer_norm_weight", (f"{HF_LAYER}input_layernorm.weight",)),
    Rule(f"{GDN}in_proj.weight", tuple(f"{HF_GDN}in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")),
         "gdn_in", tp_dim=0),
    Rule(f"{GDN}conv1d.weight", (f"{HF_GDN}conv1d.weight",), "gdn_conv", tp_dim=0),
    Rule(f"{GDN}A_log", (f"{HF_GDN}A_log",), tp_dim=0),
    Rule(f"{GDN}dt_bias", (f"{HF_GDN}dt_bias",), tp_dim=0),
    Rule(f"{GDN}out_norm.weight", (f"{HF_GDN}norm.weight",)),
    Rule(f"{GDN}out_proj.weight", (f"{HF_GDN}out_proj.weight",), tp_dim=1),
)
"""A Gated DeltaNet layer's mixer (its input norm is the layer's ``input_layernorm``, under
:func:`attention_rules`'s rule)."""

QWEN_MOE_MLP = (
    *MOE_MLP,
    *swiglu_rules(f"{LAYER}mlp.shared_experts.", f"{HF_LAYER}mlp.shared_expert."),
    Rule(f"{LAYER}mlp.shared_experts.gate_weight", (f"{HF_LAYER}mlp.shared_expert_gate.weight",)),
)
"""Qwen3-Next-style MoE: softmax router, routed experts, one sigmoid-gated shared expert."""

LAYER_TYPES = {"linear_attention": 1, "full_attention": 0}
"""HF ``layer_types`` -> Megatron's ``linear_attention_freq`` entries (1: Gated DeltaNet)."""


def _layer_types(text: Mapping[str, Any]) -> list[int]:
    """``layer_types`` (or every ``full_attention_interval``-th layer full, transformers'
    default) as ``--linear-attention-freq``; a type not handled is one line naming it."""
    count = text["num_hidden_layers"]
    interval = text.get("full_attention_interval", 4)
    types = text.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(count)]
    for index, kind in enumerate(types):
        if kind not in LAYER_TYPES:
            raise HFWeightsError(
                f"config.json layer_types[{index}] = {kind!r} is not handled (Qwen3.5 layers "
                f"here are {' or '.join(LAYER_TYPES)})")
    if len(types) != count:
        raise HFWeightsError(f"config.json layer_types has {len(types)} entries for "
                             f"num_hidden_layers = {count}; give one per layer")
    return [LAYER_TYPES[kind] for kind in types]


def _qwen3_5_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """A Qwen3.5(-VL) folder's language model: Gated DeltaNet and gated full-attention layers
    as ``layer_types`` says, 1-centred RMSNorms, partial interleaved multimodal RoPE; no MTP
    layers (the folder's are carried unchanged)."""
    text = text_config(config)
    params = text.get("rope_parameters") or {}
    partial = float(params.get("partial_rotary_factor", 1.0))
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    section = mrope_section({**text, "head_dim": int(head_dim * partial)}, interleaved=True)
    return {**qwen3_args(text), "position_embedding_type": "mrope", "mrope_section": section,
            "mrope_interleaved": True, "rotary_percent": partial,
            "layernorm_zero_centered_gamma": True, "attention_output_gate": True,
            "experimental_attention_variant": "gated_delta_net",
            "linear_attention_freq": _layer_types(text),
            **{f"linear_{field}": text[f"linear_{field}"]
               for field in ("conv_kernel_dim", "key_head_dim", "value_head_dim",
                             "num_key_heads", "num_value_heads")},
            "mtp_num_layers": None}


def _qwen3_5_moe_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3.5-MoE: every layer's MLP routed (softmax, top-k renormalized) plus a gated shared
    expert."""
    text = text_config(config)
    return {
        **_qwen3_5_args(config),
        "num_experts": text["num_experts"],
        "moe_ffn_hidden_size": text["moe_intermediate_size"],
        "moe_router_topk": text["num_experts_per_tok"],
        "moe_router_pre_softmax": False,
        "moe_router_score_function": "softmax",
        "moe_shared_expert_intermediate_size": text["shared_expert_intermediate_size"],
        "moe_shared_expert_gate": True,
        "moe_aux_loss_coeff": text.get("router_aux_loss_coef", 0.0),
    }


def _qwen3_5(name: str, architecture: str, mlp: tuple[Rule, ...], megatron_args: Any) -> Family:
    """A whole Qwen3.5-VL folder's language model; its vision tower (``model.visual.*``) is
    another model's. Its config.json is the folder's own on export (whole-VLM export)."""
    layers = (*ENDS, *_gated_attention(), *GATED_DELTA_NET, *mlp)
    return Family(name, (architecture,), name,
                  tuple(dataclasses.replace(rule, hf=tuple(map(qwen3_vl_name, rule.hf)))
                        for rule in layers),
                  megatron_args, vlm_config(architecture, name, mrope_interleaved=True),
                  unused=(r"model\.visual\.",),
                  tied=tuple((qwen3_vl_name(a), qwen3_vl_name(b)) for a, b in TIED))


QWEN3_5 = _qwen3_5("qwen3_5", "Qwen3_5ForConditionalGeneration", DENSE_MLP, _qwen3_5_args)
QWEN3_5_MOE = _qwen3_5("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", QWEN_MOE_MLP,
                       _qwen3_5_moe_args)

FAMILIES = (QWEN3_5, QWEN3_5_MOE)
"""The Qwen3.5-VL language families (whole folders only)."""
