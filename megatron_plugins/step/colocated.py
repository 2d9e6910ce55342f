"""The training step of a rank that hosts encoders on the language model's ranks (issue 28).

:class:`ColocatedSchedule` wraps the stock schedule (installed for stock ``train()`` and
``evaluate()`` by compat Gap 24) and runs one step in three phases on a rank holding
:class:`ColocatedEncoders`; elsewhere it is the stock schedule:

1. every hosted encoder runs its forward over the step's microbatches, each inside the encoder's
   RNG streams (:class:`~megatron_plugins.parallel.rng.ModuleRng`) with the same batches as on ranks of its
   own, and its rows are routed to the language model's first-stage ranks that merge them
   (:func:`route_forward` runs the :mod:`megatron_plugins.parallel.routing` plan), where they
   become one detached leaf;
2. the stock schedule runs the language model (any pipeline depth) on the step's language
   batches, each carrying its microbatch's view of the leaf (``forward.COLOCATED_ROWS``),
   with the model's gradient finalization held back;
3. the leaf's gradient is routed back to the ranks that computed the rows, one backward per
   encoder runs, and the held-back finalization reduces every module on its own groups and
   divides by the global token count, as on disjoint grids.

A hosted encoder's activations live from phase 1 to phase 3: on a colocated rank the step holds
every microbatch's encoder activations at once. With ``--colocated-encoder-recompute``
(:attr:`ColocatedEncoders.recompute`) phase 1 keeps only each microbatch's encoder inputs and the
encoder's RNG state at its start, and phase 3 runs the microbatch's forward again from that state
and backs it up at once: one more encoder forward per step, one microbatch's activations held.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.utils import get_model_config, unwrap_model

from megatron_plugins.parallel.routing import Exchange, RoutingPlan, Span
from megatron_plugins.data.streams import COLOCATED, ITEM_TOKENS, rank_slice
from megatron_plugins.parallel.layout import LANGUAGE, ModulePlacement
from megatron_plugins.parallel.rng import ModuleRng
from megatron_plugins.parallel.topology import HeteroTopology
from megatron_plugins.step.forward import COLOCATED_ROWS, check_encoder_rows, to_device
from megatron_plugins.step.phases import (
    ENCODER_BACKWARD,
    ENCODER_FORWARD,
    ROUTING,
    consumed,
    phase,
)

__all__ = ["ColocatedEncoders", "ColocatedSchedule", "HostedEncoder", "colocated_encoders",
           "route_backward", "route_forward"]

_ATTRIBUTE = "_mimo_colocated_encoders"


@dataclass(frozen=True)
class HostedEncoder:
    """One encoder on this rank's language ranks: its grid, and its output rows' width."""

    placement: ModulePlacement
    width: int
    """Elements per output row: the language hidden size, times 1 + its DeepStack levels."""
    trains: bool
    """Whether it has trainable parameters (from the freezing flags: the same on all its ranks,
    so they agree on routing gradients back)."""


@dataclass
class ColocatedEncoders:
    """What a rank hosting encoders keeps for its steps."""

    topology: HeteroTopology
    """This rank's groups: its slice of each module's microbatches is the data path's
    (:func:`~megatron_plugins.data.streams.rank_slice`)."""
    rank: int
    encoders: dict[str, HostedEncoder]
    rng: ModuleRng
    recompute: bool = False
    """Recompute each microbatch's encoder forward in phase 3 instead of keeping its activations
    from phase 1 (``--colocated-encoder-recompute``)."""
    traffic: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per encoder, the bytes of rows and row gradients this rank received from peers in the
    latest training step, and the least any routing would have to move to it (rows it merges but
    did not compute)."""

    def attach(self, model: torch.nn.Module) -> None:
        """Let the schedule find these encoders from the model it is handed."""
        setattr(unwrap_model(model), _ATTRIBUTE, self)

    def row_counts(self, name: str, batches: list[dict[str, Any]],
                   micro_batch_size: int) -> list[dict[int, int]]:
        """Rows of each position this rank computes or merges, per microbatch, from the counts
        both its encoder and its language batches carry (so no rank has to ask another)."""
        computed = rank_slice(self.topology, name, micro_batch_size).positions
        consumed = rank_slice(self.topology, LANGUAGE, micro_batch_size).positions
        counts = []
        for batch in batches:
            rows = dict(zip(consumed, map(sum, batch[ITEM_TOKENS][name])))
            rows.update(zip(computed, map(sum, batch[COLOCATED][name][ITEM_TOKENS][name])))
            counts.append(rows)
        return counts


def _take(tensor: torch.Tensor, spans: Sequence[Span]) -> torch.Tensor:
    pieces = [tensor[start:stop] for start, stop in spans]
    return pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces)


