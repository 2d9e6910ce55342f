"""Process groups for a :class:`~megatron_plugins.parallel.layout.ParallelLayout` on a live world.

One ``HyperCommGrid`` per module (dense dims ``tp, cp, dp, pp`` plus an ``"expert"`` view
``expt_tp, ep, expt_dp, pp`` sharing ``pp``), holding exactly the groups megatron-core 0.19.2
reads from a module. ``new_group`` is collective over the whole world, so every rank creates
every module's groups in layout order and keeps only those of its own module.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch.distributed as dist
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.parallel_state import (
    default_embedding_ranks,
    default_position_embedding_ranks,
)
from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator
from megatron.core.pipeline_parallel.multimodule_communicator import (
    MultiModulePipelineCommunicator,
)
from megatron.core.process_groups_config import (
    MultiModuleProcessGroupCollection,
    ProcessGroupCollection,
)

from megatron_plugins.compat import checkpointing, communication
from megatron_plugins.parallel.layout import DENSE_DIMS, EXPERT_DIMS, LANGUAGE, ModulePlacement, ParallelLayout

__all__ = ["HeteroTopology", "build_topology", "groups_of", "pipeline_communicator"]

EXPERT_VIEW = "expert"
"""Grid view name ``get_mimo_optimizer`` reads expert groups from."""

# (ProcessGroupCollection field, grid view, dims) of every module, each with the megatron-core
# 0.19.2 readers that need it (paths under megatron/). get_mimo_optimizer asks each module's grid
# for these keys (core/models/mimo/optimizer.py:353-361) and raises KeyError for a missing one.
MODULE_GROUPS: tuple[tuple[str, str | None, tuple[str, ...]], ...] = (
    # layers (core/transformer/attention.py:340), DDP (core/process_groups_config.py:677),
    # optimizer (core/optimizer/__init__.py:689), seeding (training/initialize.py:448)
    ("tp", None, ("tp",)),
    # attention (core/transformer/attention.py:343), schedules (core/pipeline_parallel/
    # schedules.py:1030), get_model (training/training.py:1798)
    ("cp", None, ("cp",)),
    # RankRole (core/models/mimo/config/role.py:123), multi-module communicator
    # (core/pipeline_parallel/multimodule_communicator.py:287), train_step (training.py:2500)
    ("pp", None, ("pp",)),
    # DDP/optimizer (core/process_groups_config.py:429), checkpointing (training/training.py:3071)
    ("dp", None, ("dp",)),
    # grad buffers (core/distributed/param_and_grad_buffer.py:1043), finalize_model_grads
    # (core/distributed/finalize_model_grads.py:606), train_step (training/training.py:2499)
    ("dp_cp", None, ("dp", "cp")),
    # train_step (training/training.py:2496), optimizer (core/process_groups_config.py:501)
    ("mp", None, ("tp", "pp")),
    # distributed optimizer grad stats (core/process_groups_config.py:485)
    ("intra_dist_opt", None, ("tp", "cp", "dp", "pp")),
    # DDP (core/process_groups_config.py:677), MoE (core/transformer/moe/moe_layer.py:178),
    # seeding (training/initialize.py:449)
    ("ep", EXPERT_VIEW, ("ep",)),
    # experts (core/transformer/moe/experts.py:209), optimizer (core/optimizer/__init__.py:690),
    # seeding (training/initialize.py:450)
    ("expt_tp", EXPERT_VIEW, ("expt_tp",)),
    # DDP/optimizer (core/process_groups_config.py:449), checkpointing (training/training.py:3074)
    ("expt_dp", EXPERT_VIEW, ("expt_dp",)),
    # optimizer for expert params (core/optimizer/__init__.py:882, process_groups_config.py:509)
    ("tp_ep_pp", EXPERT_VIEW, ("expt_tp", "ep", "pp")),
)

# Read only by MoE layers, which only the language model may have: the router
# (core/transformer/moe/router.py:56-57, also finalize_model_grads.py:599 for expert bias) and
# the token dispatcher (core/transformer/moe/token_dispatcher.py:84).
LANGUAGE_GROUPS: tuple[tuple[str, str | None, tuple[str, ...]], ...] = (
    ("tp_cp", None, ("tp", "cp")),
    ("tp_dp_cp", None, ("tp", "dp", "cp")),
    ("tp_ep", EXPERT_VIEW, ("expt_tp", "ep")),
)


def groups_of(module: ModulePlacement) -> tuple[tuple[str, str | None, tuple[str, ...]], ...]:
    """The (field, view, dims) groups built for ``module``."""
    return MODULE_GROUPS + (LANGUAGE_GROUPS if module.name == LANGUAGE else ())


class HeteroTopology:
    """Every module's grid plus this rank's process-group collections; owns all its groups."""

    def __init__(
        self,
        layout: ParallelLayout,
        grids: dict[str, HyperCommGrid],
        pg_collection: MultiModuleProcessGroupCollection,
        embedding_groups: list[dist.ProcessGroup],
    ) -> None:
        self.layout = layout
        self.grids = grids
        self.pg_collection = pg_collection
        self._embedding_groups = embedding_groups

    @property
    def active_modules(self) -> tuple[str, ...]:
        """Modules this rank belongs to (one on disjoint grids; the language model and the
        encoders it hosts on a colocated rank)."""
        return tuple(self.pg_collection.keys())

    @property
    def hosted(self) -> tuple[str, ...]:
        """Encoders this rank runs on the language model's ranks (colocated layouts)."""
        return tuple(m.name for m in self.layout.hosted if m.name in self.pg_collection.keys())

    @property
    def module_pgs(self) -> Mapping[str, ProcessGroupCollection]:
        """This rank's collection per active module."""
        return MappingProxyType(self.pg_collection.module_pgs)

    def destroy(self) -> None:
        """Destroy every group this topology or its pipeline communicator created; safe twice."""
        _destroy(self.grids, self._embedding_groups)
        BridgeCommunicator.destroy_broadcast_pgs()
        BridgeCommunicator.destroy_bridge_pgs()


