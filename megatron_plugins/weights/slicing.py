"""How a TP rank's slice of a Megatron tensor is made from slices of HF tensors, and back.

The layout math behind :data:`~megatron_plugins.weights.mapping.COMBINES`, shared by the import
(:func:`source_slices` + :func:`combine`) and streaming / export (:func:`split`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_plugins.weights.mapping import Bound, Heads

__all__ = ["combine", "source_slices", "split"]


@dataclass(frozen=True)
class Piece:
    """A slice of one HF tensor: ``start`` rows (on ``dim``) into the full HF tensor."""

    hf_name: str
    tensor: torch.Tensor
    dim: int
    start: int
    total: int | None = None
    """The HF tensor's size on ``dim`` when it is not this slice's times the TP size (one HF
    tensor holding q, k and v: each slice is a third of it)."""


def source_slices(bound: Bound, local_shape: Sequence[int], rank: int, heads: Heads | None
                  ) -> list[tuple[str, int, int, int]]:
    """Which rows of which HF tensor make this TP rank's slice: (hf name, dim, start, length)."""
    rule = bound.rule
    dim = rule.tp_dim if rule.tp_dim is not None else 0
    rows = local_shape[dim] if local_shape else 0
    if rule.tp_dim is None:
        return [(name, 0, 0, -1) for name in bound.hf]
    if rule.combine == "copy":
        return [(bound.hf[0], dim, rank * rows, rows)]
    if rule.combine == "gate_up":
        half = rows // 2
        return [(name, dim, rank * half, half) for name in bound.hf]
    if rule.combine in ("gdn_in", "gdn_conv"):
        sections = _gdn_sections(bound, heads)
        size = sum(length for _, _, length in sections) // rows
        return [(name, dim, base + rank * (length // size), length // size)
                for name, base, length in sections]
    if rule.combine == "gated_qkv":
        per_group = heads.heads // heads.groups
        groups = rows // ((2 * per_group + 2) * heads.head_dim)
        q_rows, kv_rows = groups * per_group * heads.head_dim, groups * heads.head_dim
        return [(bound.hf[0], dim, rank * 2 * q_rows, 2 * q_rows),
                (bound.hf[1], dim, rank * kv_rows, kv_rows),
                (bound.hf[2], dim, rank * kv_rows, kv_rows)]
    per_group = heads.heads // heads.groups
    groups = rows // ((per_group + 2) * heads.head_dim)
    q_rows, kv_rows = groups * per_group * heads.head_dim, groups * heads.head_dim
    if rule.combine == "fused_qkv":
        name = bound.hf[0]
        q_total, kv_total = heads.heads * heads.head_dim, heads.groups * heads.head_dim
        return [(name, dim, rank * q_rows, q_rows), (name, dim, q_total + rank * kv_rows, kv_rows),
                (name, dim, q_total + kv_total + rank * kv_rows, kv_rows)]
    return [(bound.hf[0], dim, rank * q_rows, q_rows), (bound.hf[1], dim, rank * kv_rows, kv_rows),
            (bound.hf[2], dim, rank * kv_rows, kv_rows)]


def _gdn_sections(bound: Bound, heads: Heads) -> list[tuple[str, int, int]]:
    """(HF name, first row, rows) of each Gated DeltaNet section, whole (TP 1): q, k, v inside
    the fused qkv tensor (or the convolution), then z, beta, alpha for ``in_proj``."""
    qk, v, value_heads = heads.linear
    fused = bound.hf[0]
    sections = [(fused, 0, qk), (fused, qk, qk), (fused, 2 * qk, v)]
    if bound.rule.combine == "gdn_in":
        sections += [(bound.hf[1], 0, v), (bound.hf[2], 0, value_heads),
                     (bound.hf[3], 0, value_heads)]
    return sections


def combine(bound: Bound, parts: Sequence[torch.Tensor], heads: Heads | None) -> torch.Tensor:
    """This rank's Megatron tensor from its HF slices (in :func:`source_slices` order)."""
    kind = bound.rule.combine
    if kind == "copy":
        return parts[0].reshape((1,) * bound.rule.leading_ones + tuple(parts[0].shape))
    if kind in ("gate_up", "gdn_in", "gdn_conv"):
        return torch.cat(parts, dim=bound.rule.tp_dim or 0)
    if kind == "gated_qkv":
        query_gate, k, v = parts
        groups, trailing = k.shape[0] // heads.head_dim, k.shape[1:]
        pairs = query_gate.reshape(-1, 2, heads.head_dim, *trailing)
        q, gate = (pairs[:, i].reshape(groups, -1, *trailing) for i in range(2))
        fused = torch.cat([q, gate, k.reshape(groups, -1, *trailing),
                           v.reshape(groups, -1, *trailing)], dim=1)
        return fused.reshape(-1, *trailing)
    q, k, v = parts
    groups = k.shape[0] // heads.head_dim
    trailing = q.shape[1:]
    fused = torch.cat([q.reshape(groups, -1, *trailing), k.reshape(groups, -1, *trailing),
                       v.reshape(groups, -1, *trailing)], dim=1)
    return fused.reshape(-1, *trailing)


def split(bound: Bound, local: torch.Tensor, rank: int, heads: Heads | None) -> list[Piece]:
    """The inverse of :func:`combine`: this rank's HF slices and where they sit."""
    slices = source_slices(bound, tuple(local.shape), rank, heads)
    kind = bound.rule.combine
    total = (heads.heads + 2 * heads.groups) * heads.head_dim if kind == "fused_qkv" else None
    if kind == "copy":
        parts = [local.reshape(local.shape[bound.rule.leading_ones:])]
    elif kind == "gate_up":
        parts = list(local.chunk(2, dim=bound.rule.tp_dim or 0))
    elif kind in ("gdn_in", "gdn_conv"):
        qk, v, _ = heads.linear
        total = 2 * qk + v
        parts = list(local.split([length for *_, length in slices], dim=bound.rule.tp_dim or 0))
        return [Piece(name, part, dim, start, total if index < 3 else None)
                for index, ((name, dim, start, _), part) in enumerate(zip(slices, parts))]
    elif kind == "gated_qkv":
        kv_rows = slices[1][3]
        groups, trailing = kv_rows // heads.head_dim, local.shape[1:]
        q_size = (local.shape[0] // groups - 2 * heads.head_dim) // 2
        q, gate, k, v = local.reshape(groups, -1, *trailing).split(
            [q_size, q_size, heads.head_dim, heads.head_dim], dim=1)
        query_gate = torch.stack([q.reshape(-1, heads.head_dim, *trailing),
                                  gate.reshape(-1, heads.head_dim, *trailing)], dim=1)
        parts = [query_gate.reshape(-1, *trailing), k.reshape(-1, *trailing),
                 v.reshape(-1, *trailing)]
    else:
        q_rows, kv_rows = slices[0][3], slices[1][3]
        groups = kv_rows // heads.head_dim
        per_group = local.reshape(groups, -1, *local.shape[1:])
        q_size, kv_size = q_rows // groups, kv_rows // groups
        q, k, v = per_group.split([q_size, kv_size, kv_size], dim=1)
        parts = [part.reshape(-1, *local.shape[1:]) for part in (q, k, v)]
    return [Piece(name, part, dim, max(start, 0), total)
            for (name, dim, start, _), part in zip(slices, parts)]
