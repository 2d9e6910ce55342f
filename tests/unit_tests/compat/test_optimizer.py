"""The MiMo optimizer's parameter groups (Gap 29): the canary that stock builds every module's
optimizer without parameter-group overrides, and the bridge's test, in this process (a one-rank
gloo world; the per-group optimizer, CUDA-only here, is stubbed to return its groups). The expert
TP group of its gradient norm (Gap 39): canary and bridge on stand-in grids."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from megatron_plugins.compat import optimizer as optimizer_bridge


def _module(name: str):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    module = MegatronModule(TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1))
    setattr(module, name, torch.nn.Linear(4, 4))
    module.ddp_config = DistributedDataParallelConfig()
    return module


def _mimo(language, vision):
    """A stand-in ``MimoModel``: both modules' grids hold this one rank."""
    world = torch.distributed.group.WORLD
    grid = SimpleNamespace(is_current_rank_in_grid=lambda: True,
                           get_pg=lambda *args, **kwargs: world)
    return SimpleNamespace(
        mimo_config=SimpleNamespace(module_to_grid_map={"language": grid, "vision": grid}),
        language_model=language, modality_submodules={"vision": vision})


@pytest.fixture
def built_groups(one_rank_world, monkeypatch) -> list:
    """The parameter groups each module's optimizer is built with (its inner optimizer stubbed);
    stock's ``get_megatron_optimizer`` and the bridge's registry restored afterwards."""
    import megatron.core.optimizer as optimizer_module

    built = []

    def stub(**kwargs):
        built.append(kwargs["param_groups"])
        return SimpleNamespace(param_groups=kwargs["param_groups"],
                               load_state_dict=lambda state: None)

    monkeypatch.setattr(optimizer_module, "_get_megatron_optimizer_based_on_param_groups", stub)
    monkeypatch.setattr(optimizer_module, "get_megatron_optimizer",
                        optimizer_module.get_megatron_optimizer)
    monkeypatch.setattr(optimizer_bridge, "_stock_get_megatron_optimizer", None)
    monkeypatch.setattr(optimizer_bridge, "_overrides", {})
    return built


def test_gap29_canary_mimo_optimizer_builds_each_module_without_config_overrides(monkeypatch):
    """Gap 29: ``get_mimo_optimizer`` calls ``get_megatron_optimizer`` once per module and passes
    no ``config_overrides``, so none can reach a module's parameter groups."""
    import megatron.core.optimizer as optimizer_module
    from megatron.core.models.mimo.optimizer import get_mimo_optimizer
    from megatron.core.optimizer import OptimizerConfig

    calls = []
    monkeypatch.setattr(optimizer_module, "get_megatron_optimizer",
                        lambda *args, **kwargs: calls.append(kwargs) or SimpleNamespace())
    stock = get_mimo_optimizer
    grid = SimpleNamespace(is_current_rank_in_grid=lambda: True, get_pg=lambda *a, **k: None)
    model = SimpleNamespace(mimo_config=SimpleNamespace(module_to_grid_map={"language": grid}),
                            language_model=_module("linear"), modality_submodules={})
    stock(model, OptimizerConfig(optimizer="adam", lr=0.1))
    assert len(calls) == 1
    assert calls[0].get("config_overrides") is None
    assert calls[0]["model_chunks"] == [model.language_model]


def test_gap29_bridge_gives_each_module_its_overrides_and_keeps_them_over_a_load(built_groups):
    """Each module's optimizer gets stock's standard groups (no weight decay on the bias) plus
    its own override; a checkpoint's groups loaded later give way to the run's values."""
    import megatron.core.models.mimo.optimizer as mimo_optimizer
    from megatron.core.optimizer import OptimizerConfig, ParamKey

    language, vision = _module("network"), _module("projection")
    optimizer_bridge.module_overrides({
        vision: {ParamKey(name="projection.*"): {"max_lr": 2e-5, "min_lr": 2e-6}}})
    config = OptimizerConfig(optimizer="adam", lr=0.1, min_lr=0.01)
    optimizer = mimo_optimizer.get_mimo_optimizer(_mimo(language, vision), config)
    language_groups, vision_groups = built_groups
    overridden = [g for g in vision_groups if g["max_lr"] == 2e-5]
    assert {id(p) for g in overridden for p in g["params"]} == {
        id(vision.projection.weight), id(vision.projection.bias)}
    assert {g["min_lr"] for g in overridden} == {2e-6}
    assert {g["wd_mult"] for g in overridden} == {0.0, 1.0}  # the bias keeps no weight decay
    assert all(g["max_lr"] == 0.1 for g in language_groups if g["params"])
    vision_optimizer = optimizer.module_infos["vision"].optimizer
    for group in vision_optimizer.param_groups:  # what a checkpoint of other settings would load
        group.update(max_lr=9.0, min_lr=0.9)
    vision_optimizer.load_state_dict({})
    assert {(g["max_lr"], g["min_lr"]) for g in vision_optimizer.param_groups} == {(2e-5, 2e-6)}


