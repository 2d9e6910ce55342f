"""Colocation bridges (Gaps 23-25): canaries that the stock wheel still has each gap, and the
bridges' tests, all in this process (a one-rank gloo world where a process group is needed)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from megatron_plugins.compat import colocation

DENSE = ["tp", "cp", "dp", "pp"]


def _grid(offset: int, shape: tuple[int, ...] = (1, 1, 1, 1), pp_group: bool = False):
    """A grid of ``shape`` (tp, cp, dp, pp) from rank ``offset``, with its pp group where asked
    (``RankRole`` reads it on ranks of the grid)."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    grid = HyperCommGrid(list(shape), DENSE, rank_offset=offset)
    if pp_group:
        grid.create_pg("pp")
    return grid


def _mixed_map() -> dict:
    """Rank 0 holds the language model and the vision encoder (same grid ranks); audio is on
    rank 1, apart."""
    return {"language": _grid(0, pp_group=True), "vision": _grid(0, pp_group=True),
            "audio": _grid(1)}


def _same_ranks_map() -> dict:
    """Every grid is rank 0 (``--grid vision:dp=1@language`` on one rank)."""
    return {"language": _grid(0, pp_group=True), "vision": _grid(0, pp_group=True)}


def test_gap23_canary_stock_role_is_colocated_or_encoder_only_for_an_encoder_on_the_language_ranks(
        one_rank_world, monkeypatch):
    """Gap 23: grids over the same ranks make every module a first-and-last-stage COLOCATED one
    (even a pp=2 language model), and a rank holding an encoder and the language model of a
    mixed map is NON_COLOCATED with both, which ``MimoModel.forward`` sends to the encoders."""
    from megatron.core.models.mimo.config.role import ModuleLayout, RankRole
    from megatron.core.models.mimo.model.base import MimoModel

    monkeypatch.setenv("WORLD_SIZE", "2")
    same = RankRole.build(["vision"], {"language": _grid(0, (1, 1, 1, 2)),
                                       "vision": _grid(0, (1, 1, 2, 1))})
    assert same.mode is ModuleLayout.COLOCATED
    assert {name: (stage.is_first_stage, stage.is_last_stage)
            for name, stage in same.modules.items()} == {"vision": (True, True),
                                                         "language": (True, True)}
    mixed = RankRole.build(["vision", "audio"], _mixed_map())
    assert mixed.mode is ModuleLayout.NON_COLOCATED
    assert sorted(mixed.modules) == ["language", "vision"]
    assert mixed.has_modality_modules and mixed.has_language_module
    forward = inspect.getsource(MimoModel.forward)
    assert forward.index("if self.role.has_modality_modules:") < forward.index(
        "if self.role.has_language_module:")
    assert "return self._forward_encoders(" in forward


class _Recorder:
    """Which build context each module was made in."""

    def __init__(self) -> None:
        self.entered: list[str] = []
        self.built: dict[str, str] = {}
        self._active: list[str] = []

    @contextlib.contextmanager
    def context(self, name: str) -> Iterator[None]:
        self.entered.append(name)
        self._active.append(name)
        try:
            yield
        finally:
            self._active.pop()

    def record(self, module: str) -> None:
        self.built[module] = self._active[-1] if self._active else "none"


def _language_class(recorder: _Recorder) -> type:
    from megatron.core.transformer.module import MegatronModule

    class Language(MegatronModule):
        def __init__(self, config) -> None:
            super().__init__(config)
            recorder.record("language")
            self.linear = torch.nn.Linear(4, 4)

    return Language


def _encoder_class(recorder: _Recorder) -> type:
    class Encoder(torch.nn.Linear):
        def __init__(self, name: str) -> None:
            super().__init__(4, 4)
            recorder.record(name)

    return Encoder


