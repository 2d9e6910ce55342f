"""Language-model families: Llama, Qwen2 (QKV bias), Qwen3 (QK-norm), Qwen3-MoE (experts),
dots.llm1 (DeepSeek-V3-style MoE: sigmoid router with an fp32 expert bias, shared experts, dense
first layers), Qwen2.5-VL's language model (Qwen2 with multimodal RoPE), Qwen3-VL's (Qwen3
with interleaved multimodal RoPE) and Qwen3-Omni's thinker's (Qwen3-MoE with it); Qwen3.5-VL's,
built from these pieces, are :mod:`~megatron_plugins.weights.qwen3_5_language`'s.

Each is one table of :class:`~megatron_plugins.weights.mapping.Rule` plus its config <-> stock
flags functions. Megatron names are the stock GPT model's with the local spec (what the CPU
simulation builds); the Transformer Engine spec fuses the pre-attention / pre-MLP RMSNorm into
``linear_qkv`` / ``linear_fc1`` (``layer_norm_weight``), named here too: those are also the names
stock checkpoints save the local spec's norms under.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from megatron_plugins.weights.mapping import Family, HFWeightsError, Rule

__all__ = ["DENSE_MLP", "DOTS1", "ENDS", "FAMILIES", "HF_LAYER", "LAYER", "MOE_MLP", "QWEN2_5_VL",
           "QWEN3_OMNI_MOE", "QWEN3_VL", "QWEN3_VL_TEXT", "TIED", "attention_rules",
           "mrope_section", "qwen3_args", "qwen3_vl_name", "swiglu_rules", "text_config",
           "vlm_config"]

LAYER = "decoder.layers.{layer}."
HF_LAYER = "model.layers.{layer}."


def attention_rules(bias: bool, qk_norm: bool) -> tuple[Rule, ...]:
    qkv = tuple(f"{HF_LAYER}self_attn.{p}_proj" for p in "qkv")
    rules = [
        Rule(f"{LAYER}input_layernorm.weight", (f"{HF_LAYER}input_layernorm.weight",)),
        Rule(f"{LAYER}self_attention.linear_qkv.layer_norm_weight",
             (f"{HF_LAYER}input_layernorm.weight",)),
        Rule(f"{LAYER}self_attention.linear_qkv.weight", tuple(f"{n}.weight" for n in qkv),
             "qkv", tp_dim=0),
        Rule(f"{LAYER}self_attention.linear_proj.weight", (f"{HF_LAYER}self_attn.o_proj.weight",),
             tp_dim=1),
        Rule(f"{LAYER}pre_mlp_layernorm.weight", (f"{HF_LAYER}post_attention_layernorm.weight",)),
        Rule(f"{LAYER}mlp.linear_fc1.layer_norm_weight",
             (f"{HF_LAYER}post_attention_layernorm.weight",)),
    ]
    if bias:
        rules.append(Rule(f"{LAYER}self_attention.linear_qkv.bias",
                          tuple(f"{n}.bias" for n in qkv), "qkv", tp_dim=0))
    if qk_norm:
        rules += [Rule(f"{LAYER}self_attention.{m}_layernorm.weight",
                       (f"{HF_LAYER}self_attn.{h}_norm.weight",)) for m, h in (("q", "q"), ("k", "k"))]
    return tuple(rules)


def swiglu_rules(megatron: str, hf: str) -> tuple[Rule, Rule]:
    """A SwiGLU MLP under ``megatron`` (``linear_fc1`` = [gate; up], ``linear_fc2``) from the HF
    ``gate_proj`` / ``up_proj`` / ``down_proj`` under ``hf``: dense, expert and shared alike."""
    return (Rule(f"{megatron}linear_fc1.weight", (f"{hf}gate_proj.weight", f"{hf}up_proj.weight"),
                 "gate_up", tp_dim=0),
            Rule(f"{megatron}linear_fc2.weight", (f"{hf}down_proj.weight",), tp_dim=1))


DENSE_MLP = swiglu_rules(f"{LAYER}mlp.", f"{HF_LAYER}mlp.")

EXPERT = f"{LAYER}mlp.experts.local_experts.{{expert}}."
HF_EXPERT = f"{HF_LAYER}mlp.experts.{{expert}}."
MOE_MLP = (Rule(f"{LAYER}mlp.router.weight", (f"{HF_LAYER}mlp.gate.weight",)),
           *swiglu_rules(EXPERT, HF_EXPERT))

DEEPSEEK_MOE_MLP = (
    *MOE_MLP,
    Rule(f"{LAYER}mlp.router.expert_bias", (f"{HF_LAYER}mlp.gate.e_score_correction_bias",)),
    *swiglu_rules(f"{LAYER}mlp.shared_experts.", f"{HF_LAYER}mlp.shared_experts."),
)
"""Sigmoid router with its expert bias (a buffer, kept fp32 by Megatron), routed and shared
experts."""

ENDS = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), tp_dim=0,
         pad_vocab=True),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",), tp_dim=0, pad_vocab=True),
)

TIED = (("lm_head.weight", "model.embed_tokens.weight"),)
"""A checkpoint with ``tie_word_embeddings`` has no ``lm_head``: the output layer is the embedding."""

DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}
"""str(args.params_dtype) -> config.json ``dtype``."""


def _refuse(config: Mapping[str, Any], field: str, supported: object, why: str) -> None:
    value = config.get(field, supported)
    if value != supported:
        raise HFWeightsError(f"config.json {field} = {value!r} is not supported ({why}); "
                             f"only {supported!r} can be imported")


def _rope_theta(config: Mapping[str, Any]) -> float:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise HFWeightsError(f"config.json rope type {kind!r} is not supported (Megatron's "
                             "rotary embedding here is plain RoPE); only 'default' can be imported")
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def _llama_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """Stock flags of a Llama-style decoder (RMSNorm, SwiGLU, RoPE, GQA, no linear bias)."""
    _refuse(config, "hidden_act", "silu", "SwiGLU with SiLU is the only gated MLP mapped")
    _refuse(config, "mlp_bias", False, "the MLP has no bias here")
    _refuse(config, "use_sliding_window", False, "Megatron attention here is full causal")
    heads = config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or heads
    return {
        "num_layers": config["num_hidden_layers"],
        "hidden_size": config["hidden_size"],
        "ffn_hidden_size": config["intermediate_size"],
        "num_attention_heads": heads,
        "group_query_attention": groups != heads,
        "num_query_groups": groups,
        "kv_channels": config.get("head_dim") or config["hidden_size"] // heads,
        "layernorm_epsilon": config["rms_norm_eps"],
        "normalization": "RMSNorm",
        "swiglu": True,
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "qk_layernorm": False,
        "position_embedding_type": "rope",
        "rotary_base": _rope_theta(config),
        "rotary_percent": 1.0,
        "max_position_embeddings": config["max_position_embeddings"],
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        "vocab_size": config["vocab_size"],
    }


def _dense_args(config: Mapping[str, Any]) -> dict[str, Any]:
    _refuse(config, "attention_bias", False, "o_proj bias needs --add-bias-linear on every layer")
    if config.get("model_type") == "mistral":  # a LLaVA's text model: Llama's without a window
        _refuse(config, "sliding_window", None, "Megatron attention here is full causal")
    return _llama_args(config)


def _qwen2_args(config: Mapping[str, Any]) -> dict[str, Any]:
    return {**_llama_args(config), "add_qkv_bias": True}


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A VLM's language model config: ``text_config`` over the top level (where transformers 5
    keeps ``tie_word_embeddings``; older folders keep every text field there)."""
    top = {key: value for key, value in config.items()
           if key not in ("text_config", "vision_config")}
    return {**top, **(config.get("text_config") or {})}


