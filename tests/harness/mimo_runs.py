"""MiMo training runs through examples/mimo/pretrain_mimo.py's code path, for tests.

``train_mimo`` runs the entry point's own steps (parse, start, stock ``pretrain()``) in N forked
gloo processes and returns the logged ``lm loss`` per iteration plus, per rank, what the test
asked to observe (trained parameters of the rank's module, gradient reductions per step, the
activations it held for backward). Tests declare the launches they compare as
:class:`MimoLaunch` values; :func:`shared_run` trains each distinct one once per pytest run.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tests.harness.activation_memory import HeldActivations
from tests.harness.multiprocess import run_in_processes
from tests.harness.tensorboard_scalars import read_scalars
from tests.harness.worker_cache import once_per_run
from tests.models.tiny import TINY_TRANSFORMER

TINY_MIMO = [*TINY_TRANSFORMER, "--train-iters", "10", "--eval-interval", "5"]


def count_grad_reductions() -> dict[str, int]:
    """Count DDP bucket-group reductions (all-reduce or reduce-scatter) as they start."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    counts: dict[str, int] = {"calls": 0}
    stock = _ParamAndGradBucketGroup.start_grad_sync

    def counting(self, *args, **kwargs):
        counts["calls"] += 1
        return stock(self, *args, **kwargs)

    _ParamAndGradBucketGroup.start_grad_sync = counting
    return counts


def _misalign_encoder_batches() -> None:
    """Pair every encoder microbatch's items with its samples in reverse order, as a source with
    a per-rank order bug would: the guard must catch it."""
    from megatron_plugins.data import streams

    stock = streams.MicrobatchStream.__next__

    def reversed_next(self):
        if self._slice.module == "language":
            return stock(self)
        keys, batch = next(self._source)
        positions = batch.pop(streams.POSITIONS)
        counts = {name: per_sample[::-1]
                  for name, per_sample in batch[streams.ITEM_TOKENS].items()}
        if self._guard is not None:
            self._guard.record(keys[::-1], positions, counts)
        return batch

    streams.MicrobatchStream.__next__ = reversed_next


def count_routings() -> dict[str, int]:
    """Count the colocated step's row exchanges (each one ``batch_isend_irecv``) per direction."""
    from megatron_plugins.step import colocated as colocated_step

    counts = {"forward": 0, "backward": 0}
    for direction in counts:
        stock = getattr(colocated_step, f"route_{direction}")

        def counting(*args, direction=direction, stock=stock, **kwargs):
            counts[direction] += 1
            return stock(*args, **kwargs)

        setattr(colocated_step, f"route_{direction}", counting)
    return counts


