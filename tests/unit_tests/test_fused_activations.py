"""Stock's bias-activation fusions on the local path: the CPU simulation keeps them on, as a GPU
does, and the encoders keep them only where they compute the encoder's own activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_plugins import cpu_simulation


def test_the_cpu_simulation_leaves_stocks_torch_compile_fusions_on() -> None:
    """The bias-GELU, bias-SwiGLU and bias-dropout-add fusions are ``torch.compile`` functions,
    not CUDA kernels: the simulation neither rewrites nor refuses them."""
    forced = {attr for attr, *_ in cpu_simulation.CPU_SIMULATION_VALUES}
    assert not forced & {"bias_gelu_fusion", "bias_swiglu_fusion", "bias_dropout_fusion"}
    assert {"gradient_accumulation_fusion", "masked_softmax_fusion", "apply_rope_fusion"} <= forced


def test_encoders_keep_the_fusion_only_for_swiglu(tmp_path) -> None:
    """Under a SwiGLU language model with stock's GPU default (fusion on), a GELU tower or
    projector would get stock's fused GELU, the tanh approximation; a SwiGLU tower keeps it."""
    from tests.harness.multiprocess import REPO_ROOT
    from tests.models.hf_vision import language_config, plugin, save_tiny
    from tests.models.hf_whisper import plugin as whisper_plugin
    from tests.models.hf_whisper import save_tiny as save_whisper

    qwen = plugin("qwen2_5_vl", REPO_ROOT / "examples/mimo/recipes/qwen2_5_vl/qwen2_5_vl_7b_config")
    language = language_config(bias_activation_fusion=True, activation_func=F.silu,
                               gated_linear_unit=True)
    language.hidden_size = qwen.hf_config.out_hidden_size  # what the merger checks
    towers = {"qwen2_5_vl": qwen, "clip": plugin("clip", save_tiny("clip", tmp_path / "clip")),
              "whisper": whisper_plugin(save_whisper(tmp_path / "whisper"))}
    fused = {}
    for name, tower in towers.items():
        config = tower.transformer_config(language)
        projection = tower.projection_spec(config, language.hidden_size, None).params["config"]
        fused[name] = (config.bias_activation_fusion, projection.bias_activation_fusion)
    assert fused == {"qwen2_5_vl": (True, False), "clip": (False, False),
                     "whisper": (False, False)}


def test_the_fused_swiglu_mlp_computes_the_unfused_one(one_rank_world) -> None:
    """What the simulation now runs (stock's ``bias_swiglu_impl``, eager) against the unfused
    MLP: the same output and gradients to rounding (the last bit where SIMD lanes differ), and
    fewer bytes kept."""
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    results, weights = [], None
    # Eager, as the simulation runs it (it disables dynamo): elsewhere in this process stock's
    # jit_fuser would compile the fused function with inductor, whose kernels round apart.
    with torch._dynamo.config.patch(disable=True):
        for fusion in (False, True):
            config = TransformerConfig(
                num_layers=1, hidden_size=16, ffn_hidden_size=24, num_attention_heads=1,
                gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                bias_activation_fusion=fusion, use_cpu_initialization=True,
                gradient_accumulation_fusion=False)
            mlp = MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                            linear_fc2=RowParallelLinear),
                      tp_group=torch.distributed.group.WORLD)
            weights = weights or mlp.state_dict()  # the same weights in both
            mlp.load_state_dict(weights)
            x = torch.randn(7, 2, 16, generator=torch.Generator().manual_seed(0),
                            requires_grad=True)
            kept = []
            with torch.autograd.graph.saved_tensors_hooks(
                    lambda t: kept.append(t.untyped_storage().nbytes()) or t, lambda t: t):
                out, _ = mlp(x)
            out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
            results.append((out, x.grad, mlp.linear_fc1.weight.grad, mlp.linear_fc2.weight.grad,
                            sum(kept)))
    (*unfused, unfused_bytes), (*fused, fused_bytes) = results
    for theirs, ours in zip(unfused, fused):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    assert fused_bytes < unfused_bytes
