"""Opt-in measurement of one training process: collectives, step times and a time breakdown.

Nothing here runs unless a benchmark or test calls :func:`activate` in its own worker process
(``benchmarks/step_worker.py`` does, when ``STEP_PROBE_OUT`` is set). It wraps
``torch.distributed``'s communication functions and stock ``train_step`` in this process only,
so the package and stock Megatron stay untouched. For each training step it records:

- every outermost ``torch.distributed`` call inside the step (kind, group, bytes): calls made by
  another wrapped call (``batch_isend_irecv``'s isend/irecv, ``all_gather_object``'s all_gather)
  are part of it, not extra calls;
- the step's wall time, the time spent in each of :data:`REGIONS` and in gradient finalization
  (the config's ``finalize_model_grads_func``: stock's, or the MiMo cross-grid one), and
  Megatron's timers (run with ``--timing-log-level 1 --no-barrier-with-level-1-timing`` for the
  optimizer's).

Its :meth:`Probe.save` writes ``<STEP_PROBE_OUT>.rank<R>.json``.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

WRAPPED = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
    "barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_to_all_single",
    "all_gather_object", "broadcast_object_list", "gather", "reduce", "scatter",
    "_all_gather_base", "_reduce_scatter_base",
)
"""torch.distributed functions counted as one collective call each."""

_COMMS = ("recv_forward", "send_forward", "recv_backward", "send_backward",
          "send_forward_recv_backward", "send_backward_recv_forward")
REGIONS = {
    "megatron.core.pipeline_parallel.schedules:forward_step": "forward",
    "megatron.core.pipeline_parallel.schedules:backward_step": "backward",
    "megatron.core.pipeline_parallel.schedules:backward_step_multimodule": "backward",
    **{f"megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator.{m}": "transfers"
       for m in _COMMS},
    **{"megatron.core.pipeline_parallel.multimodule_communicator:"
       f"MultiModulePipelineCommunicator.{m}": "transfers" for m in _COMMS},
}
"""Functions (``module:attribute.path``) timed as parts of a step; transfers include the
time spent waiting for the other grid."""


class Probe:
    """Per-process record of steps; see the module docstring."""

    def __init__(self, out_prefix: str) -> None:
        self.out_prefix = out_prefix
        self.steps: list[dict[str, Any]] = []
        self._calls: list[dict[str, Any]] | None = None
        self._depth = 0
        self._regions: dict[str, float] = {}
        self._open: set[str] = set()

    def _group(self, args: tuple, kwargs: dict, kind: str) -> Any:
        if "group" in kwargs:
            return kwargs["group"]
        if kind == "batch_isend_irecv":
            return args[0][0].group if args and args[0] else None
        return None

    def _record(self, kind: str, args: tuple, kwargs: dict) -> None:
        group = self._group(args, kwargs, kind)
        world = group is None or group is dist.GroupMember.WORLD
        ranks = list(range(dist.get_world_size())) if world else dist.get_process_group_ranks(group)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if kind == "batch_isend_irecv":
            tensors = [op.tensor for op in args[0]]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self._calls.append({"kind": kind, "world": world, "ranks": ranks, "bytes": nbytes})

    def wrap(self, kind: str, stock: Callable) -> Callable:
        """``stock`` counted when called outside another counted call during a step."""

        @functools.wraps(stock)
        def counted(*args, **kwargs):
            if self._calls is not None and self._depth == 0:
                self._record(kind, args, kwargs)
            self._depth += 1
            try:
                return stock(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def timed(self, region: str, stock: Callable) -> Callable:
        """``stock`` with its time added to ``region`` of the step (outermost call only)."""

        @functools.wraps(stock)
        def timed(*args, **kwargs):
            if region in self._open:
                return stock(*args, **kwargs)
            self._open.add(region)
            start = time.perf_counter()
            try:
                return stock(*args, **kwargs)
            finally:
                self._regions[region] = (self._regions.get(region, 0.0)
                                         + time.perf_counter() - start)
                self._open.discard(region)

        return timed

    def save(self) -> None:
        """Write ``<out_prefix>.rank<R>.json``: this rank's recorded steps (called when the run
        ends, however its process then exits: a forked rank runs no exit handlers)."""
        rank = int(os.environ.get("RANK", "0"))
        with open(f"{self.out_prefix}.rank{rank}.json", "w") as handle:
            json.dump({"rank": rank, "steps": self.steps}, handle)

    def step(self, stock: Callable) -> Callable:
        """Stock ``train_step`` recording one entry of :attr:`steps` per call."""

        @functools.wraps(stock)
        def recorded(*args, **kwargs):
            from megatron.training.global_vars import get_timers

            config = _model_config(args, kwargs)
            if config is not None and not hasattr(config.finalize_model_grads_func, "__wrapped__"):
                config.finalize_model_grads_func = self.timed(
                    "grad sync", config.finalize_model_grads_func)
            timers = get_timers()
            for timer in timers._timers.values():
                timer.elapsed(reset=True)
            self._calls, self._regions = [], {}
            start = time.perf_counter()
            try:
                return stock(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - start
                self.steps.append({
                    "seconds": seconds, "regions": self._regions, "collectives": self._calls,
                    "timers": {name: timer.elapsed(reset=True)
                               for name, timer in timers._timers.items()},
                })
                self._calls = None

        return recorded


def _model_config(args: tuple, kwargs: dict) -> Any:
    """The model config ``train_step(forward_step_func, data_iterator, model, ...)`` trains."""
    from megatron.core.utils import get_model_config

    model = kwargs.get("model", args[2] if len(args) > 2 else None)
    return get_model_config(model[0]) if model else None


def activate(out_prefix: str) -> Probe:
    """Wrap torch.distributed and stock ``train_step`` in this process, recording into a probe
    that saves under ``out_prefix``."""
    import megatron.training.training as training

    from torch.distributed import distributed_c10d

    probe = Probe(out_prefix)
    for kind in WRAPPED:
        wrapped = probe.wrap(kind, getattr(distributed_c10d, kind))
        # Both names: P2POp checks its op against distributed_c10d's own isend/irecv.
        setattr(distributed_c10d, kind, wrapped)
        setattr(dist, kind, wrapped)
    training.train_step = probe.step(training.train_step)
    for name, region in REGIONS.items():
        module_name, _, attr = name.partition(":")
        owner = importlib.import_module(module_name)
        for part in attr.split(".")[:-1]:
            owner = getattr(owner, part)
        leaf = attr.split(".")[-1]
        setattr(owner, leaf, probe.timed(region, getattr(owner, leaf)))
    return probe
