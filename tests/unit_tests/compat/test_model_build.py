"""Model-build bridges (Gaps 2, 3, 4, 4a, 4b, 4c, 14, 17, 36, 37, 38, 40): canaries that the
stock wheel still has each gap, and the bridges' tests."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from megatron.core import parallel_state
from megatron.core.models.vision.clip_vit_model import CLIPViTModel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.compat import model_build
from tests.harness.multiprocess import run_in_processes, run_python


STOCK_LOCAL_ATTENTION = """
import traceback
from types import SimpleNamespace
import torch
from megatron.core import parallel_state
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                     world_size=1)
config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
tp = torch.distributed.new_group([0])
attention = DotProductAttention(config, 1, AttnMaskType.causal, "self",
                                pg_collection=SimpleNamespace(tp=tp))
print("initialized", parallel_state.model_parallel_is_initialized())
print("buffer", parallel_state._GLOBAL_MEMORY_BUFFER)
qkv = torch.zeros(4, 1, 2, 4)
try:
    attention(qkv, qkv, qkv, None)
except AssertionError as error:
    frames = [frame.filename.rsplit("/", 1)[-1] + ":" + frame.name
              for frame in traceback.extract_tb(error.__traceback__)]
    print("raised", error, "in", frames[-2:])
"""


@pytest.mark.multirank
def test_gap2_canary_stock_local_attention_needs_the_buffer_only_model_parallel_init_creates():
    """Gap 2: in a fresh process with explicit groups and no ``initialize_model_parallel`` (as on
    disjoint grids), stock leaves the global memory buffer unset and the local attention
    forward asserts on it."""
    result = run_python(STOCK_LOCAL_ATTENTION, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    reported = [line for line in result.stdout.splitlines()
                if line.startswith(("initialized ", "buffer ", "raised "))]
    assert reported == [
        "initialized False", "buffer None",
        "raised global memory buffer is not initialized in "
        "['dot_product_attention.py:forward', 'parallel_state.py:get_global_memory_buffer']"]


def test_gap2_bridge_creates_the_global_memory_buffer_once(monkeypatch):
    monkeypatch.setattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    assert not parallel_state.model_parallel_is_initialized()
    model_build.ensure_global_memory_buffer()
    buffer = parallel_state.get_global_memory_buffer()
    model_build.ensure_global_memory_buffer()
    assert parallel_state.get_global_memory_buffer() is buffer


def test_gap3_canary_vit_has_no_explicit_tp_group_and_the_bridge_binds_one():
    assert "tp_group" not in inspect.getsource(CLIPViTModel)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    outer, inner = MegatronModule(config), MegatronModule(config)
    outer.inner = inner
    inner.tp_group = own = object()
    group = object()
    model_build.bind_tp_group(outer, group)
    assert outer.tp_group is group and inner.tp_group is own


def test_gap4_canary_stock_moe_spec_consults_the_global_pipeline_rank():
    from megatron.training.models import gpt

    assert "pp_rank" not in inspect.getsource(gpt.default_layer_spec)


def test_gap4_bridge_leaves_hybrid_configs_to_their_own_builder():
    from megatron.training.models.hybrid import HybridModelConfig

    config = HybridModelConfig(transformer=_moe_config(ep_size=1), hybrid_layer_pattern="*E")
    assert not hasattr(config, "transformer_layer_spec")
    assert model_build.with_explicit_moe_spec(config, pp_rank=0) is config


class _Group:
    """A process group stand-in: the expert modules only ask it for rank and size."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _moe_config(ep_size: int) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1, hidden_size=8, ffn_hidden_size=16, num_attention_heads=1,
        num_moe_experts=4, moe_router_topk=2, expert_model_parallel_size=ep_size,
        use_cpu_initialization=True, add_bias_linear=True, gradient_accumulation_fusion=False)