def _mimo_config(grid_map: dict, recorder: _Recorder):
    from megatron.core.models.mimo import MimoModelConfig
    from megatron.core.models.mimo.submodules.vision import VisionModalitySubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
    encoder = _encoder_class(recorder)
    return MimoModelConfig(
        language_model_spec=ModuleSpec(module=_language_class(recorder), params={"config": config}),
        modality_submodules_spec={
            name: ModuleSpec(module=VisionModalitySubmodules, submodules={
                "encoders": {"encoder": ModuleSpec(module=encoder, params={"name": name})}})
            for name in grid_map if name != "language"},
        special_token_ids={name: -index for index, name in enumerate(grid_map) if index},
        module_to_grid_map=grid_map,
    )


@pytest.mark.parametrize("grid_map", [_same_ranks_map, _mixed_map], ids=["same-ranks", "mixed"])
def test_gap23_bridge_presents_the_language_role_and_builds_the_hosted_encoder_in_its_context(
        one_rank_world, monkeypatch, grid_map):
    from megatron.core.models.mimo.config.role import ModuleLayout, RankRole

    monkeypatch.setenv("WORLD_SIZE", "2")
    recorder = _Recorder()
    stock_build = RankRole.__dict__["build"]
    model = colocation.build_presenting_language(_mimo_config(grid_map(), recorder), ["vision"],
                                                 recorder.context)
    assert model.role.mode is ModuleLayout.NON_COLOCATED
    assert list(model.role.modules) == ["language"]
    stage = model.role.modules["language"]
    assert stage.is_first_stage and stage.is_last_stage
    assert model.colocated_comms == {}
    assert list(model.modality_submodules) == ["vision"]
    assert recorder.entered == ["language", "vision"]
    assert recorder.built == {"language": "language", "vision": "vision"}
    assert RankRole.__dict__["build"] is stock_build


def test_gap23_bridge_refuses_an_encoder_this_rank_does_not_hold(one_rank_world, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    recorder = _Recorder()
    with pytest.raises(ValueError, match=r"\['audio'\] are hosted here, but this rank's grids "
                                         r"hold \['language', 'vision'\]"):
        colocation.build_presenting_language(_mimo_config(_mixed_map(), recorder), ["audio"],
                                             recorder.context)
    assert recorder.entered == []


def test_gap24_canary_stock_train_takes_the_plain_pipelining_schedule_for_a_multi_module_collection():
    """Gap 24: a multi-module collection selects the plain pipelining schedule, which
    ``train()`` and ``evaluate()`` look up through the name ``training`` imported."""
    import megatron.training.training as training
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_without_interleaving,
    )
    from megatron.core.process_groups_config import (
        MultiModuleProcessGroupCollection,
        ProcessGroupCollection,
    )

    collection = MultiModuleProcessGroupCollection(
        module_pgs={"vision": ProcessGroupCollection(), "language": ProcessGroupCollection()},
        language_model_module_name="language")
    assert get_forward_backward_func(schedule_pg_collection=collection) is \
        forward_backward_pipelining_without_interleaving
    assert (colocation._stock_schedule_getter or training.get_forward_backward_func) is \
        get_forward_backward_func
    for run in (training.train, training.evaluate):
        assert "= get_forward_backward_func(" in inspect.getsource(run), run.__name__


def test_gap24_bridge_has_train_run_the_wrapped_stock_schedule(monkeypatch):
    import megatron.training.training as training
    from megatron.core.pipeline_parallel import get_forward_backward_func

    monkeypatch.setattr(training, "get_forward_backward_func", training.get_forward_backward_func)
    monkeypatch.setattr(colocation, "_stock_schedule_getter", None)
    wrapped = []

    def wrap(schedule):
        wrapped.append(schedule)
        return ("wrapped", schedule)

    colocation.wrap_schedules(wrap)
    colocation.wrap_schedules(wrap)  # a second run in the process wraps the stock getter again
    stock = get_forward_backward_func(pp_size=1, vp_size=None)
    assert training.get_forward_backward_func(pp_size=1, vp_size=None) == ("wrapped", stock)
    assert wrapped == [stock]
    assert colocation._stock_schedule_getter is get_forward_backward_func


def _tiny_module():
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    module = MegatronModule(TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1))
    module.linear = torch.nn.Linear(4, 4)
    module.ddp_config = DistributedDataParallelConfig()
    return module


