"""What a count is: :class:`Flops` (forward, backward, recomputation of one pass) and
:class:`Work` (a module's forward matmul FLOPs, sorted by what its backward computes, and the
shapes of its LoRA-adaptable linears), so one formula serves a trained, a frozen, a pass-through
and a LoRA'd (:class:`Adapters`) module alike.

Counted: matrix products (linear layers, convolutions, attention's two batched products), as
``torch.utils.flop_counter.FlopCounterMode`` counts them, 2 FLOPs per multiply-add. Not counted:
elementwise work (norms, activations, softmax, rotary, residual and DeepStack additions,
embedding lookups, losses), which is a few percent of a transformer's at most.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

__all__ = ["TARGETS", "Adapters", "EncoderFlops", "FirstLayer", "Flops", "Linear", "Linears",
           "Work", "linear"]

TARGETS = ("linear_qkv", "in_proj", "linear_proj", "out_proj", "linear_fc1", "linear_fc2")
"""Megatron's linears LoRA adapts, in the order a layer runs them: attention's (its scores
between the two) or Gated DeltaNet's (its convolution and delta rule between them), then the
MLP's."""


def linear(tokens: int, fan_in: int, fan_out: int) -> int:
    """Forward FLOPs of a ``fan_in -> fan_out`` linear layer (or convolution with
    ``fan_in`` = channels x kernel size) over ``tokens`` rows."""
    return 2 * tokens * fan_in * fan_out


class _Counts:
    """Fieldwise sums and whole multiples of a frozen dataclass of counts."""

    def __add__(self, other: Any) -> Any:
        return type(self)(*(getattr(self, field.name) + getattr(other, field.name)
                            for field in fields(self)))

    def __mul__(self, times: int) -> Any:
        return type(self)(*(getattr(self, field.name) * times for field in fields(self)))

    __rmul__ = __mul__


@dataclass(frozen=True)
class Flops(_Counts):
    """FLOPs of one pass: ``model`` = forward + backward (what MFU divides by), ``hardware``
    adds recomputation (activation checkpointing, a fused attention kernel's recomputed scores)."""

    forward: int = 0
    backward: int = 0
    recompute: int = 0

    @property
    def model(self) -> int:
        """Forward and backward: the work the model needs, whatever is recomputed."""
        return self.forward + self.backward

    @property
    def hardware(self) -> int:
        """What the device executes: model FLOPs plus recomputation."""
        return self.model + self.recompute


@dataclass(frozen=True)
class Linear(_Counts):
    """Linear layers of one name, summed: their forward FLOPs, rows x fan_in and rows x fan_out
    (what a LoRA adapter on each costs: ``2 rank (rows_in + rows_out)`` forward)."""

    forward: int = 0
    rows_in: int = 0
    rows_out: int = 0


@dataclass(frozen=True)
class Linears(_Counts):
    """A module's LoRA-adaptable linears by name (:data:`TARGETS`)."""

    linear_qkv: Linear = Linear()
    in_proj: Linear = Linear()
    linear_proj: Linear = Linear()
    out_proj: Linear = Linear()
    linear_fc1: Linear = Linear()
    linear_fc2: Linear = Linear()


@dataclass(frozen=True)
class FirstLayer(_Counts):
    """A module's first layer (a tower's layer 0 per item, a projection's MLP per instance):
    where the gradient of a LoRA'd module whose input needs none starts; ``before``: the input
    gradients of the products on the way to it past the entry (a stem's second convolution),
    which that gradient skips; ``scores`` and ``kernel_recompute``: its attention's, skipped with
    the scores' backward; ``mixing``: the backward between a Gated DeltaNet's ``in_proj`` and
    ``out_proj`` (the convolution's input gradient, the delta rule's), skipped by a gradient
    starting at ``out_proj`` or later; ``routing``: the backward of an MoE layer's router (both
    operands) and shared-expert gate (its input), skipped by a gradient starting at the
    experts."""

    before: int = 0
    scores: int = 0
    linears: Linears = Linears()
    kernel_recompute: int = 0
    mixing: int = 0
    routing: int = 0