def _experts(ep_rank: int, ep_size: int, seed: int = 1234):
    """The local experts of one expert-parallel rank of a 4-expert layer, built after ``seed``."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    torch.manual_seed(seed)
    groups = SimpleNamespace(ep=_Group(ep_rank, ep_size), expt_tp=_Group(0, 1),
                             expt_dp=_Group(0, 1))
    experts = SequentialMLP(4 // ep_size, _moe_config(ep_size),
                            MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                          linear_fc2=RowParallelLinear),
                            pg_collection=groups)
    return experts


def _expert_weights(experts) -> list[torch.Tensor]:
    return [torch.cat([p.detach().flatten() for p in expert.parameters()])
            for expert in experts.local_experts]


def _expert_forward(experts) -> tuple[torch.Tensor, torch.Tensor]:
    """Output of local expert 0 for fixed tokens and routing probabilities, and its input grad."""
    tokens = torch.linspace(-1, 1, 5 * 8).reshape(5, 8).requires_grad_()
    probs = torch.linspace(0.1, 0.9, 5)
    output, bias = experts.local_experts[0](tokens, probs)
    assert bias is None
    output.sum().backward()
    return output.detach(), tokens.grad


def test_gap4a_canary_expert_bias_add_on_one_expert_rank_hits_the_identity_reduce_view(one_rank_world):
    experts = _experts(ep_rank=0, ep_size=1)
    assert not experts.local_experts[0].linear_fc2.explicit_expert_comm
    with pytest.raises(RuntimeError, match="_ReduceFromModelParallelRegion is a view"):
        _expert_forward(experts)


def test_gap4a_bridge_skips_only_the_identity_reduce(one_rank_world):
    experts = _experts(ep_rank=0, ep_size=1)
    model_build.direct_single_rank_expert_output(experts)
    output, grad = _expert_forward(experts)
    expert = experts.local_experts[0]
    tokens = torch.linspace(-1, 1, 5 * 8).reshape(5, 8).requires_grad_()
    probs = torch.linspace(0.1, 0.9, 5)
    hidden = torch.nn.functional.gelu(tokens @ expert.linear_fc1.weight.T + expert.linear_fc1.bias)
    expected = (hidden @ expert.linear_fc2.weight.T + expert.linear_fc2.bias) * probs[:, None]
    expected.sum().backward()
    torch.testing.assert_close(output, expected.detach())
    torch.testing.assert_close(grad, tokens.grad)
    # Expert layers with a real reduce (EP > 1) are left as stock built them.
    assert _experts(ep_rank=0, ep_size=2).local_experts[0].linear_fc2.explicit_expert_comm


def test_gap4b_canary_stock_cpu_init_copies_the_experts_of_every_expert_rank():
    first, second = _expert_weights(_experts(0, 2)), _expert_weights(_experts(1, 2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_gap4b_bridge_gives_every_expert_its_own_deterministic_weights():
    from megatron.core.transformer.moe import experts as experts_module

    stock_init, stock_mlp = experts_module.SequentialMLP.__init__, experts_module.MLP
    with model_build.distinct_cpu_init_experts():
        ep0 = _experts(0, 2)
        after_ep0 = torch.default_generator.get_state()
        ep1 = _experts(1, 2)
        after_ep1 = torch.default_generator.get_state()
        again = _expert_weights(_experts(1, 2))
        one_rank = _expert_weights(_experts(0, 1))
        other_seed = _expert_weights(_experts(1, 2, seed=4321))
    assert experts_module.SequentialMLP.__init__ is stock_init and experts_module.MLP is stock_mlp
    weights = _expert_weights(ep0) + _expert_weights(ep1)
    assert all(not torch.equal(weights[i], weights[j]) for i in range(4) for j in range(i))
    # Deterministic for a seed, distinct for another, independent of the EP size.
    assert all(torch.equal(a, b) for a, b in zip(_expert_weights(ep1), again))
    assert not any(torch.equal(a, b) for a, b in zip(again, other_seed))
    assert all(torch.equal(a, b) for a, b in zip(weights, one_rank))
    # Every expert rank leaves the default generator in the same state (replicated weights next).
    assert torch.equal(after_ep0, after_ep1)


def test_gap4c_canary_stock_hybrid_stack_is_transformer_engine_only():
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear
    from megatron.core.models.hybrid.hybrid_block import HybridStack
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    attention = hybrid_stack_spec.submodules.attention_layer.submodules.self_attention
    assert attention.submodules.linear_qkv is TELayerNormColumnParallelLinear
    assert "self.final_norm = TENorm(" in inspect.getsource(HybridStack.__init__)


def _spec_classes(spec) -> set[type]:
    """Every class a spec tree names (modules, submodules, partial targets)."""
    if isinstance(spec, functools.partial):
        return {spec.func.__self__ if inspect.ismethod(spec.func) else spec.func} | _spec_classes(
            spec.keywords.get("submodules"))
    if isinstance(spec, type):
        return {spec}
    if hasattr(spec, "module"):
        return _spec_classes(spec.module) | _spec_classes(getattr(spec, "submodules", None))
    if dataclasses.is_dataclass(spec):
        fields = dataclasses.fields(spec)
        return set().union(*(_spec_classes(getattr(spec, field.name)) for field in fields))
    return set()


def test_gap4c_bridge_builds_attention_mlp_and_moe_layers_from_local_modules():
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.training.models.hybrid import HybridModelConfig

    transformer = _moe_config(ep_size=1)
    transformer.transformer_impl = "local"
    config = HybridModelConfig(transformer=transformer, hybrid_layer_pattern="*-E")
    resolved = model_build.with_local_hybrid_spec(config)
    assert config.hybrid_stack_spec is None and resolved.hybrid_stack_spec is not None
    layers = resolved.hybrid_stack_spec.submodules
    used = set().union(*(_spec_classes(getattr(layers, name))
                         for name in ("attention_layer", "mlp_layer", "moe_layer")))
    assert SequentialMLP in used
    assert not [c for c in used if c.__module__.endswith("transformer_engine")]
    source = inspect.getsource(resolved.hybrid_stack_spec.module.__init__)
    assert "TENorm" not in source
    # Transformer Engine runs and explicit specs keep the stock stack.
    transformer.transformer_impl = "transformer_engine"
    assert model_build.with_local_hybrid_spec(config) is config


def _bf16_router() -> tuple[TransformerConfig, MegatronModule]:
    """A module with a router's fp32 expert bias (set before the wrap, as an import does), its
    token counter, and stock's own keep-fp32 method."""
    from megatron.core.transformer.moe.router import TopKRouter

    class Router(MegatronModule):
        _maintain_float32_expert_bias = TopKRouter._maintain_float32_expert_bias

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, bf16=True,
                               params_dtype=torch.bfloat16)
    router = Router(config)
    router.register_buffer("expert_bias", torch.tensor([0.1234567, -0.7654321]))
    router.register_buffer("local_tokens_per_expert", torch.zeros(2), persistent=False)
    return config, router


