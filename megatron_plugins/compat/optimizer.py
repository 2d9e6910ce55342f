"""The MiMo optimizer's parameter groups (Gap 29).

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

__all__ = ["RESTORED", "module_overrides"]

RESTORED = ("max_lr", "min_lr", "start_wd", "end_wd")
"""Scheduler values a resumed optimizer takes from the run, not from the checkpoint's groups."""

_stock_get_megatron_optimizer: Any = None
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
