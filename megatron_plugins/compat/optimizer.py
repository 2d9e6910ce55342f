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

_stock_mimo_optimizer: Any = None


def _module_of_chunk(mimo_model: Any) -> dict[int, str]:
    modules = {id(mimo_model.language_model): "language"} if mimo_model.language_model else {}
    modules.update({id(module): name for name, module in mimo_model.modality_submodules.items()})
    return modules


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


def module_overrides(overrides: Mapping[str, Mapping[Any, Mapping[str, Any]]]) -> None:
    """Gap 29: build each module's optimizer with stock's standard parameter-group overrides plus
    ``overrides[module]`` (``ParamKey`` -> ``ParamGroupOverride``, keys matched against the names
    inside the module's wrapped chunk), and keep those values over a checkpoint's on resume."""
    import megatron.core.models.mimo.optimizer as mimo_optimizer
    import megatron.core.optimizer as optimizer_module

    global _stock_mimo_optimizer
    if _stock_mimo_optimizer is None:
        _stock_mimo_optimizer = mimo_optimizer.get_mimo_optimizer
    stock = _stock_mimo_optimizer

    def get_mimo_optimizer(mimo_model: Any, config: Any) -> Any:
        build = optimizer_module.get_megatron_optimizer
        modules = _module_of_chunk(mimo_model)

        def with_overrides(config: Any, model_chunks: list, config_overrides: Any = None,
                           **kwargs: Any) -> Any:
            name = modules.get(id(model_chunks[0]))
            if name in overrides:
                base = (config_overrides if config_overrides is not None
                        else optimizer_module.get_standard_config_overrides(config))
                config_overrides = {**base, **overrides[name]}
            return build(config, model_chunks, config_overrides, **kwargs)

        optimizer_module.get_megatron_optimizer = with_overrides
        try:
            optimizer = stock(mimo_model, config)
        finally:
            optimizer_module.get_megatron_optimizer = build
        _keep_run_values(optimizer)
        return optimizer

    mimo_optimizer.get_mimo_optimizer = get_mimo_optimizer
    record("29")