def mrope_section(text: Mapping[str, Any], interleaved: bool = False) -> list[int]:
    """HF's ``mrope_section``, which Megatron's ``--mrope-section`` takes as is: both count
    rotary frequency pairs per axis (t, h, w) and lay the cos/sin halves out alike
    (``MultimodalRotaryEmbedding`` splits ``cat(freqs, freqs)`` by the sections twice, HF splits
    the frequencies once and concatenates them twice), so their sum is half the head dim.
    ``interleaved``: the family lays the pairs out interleaved (``--mrope-interleaved``)."""
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = params.get("mrope_section")
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    if (not isinstance(section, list) or len(section) != 3
            or sum(section) != head_dim // 2):
        raise HFWeightsError(f"config.json rope_parameters.mrope_section = {section!r} is not "
                             f"supported (Megatron's multimodal RoPE needs three counts of "
                             f"frequency pairs summing to head_dim / 2 = {head_dim // 2})")
    if params.get("mrope_interleaved", False) and not interleaved:
        raise HFWeightsError("config.json rope_parameters.mrope_interleaved = True is not "
                             "supported (Megatron's multimodal RoPE gives each axis one block of "
                             "frequencies); only False can be imported")
    return list(section)


def _qwen2_5_vl_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """A Qwen2.5-VL folder's language model: Qwen2 with multimodal RoPE (transformers 4 wrote its
    rope type as 'mrope', meaning default RoPE split by ``mrope_section``)."""
    text = text_config(config)
    params = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    if params.get("rope_type", params.get("type")) == "mrope":
        params["rope_type"] = "default"
    return {**_qwen2_args({**text, "rope_parameters": params}),
            "position_embedding_type": "mrope", "mrope_section": mrope_section(text),
            "mrope_interleaved": False}


def vlm_config(architecture: str, model_type: str, **rope: Any):
    """``config.json`` of a VLM folder's language side (the vision tower's ``vision_config`` is
    its own family's), its mrope section and ``rope`` in ``rope_parameters``."""

    def hf_config(args: Any, vocab_size: int) -> dict[str, Any]:
        text = _hf_config(architecture, f"{model_type}_text")(args, vocab_size)
        top = {key: text.pop(key) for key in ("architectures", "tie_word_embeddings", "dtype")}
        text["rope_parameters"].update(mrope_section=list(args.mrope_section), **rope)
        return {**top, "model_type": model_type, "text_config": text}

    return hf_config


def _interleaved_mrope(text: Mapping[str, Any]) -> dict[str, Any]:
    """Interleaved multimodal RoPE, which transformers' Qwen3-VL and Qwen3-Omni text rotary
    embeddings apply whatever ``mrope_interleaved`` says."""
    return {"position_embedding_type": "mrope",
            "mrope_section": mrope_section(text, interleaved=True), "mrope_interleaved": True}


def _qwen3_vl_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """A Qwen3-VL folder's language model: Qwen3 (q/k norm) with interleaved multimodal RoPE."""
    text = text_config(config)
    return {**qwen3_args(text), **_interleaved_mrope(text)}


def qwen3_args(config: Mapping[str, Any]) -> dict[str, Any]:
    return {**_dense_args(config), "qk_layernorm": True}


def _qwen3_moe_args(config: Mapping[str, Any]) -> dict[str, Any]:
    _refuse(config, "mlp_only_layers", [], "every layer must be an MoE layer")
    _refuse(config, "decoder_sparse_step", 1, "every layer must be an MoE layer")
    return {
        **qwen3_args(config),
        "num_experts": config.get("num_experts", config.get("num_local_experts")),
        "moe_ffn_hidden_size": config["moe_intermediate_size"],
        "moe_router_topk": config["num_experts_per_tok"],
        # HF: softmax over all experts, then top-k, renormalized only with norm_topk_prob;
        # Megatron without pre-softmax takes the softmax over the top-k (= renormalized).
        "moe_router_pre_softmax": not config.get("norm_topk_prob", False),
        "moe_router_score_function": "softmax",
        "moe_shared_expert_intermediate_size": None,
        "moe_aux_loss_coeff": config.get("router_aux_loss_coef", 0.0),
    }


def _sliding_layers(config: Mapping[str, Any]) -> None:
    """Refuse sliding-window layers, given as ``layer_types`` or (older configs) derived from
    ``sliding_window`` and ``max_window_layers`` as transformers does."""
    types = config.get("layer_types")
    if types is None:
        window, full = config.get("sliding_window"), config.get("max_window_layers", 0)
        types = ["sliding_attention" if window is not None and i >= full else "full_attention"
                 for i in range(config["num_hidden_layers"])]
    _refuse({"layer_types": sorted(set(types))}, "layer_types", ["full_attention"],
            "Megatron attention here is full causal, no sliding window")


def _dots1_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """dots.llm1's router in Megatron's terms, refusing config values where Megatron's routing
    math (``topk_routing_with_score_function``) would differ from ``Dots1TopkRouter``'s."""
    _sliding_layers(config)
    topk = config["num_experts_per_tok"]
    _refuse({"norm_topk_prob": config.get("norm_topk_prob", False)}, "norm_topk_prob", topk > 1,
            "Megatron's sigmoid router renormalizes the "
            "top-k weights exactly when num_experts_per_tok > 1")
    groups, group_topk = config.get("n_group") or 1, config.get("topk_group") or 1
    limited = group_topk < groups
    if limited and topk // group_topk != 2:
        raise HFWeightsError(
            f"config.json topk_group = {group_topk} is not supported (Megatron scores an expert "
            f"group by its top num_experts_per_tok // topk_group = {topk // group_topk} experts, "
            "HF by its top 2); only values giving 2, or topk_group >= n_group, can be imported")
    dense = config.get("first_k_dense_replace") or 0
    shared = config.get("n_shared_experts") or 0
    return {
        **qwen3_args(config),
        "num_experts": config["n_routed_experts"],
        "moe_ffn_hidden_size": config["moe_intermediate_size"],
        "moe_router_topk": topk,
        "moe_router_score_function": "sigmoid",
        "moe_router_pre_softmax": False,
        "moe_router_enable_expert_bias": True,
        "moe_router_topk_scaling_factor": float(config.get("routed_scaling_factor", 1.0)),
        "moe_router_num_groups": groups if limited else None,
        "moe_router_group_topk": group_topk if limited else None,
        # HF computes the router logits in fp32 whatever the model dtype.
        "moe_router_dtype": "fp32",
        "moe_shared_expert_intermediate_size": (config["moe_intermediate_size"] * shared
                                                if shared else None),
        "moe_layer_freq": [0] * dense + [1] * (config["num_hidden_layers"] - dense),
    }


def _first_dense_layers(args: Any) -> int:
    """``first_k_dense_replace`` of ``--moe-layer-freq``; only dense-first patterns exist in HF."""
    freq = args.moe_layer_freq
    pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(args.num_layers)]
    dense = pattern.index(1) if 1 in pattern else len(pattern)
    if pattern != [0] * dense + [1] * (len(pattern) - dense):
        raise HFWeightsError(f"--moe-layer-freq {freq}: dots1 has only dense layers first, then "
                             "MoE layers; this pattern has no HF config")
    return dense


