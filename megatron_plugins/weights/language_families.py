"""Language-model families: Llama, Qwen2 (QKV bias), Qwen3 (QK-norm), Qwen3-MoE (experts).

Each is one table of :class:`~megatron_plugins.weights.mapping.Rule` plus its config <-> stock
flags functions. Megatron names are the stock GPT model's with the local spec (what the CPU
simulation builds); the Transformer Engine spec fuses the pre-attention / pre-MLP RMSNorm into
``linear_qkv`` / ``linear_fc1`` (``layer_norm_weight``), named here too: those are also the names
stock checkpoints save the local spec's norms under.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_plugins.weights.mapping import Family, HFWeightsError, Rule

LAYER = "decoder.layers.{layer}."
HF_LAYER = "model.layers.{layer}."


def _attention(bias: bool, qk_norm: bool) -> tuple[Rule, ...]:
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


DENSE_MLP = (
    Rule(f"{LAYER}mlp.linear_fc1.weight",
         (f"{HF_LAYER}mlp.gate_proj.weight", f"{HF_LAYER}mlp.up_proj.weight"), "gate_up", tp_dim=0),
    Rule(f"{LAYER}mlp.linear_fc2.weight", (f"{HF_LAYER}mlp.down_proj.weight",), tp_dim=1),
)

EXPERT = f"{LAYER}mlp.experts.local_experts.{{expert}}."
HF_EXPERT = f"{HF_LAYER}mlp.experts.{{expert}}."
MOE_MLP = (
    Rule(f"{LAYER}mlp.router.weight", (f"{HF_LAYER}mlp.gate.weight",)),
    Rule(f"{EXPERT}linear_fc1.weight",
         (f"{HF_EXPERT}gate_proj.weight", f"{HF_EXPERT}up_proj.weight"), "gate_up", tp_dim=0),
    Rule(f"{EXPERT}linear_fc2.weight", (f"{HF_EXPERT}down_proj.weight",), tp_dim=1),
)

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
    return _llama_args(config)


def _qwen2_args(config: Mapping[str, Any]) -> dict[str, Any]:
    return {**_llama_args(config), "add_qkv_bias": True}


def _qwen3_args(config: Mapping[str, Any]) -> dict[str, Any]:
    return {**_dense_args(config), "qk_layernorm": True}


def _qwen3_moe_args(config: Mapping[str, Any]) -> dict[str, Any]:
    _refuse(config, "mlp_only_layers", [], "every layer must be an MoE layer")
    _refuse(config, "decoder_sparse_step", 1, "every layer must be an MoE layer")
    return {
        **_qwen3_args(config),
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


LLAMA = Family("llama", ("LlamaForCausalLM",), "llama", (*ENDS, *_attention(False, False),
                                                        *DENSE_MLP),
               _dense_args, _hf_config("LlamaForCausalLM", "llama"), tied=TIED)
QWEN2 = Family("qwen2", ("Qwen2ForCausalLM",), "qwen2", (*ENDS, *_attention(True, False),
                                                        *DENSE_MLP),
               _qwen2_args, _hf_config("Qwen2ForCausalLM", "qwen2"), tied=TIED)
QWEN3 = Family("qwen3", ("Qwen3ForCausalLM",), "qwen3", (*ENDS, *_attention(False, True),
                                                        *DENSE_MLP),
               _qwen3_args, _hf_config("Qwen3ForCausalLM", "qwen3"), tied=TIED)
QWEN3_MOE = Family(
    "qwen3_moe", ("Qwen3MoeForCausalLM",), "qwen3_moe",
    (*ENDS, *_attention(False, True), *MOE_MLP), _qwen3_moe_args,
    _hf_config("Qwen3MoeForCausalLM", "qwen3_moe", {
        "num_experts": lambda args: args.num_experts,
        "moe_intermediate_size": lambda args: args.moe_ffn_hidden_size,
        "num_experts_per_tok": lambda args: args.moe_router_topk,
        "norm_topk_prob": lambda args: not args.moe_router_pre_softmax,
        "router_aux_loss_coef": lambda args: args.moe_aux_loss_coeff,
        "decoder_sparse_step": lambda args: 1,
        "mlp_only_layers": lambda args: [],
    }), tied=TIED)

FAMILIES = (LLAMA, QWEN2, QWEN3, QWEN3_MOE)
