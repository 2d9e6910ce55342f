"""Which global sequence positions a context-parallel (CP) rank holds, as stock Megatron splits.

Stock CP balances causal work by cutting a sequence into ``2 x cp`` equal chunks and giving rank
``r`` chunks ``r`` and ``2cp-1-r`` (``get_batch_on_this_cp_rank``); packed (THD) rows are cut the
same way per document, each padded to a multiple of ``2 x cp`` (Transformer Engine's
``thd_get_partitioned_indices``, which has no CPU or TE-less form). One place states both, so the
data split, the reference CP attention and the tests agree without Transformer Engine.
"""

from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams

__all__ = ["local_positions", "thd_partitioned_indices", "zigzag_indices"]


def _check_rank(cp: int, rank: int) -> None:
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"context parallel rank {rank} is outside a group of size {cp}")


def zigzag_indices(seq_length: int, cp: int, rank: int,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions (int64, ascending) CP rank ``rank`` holds of a ``seq_length`` row:
    chunks ``rank`` and ``2cp-1-rank`` of ``2cp`` equal chunks, as stock's per-sequence split."""
    _check_rank(cp, rank)
    if seq_length % (2 * cp):
        raise ValueError(f"sequence length {seq_length} is not a multiple of 2 x context "
                         f"parallel size ({2 * cp}); pad the row or change --seq-length")
    chunk = seq_length // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device)
                      for c in (rank, 2 * cp - 1 - rank)])


def thd_partitioned_indices(cu_seqlens_padded: torch.Tensor, seq_length: int, cp: int,
                            rank: int) -> torch.Tensor:
    """Transformer Engine's ``thd_get_partitioned_indices`` in plain torch: the global positions
    (int32, in local order) CP rank ``rank`` holds of a packed row, i.e. chunks ``rank`` and
    ``2cp-1-rank`` of every document, documents in order. ``cu_seqlens_padded`` are the padded
    document boundaries; each must be a multiple of ``2 x cp`` (TE asserts on the device)."""
    _check_rank(cp, rank)
    bounds = [int(b) for b in cu_seqlens_padded.reshape(-1).tolist()]
    if bounds[0] != 0 or any(b % (2 * cp) for b in bounds) or bounds != sorted(bounds):
        raise ValueError(f"padded document boundaries {bounds} must start at 0, ascend and be "
                         f"multiples of 2 x context parallel size ({2 * cp}); pad every "
                         f"packed document to a multiple of {2 * cp}")
    if bounds[-1] != seq_length:
        # TE's kernel reads tokens past the last boundary as more of the last document.
        raise ValueError(f"padded document boundaries end at {bounds[-1]}, not at the packed "
                         f"row's {seq_length} tokens; make the trailing padding a segment")
    device = cu_seqlens_padded.device
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        chunk = (end - start) // (2 * cp)
        parts += [torch.arange(start + c * chunk, start + (c + 1) * chunk, device=device)
                  for c in (rank, 2 * cp - 1 - rank)]
    return torch.cat(parts).to(torch.int32)


def local_positions(seq_length: int, cp: int, rank: int,
                    packed_seq_params: PackedSeqParams | None = None,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions (int64) of this CP rank's tokens in local order: per document for a THD
    row (padded boundaries, the unpadded ones when no padded are given), else per sequence."""
    if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
        return zigzag_indices(seq_length, cp, rank, device)
    bounds = packed_seq_params.cu_seqlens_q_padded
    if bounds is None:
        bounds = packed_seq_params.cu_seqlens_q
    return thd_partitioned_indices(bounds.to(device), seq_length, cp, rank).long()
