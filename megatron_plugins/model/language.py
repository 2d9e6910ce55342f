"""The MiMo language model, described by stock Megatron flags and built by Megatron's own builder.

Dense and MoE GPT come from ``gpt_config_from_args``; ``--hybrid-layer-pattern`` selects
Megatron's hybrid (Mamba) model through ``hybrid_config_from_args``. Building goes through the
stock model builder of that config, so the language model is what stock
``pretrain_gpt``/``pretrain_hybrid`` would build on the same groups, with the MoE and hybrid
bridges of ``compat.model_build`` (Gaps 4-4c) applied. On the local implementation every
attention layer's core attention is :class:`~megatron_plugins.ops.fast_attention.FastAttention`
(torch's SDPA kernels, packed rows and context parallelism too), or with
``--reference-attention`` the references: :class:`ContextParallelAttention` under context
parallelism (Megatron's local ``DotProductAttention`` refuses cp > 1), :class:`PackedAttention`
with ``--pack-sequences`` (stock's refuses THD inputs), else stock's; Transformer Engine's
attention does all of it itself. With
``--mrope-interleaved`` (Qwen3-VL) the multimodal RoPE lays its frequency pairs out interleaved
(``compat.model_build`` Gap 17); under CP it splits as the model's CP group says
(``compat.context_parallel`` Gaps 20, 21).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
from typing import Any

from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.training.argument_utils import gpt_config_from_args, hybrid_config_from_args
from megatron.training.models.base import ModelConfig
from megatron.training.models.gpt import default_layer_spec

from megatron_plugins.compat import context_parallel, gated_delta_net, gdn_spec, model_build
from megatron_plugins.errors import UsageError
from megatron_plugins.ops import REFERENCE_ATTENTION
from megatron_plugins.ops.fast_attention import local_core_attention

__all__ = [
    "LanguageModelError", "MROPE_INTERLEAVED", "PACKED_SEQUENCES", "StockLanguageModel",
    "check_gated_delta_net", "language_config_from_args", "language_model_spec"
]

PACKED_SEQUENCES = "mimo_packed_sequences"
"""Attribute of a language ``ModelConfig`` saying its inputs come packed (``--pack-sequences``)."""

MROPE_INTERLEAVED = "mimo_mrope_interleaved"
"""Attribute of a language ``ModelConfig`` saying its multimodal RoPE interleaves the t, h, w
frequency pairs (``--mrope-interleaved``, Qwen3-VL)."""


class LanguageModelError(UsageError):
    """A language model that cannot be built here; the message names the flag."""


def _check_context_parallel(args: argparse.Namespace) -> None:
    """Refuse, at language cp > 1, what neither the reference CP attention nor a test covers."""
    cp = getattr(args, "context_parallel_size", 1)
    if cp <= 1:
        return
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if pattern is not None:
        raise LanguageModelError(
            f"--hybrid-layer-pattern {pattern} with language context parallelism (cp={cp}) is "
            "not supported (Mamba layers do not split the sequence here); give the language cp=1 "
            "or drop --hybrid-layer-pattern")
    if getattr(args, "mtp_num_layers", None):
        raise LanguageModelError(
            f"--mtp-num-layers {args.mtp_num_layers} with language context parallelism (cp={cp}) "
            "is not supported; drop --mtp-num-layers or give the language cp=1")
    dropout = getattr(args, "attention_dropout", 0.0)
    if getattr(args, "transformer_impl", None) == "local" and dropout > 0:
        raise LanguageModelError(
            f"--attention-dropout {dropout}: the context parallel attention of "
            f"--transformer-impl local (language cp={cp}) has no dropout; pass "
            "--attention-dropout 0 or use --transformer-impl transformer_engine")


def _with_attention_choice(config: ModelConfig, args: argparse.Namespace) -> ModelConfig:
    """Record ``--reference-attention`` on the language ``TransformerConfig`` (encoders copy it),
    refusing it off the local path and, without it, what the fast attention does not compute."""
    transformer = config.transformer
    reference = bool(getattr(args, "reference_attention", False))
    if reference and transformer.transformer_impl != "local":
        raise LanguageModelError(
            f"--reference-attention selects the reference attentions of --transformer-impl "
            f"local; with --transformer-impl {transformer.transformer_impl} the attention is "
            "Transformer Engine's: drop --reference-attention or pass --transformer-impl local")
    if (not reference and transformer.transformer_impl == "local"
            and (transformer.window_size is not None or transformer.softmax_type != "vanilla")):
        raise LanguageModelError(
            f"the fast attention of --transformer-impl local computes vanilla full attention; "
            f"--window-size {transformer.window_size} / --softmax-type "
            f"{transformer.softmax_type} need --reference-attention (Megatron's local attention) "
            "or --transformer-impl transformer_engine")
    setattr(transformer, REFERENCE_ATTENTION, reference)
    return config


def check_gated_delta_net(args: argparse.Namespace) -> None:
    """Gated DeltaNet layers are built from the local spec (``compat.gdn_spec``) only, and
    without context parallelism (no test covers their backward under it); the launch calls this
    before stock's validation, as the language grid is written into the flags."""
    if not gdn_spec.is_gated_delta_net(args):
        return
    cp = getattr(args, "context_parallel_size", 1)
    if cp > 1:
        raise LanguageModelError(
            f"language context parallelism (cp={cp}) with Gated DeltaNet layers (Qwen3.5) is not "
            "supported here (their state runs along the whole sequence); give the language "
            "cp=1 (--grid language:cp=1) and split the model with tp/pp instead")
    impl = getattr(args, "transformer_impl", "local")
    if impl != "local":
        raise LanguageModelError(
            f"--transformer-impl {impl} with Gated DeltaNet layers (Qwen3.5) is not supported: "
            "the stock Transformer Engine spec centres the Gated DeltaNet output norm, which "
            "Qwen3.5 does not, and places its layers by parallel_state; pass --transformer-impl "
            "local (Gated DeltaNet then uses flash-linear-attention where it is installed)")