def _destroy(grids: Mapping[str, HyperCommGrid], embedding_groups: list[dist.ProcessGroup]) -> None:
    while embedding_groups:
        dist.destroy_process_group(embedding_groups.pop())
    for grid in grids.values():
        grid.destroy()


def _grid(module: ModulePlacement, backend: str) -> HyperCommGrid:
    grid = HyperCommGrid(
        shape=[module.dim_size(d) for d in DENSE_DIMS], dim_names=list(DENSE_DIMS),
        rank_offset=module.rank_offset, backend=backend,
    )
    grid.register_view(
        EXPERT_VIEW, shape=[module.dim_size(d) for d in EXPERT_DIMS], dim_names=list(EXPERT_DIMS),
        shared_dims=["pp"],
    )
    return grid


def _add_embedding_groups(
    grid: HyperCommGrid, backend: str, pgc: ProcessGroupCollection | None,
    owned: list[dist.ProcessGroup],
) -> None:
    """Word/position-embedding groups of each PP chain, as stock parallel_state builds them.

    Read by the language model (core/models/common/language_module/language_module.py:63) and
    finalize_model_grads (core/distributed/finalize_model_grads.py:602-603). Collective: every
    rank creates every chain's groups; members store theirs in ``pgc`` and ``owned``.
    """
    rank = dist.get_rank()
    for chain in grid.get_rank_enum("pp"):
        for field, ranks in (("embd", default_embedding_ranks(chain)),
                             ("pos_embd", default_position_embedding_ranks(chain))):
            group = dist.new_group(ranks=ranks, backend=backend)
            if rank in ranks:
                setattr(pgc, field, group)
                owned.append(group)


