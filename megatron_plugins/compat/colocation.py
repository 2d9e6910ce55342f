"""Bridges for encoders that share the language model's ranks (colocated layouts; Gaps 23-25).

Gap 23 (MiMo's role for grids over the same ranks): ``RankRole.build`` (core/models/mimo/config/
role.py:70-89) calls a rank whose grids all coincide COLOCATED, and ``MimoModel`` then runs every
encoder inside each language microbatch through ``ColocatedBridgeCommunicator`` (model/base.py:
66-70, 451-460): language PP 1 only, one token count for every sample, and rows paired by each
rank's own DP index, which hands a rank another replica's samples whenever its encoder replica
does not feed its language replica. A rank holding an encoder and the language model in a mixed
map is NON_COLOCATED and is sent to the encoders only (base.py:462-464). Bridge
(:func:`build_presenting_language`): the rank's ``MimoModel`` is built with the role of a
language rank (its stage flags from the grid map, not COLOCATED), so its forward is the language
path and no bridge communicator is created; the hosted encoders are built next to it, each inside
the caller's context (its RNG streams), and run by our colocated step
(:mod:`megatron_plugins.step.colocated`), whose own routing moves their rows.

Gap 25 (world gathers per module optimizer): ``get_mimo_optimizer`` builds one optimizer per
module the rank is in (core/models/mimo/optimizer.py:376-404), and each build all-gathers its
parameter-group keys over the whole world twice, dense and expert groups (core/optimizer/
__init__.py:361-364, 1144, 1181). A rank hosting an encoder and the language model gathers four
times, a rank of a separate encoder twice: the world hangs. Bridge (:func:`even_optimizer_gathers`): after the stock build, a rank with fewer modules
joins the gathers it missed with no keys (which adds no group anywhere: every module already
gathered the others' keys, as on disjoint grids).

Gap 24 (one schedule per step from the pg collection): stock ``train()`` and ``evaluate()`` take
the forward-backward function from ``get_forward_backward_func`` (training/training.py:3614,
4198), which for a multi-module collection is the plain pipelining schedule (core/pipeline_
parallel/schedules.py:149-150); nothing runs on every rank before it, and a colocated encoder
must run its forward over the step's microbatches before the language schedule starts. Bridge
(:func:`wrap_schedules`): the name stock ``training`` imported returns ``wrap(stock function)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ContextManager

import torch

from megatron_plugins.compat import record

__all__ = ["build_presenting_language", "even_optimizer_gathers", "wrap_schedules"]


@contextlib.contextmanager
def _built_role(role: Any) -> Iterator[None]:
    """``RankRole.build`` answers ``role`` inside the block (MimoModel asks it once, in
    ``__init__``)."""
    from megatron.core.models.mimo.config.role import RankRole

    stock = RankRole.__dict__["build"]
    RankRole.build = classmethod(lambda cls, names, grid_map=None: role)
    try:
        yield
    finally:
        RankRole.build = stock


def build_presenting_language(mimo_config: Any, hosted: Sequence[str],
                              context: Callable[[str], ContextManager[None]],
                              **model_kwargs: Any) -> torch.nn.Module:
    """This rank's ``MimoModel`` with the role of its own grids less ``hosted`` (Gap 23), built
    under ``context(LANGUAGE)``, plus each hosted encoder built under ``context(name)`` as the
    wheel builds a submodule (``from_spec``, first and last stage)."""
    from megatron.core.models.mimo import MimoModel
    from megatron.core.models.mimo.config.role import (
        MIMO_LANGUAGE_MODULE_KEY,
        ModuleLayout,
        RankRole,
    )

    full = RankRole._from_grid_map(mimo_config.module_to_grid_map)
    missing = [name for name in hosted if name not in full.modules]
    if missing or MIMO_LANGUAGE_MODULE_KEY not in full.modules:
        raise ValueError(f"modules {list(hosted)} are hosted here, but this rank's grids hold "
                         f"{list(full.modules)}")
    presented = RankRole(modules={name: stage for name, stage in full.modules.items()
                                  if name not in hosted}, mode=ModuleLayout.NON_COLOCATED)
    with _built_role(presented), context(MIMO_LANGUAGE_MODULE_KEY):
        model = MimoModel(mimo_config, **model_kwargs)
    for name in hosted:
        spec = mimo_config.modality_submodules_spec[name]
        with context(name):
            model.modality_submodules[name] = spec.module.from_spec(
                spec, is_first_stage=True, is_last_stage=True)
    record("23")
    return model


_stock_schedule_getter: Callable[..., Any] | None = None


def wrap_schedules(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Have stock ``train()`` / ``evaluate()`` run ``wrap(schedule)`` for the schedule the wheel
    picks (Gap 24); the latest ``wrap`` wins, so a process may start several runs."""
    import megatron.training.training as training

    global _stock_schedule_getter
    if _stock_schedule_getter is None:
        _stock_schedule_getter = training.get_forward_backward_func
    stock = _stock_schedule_getter

    def get_forward_backward_func(*args: Any, **kwargs: Any) -> Callable[..., Any]:
        return wrap(stock(*args, **kwargs))

    training.get_forward_backward_func = get_forward_backward_func
    record("24")


_stock_mimo_optimizer: Callable[..., Any] | None = None


def even_optimizer_gathers(modules: int) -> None:
    """Have every rank's MiMo optimizer build take part in as many world gathers of
    parameter-group keys as a rank holding ``modules`` modules, the most any rank holds (Gap 25).
    """
    import megatron.core.models.mimo.optimizer as mimo_optimizer
    import megatron.core.optimizer as optimizer_module

    global _stock_mimo_optimizer
    if _stock_mimo_optimizer is None:
        _stock_mimo_optimizer = mimo_optimizer.get_mimo_optimizer
    stock = _stock_mimo_optimizer

    def get_mimo_optimizer(mimo_model: Any, config: Any) -> Any:
        gather = optimizer_module._get_param_groups
        gathers = 0

        def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal gathers
            gathers += 1
            return gather(*args, **kwargs)

        optimizer_module._get_param_groups = counted
        try:
            optimizer = stock(mimo_model, config)
        finally:
            optimizer_module._get_param_groups = gather
        built = sum(grid.is_current_rank_in_grid()
                    for grid in mimo_model.mimo_config.module_to_grid_map.values())
        for _ in range(gathers // built * (modules - built)):
            torch.distributed.all_gather_object([None] * torch.distributed.get_world_size(), [])
        return optimizer

    mimo_optimizer.get_mimo_optimizer = get_mimo_optimizer
    record("25")