@dataclass(frozen=True)
class Adapters:
    """LoRA on a module (``--lora``): rank-``rank`` adapters ``B A x`` on its ``targets``
    linears (``A`` ``[rank, in]``, ``B`` ``[out, rank]``), the module's own weights frozen.

    Per adapted linear over ``rows`` rows: forward ``A x`` and ``B (A x)``, ``2 rank rows
    (in + out)``; backward the weight gradients of ``B`` (``2 rank rows out``) and ``A``
    (``2 rank rows in``), the gradient of ``A x`` (``2 rank rows out``, ``A`` needs it) and of
    ``x`` through ``A`` (``2 rank rows in``, wherever ``x`` needs a gradient): twice the
    forward, less the last term at the module's first adapter when its input needs none. The
    scale and dropout are elementwise, not counted. A tensor-parallel ``A`` replicated on every
    TP rank counts once: these are model FLOPs."""

    rank: int
    targets: tuple[str, ...]

    def forward(self, linears: Linears) -> int:
        """The adapters' forward FLOPs on these linears."""
        return sum(2 * self.rank * (shape.rows_in + shape.rows_out)
                   for shape in (getattr(linears, name) for name in self.targets))

    def adapt(self, linears: Linears) -> bool:
        """Whether any of these linears is a target."""
        return any(getattr(linears, name).rows_in for name in self.targets)


