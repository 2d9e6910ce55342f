"""Checkpoint bridges for MiMo processes (stock callers keep stock checkpoint behaviour): Gaps 5,
6, 10, 16, 22 and 26 (:func:`install_checkpoint_bridges`), 27 (:func:`bind_checkpoint_group`) and
35 (:func:`keep_save_results_in_process`)."""

from __future__ import annotations

import copy
import functools
import queue
from typing import Any

import torch

from megatron_plugins.compat import record

__all__ = ["MODULE_RNG_STATES", "bind_checkpoint_group", "carry_module_rng",
           "install_checkpoint_bridges", "keep_save_results_in_process", "plain_values",
           "put_plain_values", "restore_module_rng"]

MODULE_RNG_STATES = "module_rng_states"
"""Key of a colocated rank's RNG object that holds the streams of the encoders it hosts."""

COMMON_STATE_KEY = "_mimo_module_common_state"
"""Where the per-module ShardedObject sits inside a module's optimizer state dict."""

_checkpoint_bridges_installed: set[str] = set()


def _is_sharded(value: Any) -> bool:
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    return isinstance(value, (ShardedBase, LocalNonpersistentObject))


def _holds_sharded(value: Any) -> bool:
    if _is_sharded(value):
        return True
    if isinstance(value, dict):
        return any(_holds_sharded(item) for item in value.values())
    if isinstance(value, list):
        return any(_holds_sharded(item) for item in value)
    return False


def plain_values(tree: Any, path: tuple = ()) -> dict[tuple, Any]:
    """Copies of every largest subtree of ``tree`` holding no sharded object, by path."""
    found: dict[tuple, Any] = {}
    for key, value in (tree.items() if isinstance(tree, dict) else enumerate(tree)):
        if _is_sharded(value):
            continue
        if isinstance(value, (dict, list)) and _holds_sharded(value):
            found.update(plain_values(value, path + (key,)))
        else:
            found[path + (key,)] = copy.deepcopy(value)
    return found


def put_plain_values(tree: Any, values: dict[tuple, Any], module: str) -> None:
    """Write ``values`` (from :func:`plain_values`) back into ``tree`` at their paths."""
    for path, value in values.items():
        node = tree
        for key in path[:-1]:
            if isinstance(node, dict):
                node = node.setdefault(key, {})
            elif isinstance(node, list) and isinstance(key, int) and key < len(node):
                node = node[key]
            else:
                raise ValueError(
                    f"optimizer checkpoint of MiMo module {module!r}: the saved value at {path} "
                    "does not fit this run's optimizer (other optimizer settings or layout?)"
                )
        node[path[-1]] = value


