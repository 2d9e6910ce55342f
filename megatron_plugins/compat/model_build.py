"""Bridges applied while our code builds and wraps a module (Gaps 2, 3, 4, 4a, 4b, 4c, 14, 17, 36,
37, 38, 40).

Shared context: on disjoint grids (every heterogeneous run, ``skip_model_parallel_init=True``)
``parallel_state`` is never initialized, so stock code that falls back to its globals instead of
the module's own process groups finds nothing or the wrong thing.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
from collections.abc import Iterator
from typing import Any

import torch

from megatron_plugins.compat import MegatronCompatError, record

__all__ = [
    "bind_tp_group", "direct_single_rank_expert_output", "distinct_cpu_init_experts",
    "ensure_global_memory_buffer", "exact_fp32_router_buffers", "expert_biases_stay_per_expert",
    "interleave_mrope",
    "mtp_core_attention", "sequence_parallel_local_norms", "unscattered_hybrid_embedding", "with_explicit_moe_spec",
    "with_local_hybrid_spec"
]


def ensure_global_memory_buffer() -> None:
    """Create ``parallel_state``'s global memory buffer unless it exists (Gap 2).

    Gap 2 (disjoint grids): the local attention kernel borrows scratch space from
    ``parallel_state``'s global memory buffer, which only ``initialize_model_parallel`` creates.
    With ``skip_model_parallel_init=True`` (every heterogeneous run) nothing creates it, so the
    first local attention forward asserts. This creates it, once.
    """
    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
        record("2")


def bind_tp_group(module: torch.nn.Module, tp_group: torch.distributed.ProcessGroup) -> None:
    """Give every ``MegatronModule`` inside ``module`` lacking a ``tp_group`` this one (Gap 3).

    Gap 3 (explicit groups in checkpoints): ``MegatronModule.sharded_state_dict`` shards a
    module's own parameters on ``self.tp_group`` and falls back to ``parallel_state``'s
    (uninitialized on disjoint grids) when a module has none, as ``CLIPViTModel`` and other
    modules not yet ported to explicit process groups do.
    """
    from megatron.core.transformer.module import MegatronModule

    for child in module.modules():
        if isinstance(child, MegatronModule) and not hasattr(child, "tp_group"):
            child.tp_group = tp_group
            record("3")


def with_explicit_moe_spec(model_config: Any, pp_rank: int) -> Any:
    """``model_config`` itself, or for a stock-spec MoE GPT a copy with its block spec resolved
    for pipeline rank ``pp_rank`` (Gap 4).

    Gap 4 (MoE block spec per pipeline stage): for an MoE GPT without an explicit layer spec the
    stock builder calls ``get_gpt_decoder_block_spec`` without ``pp_rank`` (training/models/
    gpt.py, ``default_layer_spec``), which then reads ``parallel_state``'s pipeline rank,
    uninitialized on disjoint grids. Hybrid models need no such bridge: ``HybridModel`` picks
    each stage's layers from ``pg_collection.pp`` and its MoE layer spec does not depend on the
    stage.
    """
    transformer = model_config.transformer
    # Hybrid configs have no layer spec (HybridModelConfig raises AttributeError for it).
    if (transformer.num_moe_experts is None or not hasattr(model_config, "transformer_layer_spec")
            or model_config.transformer_layer_spec is not None):
        return model_config
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    resolved = copy.copy(model_config)
    resolved.transformer_layer_spec = get_gpt_decoder_block_spec(
        transformer, use_transformer_engine=transformer.transformer_impl == "transformer_engine",
        normalization=transformer.normalization, qk_l2_norm=transformer.qk_l2_norm,
        pp_rank=pp_rank,
    )
    record("4")
    return resolved


def mtp_core_attention(model: torch.nn.Module, core_attention: type) -> None:
    """Give the attention of a GPT's multi-token-prediction layers ``core_attention`` (Gap 36).

    Gap 36 (MTP layers ignore the given layer spec): the GPT builder's ``mtp_block_spec``
    (training/models/gpt.py) makes the MTP layers from stock's own decoder layer specs
    (``get_gpt_decoder_layer_specs``), not from the model config's ``transformer_layer_spec``,
    so the core attention put there reaches the decoder's layers only. Each MTP attention that
    has another core attention gets ``core_attention`` instead, built with the arguments
    ``Attention.__init__`` builds its own with (MTP is refused under context parallelism).
    """
    mtp = getattr(model, "mtp", None)
    if mtp is None:
        return
    for module in mtp.modules():
        if hasattr(module, "core_attention") and not isinstance(module.core_attention,
                                                                core_attention):
            module.core_attention = core_attention(
                config=module.config, layer_number=module.layer_number,
                attn_mask_type=module.attn_mask_type, attention_type=module.attention_type,
                softmax_scale=module.config.softmax_scale, pg_collection=module.pg_collection)
            record("36")


def direct_single_rank_expert_output(model: torch.nn.Module) -> None:
    """Route every expert ``RowParallelLinear`` whose TP reduce is the identity (one expert-TP
    rank, EP 1) past that reduce, as stock does for EP > 1 (Gap 4a).

    Gap 4a (MoE experts on one expert rank with biases): an expert ``RowParallelLinear`` skips
    its TP reduce only when ``explicit_expert_comm`` (expert TP > 1 or EP > 1, tensor_parallel/
    layers.py:1326). With one expert-TP rank and EP 1 it calls ``reduce_from_tensor_model_
    parallel_region``, whose autograd function returns its input as is (mappings.py:27-28,
    230-232), so the output is a custom-Function view; ``MLP.forward`` then adds the expert bias
    into it in place (transformer/mlp.py:350-354, ``output += output_bias * per_token_scale``)
    and autograd refuses: "Output 0 of _ReduceFromModelParallelRegion is a view and is being
    modified inplace". It is not specific to the CPU simulation: stock GPT with the local spec,
    ``--num-experts`` and the default ``--add-bias-linear`` crashes the same way. Such experts'
    ``RowParallelLinear`` take the ``explicit_expert_comm`` path, which hands the matmul output
    on unchanged; the skipped reduce is the identity on one rank (forward and backward), so
    results are unchanged.
    """
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    for module in model.modules():
        if (isinstance(module, RowParallelLinear) and module.is_expert
                and not module.explicit_expert_comm and module.skip_bias_add):
            module.explicit_expert_comm = True
            record("4a")


@contextlib.contextmanager
def exact_fp32_router_buffers(module: torch.nn.Module) -> Iterator[None]:
    """While open, a precision wrapper's cast leaves the routers' fp32 buffers exact (Gap 14).

    Gap 14 (fp32 router buffers under ``--bf16`` / ``--fp16``): a router keeps its
    ``expert_bias`` in fp32 (``TopKRouter._maintain_float32_expert_bias``, core/transformer/moe/
    router.py:259), but only casts it back on its next forward, load or save; ``Float16Module``
    (transformer/module.py:458-464) first casts the whole module, so a bias set before the wrap
    (imported HF weights, a Megatron checkpoint init) is rounded to bf16 and routes differently.
    Stock ``--load`` runs after the wrap and is exact. Around the wrap, every router buffer that
    is fp32 before and kept fp32 by the router is put back to its exact value.
    """
    kept = [(router, {name: buffer.clone() for name, buffer in router.named_buffers(recurse=False)
                      if buffer.dtype == torch.float32 and not buffer.is_meta})
            for router in module.modules() if hasattr(router, "_maintain_float32_expert_bias")]
    if kept:
        record("14")
    yield
    with torch.no_grad():
        for router, buffers in kept:
            router._maintain_float32_expert_bias()
            for name, value in buffers.items():
                buffer = getattr(router, name)
                if buffer.dtype == torch.float32:
                    buffer.copy_(value)


@contextlib.contextmanager
def distinct_cpu_init_experts() -> Iterator[None]:
    """While open, CPU-initialized ``SequentialMLP`` experts get per-expert weights (Gap 4b).

    Gap 4b (``--use-cpu-initialization`` with EP > 1): CPU initialization draws every weight
    from the default CPU generator (``_initialize_affine_weight_cpu``, tensor_parallel/
    layers.py:184-227), seeded identically on every expert-parallel rank of a pipeline stage, and
    ``SequentialMLP`` builds its local experts from it in order (transformer/moe/experts.py:
    1293-1302): the experts of ep rank 1 are exact copies of ep rank 0's. (GPU initialization
    forks the expert-parallel RNG tracker instead.) Each ``SequentialMLP`` built here draws one
    layer seed from the default generator (the same draw on every rank, so non-expert weights
    stay replicated) and builds global expert ``g`` from a generator seeded with ``layer seed +
    g``, then restores the default generator. Every expert gets its own weights, the same for a
    given ``--seed`` whatever the EP size.
    """
    from megatron.core.transformer.moe import experts

    stock_init = experts.SequentialMLP.__init__
    stock_mlp = experts.MLP

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None):
        if not (config.use_cpu_initialization and config.perform_initialization):
            stock_init(self, num_local_experts, config, submodules, pg_collection, name)
            return
        record("4b")
        generator = torch.default_generator
        layer_seed = int(torch.randint(2**62, (1,), generator=generator))
        global_index = itertools.count(pg_collection.ep.rank() * num_local_experts)

        def expert(*args, **kwargs):
            state = generator.get_state()
            generator.manual_seed(layer_seed + next(global_index))
            try:
                return stock_mlp(*args, **kwargs)
            finally:
                generator.set_state(state)

        experts.MLP = expert
        try:
            stock_init(self, num_local_experts, config, submodules, pg_collection, name)
        finally:
            experts.MLP = stock_mlp

    experts.SequentialMLP.__init__ = __init__
    try:
        yield
    finally:
        experts.SequentialMLP.__init__ = stock_init


@contextlib.contextmanager
def sequence_parallel_local_norms() -> Iterator[None]:
    """While open, stock's local norm builds under sequence parallelism as TE's norm does (Gap 37).

    Gap 37 (sequence parallelism without Transformer Engine): the local spec's norm,
    ``WrappedTorchNorm`` (transformer/torch_norm.py:49), asserts ``not config.sequence_parallel``,
    so no local-spec model (the layers' norms, a block's final norm, hybrid and MTP norms) builds
    under ``--sequence-parallel``. A LayerNorm or RMSNorm normalises each token on its own, so it
    computes the same on a rank's share of the sequence; only its weight's (and bias's) gradient
    is then a partial sum over this rank's tokens. TE's ``TENorm`` and Apex's ``FusedLayerNorm``
    mark those parameters ``sequence_parallel`` and stock ``finalize_model_grads``
    (distributed/finalize_model_grads.py:452, ``_allreduce_non_tensor_model_parallel_grads``)
    sums such gradients over the tensor-parallel group. While this is open, a
    ``WrappedTorchNorm`` built for a sequence-parallel config is stock's torch norm (built on a
    copy of the config without sequence parallelism, so stock's other checks still hold) whose
    parameters carry ``sequence_parallel = True``, the mark stock's reduction reads.
    """
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    stock_new = WrappedTorchNorm.__dict__["__new__"]
    build = stock_new.__func__ if isinstance(stock_new, staticmethod) else stock_new

    def __new__(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not config.sequence_parallel:
            return build(cls, config, hidden_size, eps, *args, **kwargs)
        whole = copy.copy(config)
        whole.sequence_parallel = False
        norm = build(cls, whole, hidden_size, eps, *args, **kwargs)
        for parameter in norm.parameters():
            parameter.sequence_parallel = True
        record("37")
        return norm

    WrappedTorchNorm.__new__ = __new__
    try:
        yield
    finally:
        WrappedTorchNorm.__new__ = stock_new


def expert_biases_stay_per_expert(model: torch.nn.Module) -> None:
    """Take the ``sequence_parallel`` mark off expert parameters, whose gradients the TP
    all-reduce must not sum (Gap 38).

    Gap 38 (expert biases under sequence parallelism): an expert's ``RowParallelLinear`` marks
    its bias ``sequence_parallel`` from the config like a dense layer's
    (tensor_parallel/layers.py:1413), though experts take the explicit expert communication path
    (no sequence-parallel reduce-scatter in the layer; the token dispatcher gathers every token
    routed to an expert over the TP x EP group first). Stock ``finalize_model_grads`` then sums
    every marked gradient over the dense TP group (distributed/finalize_model_grads.py:452),
    so each expert's already complete bias gradient is added to the bias gradient of whichever
    expert the other TP ranks hold (with ``ep`` over the TP ranks: another expert) or doubled.
    Expert parameters (``allreduce = False``, which DDP reduces over the expert data-parallel
    group) lose the mark; a router, dense and replicated over TP, keeps it.
    """
    for parameter in model.parameters():
        if (not getattr(parameter, "allreduce", True)
                and getattr(parameter, "sequence_parallel", False)):
            parameter.sequence_parallel = False
            record("38")


def unscattered_hybrid_embedding(model: torch.nn.Module) -> None:
    """Have a sequence-parallel hybrid model's embedding leave the sequence whole, as MiMo
    needs (Gap 40).

    Gap 40 (hybrid language models under sequence parallelism in MiMo): ``MimoModel`` scatters
    the combined text and encoder embeddings over the TP ranks itself and refuses a language
    embedding that would scatter the text first (core/models/mimo/model/base.py:379-390: "pass
    scatter_embedding_sequence_parallel=False"). The GPT builder takes that argument from its
    config; ``HybridModelBuilder.build_model`` (training/models/hybrid.py:174-192) passes none
    and ``HybridModelConfig`` has no such field, so every hybrid model under
    ``--sequence-parallel`` fails its first forward. The flag is read only in forward
    (models/common/embeddings/language_model_embedding.py:139-141), so this sets it on the built
    embedding, which is what building with the argument does.
    """
    embedding = getattr(model, "embedding", None)
    if (embedding is not None and model.config.sequence_parallel
            and getattr(embedding, "scatter_to_sequence_parallel", False)):
        embedding.scatter_to_sequence_parallel = False
        record("40")


def _local_norm(config: Any) -> type:
    from megatron.core.models.backends import LocalSpecProvider

    return LocalSpecProvider().layer_norm(rms_norm=config.normalization == "RMSNorm")


@functools.cache
def _local_norm_hybrid_stack() -> type:
    """``HybridStack`` with the local spec's final norm in place of its hard-wired ``TENorm``."""
    from megatron.core.models.hybrid.hybrid_block import HybridStack

    class LocalNormHybridStack(HybridStack):
        """``HybridStack`` whose final norm is the local spec's norm (Gap 4c)."""

        def __init__(self, *args: Any, post_layer_norm: bool = True, **kwargs: Any) -> None:
            super().__init__(*args, post_layer_norm=False, **kwargs)
            self.post_layer_norm = post_layer_norm
            if self.post_process and post_layer_norm:
                self.final_norm = _local_norm(self.config)(
                    config=self.config, hidden_size=self.config.hidden_size,
                    eps=self.config.layernorm_epsilon,
                )

    return LocalNormHybridStack


def with_local_hybrid_spec(model_config: Any) -> Any:
    """``model_config`` itself, or for a hybrid model with ``--transformer-impl local`` and no
    explicit stack spec a copy whose stack spec uses no Transformer Engine module (Gap 4c).

    Gap 4c (hybrid models without Transformer Engine): the wheel's only training stack spec for
    ``HybridModel`` (models/hybrid/hybrid_layer_specs.py, ``hybrid_stack_spec``) is built from TE
    modules whatever ``--transformer-impl`` says, and ``HybridStack`` builds its final norm as
    ``TENorm`` unconditionally (models/hybrid/hybrid_block.py:213-219). Without TE those names
    are ``MagicMock`` stand-ins or raise ``ImportError`` (``StopIteration`` inside ``MLPLayer``).
    With ``--transformer-impl local`` and no ``--spec``, attention, MLP and MoE layers come from
    the GPT local spec's modules and the final norm is the local norm; other layer types (Mamba,
    GDN, MLA, DSA, MTP) keep the stock spec.
    """
    transformer = model_config.transformer
    if (not hasattr(model_config, "hybrid_stack_spec") or model_config.hybrid_stack_spec is not None
            or transformer.transformer_impl != "local"):
        return model_config
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    local = dict(qk_layernorm=transformer.qk_layernorm, normalization=transformer.normalization,
                 qk_l2_norm=transformer.qk_l2_norm)
    dense = get_gpt_layer_local_submodules(**local)
    # The TE spec's layers fuse these norms into their first linear; keep its checkpoint keys.
    attention_norm_key = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    mlp_norm_key = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    submodules = dataclasses.replace(
        hybrid_stack_spec.submodules,
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=dense.input_layernorm, self_attention=dense.self_attention,
            self_attn_bda=dense.self_attn_bda,
            sharded_state_dict_keys_map=attention_norm_key,
        )),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=dense.pre_mlp_layernorm, mlp=dense.mlp, mlp_bda=dense.mlp_bda,
            sharded_state_dict_keys_map=mlp_norm_key,
        )),
    )
    if transformer.num_moe_experts is not None:
        moe = get_gpt_layer_local_submodules(num_experts=transformer.num_moe_experts,
                                             moe_grouped_gemm=transformer.moe_grouped_gemm, **local)
        submodules.moe_layer = ModuleSpec(module=MoETransformerLayer, submodules=(
            TransformerLayerSubmodules(pre_mlp_layernorm=moe.pre_mlp_layernorm, mlp=moe.mlp,
                                       mlp_bda=moe.mlp_bda)))
    resolved = copy.copy(model_config)
    resolved.hybrid_stack_spec = ModuleSpec(module=_local_norm_hybrid_stack(),
                                            submodules=submodules)
    record("4c")
    return resolved