@pytest.fixture
def world_gathers(one_rank_world, monkeypatch) -> list:
    """The ``all_gather_object`` calls of the test: (output length, group, object sent)."""
    calls = []
    stock = torch.distributed.all_gather_object

    def recorded(output, obj, group=None):
        calls.append((len(output), group, obj))
        return stock(output, obj, group)

    monkeypatch.setattr(torch.distributed, "all_gather_object", recorded)
    return calls


def test_gap25_canary_stock_optimizer_build_gathers_group_keys_over_the_world_twice(
        world_gathers, monkeypatch):
    """Gap 25: each ``get_megatron_optimizer`` (one per module in ``get_mimo_optimizer``)
    gathers its parameter-group keys over the world twice, dense and expert groups, whatever
    it holds (the per-group optimizer, CUDA-only here, is stubbed: it communicates nothing)."""
    import megatron.core.optimizer as optimizer_module
    from megatron.core.models.mimo.optimizer import get_mimo_optimizer
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.process_groups_config import ProcessGroupCollection

    config = OptimizerConfig(optimizer="adam", lr=0.1)
    monkeypatch.setattr(optimizer_module, "_get_megatron_optimizer_based_on_param_groups",
                        lambda **kwargs: SimpleNamespace(config=kwargs["config"]))
    world = torch.distributed.group.WORLD
    groups = ProcessGroupCollection(dp=world, dp_cp=world, tp=world, pp=world, mp=world,
                                    tp_ep_pp=world, expt_dp=world, intra_dist_opt=world)
    optimizer_module.get_megatron_optimizer(config, [_tiny_module()], pg_collection=groups,
                                            use_gloo_process_groups=False)
    assert [(size, group) for size, group, _ in world_gathers] == [(1, None), (1, None)]
    stock = colocation._stock_mimo_optimizer or get_mimo_optimizer
    source = inspect.getsource(stock)
    assert "for module_name, grid in grid_map.items():" in source
    assert "optimizer = get_megatron_optimizer(" in source


@pytest.mark.parametrize("held", [1, 2], ids=["encoder-only", "encoder-and-language"])
def test_gap25_bridge_gives_every_rank_the_gathers_of_the_fullest_rank(
        world_gathers, monkeypatch, held):
    """A stock stand-in builds one optimizer (two key gathers) per module the rank holds: with
    the bridge a rank holding one module of two joins two more gathers, sending no keys."""
    import megatron.core.models.mimo.optimizer as mimo_optimizer
    import megatron.core.optimizer as optimizer_module
    from megatron.core.optimizer import OptimizerConfig

    config = OptimizerConfig(optimizer="adam", lr=0.1)
    module = _tiny_module()
    grids = {name: SimpleNamespace(is_current_rank_in_grid=lambda index=index: index < held)
             for index, name in enumerate(["vision", "language"])}
    model = SimpleNamespace(mimo_config=SimpleNamespace(module_to_grid_map=grids))

    def stock(mimo_model, optimizer_config):
        for grid in mimo_model.mimo_config.module_to_grid_map.values():
            if grid.is_current_rank_in_grid():
                for _ in range(2):
                    optimizer_module._get_param_groups([module], optimizer_config, {})
        return "optimizer"

    monkeypatch.setattr(mimo_optimizer, "get_mimo_optimizer", mimo_optimizer.get_mimo_optimizer)
    monkeypatch.setattr(colocation, "_stock_mimo_optimizer", stock)
    gather = optimizer_module._get_param_groups
    colocation.even_optimizer_gathers(2)
    assert mimo_optimizer.get_mimo_optimizer(model, config) == "optimizer"
    assert optimizer_module._get_param_groups is gather
    assert len(world_gathers) == 4 and {group for _, group, _ in world_gathers} == {None}
    assert [obj for _, _, obj in world_gathers[2 * held:]] == [[]] * (4 - 2 * held)
    assert all(obj for _, _, obj in world_gathers[:2 * held])
