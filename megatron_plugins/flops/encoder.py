"""What an encoder's count is made of: the embedding of its input (a patch embedding, a
convolution stem), a bidirectional transformer tower over the item's attention segments, and the
MLP projection to the language model. An encoder plugin's
:meth:`~megatron_plugins.encoders.base.EncoderPlugin.item_flops` composes them from the item's
size.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from megatron_plugins.flops.count import FirstLayer, Work
from megatron_plugins.flops.transformer import Layer, attention_kernel, linear

__all__ = ["embedding", "projection", "stem", "tower"]


def embedding(tokens: int, fan_in: int, hidden: int) -> Work:
    """A linear (or strided convolution, ``fan_in`` = channels x kernel) on the encoder's input
    itself: pixels or frames need no gradient, so its backward is the weight gradient alone."""
    return Work(entry=linear(tokens, fan_in, hidden))


def stem(tokens: int, fan_in: int, hidden: int) -> Work:
    """A linear (or convolution) on the embedding's output, before the first layer: a gradient
    reaches it when the encoder trains, none when only LoRA adapters in the layers do."""
    forward = linear(tokens, fan_in, hidden)
    return Work(inner=forward, first=FirstLayer(before=forward))


def tower(config: Any, segments: Iterable[int], layers: int | None = None,
          first: bool = True) -> Work:
    """``layers`` (default ``config.num_layers``) bidirectional layers of ``config`` (a
    ``TransformerConfig``, read by field name), attention within each segment, on the kernel its
    layers run (:func:`attention_kernel`); ``first``: they include the encoder's first layer."""
    layers = config.num_layers if layers is None else layers
    work = Layer.of(config, kernel=attention_kernel(config)).work(segments)
    if not (first and layers):
        return work * layers
    return work * (layers - 1) + work.leading()


def projection(tokens: int, fan_in: int, ffn: int, fan_out: int, transformer_impl: str) -> Work:
    """The two-layer MLP projection (``fan_in -> ffn -> fan_out``) over ``tokens`` rows.

    Its first layer reads the encoder's output: Transformer Engine's linear computes that
    input's gradient only when the encoder trains, Megatron's local tensor-parallel linear
    whenever it runs a backward (a frozen encoder's too). The MLP is the projection's one layer
    (LoRA's gradient starts there)."""
    work = Work.linear("linear_fc2", tokens, ffn, fan_out)
    if transformer_impl == "transformer_engine":
        return (work + Work(entry=linear(tokens, fan_in, ffn))).leading()
    return (Work.linear("linear_fc1", tokens, fan_in, ffn) + work).leading()