def _hf_config(architecture: str, model_type: str, extra: dict[str, Any] | None = None):
    """The inverse of a family's flag function: ``config.json`` from stock args."""

    def hf_config(args: Any, vocab_size: int) -> dict[str, Any]:
        config = {
            "architectures": [architecture],
            "model_type": model_type,
            "num_hidden_layers": args.num_layers,
            "hidden_size": args.hidden_size,
            "intermediate_size": args.ffn_hidden_size,
            "num_attention_heads": args.num_attention_heads,
            "num_key_value_heads": (args.num_query_groups if args.group_query_attention
                                    else args.num_attention_heads),
            "head_dim": args.kv_channels or args.hidden_size // args.num_attention_heads,
            "rms_norm_eps": args.layernorm_epsilon,
            "hidden_act": "silu",
            "rope_parameters": {"rope_theta": float(args.rotary_base), "rope_type": "default"},
            "max_position_embeddings": args.max_position_embeddings,
            "tie_word_embeddings": not args.untie_embeddings_and_output_weights,
            "vocab_size": vocab_size,
            "attention_bias": bool(args.add_qkv_bias),
            "dtype": DTYPES[str(args.params_dtype)],
        }
        for key, attr in (extra or {}).items():
            config[key] = attr(args)
        return config

    return hf_config