@dataclass(frozen=True)
class Work(_Counts):
    """A module's forward matmul FLOPs by what its backward computes.

    - ``entry``: products of a weight with the module's own input (a patch embedding on pixels)
      whose kernel skips an input gradient nobody needs: weight gradient when the module trains,
      input gradient when its input needs one;
    - ``inner``: products of a weight with the module's activations: weight gradient when it
      trains, input gradient whenever a gradient flows at all;
    - ``scores``: products of two activations (attention's QK^T and PV): both operands'
      gradients whenever a gradient flows;
    - ``gating``: products of a weight with activations whose kernel computes both gradients
      whenever a gradient flows, the weight frozen or not (Megatron's MoE router);
    - ``recurrence``: products of activations carried through a recurrence (Gated DeltaNet's
      chunked delta rule), whose backward whenever a gradient flows is
      ``recurrence_backward``, counted as it runs rather than as a multiple of the forward;
    - ``kernel_recompute``: what a fused attention kernel recomputes in its backward (the
      scores), counted as recomputation;
    - ``linears``: the adaptable linears among the ``inner`` products, by name, for LoRA;
    - ``first``: the module's first layer, where a LoRA'd module's gradient starts.

    Each product's backward costs its forward per operand gradient, so a module that trains and
    passes a gradient back costs 2x its forward in backward.
    """

    entry: int = 0
    inner: int = 0
    scores: int = 0
    gating: int = 0
    recurrence: int = 0
    recurrence_backward: int = 0
    kernel_recompute: int = 0
    linears: Linears = Linears()
    first: FirstLayer = FirstLayer()

    @classmethod
    def linear(cls, name: str, tokens: int, fan_in: int, fan_out: int) -> Work:
        """An adaptable linear ``name`` (one of :data:`TARGETS`) over ``tokens`` rows."""
        shape = Linear(linear(tokens, fan_in, fan_out), tokens * fan_in, tokens * fan_out)
        return cls(inner=shape.forward, linears=Linears(**{name: shape}))

    def leading(self) -> Work:
        """This work as its module's first layer too (one layer's work)."""
        return replace(self, first=FirstLayer(self.first.before, self.scores, self.linears,
                                              self.kernel_recompute, self.first.mixing,
                                              self.first.routing))

    @property
    def forward(self) -> int:
        return self.entry + self.inner + self.scores + self.gating + self.recurrence

    def flops(self, *, trains: bool, input_grad: bool, recomputed: bool = False,
              adapters: Adapters | None = None) -> Flops:
        """The pass's FLOPs: ``trains`` (its weights get gradients), ``input_grad`` (a gradient
        must reach its input: something before it trains), ``recomputed`` (activation
        checkpointing reruns its forward in backward), ``adapters`` (LoRA: its weights frozen,
        see :meth:`_adapted`). Without any gradient no backward runs, so nothing is
        recomputed."""
        if adapters is not None:
            if trains:
                raise ValueError("a LoRA'd module's own weights are frozen: trains=False")
            return self._adapted(adapters, input_grad, recomputed)
        if not (trains or input_grad):
            return Flops(self.forward)
        backward = (self.entry * (int(trains) + int(input_grad)) + self.inner * (int(trains) + 1)
                    + 2 * (self.scores + self.gating) + self.recurrence_backward)
        recompute = self.kernel_recompute + (self.forward if recomputed else 0)
        return Flops(self.forward, backward, recompute)

    def _adapted(self, adapters: Adapters, input_grad: bool, recomputed: bool) -> Flops:
        """A LoRA'd module: no weight gradient, a gradient through every product to reach the
        adapters (input gradients of the inner products, both of the scores; the entry's only
        with ``input_grad``), the adapters' own (:class:`Adapters`). Without ``input_grad`` the
        gradient starts at the first layer's first adapter (:meth:`_ahead`)."""
        adapted = adapters.forward(self.linears)
        forward = self.forward + adapted
        backward = (self.entry * int(input_grad) + self.inner + 2 * (self.scores + self.gating)
                    + self.recurrence_backward + 2 * adapted)
        recompute = self.kernel_recompute
        if not input_grad:
            backward -= self._ahead(adapters)
            if self._skips_first_scores(adapters):
                recompute -= self.first.kernel_recompute
        return Flops(forward, backward, recompute + (forward if recomputed else 0))

    def _skips_first_scores(self, adapters: Adapters) -> bool:
        """Whether the gradient starts past the first layer's attention scores (its first
        adapter is ``linear_proj`` or later, as :meth:`_ahead` skips them), so a fused kernel
        there recomputes nothing."""
        first = next((name for name in TARGETS if name in adapters.targets
                      and getattr(self.first.linears, name).rows_in), None)
        return first is not None and TARGETS.index(first) >= TARGETS.index("linear_proj")

    def _ahead(self, adapters: Adapters) -> int:
        """The backward the first layer skips when its input needs no gradient: the products
        before its first adapted linear and that linear's own input gradient (its input needs
        none), and the input gradient through that first adapter's ``A``."""
        skipped = self.first.before
        for name in TARGETS:
            if name == "linear_proj":  # past attention's scores or Gated DeltaNet's mixing
                skipped += 2 * self.first.scores + self.first.mixing
            if name == "linear_fc1":  # past an MoE layer's router and shared-expert gate
                skipped += self.first.routing
            shape = getattr(self.first.linears, name)
            skipped += shape.forward
            if name in adapters.targets and shape.rows_in:
                return skipped + 2 * adapters.rank * shape.rows_in
        return 0


@dataclass(frozen=True)
class EncoderFlops(_Counts):
    """An encoder's items (one, or a microbatch's): the encoder network's work and its
    projection's, which trains or is frozen on its own."""

    encoder: Work = Work()
    projection: Work = Work()

    def flops(self, *, encoder_trains: bool = True, projection_trains: bool = True,
              recomputed: bool = False, encoder_adapters: Adapters | None = None,
              projection_adapters: Adapters | None = None) -> Flops:
        """The pass's FLOPs with these modules trained (``--freeze-encoder`` freezes both,
        ``--freeze-projection`` the projection) or LoRA'd (``*_adapters``: their ``*_trains``
        False): the encoder's input (pixels, audio) never needs a gradient, the projection's
        does when the encoder trains or is LoRA'd. ``recomputed``: the forward runs again before
        the backward (``--colocated-encoder-recompute``)."""
        return (self.encoder.flops(trains=encoder_trains, input_grad=False, recomputed=recomputed,
                                   adapters=encoder_adapters)
                + self.projection.flops(
                    trains=projection_trains, recomputed=recomputed, adapters=projection_adapters,
                    input_grad=encoder_trains or encoder_adapters is not None))