def _install_mimo_module_common_state() -> None:
    """Gap 5 (MiMo optimizer checkpoints, any precision): keep every module's plain optimizer
    values in a sharded object of that module.

    ``dist_checkpointing.save`` writes the *common* (non-sharded) part of the state dict from
    global rank 0 only (core/dist_checkpointing/serialization.py:439-445) and every rank reads
    that copy back (serialization.py:151-152). On disjoint grids rank 0 runs the first encoder, so
    every optimizer value another module keeps as a plain object is dropped.
    ``MimoOptimizer.sharded_state_dict`` moves ``param_groups`` into a ``ShardedObject`` only when
    the module dict has an ``'optimizer'`` key (core/models/mimo/optimizer.py:233-235);
    ``FP32Optimizer`` (fp32 params) returns torch's flat ``{'state', 'param_groups'}`` and both
    ``FP32Optimizer`` and ``Float16OptimizerWithFloat16Params`` keep the Adam step as a plain
    ``state['common_step']`` (core/optimizer/optimizer.py:1176-1188, 1368-1377). The language
    model then resumes with ``param_groups == [{'params': [...]}]`` (fp32: "Could not find
    parameter group with key ...") or without a step (bf16: ``KeyError: 'step'``).
    Bridge: every plain value of each active module's optimizer dict is also saved in one
    ``ShardedObject`` per module (sharded over the module's (pp, tp), replicated over its
    dp x cp, like the stock RNG state) and written back at its path before the stock load.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.models.mimo.optimizer import MimoOptimizer

    stock_sharded_state_dict = MimoOptimizer.sharded_state_dict
    stock_load_state_dict = MimoOptimizer.load_state_dict

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        state = stock_sharded_state_dict(self, model_sharded_state_dict, is_loading, **kwargs)
        for name, info in self.module_infos.items():
            module_sd = state.get(name)
            if not (info.is_active and info.optimizer and isinstance(module_sd, dict)):
                continue
            pgc = info.pg_collection
            # Always added, even empty: a load template (fresh optimizer, no step yet) must ask
            # for the object whenever a save wrote it.
            module_sd[COMMON_STATE_KEY] = ShardedObject(
                f"optimizer.mimo.{name}.module_common_state",
                plain_values(module_sd),
                (pgc.pp.size(), pgc.tp.size()),
                (pgc.pp.rank(), pgc.tp.rank()),
                replica_id=pgc.dp_cp.rank(),
            )
        return state

    def load_state_dict(self, state_dict):
        for name, info in self.module_infos.items():
            module_sd = state_dict.get(name)
            if info.is_active and info.optimizer and isinstance(module_sd, dict):
                values = module_sd.pop(COMMON_STATE_KEY, None)
                if values is not None:
                    put_plain_values(module_sd, values, name)
        return stock_load_state_dict(self, state_dict)

    sharded_state_dict.__doc__ = stock_sharded_state_dict.__doc__
    load_state_dict.__doc__ = stock_load_state_dict.__doc__
    MimoOptimizer.sharded_state_dict = sharded_state_dict
    MimoOptimizer.load_state_dict = load_state_dict
    record("5")


def _install_distributed_optimizer_resume() -> None:
    """Gap 6 (``--use-distributed-optimizer`` resume): resume Adam at the saved step.

    With plain ``torch.optim.Adam/AdamW`` (no Transformer Engine / Apex:
    ``distrib_optimizer.HAVE_APEX_OR_TE`` False, always on the CPU simulation)
    ``DistributedOptimizer.state_dict()`` asserts on a fresh optimizer (distrib_optimizer.py:
    837-840), which the load template always is (:1532); its ``load_state_dict()`` gives every
    parameter one shared step tensor (:1024-1032) that the param-state load then overwrites with
    the template's step (:1949-1953, :1219-1225), so the resumed run restarts Adam at step 0 and
    counts once per parameter. Independently of TE, fp32 main params are views of the model
    params and the ``dp_reshardable`` param-state load ``copy_``s into them outside
    ``torch.no_grad`` ("a view of a leaf Variable that requires grad is being used in an in-place
    operation"). The ``fully_reshardable`` format (``--dist-ckpt-optim-fully-reshardable``) saves
    no per-parameter step (:1785) and its load drops any (:2390-2392), but
    ``_set_main_param_and_optimizer_states`` copies into every tensor of the parameter's torch
    Adam state, the step included (:1219-1225): ``KeyError: 'step'``.
    Bridge: load under ``torch.no_grad()``; without TE/Apex a fresh optimizer reports step 0, a
    parameter-state load that brings no step leaves the parameter's step as it is, and after
    loading each parameter gets its own step tensor holding the step saved in ``param_groups``.
    """
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    torch_adam = not distrib_optimizer.HAVE_APEX_OR_TE
    stock_state_dict = DistributedOptimizer.state_dict
    stock_load_state_dict = DistributedOptimizer.load_state_dict
    stock_set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def state_dict(self):
        inner = self.optimizer
        if not torch_adam or inner is None or any("step" in s for s in inner.state.values()):
            return stock_state_dict(self)
        # Fresh torch Adam (no step taken, nothing loaded): stock asserts on the empty step set.
        result = {"optimizer": {k: v for k, v in inner.state_dict().items() if k != "state"}}
        for group in result["optimizer"]["param_groups"]:
            del group["params"]
            group["step"] = 0.0
        if self.grad_scaler:
            result["grad_scaler"] = self.grad_scaler.state_dict()
        return result

    def load_state_dict(self, state_dict):
        with torch.no_grad():
            stock_load_state_dict(self, state_dict)
        if torch_adam and self.optimizer is not None and not self.ddp_config.use_megatron_fsdp:
            steps = {group.get("step") for group in state_dict["optimizer"]["param_groups"]}
            steps.discard(None)
            if len(steps) != 1:
                raise ValueError(f"DistributedOptimizer checkpoint holds steps {sorted(steps)}")
            step = float(steps.pop())
            for param_state in self.optimizer.state.values():
                param_state["step"] = torch.tensor(step, dtype=torch.float32)

    @functools.wraps(stock_set_states)
    def set_main_param_and_optimizer_states(self, model_param, tensors):
        if torch_adam and "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = {**tensors, "step": step}  # copied onto itself: the step is kept
        return stock_set_states(self, model_param, tensors)

    state_dict.__doc__ = stock_state_dict.__doc__
    load_state_dict.__doc__ = stock_load_state_dict.__doc__
    DistributedOptimizer.state_dict = state_dict
    DistributedOptimizer.load_state_dict = load_state_dict
    DistributedOptimizer._set_main_param_and_optimizer_states = set_main_param_and_optimizer_states
    record("6")


def _install_module_data_state() -> None:
    """Gap 10 (data loader state on disjoint grids): let a module's stream save its own state.

    Stock ``save_checkpoint`` hands the training iterator to ``maybe_save_dataloader_state``
    (training/checkpointing.py:1218-1293), which writes ``train_dataloader_dprank{dp}.pt`` from
    tensor rank 0 of the first pipeline stage of every DP replica, named by the DP rank alone. On
    disjoint grids every module has a DP rank 0, so encoder and language replicas write the same
    file and the last writer wins. Bridge: an iterator that knows its module
    (``MicrobatchStream.save_data_state``) writes ``dataloader/<module>_dp<rank>.pt`` inside the
    iteration folder, before the folder's ``metadata.json``; any other iterator gets stock's
    function.
    """
    from megatron.training import checkpointing

    stock = checkpointing.maybe_save_dataloader_state

    def maybe_save_dataloader_state(train_iterator, iteration, dataloader_save_path, **groups):
        save = getattr(getattr(train_iterator, "iterable", None), "save_data_state", None)
        if save is None or not dataloader_save_path:
            return stock(train_iterator, iteration, dataloader_save_path, **groups)
        save(checkpointing.get_checkpoint_name(dataloader_save_path, iteration,
                                               return_base_dir=True))

    maybe_save_dataloader_state.__doc__ = stock.__doc__
    checkpointing.maybe_save_dataloader_state = maybe_save_dataloader_state
    record("10")


def _install_rng_state_per_data_parallel_replica() -> None:
    """Gap 16 (RNG state of data-parallel replicas): save and restore each replica's own.

    Without ``--data-parallel-random-init`` stock ``get_rng_state`` saves one RNG state per
    (pp, tp) rank as a ``ShardedObject`` replicated over data parallelism (replica id = the dp
    rank, training/checkpointing.py:425-450), so a resumed run gives every DP replica the state of
    replica 0. That holds while replicas draw the same random numbers; with variable items per
    sample an encoder replica's dropout draws follow how many items it embedded, so replicas'
    states part and a resume with dropout is no longer bit-identical (stock's per-replica list
    comes only with ``--data-parallel-random-init``, which also changes the initialization).
    Bridge: in ``torch_dist`` checkpoints of a module with dp x cp > 1 the RNG object is sharded
    over (pp, tp, dp x cp) instead, so each replica writes and reads its own state; the save
    and the load template (the same function) agree by construction.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.training import checkpointing

    stock = checkpointing.get_rng_state

    def get_rng_state(ckpt_format, tp_group, pp_group, dp_cp_group=None, dp_group=None,
                      key_prefix=""):
        state = stock(ckpt_format, tp_group, pp_group, dp_cp_group=dp_cp_group,
                      dp_group=dp_group, key_prefix=key_prefix)
        if (not isinstance(state, ShardedObject) or dp_cp_group is None
                or dp_cp_group.size() == 1 or len(state.data) != 1):
            return state  # one replica, or stock's own per-replica list
        return ShardedObject(state.key, state.data, (*state.global_shape, dp_cp_group.size()),
                             (*state.global_offset, dp_cp_group.rank()), replica_id=0)

    get_rng_state.__doc__ = stock.__doc__
    checkpointing.get_rng_state = get_rng_state
    record("16")


def _install_mimo_replica_ids_over_context_parallel() -> None:
    """Gap 22 (MiMo optimizer checkpoints with context parallelism): one main copy per module
    shard, not one per CP rank.

    ``MimoOptimizer.sharded_state_dict`` saves ``param_groups`` (whenever the module dict has an
    ``'optimizer'`` key: bf16/fp16, or the distributed optimizer's fully reshardable formats),
    ``param_state_sharding_type`` (every ``--use-distributed-optimizer`` run) and ``grad_scaler``
    as ``ShardedObject``s with ``replica_id=_get_replica_id(pg_collection)`` =
    ``(tp, pp, dp)`` (core/models/mimo/optimizer.py:195-203, 233-273, 322-339). With language
    cp > 1 every CP rank of tensor, pipeline and data rank 0 is a main replica, and the save's
    validation rejects the duplicates (core/dist_checkpointing/validation.py:458-475: "Duplicate
    ShardedObject keys"). Model tensors ``(0, tp, dp_cp)``, the distributed optimizer's own
    objects and buffers (sharded over its dp x cp group) and Gaps 5/16 are already CP-aware.
    Bridge: the replica id's last coordinate is the rank in the module's dp x cp group, so only
    rank 0 of dp x cp (and of tp and pp) writes each object; with cp = 1 it equals stock's.
    """
    from megatron.core.models.mimo import optimizer as mimo_optimizer

    stock = mimo_optimizer._get_replica_id

    @functools.wraps(stock)
    def get_replica_id(pg_collection: Any) -> tuple:
        tp_rank, pp_rank, dp_rank = stock(pg_collection)
        dp_cp = getattr(pg_collection, "dp_cp", None)
        return (tp_rank, pp_rank, dp_rank if dp_cp is None else dp_cp.rank())

    mimo_optimizer._get_replica_id = get_replica_id
    record("22")


_module_rng: Any = None
_module_rng_replica = 0


def carry_module_rng(rng: Any, data_parallel_rank: int) -> None:
    """Save and restore, with the rank's RNG object, the streams of every module of ``rng`` (a
    :class:`~megatron_plugins.parallel.rng.ModuleRng`) but the live one, which stock handles (Gap 26);
    ``data_parallel_rank``: the live module's, which picks this rank's entry of a checkpoint
    with one entry per replica (``--data-parallel-random-init``)."""
    global _module_rng, _module_rng_replica
    _module_rng, _module_rng_replica = rng, data_parallel_rank


def restore_module_rng(state_dict: Any) -> None:
    """The hosted encoders' streams of a loaded ``state_dict`` back into their contexts, where
    stock restores RNG state too (Gap 26)."""
    from megatron.training import checkpointing

    entries = state_dict.get("rng_state") if isinstance(state_dict, dict) else None
    if _module_rng is None or not isinstance(entries, list):
        return
    options = checkpointing.get_args()
    if options.finetune or options.no_load_rng:
        return
    entry = entries[_module_rng_replica if options.data_parallel_random_init
                    and len(entries) > 1 else 0]
    if isinstance(entry, dict) and MODULE_RNG_STATES in entry:
        _module_rng.load_state_dict(entry[MODULE_RNG_STATES])


def _install_module_rng_states() -> None:
    """Gap 26 (one RNG state per rank): a rank hosting encoders keeps their streams too.

    Stock checkpoints one RNG state per rank, read from the process generators (``get_rng_state``,
    training/checkpointing.py:398-450) and written back into them on load (:2655-2685). A rank
    that hosts an encoder next to the language model runs the encoder inside its own streams
    (:class:`~megatron_plugins.parallel.rng.ModuleRng`), which stock neither sees nor restores, so a resume
    with encoder dropout would not be bit-identical. Bridge: the rank's RNG object (per data-
    parallel replica, Gap 16) carries the other modules' streams under :data:`MODULE_RNG_STATES`,
    and when the loaded object has them and stock restores RNG state (no ``--finetune`` or
    ``--no-load-rng``), they go back into their modules' streams.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.training import checkpointing

    stock_state, stock_load = checkpointing.get_rng_state, checkpointing._load_base_checkpoint

    def get_rng_state(ckpt_format, tp_group, pp_group, dp_cp_group=None, dp_group=None,
                      key_prefix=""):
        state = stock_state(ckpt_format, tp_group, pp_group, dp_cp_group=dp_cp_group,
                            dp_group=dp_group, key_prefix=key_prefix)
        if _module_rng is None or not isinstance(state, ShardedObject):
            return state
        mine = {name: streams for name, streams in _module_rng.state_dict().items()
                if name != _module_rng.live}
        states = [mine]
        if len(state.data) > 1:  # --data-parallel-random-init: one entry per replica
            states = [None] * len(state.data)
            torch.distributed.all_gather_object(states, mine, group=dp_group)
        for entry, modules in zip(state.data, states):
            entry[MODULE_RNG_STATES] = modules
        return state

    def _load_base_checkpoint(*args: Any, **kwargs: Any) -> Any:
        loaded = stock_load(*args, **kwargs)
        restore_module_rng(loaded[0])
        return loaded

    get_rng_state.__doc__ = stock_state.__doc__
    checkpointing.get_rng_state = get_rng_state
    checkpointing._load_base_checkpoint = _load_base_checkpoint
    record("26")


def install_checkpoint_bridges(context_parallel: bool = False, colocated: bool = False) -> None:
    """Apply Gaps 5, 6, 10 and 16, Gap 22 with ``context_parallel`` (a module of the layout has
    cp > 1) and Gap 26 with ``colocated`` (an encoder runs on the language ranks); without them
    those two would change nothing. Idempotent per gap; the MiMo builder calls it before stock
    ``pretrain()`` builds the optimizer (MiMo processes only: stock callers keep stock checkpoint
    behaviour)."""
    for gap, install, wanted in (
            ("5", _install_mimo_module_common_state, True),
            ("6", _install_distributed_optimizer_resume, True),
            ("10", _install_module_data_state, True),
            ("16", _install_rng_state_per_data_parallel_replica, True),
            ("22", _install_mimo_replica_ids_over_context_parallel, context_parallel),
            ("26", _install_module_rng_states, colocated)):
        if wanted and gap not in _checkpoint_bridges_installed:
            install()
            _checkpoint_bridges_installed.add(gap)


def bind_checkpoint_group(pg_collection: Any) -> None:
    """Give a module's process-group collection the group stock checkpoint save and load take as
    its data-parallel x context-parallel group (Gap 27).

    Gap 27 (GTP-remat group in checkpoints): stock ``save_checkpoint_and_time`` and
    ``setup_model_and_optimizer`` pass the model's ``pg_collection.dp_cp_gtp_remat`` (the DP x CP
    group widened by GTP weight-remat peers, training/training.py:2211, 3073) to the checkpoint
    functions, which without it fall back to ``parallel_state``'s group
    (training/checkpointing.py:510-511), uninitialized on disjoint grids. With GTP remat off
    (always here) that group is the module's ``dp_cp``.
    """
    pg_collection.dp_cp_gtp_remat = pg_collection.dp_cp
    record("27")


def keep_save_results_in_process(async_save: bool) -> None:
    """Gap 35 (a process per rank for a synchronous save): without ``--async-save``, the writer's
    results stay in this process.

    Stock's ``torch_dist`` writer hands its write results over a queue it makes once per process
    with ``multiprocessing.get_context('spawn').Manager()``
    (dist_checkpointing/strategies/filesystem_async.py:53-66), whether or not the save is
    asynchronous. So every rank's first save starts a second interpreter that lives as long as the
    run and re-imports the rank's main script: for a script that imports torch and Megatron at
    module level, 6 s and 750 MiB per rank (docs/architecture.md). A synchronous save writes and
    reads that queue in this process only (``execute_sync``), so a plain queue carries the same
    results. With ``--async-save`` the results cross processes and stock's queue stays.
    Idempotent; the MiMo launch calls it before stock ``pretrain()``.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if async_save or filesystem_async._results_queue is not None:
        return
    filesystem_async._results_queue = queue.Queue()
    record("35")
