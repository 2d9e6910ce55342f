"""The MiMo optimizer's parameter groups (Gap 29) and the expert groups of its gradient norm
(Gap 39).

Stock ``get_megatron_optimizer`` hands a ``MimoModel`` to ``get_mimo_optimizer``, which builds one
optimizer per module by calling ``get_megatron_optimizer`` again without ``config_overrides``: the
overrides stock ``pretrain()`` passes are dropped and every module gets the standard ones only (no
weight decay on biases and 1-D parameters). Nothing can give a module, or a part of one, its own
learning rate, minimum learning rate or weight decay, although the scheduler reads them per
parameter group (``max_lr``, ``min_lr``, ``start_wd``, ``end_wd``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_plugins.compat import record

__all__ = ["RESTORED", "expert_tp_in_grad_norms", "module_overrides"]

RESTORED = ("max_lr", "min_lr", "start_wd", "end_wd")
"""Scheduler values a resumed optimizer takes from the run, not from the checkpoint's groups."""

_stock_get_megatron_optimizer: Any = None
_stock_pg_collection_for_optimizer: Any = None
_overrides: dict[int, tuple[Any, Mapping[Any, Mapping[str, Any]]]] = {}
"""id(module chunk) -> (the chunk, its overrides), for the modules of this process's model."""


def _keep_run_values(optimizer: Any) -> None:
    """After a checkpoint load, every group's :data:`RESTORED` values are the run's again
    (stock's load replaces the groups with the checkpoint's)."""
    before = [{key: group[key] for key in RESTORED if key in group}
              for group in optimizer.param_groups]
    load = optimizer.load_state_dict

    def load_state_dict(state_dict: Any) -> None:
        load(state_dict)
        for group, values in zip(optimizer.param_groups, before, strict=True):
            group.update(values)

    optimizer.load_state_dict = load_state_dict


def _with_overrides(config: Any, model_chunks: list, config_overrides: Any = None,
                    **kwargs: Any) -> Any:
    """``get_megatron_optimizer``, with a registered module's overrides added to the standard
    ones (or to those given)."""
    import megatron.core.optimizer as optimizer_module

    entry = _overrides.get(id(model_chunks[0]))
    if entry is None:
        return _stock_get_megatron_optimizer(config, model_chunks, config_overrides, **kwargs)
    base = (config_overrides if config_overrides is not None
            else optimizer_module.get_standard_config_overrides(config))
    optimizer = _stock_get_megatron_optimizer(config, model_chunks, {**base, **entry[1]},
                                              **kwargs)
    _keep_run_values(optimizer)
    return optimizer


def module_overrides(overrides: Mapping[Any, Mapping[Any, Mapping[str, Any]]]) -> None:
    """Gap 29: build the optimizer of each module chunk in ``overrides`` (as the ``MimoModel``
    holds it, wrapped) with stock's standard parameter-group overrides plus its own
    (``ParamKey`` -> ``ParamGroupOverride``, matched against the names inside the chunk), and
    keep those values over a checkpoint's on resume. ``get_mimo_optimizer`` looks
    ``get_megatron_optimizer`` up when it runs, so it finds this one."""
    import megatron.core.optimizer as optimizer_module

    global _stock_get_megatron_optimizer
    if _stock_get_megatron_optimizer is None:
        _stock_get_megatron_optimizer = optimizer_module.get_megatron_optimizer
    _overrides.clear()
    _overrides.update({id(chunk): (chunk, values) for chunk, values in overrides.items()})
    optimizer_module.get_megatron_optimizer = _with_overrides
    record("29")


def expert_tp_in_grad_norms() -> None:
    """Give each module optimizer ``get_mimo_optimizer`` builds its grid's expert
    tensor-parallel group (Gap 39).

    Gap 39 (expert parameters in the MiMo gradient norm): ``get_mimo_optimizer`` builds each
    module's optimizer on a group collection that leaves ``expt_tp`` unset
    (core/models/mimo/optimizer.py:345-362; the collection reads an unset group as None), so the
    optimizer's ``expert_tp_group`` is None (core/optimizer/__init__.py:690) and the gradient
    norm filters expert parameters over the dense TP group: one that is not tensor-parallel
    counts only on TP rank 0 (``param_is_not_tensor_parallel_duplicate``,
    core/tensor_parallel/layers.py:95-110). With the expert-parallel ranks over the TP ranks
    (``tp=2,ep=2,etp=1``, MoE with biases) the biases of every expert off TP rank 0 drop out of
    the norm, and gradient clipping scales the step by a wrong norm. With this, the collection
    carries the grid's ``expt_tp`` group, as stock's own collections do; recorded where it
    differs from the TP group.
    """
    import megatron.core.models.mimo.optimizer as mimo_optimizer

    global _stock_pg_collection_for_optimizer
    if _stock_pg_collection_for_optimizer is None:
        _stock_pg_collection_for_optimizer = mimo_optimizer._get_pg_collection_for_optimizer
    stock = _stock_pg_collection_for_optimizer

    def _get_pg_collection_for_optimizer(grid: Any) -> Any:
        import torch.distributed as dist

        collection = stock(grid)
        expert_tp = grid.get_pg("expt_tp", view=mimo_optimizer._EXPERT_VIEW)
        collection.expt_tp = expert_tp
        if dist.get_process_group_ranks(expert_tp) != dist.get_process_group_ranks(
                collection.tp):
            record("39")
        return collection

    mimo_optimizer._get_pg_collection_for_optimizer = _get_pg_collection_for_optimizer
