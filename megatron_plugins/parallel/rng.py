"""Per-module RNG seeding and checkpoint RNG keys for heterogeneous MiMo runs.

Stock ``pretrain()`` skips its own seeding when given a ``MultiModuleProcessGroupCollection``;
each rank then seeds its module here, through stock ``_set_random_seed`` with the module's own
groups, so stock's stream rules hold inside every module:

* ``seed + 100 * pp_rank`` (``+ 10 * dp_rank`` with ``--data-parallel-random-init``) for the
  Python, NumPy, torch and CUDA default generators: identical across DP and CP replicas, distinct
  across PP stages;
* tracker streams on top of that: tensor-parallel ``+ 2718 + tp_rank``, expert-parallel
  ``+ 1024 + 100 * ep_rank + etp_rank`` (stock's formula, kept as is: expert streams of
  ``(pp, ep) = (0, 1)`` and ``(1, 0)`` coincide).

Seed-offset scheme: module ``i`` seeds with ``seed + MODULE_SEED_STRIDE * i``, where the language
model is ``i = 0`` (its streams equal a stock run's with the same ``--seed``) and encoders are
``i = 1, 2, ...`` in layout order. The stride (10,000,000) is larger than the largest offset stock
adds inside a module (:func:`module_seed` checks it), so no stream of one module can coincide with
a stream of another.

A rank that hosts more than one module (colocated layouts) keeps each module's streams apart in a
:class:`ModuleRng` and draws inside ``enter(module)``; a rank with one module seeds it with
:func:`seed_module` alone.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from megatron.core.tensor_parallel import random as tensor_parallel_random
from megatron.training.initialize import _set_random_seed

from megatron_plugins.parallel.layout import LANGUAGE, ModulePlacement, ParallelLayout
from megatron_plugins.parallel.topology import HeteroTopology

__all__ = ["MODULE_SEED_STRIDE", "ModuleRng", "module_seed", "rng_state_key_prefix", "seed_module"]

MODULE_SEED_STRIDE = 10_000_000


class SeedArgs(Protocol):
    """The stock arguments ``initialize_megatron`` forwards to ``_set_random_seed``."""

    data_parallel_random_init: bool
    te_rng_tracker: bool
    inference_rng_tracker: bool
    cuda_graph_impl: str


def _largest_stock_offset(module: ModulePlacement) -> int:
    """Largest offset stock seeding adds to a module's seed, over all its ranks and streams."""
    default = 100 * (module.pp - 1) + 10 * (module.dp - 1)
    tracker = max(2718 + module.tp - 1, 1024 + 100 * (module.ep - 1) + module.etp - 1)
    return default + tracker


def module_seed(layout: ParallelLayout, module_name: str, seed: int) -> int:
    """The base seed of ``module_name``: the language model keeps ``seed``, encoders are offset."""
    order = [LANGUAGE] + [m.name for m in layout.encoders]
    module = layout.module(module_name)
    if _largest_stock_offset(module) >= MODULE_SEED_STRIDE:
        raise ValueError(
            f"module {module_name} is too large for distinct per-module RNG streams: stock adds "
            f"offsets up to {_largest_stock_offset(module)} >= {MODULE_SEED_STRIDE}"
        )
    return seed + MODULE_SEED_STRIDE * order.index(module_name)


def seed_module(topology: HeteroTopology, module_name: str, seed: int, args: SeedArgs) -> None:
    """Seed this rank's generators for ``module_name`` exactly as stock initialize_megatron does.

    Forwards ``data_parallel_random_init``, ``te_rng_tracker``, ``inference_rng_tracker`` and
    ``use_cudagraphable_rng = cuda_graph_impl != "none"`` like ``initialize.py``, with the
    module's pp/dp/tp/ep/expert-tp groups in place of the uninitialized global ones.
    """
    pgc = topology.module_pgs.get(module_name)
    if pgc is None:
        raise ValueError(
            f"this rank is in {', '.join(topology.active_modules)}, not in {module_name}; "
            "seed the module this rank runs"
        )
    _set_random_seed(
        module_seed(topology.layout, module_name, seed),
        args.data_parallel_random_init,
        args.te_rng_tracker,
        args.inference_rng_tracker,
        use_cudagraphable_rng=args.cuda_graph_impl != "none",
        pp_group=pgc.pp,
        dp_group=pgc.dp,
        tp_group=pgc.tp,
        ep_group=pgc.ep,
        etp_group=pgc.expt_tp,
    )


