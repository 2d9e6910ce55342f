"""The phases of a training step our own step code marks, for a recorder to time (issue 39).

The colocated schedule (encoder forward and backward, row routing), the forward step (each
microbatch's batch, for the FLOPs and tokens it carries) and gradient finalization call
:func:`phase` and :func:`consumed` here. Nothing listens unless a run asks for throughput, a
timeline or a profile (:mod:`megatron_plugins.performance` then :func:`listen`\\ s): until then
:func:`phase` returns one shared null context and :func:`consumed` returns at once, and no
function of the step is wrapped. Stock code's phases (the schedule's forward and backward, the
cross-grid and pipeline transfers, the optimizer) are timed by the performance room's probes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, ContextManager, Protocol

__all__ = [
    "COMPUTE_KINDS", "ENCODER_BACKWARD", "ENCODER_FORWARD", "GRAD_REDUCE", "LANGUAGE_BACKWARD",
    "LANGUAGE_FORWARD", "Listener", "OPTIMIZER", "PHASE_KINDS", "RECV_WAIT", "ROUTING",
    "SEND_WAIT", "STEP", "WAIT_KINDS", "consumed", "listen", "listener", "phase",
]

ENCODER_FORWARD = "encoder-forward"
ENCODER_BACKWARD = "encoder-backward"
LANGUAGE_FORWARD = "language-forward"
LANGUAGE_BACKWARD = "language-backward"
SEND_WAIT = "send-wait"
RECV_WAIT = "recv-wait"
ROUTING = "colocated-routing"
GRAD_REDUCE = "grad-reduce"
OPTIMIZER = "optimizer"
STEP = "step"

PHASE_KINDS = (ENCODER_FORWARD, ENCODER_BACKWARD, LANGUAGE_FORWARD, LANGUAGE_BACKWARD,
               SEND_WAIT, RECV_WAIT, ROUTING, GRAD_REDUCE, OPTIMIZER, STEP)
"""Every kind of phase, in the order a timeline's legend lists them."""

COMPUTE_KINDS = frozenset({ENCODER_FORWARD, ENCODER_BACKWARD, LANGUAGE_FORWARD,
                           LANGUAGE_BACKWARD})
"""A module's own computation: what its busy share counts."""

WAIT_KINDS = frozenset({SEND_WAIT, RECV_WAIT})
"""Waiting on another grid or pipeline stage."""


class Listener(Protocol):
    """What records a step's phases (:class:`megatron_plugins.performance.recorder.Recorder`)."""

    def span(self, kind: str, module: str | None, microbatch: int | None) -> ContextManager:
        """Time one phase of ``module`` (None: the rank's step as a whole)."""

    def consumed(self, module: str | None, batch: Mapping[str, Any]) -> None:
        """A microbatch ``module`` (None: the module the stock schedule runs on this rank) ran
        its forward over."""


_NULL = contextlib.nullcontext()
_listener: Listener | None = None


def listen(recorder: Listener | None) -> None:
    """Start (or, with None, stop) sending the step's phases and batches to ``recorder``."""
    global _listener
    _listener = recorder


def listener() -> Listener | None:
    """The recorder the step reports to, None when nobody listens."""
    return _listener


def phase(kind: str, module: str | None = None, microbatch: int | None = None) -> ContextManager:
    """Mark the code in the ``with`` block as one phase of ``kind`` of ``module``."""
    if _listener is None:
        return _NULL
    return _listener.span(kind, module, microbatch)


def consumed(batch: Mapping[str, Any], module: str | None = None) -> None:
    """Tell the recorder ``module`` (None: the module the stock schedule runs on this rank) ran
    its forward over ``batch`` (the recorder counts only batches of a training step)."""
    if _listener is not None:
        _listener.consumed(module, batch)
