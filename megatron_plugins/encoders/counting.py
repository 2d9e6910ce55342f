"""An encoder's FLOPs over a collated microbatch, from its items' sizes.

The preprocessors collate a microbatch's items end to end (stacked, or packed with one attention
segment each), so every product of the encoder and its projection is a sum over items: the
microbatch costs the sum of :meth:`~.base.EncoderPlugin.item_flops` over its items' sizes (the
sizes :meth:`~.base.EncoderPlugin.item_tokens` turns into each sample's ``ITEM_TOKENS``).
"""

from __future__ import annotations

from collections.abc import Iterable

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.encoders.base import EncoderPlugin
from megatron_plugins.flops.count import EncoderFlops

__all__ = ["flops_notice", "microbatch_flops"]


def microbatch_flops(plugin: EncoderPlugin, sizes: Iterable[tuple[int | float, ...]],
                     config: TransformerConfig,
                     language_hidden_size: int) -> EncoderFlops | None:
    """The encoder's and its projection's work on a microbatch of items of these sizes (in any
    order; none: nothing runs); None when the plugin does not count FLOPs."""
    if not plugin.counts_flops:
        return None
    return sum((plugin.item_flops(tuple(size), config, language_hidden_size) for size in sizes),
               EncoderFlops())


def flops_notice(plugin: EncoderPlugin) -> str | None:
    """The one line to show (once per run, where throughput is logged) for an encoder whose
    FLOPs are not counted; None when they are."""
    if plugin.counts_flops:
        return None
    return (f"--encoder {plugin.name}={plugin.grid.provider}: {type(plugin).__name__} does not "
            "count its FLOPs (EncoderPlugin.item_flops), so throughput leaves this encoder out; "
            "implement item_flops to include it")