@dataclass
class _Streams:
    """One module's generator states as they live in the process (tracker values by identity)."""

    python: tuple
    numpy: tuple
    torch: torch.Tensor
    cuda: torch.Tensor | torch.Generator | None
    tracker: dict[str, torch.Tensor | torch.Generator]
    tracker_stream: str | None


def _has_cuda() -> bool:
    """Stock seeds the CUDA generator and tracker only where a device (or the simulation) is."""
    return torch.cuda.device_count() > 0


def _graph_safe() -> bool:
    return tensor_parallel_random.is_graph_safe_cuda_rng_tracker(
        tensor_parallel_random.get_cuda_rng_tracker())


def _read_streams(clone_cuda: bool) -> _Streams:
    """The process's generator states. ``clone_cuda``: copy a graph-safe CUDA state, which the
    next ``manual_seed`` would otherwise change in place (tensor states are always copies)."""
    cuda, tracker_states, tracker_stream = None, {}, None
    if _has_cuda():
        tracker = tensor_parallel_random.get_cuda_rng_tracker()
        cuda = tensor_parallel_random._get_cuda_rng_state(clone=clone_cuda,
                                                          graph_safe=_graph_safe())
        tracker_states = tracker.get_states()
        # Which tracker stream the CUDA generator holds: entering a module inside a fork must
        # give the module its default stream and leave the fork's bookkeeping to the outer one.
        tracker_stream = getattr(tracker, "_current_state_name", None)
    return _Streams(random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda,
                    tracker_states, tracker_stream)


def _write_streams(streams: _Streams) -> None:
    random.setstate(streams.python)
    np.random.set_state(streams.numpy)
    torch.set_rng_state(streams.torch)
    if streams.cuda is not None:
        tracker = tensor_parallel_random.get_cuda_rng_tracker()
        tensor_parallel_random._set_cuda_rng_state(streams.cuda, graph_safe=_graph_safe())
        tracker.set_states(dict(streams.tracker))
        if streams.tracker_stream is not None and hasattr(tracker, "_current_state_name"):
            tracker._current_state_name = streams.tracker_stream


def _checkpoint_form(state: torch.Tensor | torch.Generator) -> torch.Tensor:
    """A CUDA or tracker state as a tensor copy, as stock checkpoints it."""
    return tensor_parallel_random.convert_cuda_rng_state(state, to_graphable=False).clone()


def _process_form(state: torch.Tensor) -> torch.Tensor | torch.Generator:
    """A checkpointed state in the form the tracker uses (a generator when graph-safe), as stock
    restores it."""
    return tensor_parallel_random.convert_cuda_rng_state(state.clone(), to_graphable=_graph_safe())