def test_gap14_canary_float16_module_rounds_a_router_bias_set_before_the_wrap():
    from megatron.core.transformer.module import Float16Module

    config, router = _bf16_router()
    exact = router.expert_bias.clone()
    Float16Module(config, router)
    router._maintain_float32_expert_bias()  # what the router's next forward does
    assert router.expert_bias.dtype == torch.float32
    assert not torch.equal(router.expert_bias, exact)


def test_gap14_bridge_puts_back_exactly_the_buffers_the_router_keeps_fp32():
    from megatron.core.transformer.module import Float16Module

    config, router = _bf16_router()
    exact = router.expert_bias.clone()
    with model_build.exact_fp32_router_buffers(router):
        Float16Module(config, router)
    assert router.expert_bias.dtype == torch.float32 and torch.equal(router.expert_bias, exact)
    assert router.local_tokens_per_expert.dtype == torch.bfloat16  # stock keeps it in bf16


def test_gap17_canary_stock_mrope_has_no_interleaved_layout():
    """Gap 17: stock multimodal RoPE gives each axis one contiguous block of pairs, and no config
    field or constructor argument asks for another layout."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        MultimodalRotaryEmbedding,
    )

    forward = inspect.getsource(MultimodalRotaryEmbedding.forward)
    assert "m[i % 3] for i, m in enumerate(emb.split(mrope_section, dim=-1))" in forward
    assert list(inspect.signature(MultimodalRotaryEmbedding.__init__).parameters) == [
        "self", "kv_channels", "rotary_percent", "rotary_interleaved",
        "seq_len_interpolation_factor", "rotary_base", "cp_group"]
    assert [f.name for f in dataclasses.fields(TransformerConfig) if "mrope" in f.name] == [
        "mrope_section"]


def _stock_mrope(monkeypatch, rotary_interleaved: bool = False) -> torch.nn.Module:
    """A module holding stock ``MultimodalRotaryEmbedding`` (head dim 24) as GPTModel does."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        MultimodalRotaryEmbedding,
    )

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    model = torch.nn.Module()
    model.rotary_pos_emb = MultimodalRotaryEmbedding(24, 1.0, rotary_interleaved,
                                                     rotary_base=10000)
    return model


