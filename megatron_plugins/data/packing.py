"""Sequence packing (``--pack-sequences``): a language microbatch's samples laid end to end in one row.

Each sample keeps its natural length, its own position ids (0 up; multimodal RoPE's three rows
alike) and its loss mask; the rest of the row is padding. The row's THD segments (one per sample,
the padding its own) make attention stay inside each sample. Samples stay in order, so the encoders' outputs, which the language
model scatters into the placeholder positions in row-major order, land where they did unpacked.
When the samples do not fit, the later samples' text is cut from their end, never into a
placeholder run (a text-only sample may be cut away whole: dropped).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from megatron_plugins.data.media import BadSampleError

__all__ = ["PACKED_FIELDS", "PackedRow", "PackingError", "pack_row", "padding_share"]

PACKED_FIELDS = ("tokens", "labels", "loss_mask", "position_ids")
"""The per-position fields a language batch packs."""


class PackingError(BadSampleError):
    """A microbatch whose encoder placeholder runs alone do not fit in one packed row."""

    def __init__(self, keys: Sequence[str], needed: int, seq_length: int) -> None:
        RuntimeError.__init__(
            self, f"samples {', '.join(repr(key) for key in keys)}: their encoder placeholder "
                  f"runs need {needed} positions, more than one packed row of --seq-length "
                  f"{seq_length} holds (--pack-sequences); raise --seq-length or lower "
                  "--micro-batch-size")
        self.key = keys[0]
        self.field = "tokens"


@dataclass(frozen=True)
class PackedRow:
    """One packed row: each field ``[1, seq_length]``, and what :func:`pack_row` kept."""

    fields: dict[str, torch.Tensor]
    kept: tuple[int, ...]
    """Positions each sample kept (0: dropped)."""
    cut: tuple[str, ...]
    """Keys of the samples whose text was cut (or which were dropped) to fit."""

    @property
    def segment_lengths(self) -> list[int]:
        """THD segments: each kept sample, then the trailing padding (when there is any)."""
        length = self.fields["tokens"].shape[-1]
        lengths = [kept for kept in self.kept if kept]
        padding = length - sum(lengths)
        return lengths + [padding] if padding else lengths

    def packing_kwargs(self) -> dict[str, torch.Tensor | int]:
        """What ``MimoModel.forward(packing_kwargs=...)`` builds THD ``PackedSeqParams`` from."""
        lengths = torch.tensor(self.segment_lengths, dtype=torch.int32)
        cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.cumsum(lengths, 0)
        longest = int(lengths.max())
        return {"cu_seqlens_q": cu_seqlens, "cu_seqlens_kv": cu_seqlens.clone(),
                "max_seqlen_q": longest, "max_seqlen_kv": longest}


def _shortest(tokens: torch.Tensor, length: int, placeholder_ids: Collection[int]) -> int:
    """The fewest leading positions of a sample that keep all its placeholder runs."""
    is_placeholder = torch.isin(tokens[:length], torch.tensor(sorted(placeholder_ids),
                                                              dtype=tokens.dtype))
    positions = torch.nonzero(is_placeholder).flatten()
    return int(positions[-1]) + 1 if positions.numel() else 0


def _kept_lengths(rows: torch.Tensor, lengths: Sequence[int], keys: Sequence[str],
                  placeholder_ids: Collection[int]) -> list[int]:
    """Each sample's kept length: all of it while the row holds them, else the later samples cut
    first, each down to the end of its last placeholder run at most."""
    seq_length = rows.shape[-1]
    kept = list(lengths)
    excess = sum(kept) - seq_length
    if excess <= 0:
        return kept
    shortest = [_shortest(rows[i], lengths[i], placeholder_ids) for i in range(len(lengths))]
    if sum(shortest) > seq_length:
        raise PackingError(keys, sum(shortest), seq_length)
    for i in reversed(range(len(kept))):
        cut = min(excess, kept[i] - shortest[i])
        kept[i] -= cut
        excess -= cut
        if excess == 0:
            break
    return kept


def pack_row(batch: dict[str, torch.Tensor], lengths: Sequence[int], keys: Sequence[str],
             placeholder_ids: Collection[int]) -> PackedRow:
    """Pack a microbatch's rows (:data:`PACKED_FIELDS`, each ``[samples, seq_length]``, sample
    ``i`` occupying its first ``lengths[i]`` positions; multimodal RoPE's position ids are
    ``[samples, 3, seq_length]``) into one row of ``seq_length``.

    A cut sample's last kept position leaves the loss (its target is no longer in the row). Raises
    :class:`PackingError` when the samples' placeholder runs alone exceed the row.
    """
    tokens = batch["tokens"]
    kept = _kept_lengths(tokens, lengths, keys, placeholder_ids)
    padding = tokens.shape[-1] - sum(kept)
    fields = {}
    for name in PACKED_FIELDS:
        parts = [batch[name][i, ..., :count] for i, count in enumerate(kept)]
        if name == "loss_mask":
            parts = [part.clone() for part in parts]
            for part, count, natural in zip(parts, kept, lengths):
                if 0 < count < natural:
                    part[-1] = 0
        if name == "position_ids":
            parts.append(torch.arange(padding, dtype=batch[name].dtype).expand(
                *batch[name].shape[1:-1], padding))
        else:
            # No sample was cut when there is padding, so the first sample's own padding (its
            # row beyond its length) is at least that long.
            parts.append(batch[name][0, lengths[0]:lengths[0] + padding])
        fields[name] = torch.cat(parts, dim=-1).unsqueeze(0)
    cut = tuple(key for key, count, natural in zip(keys, kept, lengths) if count < natural)
    return PackedRow(fields=fields, kept=tuple(kept), cut=cut)


def padding_share(occupied: int, rows: int, seq_length: int) -> float:
    """The share of ``rows`` rows' positions that are padding when ``occupied`` hold samples."""
    return 1.0 - occupied / (rows * seq_length) if rows else 0.0
