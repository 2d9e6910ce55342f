"""Gated DeltaNet GPTs on the local implementation (Gaps 31, 32): stock's block spec for them
asserts Transformer Engine and its local norm refuses 1-centred weights; the bridged spec places
Gated DeltaNet and gated attention layers as ``linear_attention_freq`` says, with
:class:`~megatron_plugins.ops.rms_norm.RMSNorm` computing transformers' Qwen3.5 norms. The whole
model's numbers: tests/unit_tests/test_qwen3_5_vlm.py."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.compat import gdn_spec
from megatron_plugins.ops.rms_norm import PlainRMSNorm, RMSNorm


def _config(**fields) -> TransformerConfig:
    base = dict(num_layers=4, hidden_size=16, num_attention_heads=2, normalization="RMSNorm",
                transformer_impl="local", experimental_attention_variant="gated_delta_net",
                linear_attention_freq=[1, 0, 1, 0], linear_num_key_heads=2,
                linear_num_value_heads=2, linear_key_head_dim=4, linear_value_head_dim=4,
                layernorm_zero_centered_gamma=True, qk_layernorm=True)
    return TransformerConfig(**{**base, **fields})


def test_gap31_canary_linear_attention_spec_asserts_transformer_engine():
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_block_with_experimental_attention_variant_spec,
    )

    with pytest.raises(AssertionError, match="only supports transformer engine"):
        get_transformer_block_with_experimental_attention_variant_spec(_config(), pp_rank=0)


def test_gap32_canary_local_norm_refuses_zero_centered_gamma():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    with pytest.raises(AssertionError, match="zero_centered_gamma not supported"):
        WrappedTorchNorm(_config(), hidden_size=16)


def test_the_bridged_spec_places_each_pipeline_stage_s_layer_kinds():
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.attention import SelfAttention

    model_config = type("ModelConfig", (), {})()
    model_config.transformer = _config(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    model_config.transformer_layer_spec = None
    kinds = []
    for pp_rank in (0, 1):
        block = gdn_spec.with_local_gdn_spec(model_config, pp_rank).transformer_layer_spec
        assert block.layer_norm is RMSNorm
        for layer in block.layer_specs:
            attention = layer.submodules.self_attention
            kinds.append(attention.module)
            assert layer.submodules.input_layernorm is RMSNorm
            if attention.module is GatedDeltaNet:
                assert attention.submodules.out_norm is PlainRMSNorm
                assert layer.submodules.sharded_state_dict_keys_map["input_layernorm."] == (
                    "self_attention.in_proj.layer_norm_")
            else:
                assert attention.submodules.q_layernorm is RMSNorm
    assert kinds == [GatedDeltaNet, SelfAttention, GatedDeltaNet, SelfAttention]
    assert model_config.transformer_layer_spec is None  # a copy was resolved


def test_rms_norm_computes_transformers_qwen3_5_norms():
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        Qwen3_5RMSNorm,
        Qwen3_5RMSNormGated,
    )

    torch.manual_seed(0)
    x, gate = torch.randn(3, 5, 16), torch.randn(3, 5, 16)
    centred, hf = RMSNorm(_config(), 16, eps=1e-6), Qwen3_5RMSNorm(16, eps=1e-6)
    plain, hf_gated = PlainRMSNorm(_config(), 16, eps=1e-6), Qwen3_5RMSNormGated(16, eps=1e-6)
    with torch.no_grad():
        for ours, theirs in ((centred, hf), (plain, hf_gated)):
            weight = 0.3 * torch.randn(16)
            ours.weight.copy_(weight)
            theirs.weight.copy_(weight)
    torch.testing.assert_close(centred(x), hf(x))  # torch's rms_norm vs transformers' passes
    gated = plain(x) * torch.nn.functional.silu(gate)  # Megatron's _apply_gated_norm
    torch.testing.assert_close(gated, hf_gated(x, gate), rtol=0, atol=1e-6)
    for dtype in (torch.float32, torch.bfloat16):  # outputs and every gradient, bf16 inputs too
        silu = torch.nn.functional.silu(gate.to(dtype))
        pairs = ((lambda t: centred(t), lambda t: hf(t), centred, hf, None),
                 (lambda t: plain(t) * silu, lambda t: hf_gated(t, gate.to(dtype)), plain,
                  hf_gated, 1e-6 if dtype == torch.float32 else 1e-2))
        for ours, theirs, our_norm, their_norm, atol in pairs:
            results = []
            for call, norm in ((ours, our_norm), (theirs, their_norm)):
                inputs = x.to(dtype).detach().requires_grad_()
                norm.zero_grad()
                out = call(inputs)
                out.backward(torch.linspace(-1, 1, out.numel()).view_as(out).to(dtype))
                results.append((out, inputs.grad, norm.weight.grad))
            for mine, reference in zip(*results):
                assert mine.dtype == reference.dtype
                # The centred norm within the dtype's last bits (another CPU may round the two
                # code paths apart); the gated one rounds its product differently by design.
                torch.testing.assert_close(mine, reference, **(
                    {} if atol is None else {"rtol": 0, "atol": atol}))
    assert torch.equal(RMSNorm(_config(layernorm_zero_centered_gamma=False), 16)(x),
                       PlainRMSNorm(_config(), 16)(x))


def test_gap33_canary_stock_sums_replicated_grads_only_under_sequence_parallelism(monkeypatch,
                                                                                 one_rank_world):
    """Gap 33: at TP 2 without sequence parallelism stock reduces a q/k norm's gradient but not
    Gated DeltaNet's output norm's (its per-rank gradient is a part of the whole)."""
    from types import SimpleNamespace

    import importlib

    finalize_model_grads = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    reduced = []
    monkeypatch.setattr(torch.distributed, "all_reduce",
                        lambda tensor, **kwargs: reduced.append(tensor.numel()))
    chunk = torch.nn.Module()
    chunk.ddp_config = SimpleNamespace(use_megatron_fsdp=False)
    chunk.q_layernorm = torch.nn.Linear(3, 1, bias=False)
    chunk.out_norm = PlainRMSNorm(_config(), 5)
    for param in chunk.parameters():
        param.main_grad = torch.ones_like(param)
        param.grad = torch.ones_like(param)
    tp = SimpleNamespace(size=lambda: 2)
    finalize_model_grads._allreduce_non_tensor_model_parallel_grads([chunk], _config(), tp)
    assert reduced == [3]  # the q norm's 3 values; not the output norm's 5