def test_gap17_bridge_gives_transformers_qwen3_vl_rotation_at_3d_positions(monkeypatch):
    import transformers
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    section = [4, 4, 4]
    model = _stock_mrope(monkeypatch)
    positions = torch.randint(0, 50, (3, 2, 11), generator=torch.Generator().manual_seed(0))
    contiguous = model.rotary_pos_emb(positions, section)
    model_build.interleave_mrope(model)
    got = model.rotary_pos_emb(positions, section)
    config = transformers.Qwen3VLTextConfig(hidden_size=48, num_attention_heads=2, head_dim=24,
                                            rope_parameters={"rope_type": "default",
                                                             "rope_theta": 10000.0,
                                                             "mrope_section": section})
    cos, sin = Qwen3VLTextRotaryEmbedding(config)(torch.zeros(1), positions)
    assert got.shape == (11, 2, 1, 24)
    assert torch.allclose(got.cos()[:, :, 0].transpose(0, 1), cos, atol=1e-6)
    assert torch.allclose(got.sin()[:, :, 0].transpose(0, 1), sin, atol=1e-6)
    assert not torch.allclose(got, contiguous)
    same = positions[:1].expand(3, -1, -1)  # text: every axis at one position
    assert torch.equal(model.rotary_pos_emb(same, section),
                       _stock_mrope(monkeypatch).rotary_pos_emb(same, section))


def test_gap17_bridge_refuses_a_model_without_stock_multimodal_rope():
    from megatron_plugins.compat import MegatronCompatError

    model = torch.nn.Module()
    model.rotary_pos_emb = torch.nn.Identity()
    with pytest.raises(MegatronCompatError, match="found Identity"):
        model_build.interleave_mrope(model)


def test_gap36_canary_stock_mtp_layers_take_stocks_decoder_layer_spec():
    from megatron.training.models import gpt

    source = inspect.getsource(gpt.mtp_block_spec)
    assert "decoder_specs = get_gpt_decoder_layer_specs(" in source
    assert "spec = decoder_specs[-1]" in source


def test_gap36_bridge_gives_mtp_attention_the_given_core_attention():
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_plugins.compat import installed
    from megatron_plugins.ops.fast_attention import FastAttention

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                               use_cpu_initialization=True, softmax_scale=0.3)
    attention = torch.nn.Module()
    attention.config, attention.layer_number, attention.pg_collection = config, 2, None
    attention.attn_mask_type, attention.attention_type = AttnMaskType.causal, "self"
    attention.core_attention = torch.nn.Identity()
    decoder = torch.nn.Module()
    decoder.core_attention = torch.nn.Identity()
    model = torch.nn.Module()
    model.decoder, model.mtp = decoder, torch.nn.ModuleList([attention])
    model_build.mtp_core_attention(model, FastAttention)
    core = attention.core_attention
    assert isinstance(core, FastAttention) and core.softmax_scale == 0.3
    assert core.attn_mask_type == AttnMaskType.causal
    assert isinstance(decoder.core_attention, torch.nn.Identity)  # the decoder's spec has it
    assert "36" in installed()


def _sequence_parallel_config(**fields) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                             tensor_model_parallel_size=2, sequence_parallel=True, **fields)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_gap37_canary_stock_local_norm_refuses_sequence_parallelism(normalization):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    with pytest.raises(AssertionError, match="sequence parallel not supported by torch"):
        WrappedTorchNorm(config=_sequence_parallel_config(normalization=normalization),
                         hidden_size=8)


