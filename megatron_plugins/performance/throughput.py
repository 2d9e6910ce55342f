"""``--log-throughput`` on a MiMo run: the interval's figures on stock's log line, in TensorBoard
and in W&B, and stock's own FLOPs count made the MiMo model's (compat Gap 28).

Stock ``train()`` asks ``num_floating_point_operations`` once per iteration, on every rank at
the same point, after the step. :meth:`ThroughputLog.flops` answers: on an iteration stock logs
(every ``--log-interval``-th and the first; with ``--log-progress`` also the ones it saves and
the last), the world's model FLOPs since the previous such iteration, gathered by the interval
meter's one all-reduce; on other iterations 0. Stock's running total (checkpoints, progress log)
is then the MiMo model's at every logged iteration. Inside ``training_log`` (wrapped by
:meth:`ThroughputLog.training_log`) the same name answers the logged interval's FLOPs per
iteration, so stock's ``throughput per GPU (TFLOP/s/GPU)`` is the MiMo model's over the world,
and stock's print of the line gets the MiMo fields appended (:class:`~.figures.Figures`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection
from typing import Any

import torch

from megatron_plugins.parallel.layout import ParallelLayout
from megatron_plugins.performance.figures import Figures, interval_figures
from megatron_plugins.performance.meter import IntervalMeter
from megatron_plugins.performance.peaks import Peak
from megatron_plugins.performance.recorder import Recorder

__all__ = ["ThroughputLog"]


class ThroughputLog:
    """The figures of each logged interval (see the module docstring). ``counted``: the
    modules whose FLOPs are counted; ``notices``: lines to print once, with the first log line."""

    def __init__(self, args: Any, recorder: Recorder, meter: IntervalMeter,
                 layout: ParallelLayout, counted: Collection[str], peak: Peak,
                 notices: Collection[str] = ()) -> None:
        self._args = args
        self._recorder = recorder
        self._meter = meter
        self._layout = layout
        self._counted = set(counted)
        self._peak = peak
        self._notices = [*notices, *([peak.notice] if peak.notice else [])]
        self._window: torch.Tensor | None = None
        self._first = True
        self._logging: Figures | None = None
        self.printed: list[Figures] = []
        """The figures of every log line so far."""

    def _syncs(self, iteration: int) -> bool:
        """Whether ``iteration`` gathers (every rank decides the same)."""
        args = self._args
        saves = args.log_progress and (args.save_interval and iteration % args.save_interval == 0
                                       or iteration == args.train_iters)
        return self._first or iteration % args.log_interval == 0 or bool(saves)

    def flops(self, args: Any, batch_size: int) -> float:
        """Stock's ``num_floating_point_operations`` (compat Gap 28; see the module docstring)."""
        if self._logging is not None:
            return self._logging.total_flops / max(self._logging.iterations, 1)
        iteration = self._recorder.last_iteration
        if iteration is None or not self._syncs(iteration):
            return 0.0
        self._first = False
        matrix = self._meter.gather()
        self._window = matrix if self._window is None else self._window + matrix
        columns = self._meter.columns
        return float(sum(matrix[:, columns.of(name, "flops")].sum() for name in self._counted))

    def training_log(self, stock: Callable, *args: Any, **kwargs: Any) -> Any:
        """Stock ``training_log``; on a logged iteration with the interval's figures (on its line,
        in TensorBoard and W&B)."""
        import megatron.training.training as training
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

        iteration = kwargs["iteration"] if "iteration" in kwargs else args[3]
        first = kwargs.get("is_first_iteration", False)
        if self._window is None or not (iteration % self._args.log_interval == 0 or first):
            return stock(*args, **kwargs)
        figures = interval_figures(self._window.tolist(), self._meter.columns, self._layout,
                                   self._counted, self._peak.tflops)
        self._window = None
        self._logging = figures
        print_line = training.print_rank_last
        training.print_rank_last = lambda line: print_line(line + figures.log_fields())
        try:
            result = stock(*args, **kwargs)
        finally:
            training.print_rank_last = print_line
            self._logging = None
        self.printed.append(figures)
        for writer in (get_tensorboard_writer(), get_wandb_writer()):
            if writer is None:
                continue
            for tag, value in figures.scalars().items():
                if hasattr(writer, "add_scalar"):
                    writer.add_scalar(tag, value, iteration)
                else:
                    writer.log({tag: value}, iteration)
        self._notify()
        return result

    def _notify(self) -> None:
        """The notices, once, on the rank that prints the log."""
        if self._notices and torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
            for notice in self._notices:
                print(f"pretrain_mimo.py: notice: {notice}", file=sys.stderr, flush=True)
        self._notices = []