def _collection(module: ModulePlacement, grid: HyperCommGrid) -> ProcessGroupCollection:
    pgc = ProcessGroupCollection()
    for name, view, dims in groups_of(module):
        setattr(pgc, name, grid.get_pg(list(dims), view=view))
    checkpointing.bind_checkpoint_group(pgc)  # the DP x CP group stock save / load read
    return pgc


def build_topology(layout: ParallelLayout, backend: str | None = None) -> HeteroTopology:
    """Create all groups of ``layout``; call on every rank, with the same layout, after init.

    ``backend`` defaults to the default group's backend.
    """
    layout.check_world_size(dist.get_world_size())
    backend = backend or dist.get_backend()
    rank = dist.get_rank()
    grids: dict[str, HyperCommGrid] = {}
    module_pgs: dict[str, ProcessGroupCollection] = {}
    embedding: list[dist.ProcessGroup] = []
    try:
        for module in layout.modules:
            grid = grids[module.name] = _grid(module, backend)
            for _, view, dims in groups_of(module):
                grid.create_pg(list(dims), view=view)
            pgc = _collection(module, grid) if rank in module.ranks else None
            if module.name == LANGUAGE:
                _add_embedding_groups(grid, backend, pgc, embedding)
            if pgc is not None:
                module_pgs[module.name] = pgc
    except BaseException:
        _destroy(grids, embedding)
        raise
    carrier = MultiModuleProcessGroupCollection(
        module_pgs=module_pgs,
        language_model_module_name=LANGUAGE if LANGUAGE in module_pgs else None,
    )
    return HeteroTopology(layout, grids, carrier, embedding)


def pipeline_communicator(topology: HeteroTopology, config: ModelParallelConfig,
                          static_shapes: bool) -> MultiModulePipelineCommunicator:
    """The schedule's cross-grid communicator: every encoder on ranks of its own feeds the
    language model (a hosted encoder's rows are routed by the colocated step, not the schedule:
    the wheel's communicator would count a rank at language stage 1 as a first stage because its
    encoder is one, multimodule_communicator.py:187-216).

    Encoders hand over ``[tokens, hidden]`` (batch folded into dim 0, split per sample by the
    bridge); language stages pass ``[seq, batch, hidden]``. Stage links exchange shapes once per
    direction (compat Gap 13); bridges too when every sample fills the same positions
    (``static_shapes``, Gap 9), else on each transfer (one small message per peer), a fan-in
    splitting gradients as it received (Gap 15). A one-rank grid does not broadcast what it
    received (Gap 12). With language CP every CP rank receives all encoder rows, and their
    gradients are summed before the send (Gap 18). Collective: call on every rank.
    """
    hosted = {module.name for module in topology.layout.hosted}
    encoders = [module.name for module in topology.layout.encoders if module.name not in hosted]
    with communication.fold_destination_cp():
        communicator = MultiModulePipelineCommunicator(
            {name: grid for name, grid in topology.grids.items() if name not in hosted},
            {**{name: [LANGUAGE] for name in encoders}, LANGUAGE: []},
            config,
            dim_mapping={"s": 0, "b": 1, "h": 2},
            module_output_ndim={name: 2 for name in encoders},
        )
    # Before the other wrappers: the CP ranks' gradients are summed once, ahead of the shape
    # exchange and the fan-in split of what the leader sends.
    communication.reduce_destination_cp_gradients(
        communicator, {name: pgc.cp for name, pgc in topology.module_pgs.items()})
    # Stage links carry [seq, batch, hidden], and with static_shapes bridges carry fixed token
    # counts: one shape handshake per link and direction, not one per transfer.
    communication.exchange_shapes_once(communicator, bridges=static_shapes)
    if not static_shapes:
        communication.split_fan_in_gradients_as_received(communicator)
    # A grid of one rank needs no broadcast of what its leader received.
    communication.skip_lone_broadcasts()
    return communicator