def _place(target: torch.Tensor, span: Span, values: torch.Tensor, accumulate: bool) -> None:
    if accumulate:
        target[span[0]:span[1]] += values
    else:
        target[span[0]:span[1]] = values


def _run(source: torch.Tensor, target: torch.Tensor, exchange: Exchange,
         group: dist.ProcessGroup | None, accumulate: bool) -> None:
    """One ``batch_isend_irecv`` over every peer with rows (none when there is none), the local
    copies while it runs, then the received rows into place."""
    ops = [dist.P2POp(dist.isend, _take(source, message.spans), message.peer, group)
           for message in exchange.sends]
    buffers = [source.new_empty((message.rows, *source.shape[1:]))
               for message in exchange.receives]
    ops += [dist.P2POp(dist.irecv, buffer, message.peer, group)
            for message, buffer in zip(exchange.receives, buffers)]
    requests = dist.batch_isend_irecv(ops) if ops else []
    for (start, stop), span in exchange.local:
        _place(target, span, source[start:stop], accumulate)
    for request in requests:
        request.wait()
    for message, buffer in zip(exchange.receives, buffers):
        offset = 0
        for span in message.spans:
            length = span[1] - span[0]
            _place(target, span, buffer[offset:offset + length], accumulate)
            offset += length


def _check_rows(tensor: torch.Tensor, expected: int, what: str) -> None:
    if tensor.dim() < 1 or tensor.shape[0] != expected:
        raise ValueError(f"{what} has shape {tuple(tensor.shape)}; the routing plan expects "
                         f"{expected} rows on this rank")