def test_the_bridge_leaves_modules_without_overrides_as_stock_builds_them(built_groups):
    import megatron.core.models.mimo.optimizer as mimo_optimizer
    from megatron.core.optimizer import OptimizerConfig

    config = OptimizerConfig(optimizer="adam", lr=0.1, min_lr=0.01)
    language, vision = _module("network"), _module("projection")
    mimo_optimizer.get_mimo_optimizer(_mimo(language, vision), config)
    stock = [[(g["max_lr"], g["wd_mult"], len(g["params"])) for g in groups]
             for groups in built_groups]
    built_groups.clear()
    optimizer_bridge.module_overrides({_module("other"): {}})
    mimo_optimizer.get_mimo_optimizer(_mimo(language, vision), config)
    assert [[(g["max_lr"], g["wd_mult"], len(g["params"])) for g in groups]
            for groups in built_groups] == stock


class _Group:
    """A stand-in process group: its rank and size (and its members, for the bridge)."""

    def __init__(self, rank: int, size: int, members: tuple[int, ...] = (0,)) -> None:
        self._rank, self._size, self.members = rank, size, members

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _grid(groups: dict) -> SimpleNamespace:
    """A stand-in module grid whose ``get_pg`` hands out ``groups`` by dimension (a fresh
    one-rank group for any other)."""
    def get_pg(dims, view=None):
        key = dims if isinstance(dims, str) else "-".join(dims)
        return groups.get(key) or _Group(0, 1)
    return SimpleNamespace(get_pg=get_pg)


def _expert_bias() -> torch.nn.Parameter:
    """What an expert's ``RowParallelLinear`` bias is to the gradient norm: not tensor-parallel,
    reduced over the expert data-parallel group (``allreduce = False``)."""
    bias = torch.nn.Parameter(torch.zeros(3))
    bias.allreduce = False
    return bias


def test_gap39_canary_mimo_optimizer_groups_have_no_expert_tensor_parallel_group():
    """Gap 39: the collection ``get_mimo_optimizer`` builds each optimizer on leaves ``expt_tp``
    unset (read as None), so the gradient norm filters an expert's bias over the TP group: on TP
    rank 1 (experts split over the TP ranks, etp=1) it counts as another rank's duplicate."""
    from megatron.core.models.mimo.optimizer import _get_pg_collection_for_optimizer
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    tp = _Group(1, 2)
    collection = _get_pg_collection_for_optimizer(_grid({"tp": tp, "expt_tp": _Group(0, 1)}))
    assert collection.tp is tp and collection.expt_tp is None
    assert not param_is_not_tensor_parallel_duplicate(_expert_bias(), tp_group=tp,
                                                      expert_tp_group=collection.expt_tp)


def test_gap39_bridge_gives_the_collection_the_grids_expert_tp_group(monkeypatch):
    import megatron.core.models.mimo.optimizer as mimo_optimizer
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    from megatron_plugins.compat import installed

    monkeypatch.setattr(mimo_optimizer, "_get_pg_collection_for_optimizer",
                        mimo_optimizer._get_pg_collection_for_optimizer)
    monkeypatch.setattr(optimizer_bridge, "_stock_pg_collection_for_optimizer", None)
    monkeypatch.setattr(torch.distributed, "get_process_group_ranks",
                        lambda group: list(group.members))
    optimizer_bridge.expert_tp_in_grad_norms()
    optimizer_bridge.expert_tp_in_grad_norms()  # once installed, installing again changes nothing
    tp, expert_tp = _Group(1, 2, (1, 2)), _Group(0, 1, (2,))
    collection = mimo_optimizer._get_pg_collection_for_optimizer(
        _grid({"tp": tp, "expt_tp": expert_tp}))
    assert collection.tp is tp and collection.expt_tp is expert_tp
    assert param_is_not_tensor_parallel_duplicate(_expert_bias(), tp_group=tp,
                                                  expert_tp_group=collection.expt_tp)
    assert "39" in installed()
