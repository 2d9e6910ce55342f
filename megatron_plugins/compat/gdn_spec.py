"""A Gated DeltaNet language model (Qwen3.5) without Transformer Engine (Gaps 31, 32, 33).

:func:`with_local_gdn_spec` gives such a model, on ``--transformer-impl local``, the same layers
built from local modules: Gated DeltaNet (in_proj, causal conv, the gated delta rule, gated output
norm, out_proj; its own input norm, which TE fuses into in_proj) at the ``linear_attention_freq``
positions, the local self-attention (with its output gate) elsewhere, dense or MoE MLPs as
``moe_layer_freq`` says, and :class:`~megatron_plugins.ops.rms_norm.RMSNorm` for every norm
(:class:`~megatron_plugins.ops.rms_norm.PlainRMSNorm` for Gated DeltaNet's output norm, which
transformers does not centre).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from megatron_plugins.compat import record
from megatron_plugins.ops.rms_norm import PlainRMSNorm, RMSNorm

__all__ = ["is_gated_delta_net", "sum_out_norm_grads_over_tp", "with_local_gdn_spec"]


def is_gated_delta_net(transformer: Any) -> bool:
    """Whether a TransformerConfig (or stock args) has Gated DeltaNet layers."""
    return getattr(transformer, "experimental_attention_variant", None) == "gated_delta_net"


def _layer_specs(transformer: Any) -> list[Any]:
    """Every layer's local spec, in model order."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_linear_attention_pattern,
        get_moe_layer_pattern,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    def local(num_experts: int | None) -> Any:
        submodules = get_gpt_layer_local_submodules(
            num_experts=num_experts, moe_grouped_gemm=transformer.moe_grouped_gemm,
            qk_layernorm=transformer.qk_layernorm, normalization="RMSNorm")
        attention = copy.deepcopy(submodules.self_attention)
        if transformer.qk_layernorm:
            attention.submodules.q_layernorm = attention.submodules.k_layernorm = RMSNorm
        return dataclasses.replace(submodules, input_layernorm=RMSNorm, self_attention=attention,
                                   pre_mlp_layernorm=RMSNorm)

    dense, moe = local(None), local(transformer.num_moe_experts)
    linear = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=PlainRMSNorm, out_proj=RowParallelLinear))
    layers = []
    for attention_kind, mlp_kind in zip(get_linear_attention_pattern(transformer),
                                        get_moe_layer_pattern(transformer)):
        submodules = moe if mlp_kind == 1 else dense
        if attention_kind == 1:
            # TE fuses this norm into in_proj; keep that checkpoint key, as the local GPT spec
            # keeps linear_qkv's.
            keys = {**submodules.sharded_state_dict_keys_map,
                    "input_layernorm.": "self_attention.in_proj.layer_norm_"}
            submodules = dataclasses.replace(submodules, self_attention=linear,
                                             sharded_state_dict_keys_map=keys)
        layers.append(ModuleSpec(module=TransformerLayer, submodules=submodules))
    return layers


def with_local_gdn_spec(model_config: Any, pp_rank: int) -> Any:
    """``model_config`` itself, or for a Gated DeltaNet GPT on ``--transformer-impl local``
    without an explicit spec a copy whose block spec is this pipeline rank's local layers.

    Gap 31 (no local spec for linear attention): a GPT with ``experimental_attention_variant=
    "gated_delta_net"`` gets its block spec from ``get_transformer_block_with_experimental_attention_
    variant_spec`` (training/models/gpt.py, ``default_layer_spec``), whose backend provider asserts
    ``transformer_impl == "transformer_engine"`` (models/gpt/experimental_attention_variant_module_
    specs.py, ``_get_backend_spec_provider``) and whose full-attention layers come from the TE spec.
    
    Gap 32 (1-centred norms): the local norm (``WrappedTorchNorm``) asserts
    ``layernorm_zero_centered_gamma`` is off, which Qwen3.5's norms need (``--apply-layernorm-1p``).
    """
    transformer = model_config.transformer
    if (not is_gated_delta_net(transformer) or transformer.transformer_impl != "local"
            or getattr(model_config, "transformer_layer_spec", None) is not None):
        return model_config
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(transformer, pp_rank=pp_rank)
    count = get_num_layers_to_build(transformer, pp_rank=pp_rank)
    resolved = copy.copy(model_config)
    resolved.transformer_layer_spec = TransformerBlockSubmodules(
        layer_specs=_layer_specs(transformer)[offset:offset + count], layer_norm=RMSNorm)
    record("31")
    if transformer.layernorm_zero_centered_gamma:
        record("32")
    return resolved


def sum_out_norm_grads_over_tp(model: Any) -> None:
    """Give every Gated DeltaNet output norm of ``model`` its layer's TP group (Gap 33).

    Gap 33 (the output norm's gradient under TP): Gated DeltaNet normalises each value head with
    one weight replicated over TP, each rank seeing only its own heads, so each rank's gradient
    is a part of the whole; stock's ``_allreduce_non_tensor_model_parallel_grads``
    (distributed/finalize_model_grads.py) sums replicated weights only under sequence
    parallelism (and q/k norms by name), so at TP > 1 without it the replicas drift apart.
    :class:`~megatron_plugins.ops.rms_norm.PlainRMSNorm` sums the gradient over the group given.
    """
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    for module in model.modules():
        if isinstance(module, GatedDeltaNet) and isinstance(module.out_norm, PlainRMSNorm):
            module.out_norm.tp_group = module.pg_collection.tp
            if module.pg_collection.tp.size() > 1:
                record("33")