def train_mimo_rank(argv: list[str], observe_params: bool, count_reductions: bool,
                    observe_keys: bool = False, misalign: bool = False,
                    observe_memory: bool = False) -> list[dict[str, Any]]:
    """One rank of a MiMo run; returns, per module the rank runs (two on a rank hosting an
    encoder), its coordinates and what was asked to observe (with ``count_reductions``, on a
    hosted encoder's entry also its row exchanges and the bytes of the last step; with
    ``observe_memory``, the rank's :meth:`HeldActivations.report` on each of its entries)."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    from megatron_plugins.step.colocated import colocated_encoders
    from megatron_plugins.launch.pretrain import parse_mimo_args, train
    from megatron_plugins.weights.local_view import global_names

    models: list[Any] = []
    meters: list[HeldActivations] = []
    results: dict[str, dict[str, Any]] = {}

    def observe(session: Any) -> None:
        for module in session.topology.active_modules:
            pgc = session.topology.module_pgs[module]
            results[module] = {"module": module, "tp_rank": pgc.tp.rank(),
                               "cp_rank": pgc.cp.rank(), "dp_rank": pgc.dp.rank(),
                               "pp_rank": pgc.pp.rank(),
                               "ep_rank": _group_rank(pgc, "ep"),
                               "etp_rank": _group_rank(pgc, "expt_tp")}
        session.config.model.post_wrap_hooks.append(lambda chunks: models.extend(chunks) or chunks)
        if observe_memory:
            session.config.model.post_wrap_hooks.append(
                lambda chunks: meters.append(HeldActivations.install(chunks[0])) or chunks)
        if misalign and any(module != "language" for module in results):
            _misalign_encoder_batches()
        if observe_keys:
            for module, result in results.items():
                _record_keys(session.guard[module], result)

    run = parse_mimo_args(argv)
    reductions = count_grad_reductions() if count_reductions else None
    routings = count_routings() if count_reductions else None
    train(run, observe)
    for meter in meters:
        meter.stop()
    for module, result in results.items():
        if meters:
            result["memory"] = meters[0].report()
        if observe_params:
            [mimo] = models
            part = (mimo.language_model if module == "language"
                    else mimo.modality_submodules[module])
            result["params"] = {name: p.detach().float().numpy().copy()
                                for name, p in part.named_parameters()}
            result["partition_dims"] = {
                name: p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
                for name, p in part.named_parameters()}
            result["global_names"] = global_names(part)  # layers and experts numbered globally
        if reductions is not None:
            result["reductions"] = reductions["calls"]
        hosted = colocated_encoders(models[0]) if models else None
        if routings is not None and hosted is not None and module in hosted.encoders:
            result.update(routings=dict(routings), traffic=hosted.traffic[module])
    return list(results.values())


def _group_rank(pgc: Any, name: str) -> int:
    """This rank's rank in ``pgc``'s group ``name`` (0 where the collection has none)."""
    group = getattr(pgc, name, None)
    return 0 if group is None else group.rank()


def _record_keys(guard: Any, result: dict[str, Any]) -> None:
    """Keep the keys, positions and item token counts ``guard`` records into ``result``."""
    keys = result.setdefault("keys", [])
    held = result.setdefault("positions", [])
    item_tokens = result.setdefault("item_tokens", [])
    record = guard.record

    def recording(batch_keys, positions, counts):
        keys.append(list(batch_keys))
        held.append(list(positions))
        item_tokens.append({name: [list(c) for c in per_sample]
                            for name, per_sample in counts.items()})
        record(batch_keys, positions, counts)

    guard.record = recording


def train_mimo(nproc: int, flags: tuple[str, ...], *, extra: tuple[str, ...] = (),
               observe_params: bool = False, count_reductions: bool = False,
               observe_keys: bool = False, misalign: bool = False, observe_memory: bool = False,
               timeout: float = 150.0
               ) -> tuple[dict[str, dict[int, float]], list[dict[str, Any]]]:
    """Train the tiny MiMo model on ``nproc`` ranks.

    Returns the logged ``lm loss`` and ``grad-norm`` per iteration and the results of every
    (rank, module) pair, rank by rank.
    """
    logdir = tempfile.mkdtemp(prefix="mimo-")
    argv = [*TINY_MIMO, *extra, *flags, "--tensorboard-dir", logdir]
    per_rank = run_in_processes(train_mimo_rank, nproc, timeout=timeout, simulated=True,
                                args=(argv, observe_params, count_reductions, observe_keys,
                                      misalign, observe_memory))
    results = [entry for entries in per_rank for entry in entries]
    return {tag: read_scalars(logdir, tag) for tag in ("lm loss", "grad-norm")}, results


@dataclass(frozen=True)
class MimoLaunch:
    """A tiny MiMo training launch as data: its ranks, its flags after :data:`TINY_MIMO` and
    whether it measures held activations. A pytest session trains each distinct launch once
    (:func:`shared_run`), whichever tests, in whichever files, ask for it."""

    nproc: int
    flags: tuple[str, ...]
    observe_memory: bool = False
    timeout: float = field(default=150.0, compare=False)


@once_per_run
def shared_run(launch: MimoLaunch) -> tuple[dict[str, dict[int, float]], list[dict[str, Any]]]:
    """:func:`train_mimo` of ``launch``, once per pytest run (across its xdist workers too), observing everything the tests
    read (trained parameters, consumed keys, gradient reductions and row exchanges)."""
    return train_mimo(launch.nproc, launch.flags, observe_params=True, observe_keys=True,
                      count_reductions=True, observe_memory=launch.observe_memory,
                      timeout=launch.timeout)


def consumed_keys(results: list[dict[str, Any]], module: str) -> list[str]:
    """The sample keys ``module`` trained on, in the global stream's order: each global
    microbatch's DP replicas in DP order (one rank per replica speaks: tensor and context-parallel
    rank 0, first to report), so layouts of any micro-batch split compare equal."""
    replicas: dict[int, list[list[str]]] = {}
    for result in results:
        if result["module"] == module and result["tp_rank"] == 0 and result["cp_rank"] == 0:
            replicas.setdefault(result["dp_rank"], result["keys"])
    return [key for microbatch in zip(*(replicas[r] for r in sorted(replicas)))
            for keys in microbatch for key in keys]


def module_params(results: list[dict[str, Any]], module: str) -> dict[str, np.ndarray]:
    """The trained, unsharded parameters of ``module``: its first DP replica's TP shards joined
    (of context-parallel rank 0: CP ranks hold whole copies)."""
    shards = sorted((r for r in results
                     if r["module"] == module and r["dp_rank"] == 0 and r["cp_rank"] == 0),
                    key=lambda r: r["tp_rank"])
    return {name: value if shards[0]["partition_dims"][name] is None else
            np.concatenate([s["params"][name] for s in shards],
                           axis=shards[0]["partition_dims"][name])
            for name, value in shards[0]["params"].items()}


LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def _joined(shards: list[dict[str, Any]], name: str) -> np.ndarray:
    """``name`` from ``shards`` (ordered by their tensor-parallel rank), joined on its partition
    dimension (one shard: as it is)."""
    dim = shards[0]["partition_dims"][name]
    if dim is None or len(shards) == 1:
        return shards[0]["params"][name]
    return np.concatenate([s["params"][name] for s in shards], axis=dim)


def expert_parallel_params(results: list[dict[str, Any]], module: str = "language"
                           ) -> dict[str, np.ndarray]:
    """The trained, unsharded parameters of a MoE ``module`` at any TP x EP x expert-TP layout:
    :func:`module_params` for the dense ones; each expert's from its expert-parallel rank (of
    context-parallel rank 0), its expert-TP shards joined, under its global index (``ep_rank x
    local experts + local index``), so layouts of any expert split compare by name."""
    mine = [r for r in results if r["module"] == module and r["cp_rank"] == 0]
    dense = [r for r in mine if r["dp_rank"] == 0]
    dense.sort(key=lambda r: r["tp_rank"])
    names = list(dense[0]["params"])
    joined = {name: _joined(dense, name) for name in names if not LOCAL_EXPERT.search(name)}
    by_ep: dict[int, dict[int, dict[str, Any]]] = {}
    for result in mine:
        by_ep.setdefault(result["ep_rank"], {}).setdefault(result["etp_rank"], result)
    for ep_rank, shards_by_rank in sorted(by_ep.items()):
        shards = [shards_by_rank[r] for r in sorted(shards_by_rank)]
        experts = [name for name in shards[0]["params"] if LOCAL_EXPERT.search(name)]
        if not experts:
            continue
        local = 1 + max(int(LOCAL_EXPERT.search(name).group(1)) for name in experts)
        for name in experts:
            index = ep_rank * local + int(LOCAL_EXPERT.search(name).group(1))
            joined[LOCAL_EXPERT.sub(f".local_experts.{index}.", name)] = _joined(shards, name)
    return joined