@pytest.mark.parametrize("normalization, norm_class", [("LayerNorm", torch.nn.LayerNorm),
                                                       ("RMSNorm", torch.nn.RMSNorm)])
def test_gap37_bridge_builds_stocks_torch_norm_with_its_parameters_marked(normalization,
                                                                         norm_class):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_plugins.compat import installed

    stock = WrappedTorchNorm.__dict__["__new__"]
    with model_build.sequence_parallel_local_norms():
        norm = WrappedTorchNorm(config=_sequence_parallel_config(normalization=normalization),
                                hidden_size=8, eps=1e-6)
        plain = WrappedTorchNorm(config=TransformerConfig(
            num_layers=1, hidden_size=8, num_attention_heads=2, normalization=normalization),
            hidden_size=8)
        with pytest.raises(AssertionError, match="zero_centered_gamma not supported"):
            WrappedTorchNorm(config=_sequence_parallel_config(
                normalization=normalization, layernorm_zero_centered_gamma=True), hidden_size=8)
    assert WrappedTorchNorm.__dict__["__new__"] is stock
    assert type(norm) is norm_class and norm.eps == 1e-6
    assert [name for name, _ in norm.named_parameters()] == (
        ["weight", "bias"] if normalization == "LayerNorm" else ["weight"])
    assert all(parameter.sequence_parallel is True for parameter in norm.parameters())
    assert type(plain) is norm_class
    assert not any(hasattr(parameter, "sequence_parallel") for parameter in plain.parameters())
    assert "37" in installed()


def _sequence_parallel_norm_rank(normalization: str) -> dict:
    """Rank ``r`` of TP 2: the bridged local norm on rows ``r`` of a sequence split in two, its
    gradients before and after stock's TP reduction; and the whole sequence on one rank."""
    import importlib

    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    x, upstream = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    values = {"weight": 1 + 0.1 * torch.randn(8), "bias": 0.1 * torch.randn(8)}
    sequence_parallel = _sequence_parallel_config(normalization=normalization)

    def norm(config):
        with model_build.sequence_parallel_local_norms():
            built = WrappedTorchNorm(config=config, hidden_size=8)
        with torch.no_grad():
            for name, parameter in built.named_parameters():
                parameter.copy_(values[name])
        return built

    whole = norm(TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                                   normalization=normalization))
    (whole(x) * upstream).sum().backward()
    chunk = torch.nn.Module()
    chunk.ddp_config = SimpleNamespace(use_megatron_fsdp=False)
    chunk.norm = norm(sequence_parallel)
    rows = slice(3 * rank, 3 * rank + 3)
    (chunk.norm(x[rows]) * upstream[rows]).sum().backward()
    partial = {name: p.grad.numpy().copy() for name, p in chunk.norm.named_parameters()}
    finalize._allreduce_non_tensor_model_parallel_grads([chunk], sequence_parallel,
                                                         torch.distributed.group.WORLD)
    # numpy, not tensors: torch's shared-memory pickling does not outlive the worker.
    return {"whole": {name: p.grad.numpy().copy() for name, p in whole.named_parameters()},
            "partial": partial,
            "reduced": {name: p.grad.numpy().copy() for name, p in chunk.norm.named_parameters()}}


@pytest.mark.multirank
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_gap37_bridged_norms_gradients_are_summed_over_tp_by_stocks_finalize(normalization):
    """Each TP rank's norm gradient covers its half of the sequence; stock's finalize reduction,
    reading the bridge's mark, sums them into the whole sequence's gradient on both ranks."""
    ranks = run_in_processes(_sequence_parallel_norm_rank, 2, args=(normalization,),
                             timeout=120, simulated=True)
    whole = ranks[0]["whole"]
    for rank in ranks:
        assert rank["reduced"].keys() == whole.keys()
        for name, gradient in whole.items():
            np.testing.assert_allclose(rank["reduced"][name], gradient, rtol=1e-6, atol=1e-6)
            assert not np.allclose(rank["partial"][name], gradient)
    for name, gradient in whole.items():
        np.testing.assert_allclose(ranks[0]["partial"][name] + ranks[1]["partial"][name],
                                   gradient, rtol=1e-6, atol=1e-6)