def _decoder(model_type: str, architecture: str, layer_rules: tuple[Rule, ...],
             megatron_args: Any, extra: dict[str, Any] | None = None) -> Family:
    """A decoder-only family: embedding, final norm and output layer (tied when the checkpoint
    has no ``lm_head``) around its layers' rules; ``extra`` adds config.json fields on export."""
    return Family(model_type, (architecture,), model_type, (*ENDS, *layer_rules), megatron_args,
                  _hf_config(architecture, model_type, extra), tied=TIED)


LLAMA = _decoder("llama", "LlamaForCausalLM", (*attention_rules(False, False), *DENSE_MLP),
                 _dense_args)
QWEN2 = _decoder("qwen2", "Qwen2ForCausalLM", (*attention_rules(True, False), *DENSE_MLP),
                 _qwen2_args)
QWEN3 = _decoder("qwen3", "Qwen3ForCausalLM", (*attention_rules(False, True), *DENSE_MLP),
                 qwen3_args)
QWEN3_MOE = _decoder(
    "qwen3_moe", "Qwen3MoeForCausalLM", (*attention_rules(False, True), *MOE_MLP), _qwen3_moe_args, {
        "num_experts": lambda args: args.num_experts,
        "moe_intermediate_size": lambda args: args.moe_ffn_hidden_size,
        "num_experts_per_tok": lambda args: args.moe_router_topk,
        "norm_topk_prob": lambda args: not args.moe_router_pre_softmax,
        "router_aux_loss_coef": lambda args: args.moe_aux_loss_coeff,
        "decoder_sparse_step": lambda args: 1,
        "mlp_only_layers": lambda args: [],
    })