@functools.cache
def _interleaved_mrope_class() -> type:
    """``MultimodalRotaryEmbedding`` computing Qwen3-VL's interleaved frequency layout."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        MultimodalRotaryEmbedding,
        get_pos_emb_on_this_cp_rank,
    )

    class InterleavedMultimodalRotaryEmbedding(MultimodalRotaryEmbedding):
        """Multimodal RoPE whose frequency pairs cycle t, h, w (Gap 17): pair ``j`` rotates by
        the height position when ``j % 3 == 1`` and ``j < 3 * section[1]``, by the width
        position when ``j % 3 == 2`` and ``j < 3 * section[2]``, else by the temporal one
        (transformers' ``Qwen3VLTextRotaryEmbedding.recomposition_frequencies``)."""

        def forward(self, position_ids: torch.Tensor, mrope_section: list[int],
                    cp_group: Any = None) -> torch.Tensor:
            seq = position_ids.to(device=self.inv_freq.device, dtype=self.inv_freq.dtype)
            if self.seq_len_interpolation_factor is not None:
                seq = seq / self.seq_len_interpolation_factor
            freqs = seq[..., None].float() * self.inv_freq  # [3, B, S, pairs]
            merged = freqs[0].clone()
            for axis in (1, 2):
                pairs = slice(axis, mrope_section[axis] * 3, 3)
                merged[..., pairs] = freqs[axis, ..., pairs]
            if self.rotary_interleaved:
                emb = torch.stack((merged, merged), dim=-1).flatten(-2)
            else:
                emb = torch.cat((merged, merged), dim=-1)
            emb = emb[..., None, :].transpose(0, 1).contiguous()  # [S, B, 1, 2 * pairs]
            cp_group = self.cp_group if cp_group is None else cp_group
            if cp_group is not None and cp_group.size() > 1:
                emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
            return emb

    return InterleavedMultimodalRotaryEmbedding


def interleave_mrope(model: torch.nn.Module) -> None:
    """Make a GPT model's multimodal RoPE lay its frequencies out interleaved (Gap 17).

    Gap 17 (interleaved multimodal RoPE): Qwen3-VL's language model rotates frequency pair ``j``
    by the temporal, height or width position in turn (``mrope_interleaved``); 0.19.2's
    ``MultimodalRotaryEmbedding`` (models/common/embeddings/rotary_pos_embedding.py) only gives
    each axis one contiguous block of ``mrope_section[axis]`` pairs, and ``TransformerConfig``
    has no switch for another layout. The model's ``rotary_pos_emb`` keeps its state (inverse
    frequencies, CP group) and computes the interleaved layout; ``GPTModel`` calls it as before.
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        MultimodalRotaryEmbedding,
    )

    rotary = getattr(model, "rotary_pos_emb", None)
    if type(rotary) is not MultimodalRotaryEmbedding:
        raise MegatronCompatError(
            f"interleaved multimodal RoPE expects the GPT model's rotary_pos_emb to be "
            f"MultimodalRotaryEmbedding (--position-embedding-type mrope), found "
            f"{type(rotary).__name__}")
    rotary.__class__ = _interleaved_mrope_class()
    record("17")