def language_config_from_args(args: argparse.Namespace) -> ModelConfig:
    """The stock model config for the language flags; hybrid needs ``mamba-ssm`` for Mamba layers."""
    _check_context_parallel(args)
    check_gated_delta_net(args)
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if pattern is None:
        config = gpt_config_from_args(args)
        # Not a GPTModelConfig field: stored on the config object itself (its __setattr__ puts
        # names the TransformerConfig lacks there), and copied with it.
        setattr(config, PACKED_SEQUENCES, bool(getattr(args, "pack_sequences", False)))
        setattr(config, MROPE_INTERLEAVED, bool(getattr(args, "mrope_interleaved", False)))
        if config.transformer.sequence_parallel:
            # MimoModel scatters the combined text and encoder embeddings over the sequence
            # itself (its PartitionAdapter) and refuses an embedding that scatters the text.
            config.scatter_embedding_sequence_parallel = False
        return _with_attention_choice(config, args)
    if Symbols.MAMBA in pattern and importlib.util.find_spec("mamba_ssm") is None:
        raise LanguageModelError(
            f"--hybrid-layer-pattern {pattern} has Mamba layers ('{Symbols.MAMBA}'), which need "
            "the mamba-ssm kernels (GPU only): pip install 'megatron-plugins[ssm]' on a GPU "
            f"machine, or use a pattern without '{Symbols.MAMBA}'"
        )
    if getattr(args, "pack_sequences", False):
        raise LanguageModelError(
            f"--pack-sequences packs GPT language models only; drop it or drop "
            f"--hybrid-layer-pattern {pattern}")
    return _with_attention_choice(hybrid_config_from_args(args), args)


