"""The MiMo language model, described by stock Megatron flags and built by Megatron's own builder.

Dense and MoE GPT come from ``gpt_config_from_args``; ``--hybrid-layer-pattern`` selects
Megatron's hybrid (Mamba) model through ``hybrid_config_from_args``. Building goes through the
stock model builder of that config, so the language model is what stock
``pretrain_gpt``/``pretrain_hybrid`` would build on the same groups, with the MoE and hybrid
bridges of ``compat.model_build`` (Gaps 4-4c) applied.
"""

from __future__ import annotations

import argparse
import importlib.util

from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.training.argument_utils import gpt_config_from_args, hybrid_config_from_args
from megatron.training.models.base import ModelConfig

from megatron_plugins.compat import model_build
from megatron_plugins.errors import UsageError

__all__ = [
    "LanguageModelError", "StockLanguageModel", "language_config_from_args", "language_model_spec"
]


class LanguageModelError(UsageError):
    """A language model that cannot be built here; the message names the flag."""


def language_config_from_args(args: argparse.Namespace) -> ModelConfig:
    """The stock model config for the language flags; hybrid needs ``mamba-ssm`` for Mamba layers."""
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if pattern is None:
        return gpt_config_from_args(args)
    if Symbols.MAMBA in pattern and importlib.util.find_spec("mamba_ssm") is None:
        raise LanguageModelError(
            f"--hybrid-layer-pattern {pattern} has Mamba layers ('{Symbols.MAMBA}'), which need "
            "the mamba-ssm kernels (GPU only): pip install 'megatron-plugins[ssm]' on a GPU "
            f"machine, or use a pattern without '{Symbols.MAMBA}'"
        )
    return hybrid_config_from_args(args)


class StockLanguageModel:
    """``ModuleSpec`` target that builds the language model with Megatron's stock builder.

    ``MimoModel`` instantiates its language model from a spec; constructing this class returns
    the model the stock builder makes for ``model_config`` on ``pg_collection`` (pre/post process
    from the PP stage), so no GPT/hybrid construction logic is repeated here.
    """

    def __new__(cls, config: object, model_config: ModelConfig,
                pg_collection: ProcessGroupCollection, max_sequence_length: int) -> MegatronModule:
        # ``config`` and ``max_sequence_length`` are read from the spec by MimoModel itself.
        model_config = model_build.with_explicit_moe_spec(model_config, pg_collection.pp.rank())
        model_config = model_build.with_local_hybrid_spec(model_config)
        with model_build.distinct_cpu_init_experts():
            model = model_config.get_builder_cls()(model_config).build_model(pg_collection)
        model_build.direct_single_rank_expert_output(model)
        return model


def language_model_spec(model_config: ModelConfig,
                        pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
    """The spec ``MimoModelConfig.language_model_spec`` takes (``params['config']`` is read by MiMo)."""
    return ModuleSpec(
        module=StockLanguageModel,
        params={"config": model_config.transformer, "model_config": model_config,
                "pg_collection": pg_collection,
                "max_sequence_length": model_config.seq_length},
    )
