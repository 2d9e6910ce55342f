"""Attention products on ``torch.nn.functional.scaled_dot_product_attention`` (SDPA), for the
fast core attention of the local path (:mod:`megatron_plugins.ops.fast_attention`).

The reference products (:func:`megatron_plugins.ops.packed_attention.attend`, Megatron's local
``DotProductAttention``) multiply out every ``sq x sk`` score matrix and keep the probabilities
for the backward. SDPA's fused kernels (flash / memory-efficient / cuDNN on CUDA, the flash kernel
on CPU) keep only the inputs, the output and one log-sum-exp per query row, and recompute the
scores in the backward. These functions give SDPA the reference's layouts: sequence-major
tensors, grouped keys and values (GQA), Megatron's boolean masks (True: masked out), and the
causal mask of queries that are the last rows of their keys' span (context parallelism).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["positioned", "product", "runs"]


def product(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float,
            causal: bool, dropout_p: float = 0.0,
            masked: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(scale QK^T)V over ``query`` ``[n, sq, heads, dim]`` and ``key`` / ``value``
    ``[n, sk, groups, dim]`` (groups dividing heads) -> ``[n, sq, heads, dim]``.

    ``causal``: query ``i`` sees keys ``j <= i + sk - sq`` (its own position and before when the
    queries are the last ``sq`` positions of the keys); ``masked``: Megatron's boolean mask
    broadcastable to ``[n, heads, sq, sk]``, True where a key is masked out (it then decides, as
    in ``DotProductAttention``). Without a mask the kernel reads the key and value groups itself
    (``enable_gqa``: the flash kernels on CPU and CUDA, cuDNN's and the memory-efficient one on
    CUDA), so no copy repeated to every query head is made or kept; with one they are repeated as
    the reference does, for the kernels that take a mask but not groups.
    """
    sq, sk = query.shape[1], key.shape[1]
    keep = None if masked is None else ~masked
    if causal and masked is None and sq != sk:
        # SDPA's is_causal aligns top-left; these queries end where the keys end.
        positions = torch.arange(sq, device=query.device) + (sk - sq)
        keep = torch.arange(sk, device=query.device)[None, :] <= positions[:, None]
    repeats = query.shape[2] // key.shape[2]
    if repeats > 1 and keep is not None:
        key = key.repeat_interleave(repeats, dim=2)
        value = value.repeat_interleave(repeats, dim=2)
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=keep,
        dropout_p=dropout_p, is_causal=causal and keep is None, scale=scale,
        enable_gqa=repeats > 1 and keep is None)
    return out.transpose(1, 2)


def runs(positions: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(first row, rows, first position)`` of each run of consecutive ``positions``."""
    if positions.numel() == 0:
        return []
    breaks = (torch.diff(positions) != 1).nonzero().squeeze(1) + 1
    bounds = [0, *breaks.tolist(), positions.numel()]
    firsts = positions[bounds[:-1]].tolist()
    return [(start, end - start, first)
            for start, end, first in zip(bounds[:-1], bounds[1:], firsts)]


def positioned(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               positions: torch.Tensor, *, scale: float, causal: bool) -> torch.Tensor:
    """Queries ``[sq, b, heads, dim]`` at ``positions`` (indices into the keys) against keys /
    values ``[sk, b, groups, dim]`` -> ``[sq, b, heads, dim]``; causal: a query sees the keys up
    to its own position.

    A context-parallel rank's queries are a few runs of consecutive positions (stock's two
    chunks per sequence or document): each run is one product over the keys up to its last
    position, the run being their last rows. A run that starts at position 0 is SDPA's own
    causal case; a later one carries a ``run x keys`` boolean mask, no heads, which the CP
    attention does not keep for its backward (it keeps only its local inputs).
    """
    q, k, v = (t.transpose(0, 1) for t in (query, key, value))
    if not causal:
        return product(q, k, v, scale=scale, causal=False).transpose(0, 1)
    parts = [product(q[:, start:start + rows], k[:, :first + rows], v[:, :first + rows],
                     scale=scale, causal=True)
             for start, rows, first in runs(positions)]
    return torch.cat(parts, dim=1).transpose(0, 1)
