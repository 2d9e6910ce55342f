"""Timing probes over the stock calls a step's phases happen in, installed only on request.

Our own step code marks its phases itself (:mod:`megatron_plugins.step.phases`); where stock
owns the call, a probe wraps it for as long as a run measures and is removed afterwards, so a run
that measures nothing runs the stock functions untouched. Each probe is where megatron-core
0.19.2 looks the callee up at call time:

- ``training.train_step`` (called by ``train``, training/training.py:3856): each step
  (:data:`STEP`), numbered as stock logs it;
- ``schedules.forward_step`` and ``schedules.backward_step_multimodule`` (looked up by the
  pipelining schedule, core/pipeline_parallel/schedules.py:2313, 2356 and the ``partial`` at
  :2262): a microbatch's forward (loss included) and backward on this rank;
- the methods of the run's ``MultiModulePipelineCommunicator`` (schedules.py:2310-2440): waits
  for the other grid (cross-grid bridges) or pipeline stage; a call that receives is a
  :data:`RECV_WAIT`, one that only sends a :data:`SEND_WAIT`;
- the optimizer's ``step`` (training.py ``train_step``): :data:`OPTIMIZER`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_plugins.parallel.layout import LANGUAGE
from megatron_plugins.performance.patches import Patches
from megatron_plugins.performance.recorder import Recorder
from megatron_plugins.step.phases import (
    ENCODER_BACKWARD,
    ENCODER_FORWARD,
    LANGUAGE_BACKWARD,
    LANGUAGE_FORWARD,
    OPTIMIZER,
    RECV_WAIT,
    SEND_WAIT,
)

__all__ = ["COMMUNICATOR_WAITS", "install_probes"]

COMMUNICATOR_WAITS = {
    "recv_forward": RECV_WAIT, "recv_backward": RECV_WAIT,
    "send_forward_recv_backward": RECV_WAIT, "send_backward_recv_forward": RECV_WAIT,
    "send_forward": SEND_WAIT, "send_backward": SEND_WAIT,
}
"""The communicator methods the non-interleaved schedule calls, and the wait each is."""


def _kinds(module: str) -> tuple[str, str]:
    """The forward and backward phase kinds of ``module``."""
    if module == LANGUAGE:
        return LANGUAGE_FORWARD, LANGUAGE_BACKWARD
    return ENCODER_FORWARD, ENCODER_BACKWARD


def install_probes(recorder: Recorder, patches: Patches, communicator: Any,
                   optimizer: Any) -> None:
    """Probe ``train_step``, the schedule's forward and backward, the run's ``communicator``
    (its waits) and ``optimizer`` (its step) into ``recorder`` until ``patches`` are removed."""
    import megatron.training.training as training
    from megatron.core.pipeline_parallel import schedules

    forward, backward = _kinds(recorder.schedule_module)
    backwards = [0]
    """Backward calls of the current step: the schedule backs microbatches up in order."""

    def train_step(stock: Callable) -> Callable:
        def step(*args: Any, **kwargs: Any) -> Any:
            iteration = kwargs.get("iteration")
            recorder.begin_step(iteration + 1 if iteration is not None
                                else (recorder.last_iteration or 0) + 1)
            backwards[0] = 0
            try:
                return stock(*args, **kwargs)
            finally:
                recorder.end_step()
        return step

    def forward_step(stock: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with recorder.span(forward, None, kwargs.get("current_microbatch")):
                return stock(*args, **kwargs)
        return timed

    def backward_step(stock: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            index = backwards[0]
            backwards[0] += 1
            with recorder.span(backward, None, index):
                return stock(*args, **kwargs)
        return timed

    def waiting(kind: str) -> Callable[[Callable], Callable]:
        def make(stock: Callable) -> Callable:
            def call(*args: Any, **kwargs: Any) -> Any:
                with recorder.span(kind):
                    return stock(*args, **kwargs)
            return call
        return make

    patches.replace(training, "train_step", train_step)
    patches.replace(schedules, "forward_step", forward_step)
    patches.replace(schedules, "backward_step_multimodule", backward_step)
    if communicator is not None:
        for name, kind in COMMUNICATOR_WAITS.items():
            patches.replace(communicator, name, waiting(kind))
    if optimizer is not None:
        patches.replace(optimizer, "step", waiting(OPTIMIZER))
