"""What an encoder's count is made of: the embedding of its input (a patch embedding, a
convolution stem), a bidirectional transformer tower over the item's attention segments, and the
MLP projection to the language model. An encoder plugin's
:meth:`~megatron_plugins.encoders.base.EncoderPlugin.item_flops` composes them from the item's
size.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from megatron_plugins.flops.count import Work
from megatron_plugins.flops.transformer import Layer, attention_kernel, linear

__all__ = ["embedding", "projection", "tower"]


def embedding(tokens: int, fan_in: int, hidden: int) -> Work:
    """A linear (or strided convolution, ``fan_in`` = channels x kernel) on the encoder's input
    itself: pixels or frames need no gradient, so its backward is the weight gradient alone."""
    return Work(entry=linear(tokens, fan_in, hidden))


def tower(config: Any, segments: Iterable[int], layers: int | None = None) -> Work:
    """``layers`` (default ``config.num_layers``) bidirectional layers of ``config`` (a
    ``TransformerConfig``, read by field name), attention within each segment, on the kernel its
    ``transformer_impl`` runs."""
    layer = Layer.of(config, kernel=attention_kernel(config.transformer_impl))
    return layer.work(segments) * (config.num_layers if layers is None else layers)


def projection(tokens: int, fan_in: int, ffn: int, fan_out: int, transformer_impl: str) -> Work:
    """The two-layer MLP projection (``fan_in -> ffn -> fan_out``) over ``tokens`` rows.

    Its first layer reads the encoder's output: Transformer Engine's linear computes that
    input's gradient only when the encoder trains, Megatron's local tensor-parallel linear
    whenever it runs a backward (a frozen encoder's too)."""
    first = linear(tokens, fan_in, ffn)
    work = Work(inner=linear(tokens, ffn, fan_out))
    if transformer_impl == "transformer_engine":
        return work + Work(entry=first)
    return work + Work(inner=first)