class ModuleRng:
    """Per-module RNG contexts for a rank that hosts more than one module (colocated layouts).

    Stock keeps one set of process-global generators and seeding a second module resets the
    first's tracker (``model_parallel_cuda_manual_seed``); here every hosted module is seeded by
    :func:`seed_module` in turn and its Python, NumPy, torch, CUDA and tracker states are kept
    apart. :meth:`enter` swaps a module's states in, so its draws continue its own stream exactly
    as on a rank that runs that module alone. Outside any context the process generators hold the
    *resident* module (the language model where hosted): stock code that reads or restores them
    (checkpoint RNG state) sees that module, as on a disjoint-grid rank.
    """

    def __init__(self, modules: Sequence[str], stored: dict[str, _Streams], resident: str) -> None:
        self._modules = tuple(modules)
        self._stored = stored
        self._live = resident

    @classmethod
    def seed(cls, topology: HeteroTopology, seed: int, args: SeedArgs,
             modules: Sequence[str] | None = None) -> ModuleRng:
        """Seed each of ``modules`` (default: the rank's active modules) like :func:`seed_module`.

        The resident module is seeded last and stays live; the others are captured right after
        their seeding.
        """
        names = list(topology.active_modules if modules is None else modules)
        if not names or len(set(names)) != len(names):
            raise ValueError(f"ModuleRng needs distinct module names, got {names}")
        resident = LANGUAGE if LANGUAGE in names else names[-1]
        stored = {}
        for name in names:
            if name != resident:
                seed_module(topology, name, seed, args)
                stored[name] = _read_streams(clone_cuda=True)
        seed_module(topology, resident, seed, args)
        return cls(names, stored, resident)

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules this rank hosts, in seeding order."""
        return self._modules

    @property
    def live(self) -> str:
        """The module whose streams the process generators hold now."""
        return self._live

    def _check(self, name: str) -> None:
        if name not in self.modules:
            raise ValueError(f"no RNG streams for module {name}: this rank hosts "
                             f"{', '.join(self.modules)}")

    @contextlib.contextmanager
    def enter(self, name: str) -> Iterator[None]:
        """Draw from ``name``'s streams inside the block; the live module's resume on exit.

        Nests (an inner context stashes the outer module's current states and gives them back)
        and re-enters exactly; entering the live module changes nothing.
        """
        self._check(name)
        if name == self._live:
            yield
            return
        outer = self._live
        self._stored[outer] = _read_streams(clone_cuda=False)
        _write_streams(self._stored.pop(name))
        self._live = name
        try:
            yield
        finally:
            self._stored[name] = _read_streams(clone_cuda=False)
            _write_streams(self._stored.pop(outer))
            self._live = outer

    def _streams(self, name: str) -> _Streams:
        return _read_streams(clone_cuda=False) if name == self._live else self._stored[name]

    def state_dict(self, modules: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
        """Every hosted module's states (or those of ``modules``: a replay of a module's work
        restores its own), copied and picklable, under stock's checkpoint RNG keys."""
        names = self.modules if modules is None else modules
        for name in names:
            self._check(name)
        states = {}
        for name in names:
            streams = self._streams(name)
            states[name] = {
                "random_rng_state": streams.python,
                "np_rng_state": streams.numpy,
                "torch_rng_state": streams.torch.clone(),
                "cuda_rng_state": None if streams.cuda is None else _checkpoint_form(streams.cuda),
                "rng_tracker_states": {k: _checkpoint_form(v) for k, v in streams.tracker.items()},
            }
        return states

    def load_state_dict(self, states: dict[str, dict[str, Any]]) -> None:
        """Restore the modules in ``states`` (a :meth:`state_dict`, or the part of one stock does
        not restore itself); modules not in it keep their streams."""
        for name in states:
            self._check(name)
        for name, state in states.items():
            cuda = state["cuda_rng_state"]
            streams = _Streams(
                state["random_rng_state"], state["np_rng_state"],
                state["torch_rng_state"].clone(), None if cuda is None else _process_form(cuda),
                {k: _process_form(v) for k, v in state["rng_tracker_states"].items()},
                "default-rng" if cuda is not None and name != self._live else None,
            )
            if name == self._live:
                _write_streams(streams)
            else:
                self._stored[name] = streams


def rng_state_key_prefix(module_name: str) -> str:
    """Checkpoint RNG key prefix of a module (``model.rng_state_key_prefix``).

    Stock saves RNG state as ``f"{prefix}rng_state"`` sharded over the module's (pp, tp); modules
    on disjoint grids need distinct keys. Module names cannot contain ``.``, so prefixes never
    collide.
    """
    return f"{module_name}."