def _expert_and_router(group) -> torch.nn.Module:
    """A chunk holding an expert ``RowParallelLinear`` with its bias and a router-like weight,
    built for sequence parallelism, every gradient set, ready for stock's TP reduction."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    config = _sequence_parallel_config(num_moe_experts=4, add_bias_linear=True,
                                       expert_tensor_parallel_size=1, use_cpu_initialization=True,
                                       gradient_accumulation_fusion=False)
    chunk = torch.nn.Module()
    chunk.ddp_config = SimpleNamespace(use_megatron_fsdp=False)
    chunk.expert = RowParallelLinear(
        6, 5, config=config, init_method=torch.nn.init.zeros_, bias=True,
        input_is_parallel=True, skip_bias_add=True, is_expert=True, tp_group=group)
    chunk.router = torch.nn.Parameter(torch.zeros(7))
    chunk.router.sequence_parallel = True  # as stock's Router marks its weight
    for parameter in chunk.parameters():
        parameter.grad = torch.ones_like(parameter)
    return chunk


def _reduced_sizes(monkeypatch, chunk) -> list[int]:
    """The sizes of the gradients stock's finalize sums over a TP group of 2."""
    import importlib

    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    reduced = []
    monkeypatch.setattr(torch.distributed, "all_reduce",
                        lambda tensor, **kwargs: reduced.append(tensor.numel()))
    finalize._allreduce_non_tensor_model_parallel_grads(
        [chunk], _sequence_parallel_config(), SimpleNamespace(size=lambda: 2))
    return reduced


def test_gap38_canary_stock_sums_expert_bias_grads_over_tensor_parallel_ranks(monkeypatch,
                                                                            one_rank_world):
    """Gap 38: an expert's bias is marked sequence-parallel like a dense layer's, so the TP
    reduction of norm gradients takes it too (7 router values + 5 expert bias values)."""
    chunk = _expert_and_router(torch.distributed.group.WORLD)
    bias = chunk.expert.bias
    assert bias.sequence_parallel is True and bias.allreduce is False
    assert _reduced_sizes(monkeypatch, chunk) == [12]


def test_gap38_bridge_unmarks_expert_parameters_only(monkeypatch, one_rank_world):
    from megatron_plugins.compat import installed

    chunk = _expert_and_router(torch.distributed.group.WORLD)
    model_build.expert_biases_stay_per_expert(chunk)
    assert chunk.expert.bias.sequence_parallel is False and chunk.router.sequence_parallel
    assert _reduced_sizes(monkeypatch, chunk) == [7]  # the router's alone
    assert "38" in installed()


def test_gap40_canary_hybrid_builder_scatters_the_embedding_under_sequence_parallelism():
    """Gap 40: the GPT builder passes ``scatter_embedding_sequence_parallel`` from its config; the
    hybrid one has no such field and passes nothing, so HybridModel's default (True) stands."""
    import dataclasses as dc

    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.training.models import gpt, hybrid

    assert "scatter_embedding_sequence_parallel" in inspect.getsource(gpt.GPTModelBuilder)
    assert "scatter_embedding_sequence_parallel" not in inspect.getsource(
        hybrid.HybridModelBuilder)
    assert "scatter_embedding_sequence_parallel" not in {
        field.name for field in dc.fields(hybrid.HybridModelConfig)}
    default = inspect.signature(HybridModel).parameters["scatter_embedding_sequence_parallel"]
    assert default.default is True


def test_gap40_bridge_leaves_the_sequence_to_mimo_under_sequence_parallelism_only():
    from megatron_plugins.compat import installed

    def model(sequence_parallel):
        return SimpleNamespace(config=SimpleNamespace(sequence_parallel=sequence_parallel),
                               embedding=SimpleNamespace(scatter_to_sequence_parallel=True))

    split, whole, later_stage = model(True), model(False), model(True)
    later_stage.embedding = None  # a later pipeline stage has no embedding
    for each in (split, whole, later_stage):
        model_build.unscattered_hybrid_embedding(each)
    assert split.embedding.scatter_to_sequence_parallel is False
    assert whole.embedding.scatter_to_sequence_parallel is True
    assert "40" in installed()
