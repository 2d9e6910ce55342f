"""What a run measures about its own speed, installed by the launch's one call (:func:`install`).

Before any process group exists :func:`install` checks the measurement flags (one line naming
the flag) and, when the run asks for throughput (stock ``--log-throughput``), a timeline
(``--mimo-timeline``) or a profile (``--mimo-profile``), wraps stock ``training.train``; a run
that asks for none gets nothing installed. When stock ``pretrain()`` starts training, the wrapper
builds this rank's :class:`~.recorder.Recorder`, installs the probes over stock's calls
(:mod:`.probes`), makes our step code report to it (:func:`megatron_plugins.step.phases.listen`)
and, with ``--log-throughput``, the log's figures (:mod:`.throughput`; stock's FLOPs count is
bridged to theirs by :func:`install` already, compat Gap 28). When
training ends it removes all of it, and global rank 0 writes the timeline and the profile from
one gather.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_plugins import cpu_simulation
from megatron_plugins.compat import throughput as compat_throughput
from megatron_plugins.parallel.layout import layout_record
from megatron_plugins.performance.batches import BatchCounter
from megatron_plugins.performance.flags import check_performance_args, measures, timeline_steps
from megatron_plugins.performance.meter import IntervalMeter
from megatron_plugins.performance.patches import Patches
from megatron_plugins.performance.peaks import peak_for
from megatron_plugins.performance.probes import install_probes
from megatron_plugins.performance.profile import ProfileSink, profile, write_profile
from megatron_plugins.performance.recorder import Recorder
from megatron_plugins.performance.throughput import ThroughputLog
from megatron_plugins.performance.timeline import TimelineSink, write_timeline
from megatron_plugins.step import phases

__all__ = ["Measurement", "device_name", "install"]


def device_name() -> str:
    """What the run's devices are, as the profile names them."""
    if cpu_simulation.is_active():
        return "cpu-simulation"
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _synchronizer() -> Callable[[], None] | None:
    """How a phase boundary waits for the device: only a real GPU runs asynchronously."""
    if cpu_simulation.is_active() or not torch.cuda.is_available():
        return None
    return torch.cuda.synchronize


class Measurement:
    """One run's measurement (see the module docstring) of a checked ``run``
    (:class:`~megatron_plugins.launch.pretrain.MimoRun`)."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.args = run.args
        self.counter = BatchCounter.of_run(run)
        self.patches = Patches()
        self.recorder: Recorder | None = None
        self.throughput: ThroughputLog | None = None

    def train(self, stock: Callable, *args: Any, **kwargs: Any) -> Any:
        """Stock ``train()`` measured (see the module docstring)."""
        bound = inspect.signature(stock).bind(*args, **kwargs).arguments
        layout, run_args = self.run.layout, self.args
        rank, world = dist.get_rank(), dist.get_world_size()
        own = [module.name for module in layout.modules_of_rank(rank)]
        profile_sink = ProfileSink(rank, own) if run_args.mimo_profile else None
        timeline_sink = (TimelineSink(timeline_steps(run_args.mimo_timeline_steps))
                         if run_args.mimo_timeline else None)
        meter = (IntervalMeter([m.name for m in layout.modules], rank, world,
                               torch.device("cuda", torch.cuda.current_device()))
                 if run_args.log_throughput else None)
        recorder = Recorder(
            rank, {m.name: m.coordinates(rank)["pp"] for m in layout.modules_of_rank(rank)},
            layout.module_of_rank(rank).name, self.counter.for_rank(rank), _synchronizer(),
            [sink for sink in (meter, profile_sink, timeline_sink) if sink is not None])
        self.recorder = recorder
        install_probes(recorder, self.patches, bound.get("p2p_communicator"),
                       bound.get("optimizer"))
        if meter is not None:
            self._log_throughput(recorder, meter)
        phases.listen(recorder)
        self.patches.add(lambda: phases.listen(None))
        try:
            result = stock(*args, **kwargs)
        finally:
            self.patches.remove()
        self._write(rank, world, profile_sink, timeline_sink)
        return result

    def _log_throughput(self, recorder: Recorder, meter: IntervalMeter) -> None:
        import megatron.training.training as training

        peak = peak_for(device_name(), self.args.peak_tflops)
        self.throughput = ThroughputLog(self.args, recorder, meter, self.run.layout,
                                        self.counter.counted, peak, self.counter.notices)
        self.patches.replace(training, "training_log",
                             lambda stock: functools.partial(self.throughput.training_log, stock))

    def flops(self, args: Any, batch_size: int) -> float:
        """Stock's FLOPs count while training (compat Gap 28, bridged before the model is built
        so the start-up line names it): the throughput log's."""
        return self.throughput.flops(args, batch_size)

    def _write(self, rank: int, world: int, profile_sink: ProfileSink | None,
               timeline_sink: TimelineSink | None) -> None:
        """Gather the profile's steps and the timeline's phases to rank 0 (one gather), which
        writes them."""
        if profile_sink is None and timeline_sink is None:
            return
        payload = (profile_sink.steps if profile_sink else None,
                   timeline_sink.phases if timeline_sink else None)
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(payload, gathered, dst=0)
        if rank != 0:
            return
        layout, args = self.run.layout, self.args
        if profile_sink is not None:
            header = {"device": device_name(),
                      "peak_tflops": peak_for(device_name(), args.peak_tflops).tflops,
                      "layout": layout_record(layout), "command": list(self.run.command)}
            path = write_profile(args.mimo_profile,
                                 profile([steps for steps, _ in gathered], layout, header))
            print(f"pretrain_mimo.py: profile written to {path}", file=sys.stderr, flush=True)
        if timeline_sink is not None:
            phases_of_all = [phase for _, timeline in gathered for phase in timeline]
            trace, picture = write_timeline(args.mimo_timeline, phases_of_all, layout,
                                            timeline_sink.steps)
            print(f"pretrain_mimo.py: timeline written to {trace} and {picture}",
                  file=sys.stderr, flush=True)


def install(run: Any) -> Measurement | None:
    """The launch's one call, before its process groups: check the measurement flags and, when
    the run measures anything, measure stock ``train()``; None (nothing installed) otherwise."""
    import megatron.training.training as training

    check_performance_args(run.args)
    if not measures(run.args):
        return None
    measurement = Measurement(run)
    measurement.patches.replace(training, "train",
                                lambda stock: functools.partial(measurement.train, stock))
    if run.args.log_throughput:
        measurement.patches.add(compat_throughput.count_flops_with(measurement.flops))
    return measurement
