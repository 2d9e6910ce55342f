"""What a count is: :class:`Flops` (forward, backward, recomputation of one pass) and
:class:`Work` (a module's forward matmul FLOPs, sorted by what its backward computes), so one
formula serves a trained, a frozen and a pass-through module alike.

Counted: matrix products (linear layers, convolutions, attention's two batched products), as
``torch.utils.flop_counter.FlopCounterMode`` counts them, 2 FLOPs per multiply-add. Not counted:
elementwise work (norms, activations, softmax, rotary, residual and DeepStack additions,
embedding lookups, losses), which is a few percent of a transformer's at most.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

__all__ = ["EncoderFlops", "Flops", "Work"]


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
class Work(_Counts):
    """A module's forward matmul FLOPs by what its backward computes.

    - ``entry``: products of a weight with the module's own input (a patch embedding on pixels)
      whose kernel skips an input gradient nobody needs: weight gradient when the module trains,
      input gradient when its input needs one;
    - ``inner``: products of a weight with the module's activations: weight gradient when it
      trains, input gradient whenever a gradient flows at all;
    - ``scores``: products of two activations (attention's QK^T and PV): both operands'
      gradients whenever a gradient flows;
    - ``kernel_recompute``: what a fused attention kernel recomputes in its backward (the
      scores), counted as recomputation.

    Each product's backward costs its forward per operand gradient, so a module that trains and
    passes a gradient back costs 2x its forward in backward.
    """

    entry: int = 0
    inner: int = 0
    scores: int = 0
    kernel_recompute: int = 0

    @property
    def forward(self) -> int:
        return self.entry + self.inner + self.scores

    def flops(self, *, trains: bool, input_grad: bool, recomputed: bool = False) -> Flops:
        """The pass's FLOPs: ``trains`` (its weights get gradients), ``input_grad`` (a gradient
        must reach its input: something before it trains), ``recomputed`` (activation
        checkpointing reruns its forward in backward). Without either gradient no backward runs,
        so nothing is recomputed."""
        if not (trains or input_grad):
            return Flops(self.forward)
        backward = (self.entry * (int(trains) + int(input_grad)) + self.inner * (int(trains) + 1)
                    + 2 * self.scores)
        recompute = self.kernel_recompute + (self.forward if recomputed else 0)
        return Flops(self.forward, backward, recompute)


@dataclass(frozen=True)
class EncoderFlops(_Counts):
    """An encoder's items (one, or a microbatch's): the encoder network's work and its
    projection's, which trains or is frozen on its own."""

    encoder: Work = Work()
    projection: Work = Work()

    def flops(self, *, encoder_trains: bool = True, projection_trains: bool = True,
              recomputed: bool = False) -> Flops:
        """The pass's FLOPs with these modules trained (``--freeze-encoder`` freezes both,
        ``--freeze-projection`` the projection): the encoder's input (pixels, audio) never needs
        a gradient, the projection's does when the encoder trains. ``recomputed``: the forward
        runs again before the backward (``--colocated-encoder-recompute``)."""
        return (self.encoder.flops(trains=encoder_trains, input_grad=False, recomputed=recomputed)
                + self.projection.flops(trains=projection_trains, input_grad=encoder_trains,
                                        recomputed=recomputed))