DOTS1 = _decoder(
    "dots1", "Dots1ForCausalLM", (*attention_rules(False, True), *DENSE_MLP, *DEEPSEEK_MOE_MLP),
    _dots1_args, {
        "n_routed_experts": lambda args: args.num_experts,
        "moe_intermediate_size": lambda args: args.moe_ffn_hidden_size,
        "num_experts_per_tok": lambda args: args.moe_router_topk,
        "norm_topk_prob": lambda args: args.moe_router_topk > 1,
        "routed_scaling_factor": lambda args: args.moe_router_topk_scaling_factor or 1.0,
        "n_group": lambda args: args.moe_router_num_groups or 1,
        "topk_group": lambda args: args.moe_router_group_topk or 1,
        "n_shared_experts": lambda args: (args.moe_shared_expert_intermediate_size or 0)
        // args.moe_ffn_hidden_size,
        "first_k_dense_replace": _first_dense_layers,
        "sliding_window": lambda args: None,
        "layer_types": lambda args: ["full_attention"] * args.num_layers,
    })

QWEN2_5_VL = Family("qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration",), "qwen2_5_vl",
                    (*ENDS, *attention_rules(True, False), *DENSE_MLP), _qwen2_5_vl_args,
                    vlm_config("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl"),
                    unused=(r"visual\.",), tied=TIED)
"""The language model of a whole Qwen2.5-VL folder (Qwen2's tensor names); its vision tower
(``visual.*``) is another model's."""

QWEN3_VL_TEXT = "model.language_model."
"""Where a Qwen3-VL folder keeps its text model's ``model.*`` tensors (``lm_head`` stays)."""


def qwen3_vl_name(name: str) -> str:
    return QWEN3_VL_TEXT + name[len("model."):] if name.startswith("model.") else name


QWEN3_VL = Family(
    "qwen3_vl", ("Qwen3VLForConditionalGeneration",), "qwen3_vl",
    tuple(dataclasses.replace(rule, hf=tuple(map(qwen3_vl_name, rule.hf)))
          for rule in (*ENDS, *attention_rules(False, True), *DENSE_MLP)),
    _qwen3_vl_args,
    vlm_config("Qwen3VLForConditionalGeneration", "qwen3_vl", mrope_interleaved=True),
    unused=(r"model\.visual\.",),
    tied=tuple((qwen3_vl_name(a), qwen3_vl_name(b)) for a, b in TIED))
"""The language model of a whole Qwen3-VL folder (Qwen3's tensors under
``model.language_model.``); its vision tower (``model.visual.*``) is another model's."""

FAMILIES = (LLAMA, QWEN2, QWEN3, QWEN3_MOE, DOTS1, QWEN2_5_VL, QWEN3_VL)


def _qwen3_omni_moe_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """A Qwen3-Omni thinker's language model: Qwen3-MoE (every layer routed, top-k renormalized
    by ``norm_topk_prob``, no shared expert) with interleaved multimodal RoPE."""
    text = text_config(config)
    return {**_qwen3_moe_args(text), **_interleaved_mrope(text)}


QWEN3_OMNI_MOE = dataclasses.replace(
    QWEN3_MOE, name="qwen3_omni_moe", architectures=("Qwen3OmniMoeForConditionalGeneration",
                                                     "Qwen3OmniMoeThinkerForConditionalGeneration"),
    model_type="qwen3_omni_moe", megatron_args=_qwen3_omni_moe_args)
"""The language model of a whole Qwen3-Omni-MoE folder, Qwen3-MoE's names (the folder's prefix
``thinker.`` is the whole-VLM entry's); its config.json is the folder's own on export. Not in
:data:`FAMILIES`: whole folders only (``--hf-model``)."""
