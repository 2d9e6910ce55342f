"""Bridges for gaps in the released megatron-core 0.19.2 wheel, applied explicitly by our entry points.

Each bridge is installed by :func:`install` (never on import) and documents the gap it closes; its
test in ``tests/unit_tests/test_megatron_compat.py`` fails when the wheel changes underneath it, so
a bridge that became unnecessary is noticed and removed.

Gap 1 (dataset helpers): stock ``pretrain()`` calls ``megatron.core.datasets.utils.compile_helpers``,
which runs ``make`` in a folder the wheel ships without a Makefile, so every process exits with
code 1. The wheel does ship the prebuilt ``helpers_cpp`` extension; when it imports there is
nothing to compile.

Gap 2 (disjoint grids): the local attention kernel borrows scratch space from
``parallel_state``'s global memory buffer, which only ``initialize_model_parallel`` creates. With
``skip_model_parallel_init=True`` (every heterogeneous run) nothing creates it, so the first local
attention forward asserts. :func:`ensure_global_memory_buffer` creates it, once.

Gap 3 (explicit groups in checkpoints): ``MegatronModule.sharded_state_dict`` shards a module's
own parameters on ``self.tp_group`` and falls back to ``parallel_state``'s (uninitialized on
disjoint grids) when a module has none, as ``CLIPViTModel`` and other modules not yet ported to
explicit process groups do. :func:`bind_tp_group` gives every such module its grid's TP group.
"""

from __future__ import annotations

import copy
import importlib
from typing import Any

import torch

_installed = False


class MegatronCompatError(RuntimeError):
    """The installed megatron-core lacks something our bridges need."""


def prebuilt_dataset_helpers_available() -> bool:
    """Whether the wheel's compiled dataset index helpers import."""
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return False
    return True


def _use_prebuilt_dataset_helpers() -> None:
    if not prebuilt_dataset_helpers_available():
        raise MegatronCompatError(
            "megatron.core.datasets.helpers_cpp does not import, and the megatron-core wheel ships "
            "no Makefile to build it. Reinstall megatron-core==0.19.2 from a binary wheel for this "
            "Python (pip install --force-reinstall --only-binary=:all: megatron-core==0.19.2)."
        )


def install() -> None:
    """Apply every bridge. Idempotent; call before stock ``pretrain()``."""
    global _installed
    if _installed:
        return
    import megatron.core.datasets.utils as dataset_utils

    dataset_utils.compile_helpers = _use_prebuilt_dataset_helpers
    _installed = True


def ensure_global_memory_buffer() -> None:
    """Create ``parallel_state``'s global memory buffer unless it exists (Gap 2)."""
    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


def bind_tp_group(module: torch.nn.Module, tp_group: torch.distributed.ProcessGroup) -> None:
    """Give every ``MegatronModule`` inside ``module`` lacking a ``tp_group`` this one (Gap 3)."""
    from megatron.core.transformer.module import MegatronModule

    for child in module.modules():
        if isinstance(child, MegatronModule) and not hasattr(child, "tp_group"):
            child.tp_group = tp_group


def with_explicit_moe_spec(model_config: Any, pp_rank: int) -> Any:
    """``model_config`` itself, or for a stock-spec MoE GPT a copy with its block spec resolved
    for pipeline rank ``pp_rank`` (Gap 4)."""
    transformer = model_config.transformer
    if (transformer.num_moe_experts is None or model_config.transformer_layer_spec is not None
            or not hasattr(model_config, "transformer_layer_spec")):
        return model_config
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    resolved = copy.copy(model_config)
    resolved.transformer_layer_spec = get_gpt_decoder_block_spec(
        transformer, use_transformer_engine=transformer.transformer_impl == "transformer_engine",
        normalization=transformer.normalization, qk_l2_norm=transformer.qk_l2_norm,
        pp_rank=pp_rank,
    )
    return resolved
