"""One module for an encoder family whose HF model also holds the input projection.

Qwen2.5-VL's merger MLP is trained with its vision tower and saved with it, but in MiMo it is the
modality's input projection, a sibling of the encoder network. A family covering both names its
Megatron parameters under :data:`TOWER` (the network) and :data:`PROJECTION` (the projection);
:func:`encoder_module` gives import and streaming one module with exactly those names, and
:func:`module_tensors` renames a checkpoint's two modules the same way for the export.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_plugins.weights.mapping import PROJECTION, TOWER, includes_projection

__all__ = ["PROJECTION", "TOWER", "EncoderView", "encoder_module", "includes_projection",
           "module_tensors"]

class EncoderView(torch.nn.Module):
    """The encoder network and its input projection under one root (both are shared, not
    copied): what the weights code reads and writes for a family that includes the projection."""

    def __init__(self, network: torch.nn.Module, projection: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = network
        self.projection = projection

    @property
    def config(self) -> Any:
        """The network's TransformerConfig (its attention geometry maps the qkv tensors)."""
        return self.encoder.config


def encoder_module(submodules: Any, name: str, family: Any) -> torch.nn.Module:
    """What encoder ``name`` of a modality's submodules imports and streams under ``family``:
    its network, or an :class:`EncoderView` with its input projection."""
    network = submodules.encoders[name]
    if not includes_projection(family):
        return network
    return EncoderView(network, submodules.input_projections[0])


def module_tensors(tensors: Callable[[str], Iterator[tuple[str, torch.Tensor]]], name: str,
                   family: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors of encoder ``name`` under the family's names: ``tensors(module)``
    yields (name inside the module, tensor) of a checkpoint module (``NAME``,
    ``NAME:projection``, whose names start with the projection's index)."""
    if not includes_projection(family):
        yield from tensors(name)
        return
    for inner, tensor in tensors(name):
        yield TOWER + inner, tensor
    for inner, tensor in tensors(f"{name}:projection"):
        yield PROJECTION + inner.partition(".")[2], tensor