class StockLanguageModel:
    """``ModuleSpec`` target that builds the language model with Megatron's stock builder.

    ``MimoModel`` instantiates its language model from a spec; constructing this class returns
    the model the stock builder makes for ``model_config`` on ``pg_collection`` (pre/post process
    from the PP stage), so no GPT/hybrid construction logic is repeated here.
    """

    def __new__(cls, config: object, model_config: ModelConfig,
                pg_collection: ProcessGroupCollection, max_sequence_length: int) -> MegatronModule:
        # ``config`` and ``max_sequence_length`` are read from the spec by MimoModel itself.
        model_config = gdn_spec.with_local_gdn_spec(model_config, pg_collection.pp.rank())
        if gdn_spec.is_gated_delta_net(model_config.transformer):
            gated_delta_net.use_reference_gdn_kernels()
        model_config = model_build.with_explicit_moe_spec(model_config, pg_collection.pp.rank())
        model_config = model_build.with_local_hybrid_spec(model_config)
        model_config = _with_local_core_attention(model_config)
        with model_build.distinct_cpu_init_experts(), model_build.sequence_parallel_local_norms():
            model = model_config.get_builder_cls()(model_config).build_model(pg_collection)
        if model_config.transformer.transformer_impl == "local":
            model_build.mtp_core_attention(model, local_core_attention(
                model_config.transformer, packed=getattr(model_config, PACKED_SEQUENCES, False)))
        model_build.direct_single_rank_expert_output(model)
        model_build.expert_biases_stay_per_expert(model)
        model_build.unscattered_hybrid_embedding(model)
        gdn_spec.sum_out_norm_grads_over_tp(model)
        if getattr(model_config, MROPE_INTERLEAVED, False):
            model_build.interleave_mrope(model)
        if model_config.transformer.context_parallel_size > 1:
            context_parallel.bind_mrope_cp_group(model, pg_collection.cp)
            context_parallel.whole_packed_mrope_rows(model)
        return model


def _with_core_attention(spec: Any, core_attention: type) -> Any:
    """A copy of a layer spec, of each layer of a block spec (MoE, Gated DeltaNet) or of the
    attention layer of a hybrid stack spec, with ``core_attention`` in its attention; copied
    along that path only (a hybrid stack's module class does not deep-copy), the rest shared."""
    submodules = getattr(spec, "submodules", None)
    if getattr(submodules, "attention_layer", None) is not None:
        stack = copy.copy(submodules)
        stack.attention_layer = _with_core_attention(submodules.attention_layer, core_attention)
        return dataclasses.replace(spec, submodules=stack)
    if hasattr(spec, "layer_specs"):  # a block spec, no layers on some pipeline stages
        block = copy.copy(spec)
        block.layer_specs = [_with_core_attention(layer, core_attention)
                             for layer in spec.layer_specs]
        return block
    attention = submodules.self_attention
    if not hasattr(attention.submodules, "core_attention"):  # Gated DeltaNet's
        return spec
    inner = copy.copy(attention.submodules)
    inner.core_attention = core_attention
    layer = copy.copy(submodules)
    layer.self_attention = dataclasses.replace(attention, submodules=inner)
    return dataclasses.replace(spec, submodules=layer)


def _with_local_core_attention(model_config: ModelConfig) -> ModelConfig:
    """``model_config`` itself on Transformer Engine, else a copy whose layer spec (given, or the
    stock default; a hybrid model's stack spec) has the local path's core attention
    (:func:`local_core_attention`) in every attention layer."""
    transformer = model_config.transformer
    if transformer.transformer_impl != "local":
        return model_config
    core_attention = local_core_attention(
        transformer, packed=getattr(model_config, PACKED_SEQUENCES, False))
    if hasattr(model_config, "hybrid_stack_spec"):
        # Set by compat.model_build.with_local_hybrid_spec (Gap 4c) unless given.
        field, spec = "hybrid_stack_spec", model_config.hybrid_stack_spec
    else:
        field, spec = "transformer_layer_spec", model_config.transformer_layer_spec
        if spec is None:
            spec = default_layer_spec(model_config, None)
        elif not isinstance(spec, ModuleSpec) and callable(spec):
            spec = spec(model_config)
    swapped = copy.copy(model_config)
    setattr(swapped, field, _with_core_attention(spec, core_attention))
    return swapped


def language_model_spec(model_config: ModelConfig,
                        pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
    """The spec ``MimoModelConfig.language_model_spec`` takes (``params['config']`` is read by MiMo)."""
    return ModuleSpec(
        module=StockLanguageModel,
        params={"config": model_config.transformer, "model_config": model_config,
                "pg_collection": pg_collection,
                "max_sequence_length": model_config.seq_length},
    )