@torch.no_grad()
def route_forward(rows: torch.Tensor, plan: RoutingPlan,
                  group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's consumed rows (``[plan.consumed_rows, ...]``, empty off language stage 0)
    from its computed ``rows`` (``[plan.computed_rows, ...]``); every rank of ``group`` (default:
    the world) calls it with its own plan. Detached: the caller joins the graphs (Phase 3)."""
    _check_rows(rows, plan.computed_rows, "encoder rows")
    rows = rows.detach()
    out = rows.new_empty((plan.consumed_rows, *rows.shape[1:]))
    _run(rows, out, plan.forward, group, accumulate=False)
    return out


@torch.no_grad()
def route_backward(grads: torch.Tensor, plan: RoutingPlan,
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The gradient of this rank's computed rows (``[plan.computed_rows, ...]``), summed over the
    language CP lanes, from the gradient of its consumed rows (``[plan.consumed_rows, ...]``;
    every TP rank of a CP lane holds the same). Every rank of ``group`` calls it."""
    _check_rows(grads, plan.consumed_rows, "row gradients")
    grads = grads.detach()
    out = grads.new_zeros((plan.computed_rows, *grads.shape[1:]))
    _run(grads, out, plan.backward, group, accumulate=True)
    return out


def colocated_encoders(model: torch.nn.Module) -> ColocatedEncoders | None:
    """The encoders ``model``'s rank hosts, None on a rank without any."""
    return getattr(unwrap_model(model), _ATTRIBUTE, None)


def _encoder_inputs(name: str, batch: Mapping[str, Any]) -> Any:
    """A microbatch's inputs of encoder ``name``, None when none of its samples has any."""
    inputs = batch.get("modality_inputs")
    return inputs.get(name) if inputs else None


def _encoder_rows(mimo: torch.nn.Module, name: str, width: int,
                  batch: Mapping[str, Any]) -> torch.Tensor:
    """One microbatch through a hosted encoder, checked against the rows its items declare."""
    inputs = _encoder_inputs(name, batch)
    if inputs is None:
        output = torch.empty((0, width), device=torch.cuda.current_device(),
                             dtype=mimo.config.params_dtype)
    else:
        output = mimo.modality_submodules[name](encoder_inputs=inputs, hidden_states=None)
    check_encoder_rows(name, output, batch[ITEM_TOKENS][name])
    return output


@dataclass
class _Routed:
    plan: RoutingPlan
    computed: torch.Tensor
    """The encoder's rows of the step (with their graph unless they are recomputed)."""
    leaf: torch.Tensor
    replays: list[tuple[Mapping[str, Any], dict[str, Any]]] = field(default_factory=list)
    """With recompute: each microbatch's encoder batch and the encoder's RNG state at its
    start."""


class ColocatedSchedule:
    """The stock forward-backward function, in three phases on ranks hosting encoders."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner

    def __call__(self, *, forward_step_func: Callable, data_iterator: Any, model: Any,
                 num_microbatches: int, forward_only: bool = False, **kwargs: Any) -> Any:
        chunk = model[0] if isinstance(model, list) else model
        hosted = colocated_encoders(chunk)
        if hosted is None:
            return self.inner(forward_step_func=forward_step_func, data_iterator=data_iterator,
                              model=model, num_microbatches=num_microbatches,
                              forward_only=forward_only, **kwargs)
        iterator = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
        batches = [next(iterator) for _ in range(num_microbatches)]
        mimo = unwrap_model(chunk)
        routed = self._encode(mimo, hosted, batches, kwargs["micro_batch_size"], forward_only)
        for index, batch in enumerate(batches):
            batch.pop(COLOCATED)
            batch[COLOCATED_ROWS] = {
                name: route.leaf[slice(*route.plan.consumed_microbatches[index])]
                for name, route in routed.items() if route.plan.consumed_rows}
        config = get_model_config(chunk)
        finalize = config.finalize_model_grads_func
        held: list[tuple[tuple, dict]] = []
        if finalize is not None:  # None: the caller finalizes (the split train step)
            config.finalize_model_grads_func = lambda *args, **kw: held.append((args, kw))
        try:
            losses = self.inner(forward_step_func=forward_step_func,
                                data_iterator=iter(batches), model=model,
                                num_microbatches=num_microbatches, forward_only=forward_only,
                                **kwargs)
        finally:
            config.finalize_model_grads_func = finalize
        if not forward_only:
            self._backward(mimo, hosted, routed)
        for args, kw in held:
            finalize(*args, **kw)
        return losses

    @staticmethod
    def _encode(mimo: torch.nn.Module, hosted: ColocatedEncoders, batches: list[dict[str, Any]],
                micro_batch_size: int, forward_only: bool) -> dict[str, _Routed]:
        """Phase 1: every hosted encoder over the step's microbatches, rows routed."""
        routed = {}
        for name, encoder in hosted.encoders.items():
            recompute = hosted.recompute and encoder.trains and not forward_only
            outputs, replays = [], []
            with hosted.rng.enter(name), torch.set_grad_enabled(not (forward_only or recompute)):
                for index, batch in enumerate(batches):
                    inputs = to_device(batch[COLOCATED][name])
                    if recompute:
                        replays.append((inputs, hosted.rng.state_dict([name])))
                    consumed(inputs, name)
                    with phase(ENCODER_FORWARD, name, index):
                        outputs.append(_encoder_rows(mimo, name, encoder.width, inputs))
            computed = torch.cat(outputs)
            plan = RoutingPlan.build(encoder.placement, hosted.topology.layout.language, hosted.rank,
                                     micro_batch_size,
                                     hosted.row_counts(name, batches, micro_batch_size))
            with phase(ROUTING, name):
                leaf = route_forward(computed, plan)
            leaf.requires_grad_(encoder.trains and not forward_only)
            if not forward_only:
                hosted.traffic[name] = (plan.bytes_moved(encoder.width, computed.dtype),
                                        plan.bytes_minimum(encoder.width, computed.dtype))
            routed[name] = _Routed(plan, computed, leaf, replays)
        return routed

    @staticmethod
    def _backward(mimo: torch.nn.Module, hosted: ColocatedEncoders,
                  routed: Mapping[str, _Routed]) -> None:
        """Phase 3: the leaves' gradients back to the ranks that computed the rows, then one
        backward per encoder (a frozen encoder's rows need none), or one per recomputed
        microbatch."""
        for name, route in routed.items():
            if not hosted.encoders[name].trains:
                continue
            grad = route.leaf.grad if route.leaf.grad is not None else torch.zeros_like(route.leaf)
            with phase(ROUTING, name):
                rows = route_backward(grad, route.plan)
            with phase(ENCODER_BACKWARD, name):
                if route.replays:
                    _replay(mimo, hosted, name, route, rows)
                elif route.computed.requires_grad:
                    with hosted.rng.enter(name):
                        torch.autograd.backward(route.computed, rows)


def _replay(mimo: torch.nn.Module, hosted: ColocatedEncoders, name: str, route: _Routed,
            rows: torch.Tensor) -> None:
    """Each microbatch's encoder forward again from the RNG state phase 1 started it with (same
    dropout draws), backed up at once with its rows' gradients; all but the last microbatch with
    inputs under the encoder's no-sync, so its DDP reduces once, as after one backward."""
    live = [index for index, (inputs, _) in enumerate(route.replays)
            if _encoder_inputs(name, inputs) is not None]
    no_sync = getattr(mimo.modality_submodules[name], "no_sync", contextlib.nullcontext)

    def backward(index: int) -> None:
        inputs, state = route.replays[index]
        hosted.rng.load_state_dict(state)
        output = _encoder_rows(mimo, name, hosted.encoders[name].width, inputs)
        if output.requires_grad:
            torch.autograd.backward(output, rows[slice(*route.plan.computed_microbatches[index])])

    with hosted.rng.enter(name):
        with no_sync():
            for index in live[:-1]:
                backward(index)
        for index in live[-1:]:
            backward(index)

