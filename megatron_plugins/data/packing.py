"""Sequence packing (``--pack-sequences``): a language microbatch's samples laid end to end in one row.

Each sample keeps its natural length, its own position ids (0 up; multimodal RoPE's three rows
alike) and its loss mask; the rest of the row is padding. The row's THD segments (one per sample,
the padding its own) make attention stay inside each sample. Samples stay in order, so the
encoders' outputs, which the language model scatters into the placeholder positions in row-major
order, land where they did unpacked. When the samples do not fit, the later samples' text is cut
from their end, never into a placeholder run (a text-only sample may be cut away whole: dropped).

Under language context parallelism (CP) every segment is cut into ``2 x cp`` chunks, so each
sample is padded to a ``multiple`` of ``2 x cp`` (pad token 0, out of the loss, positions going
on as the sample's own padding has them) and the row carries Megatron's padded boundaries
(``cu_seqlens_*_padded``) beside the real ones; the trailing padding is then a segment with no
real tokens, so the padded boundaries end at the row's length, as Transformer Engine's split and
:mod:`megatron_plugins.ops.cp_positions` need.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from megatron_plugins.media.codec import BadSampleError

__all__ = ["PACKED_FIELDS", "PackedRow", "PackingError", "pack_row", "padding_share"]

PACKED_FIELDS = ("tokens", "labels", "loss_mask", "position_ids")
"""The per-position fields a language batch packs."""


class PackingError(BadSampleError):
    """A microbatch whose encoder placeholder runs alone do not fit in one packed row."""

    def __init__(self, keys: Sequence[str], needed: int, seq_length: int,
                 padded: int | None = None, multiple: int = 1) -> None:
        cp_padding = (f" ({padded} once each sample is padded to a multiple of {multiple}, "
                      "2 x the language cp, for context parallelism)"
                      if padded is not None and padded != needed else "")
        RuntimeError.__init__(
            self, f"samples {', '.join(repr(key) for key in keys)}: their encoder placeholder "
                  f"runs need {needed} positions{cp_padding}, more than one packed row of "
                  f"--seq-length {seq_length} holds (--pack-sequences); raise --seq-length or "
                  "lower --micro-batch-size")
        self.key = keys[0]
        self.field = "tokens"


def _padded(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``."""
    return -(-length // multiple) * multiple


@dataclass(frozen=True)
class PackedRow:
    """One packed row: each field ``[1, seq_length]``, and what :func:`pack_row` kept."""

    fields: dict[str, torch.Tensor]
    kept: tuple[int, ...]
    """Positions each sample kept (0: dropped)."""
    cut: tuple[str, ...]
    """Keys of the samples whose text was cut (or which were dropped) to fit."""
    multiple: int = 1
    """Each kept sample occupies a multiple of this many positions (``2 x cp``; 1 without CP)."""

    @property
    def padded_lengths(self) -> list[int]:
        """Positions each segment occupies: each kept sample padded to :attr:`multiple`, then the
        trailing padding (when there is any)."""
        length = self.fields["tokens"].shape[-1]
        lengths = [_padded(kept, self.multiple) for kept in self.kept if kept]
        padding = length - sum(lengths)
        return lengths + [padding] if padding else lengths

    @property
    def segment_lengths(self) -> list[int]:
        """Real tokens of each segment of :attr:`padded_lengths`. Without CP the trailing padding
        is a segment of its own tokens (as before CP existed); with CP it holds none."""
        real = [kept for kept in self.kept if kept]
        padded = self.padded_lengths
        if len(padded) == len(real):
            return real
        return real + [padded[-1] if self.multiple == 1 else 0]

    def packing_kwargs(self) -> dict[str, torch.Tensor | int]:
        """What ``MimoModel.forward(packing_kwargs=...)`` builds THD ``PackedSeqParams`` from:
        cumulative real lengths, and under CP the padded ones (Megatron's and Transformer
        Engine's convention, ending at the row's length); ``max_seqlen_*`` is the longest
        padded segment (the rotary length under CP)."""
        cu_seqlens = _cumulative(self.segment_lengths)
        longest = max(self.padded_lengths)
        kwargs: dict[str, torch.Tensor | int] = {
            "cu_seqlens_q": cu_seqlens, "cu_seqlens_kv": cu_seqlens.clone(),
            "max_seqlen_q": longest, "max_seqlen_kv": longest}
        if self.multiple > 1:
            padded = _cumulative(self.padded_lengths)
            kwargs.update(cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded.clone())
        return kwargs


def _cumulative(lengths: Sequence[int]) -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]`` as int32, the THD boundary convention."""
    cumulative = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cumulative[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    return cumulative


def _shortest(tokens: torch.Tensor, length: int, placeholder_ids: Collection[int]) -> int:
    """The fewest leading positions of a sample that keep all its placeholder runs."""
    is_placeholder = torch.isin(tokens[:length], torch.tensor(sorted(placeholder_ids),
                                                              dtype=tokens.dtype))
    positions = torch.nonzero(is_placeholder).flatten()
    return int(positions[-1]) + 1 if positions.numel() else 0


def _kept_lengths(rows: torch.Tensor, lengths: Sequence[int], keys: Sequence[str],
                  placeholder_ids: Collection[int], multiple: int) -> list[int]:
    """Each sample's kept length: all of it while the row holds them (each padded to
    ``multiple``), else the later samples cut first, each down to the end of its last
    placeholder run at most (padded too); a cut sample fills its padded length."""
    seq_length = rows.shape[-1]
    kept = list(lengths)
    excess = sum(_padded(length, multiple) for length in kept) - seq_length
    if excess <= 0:
        return kept
    shortest = [_shortest(rows[i], lengths[i], placeholder_ids) for i in range(len(lengths))]
    needed = sum(_padded(length, multiple) for length in shortest)
    if needed > seq_length:
        raise PackingError(keys, sum(shortest), seq_length, needed, multiple)
    for i in reversed(range(len(kept))):
        padded = _padded(kept[i], multiple)
        cut = min(excess, padded - _padded(shortest[i], multiple))
        kept[i] = min(kept[i], padded - cut)
        excess -= cut
        if excess == 0:
            break
    return kept


def pack_row(batch: dict[str, torch.Tensor], lengths: Sequence[int], keys: Sequence[str],
             placeholder_ids: Collection[int], multiple: int = 1) -> PackedRow:
    """Pack a microbatch's rows (:data:`PACKED_FIELDS`, each ``[samples, seq_length]``, sample
    ``i`` occupying its first ``lengths[i]`` positions; multimodal RoPE's position ids are
    ``[samples, 3, seq_length]``) into one row of ``seq_length``, each kept sample padded to a
    ``multiple`` of positions (``2 x cp`` under context parallelism; ``seq_length`` must be a
    multiple of it, as the layout check makes it).

    A cut sample's last kept position leaves the loss (its target is no longer in the row). Raises
    :class:`PackingError` when the samples' placeholder runs alone (padded) exceed the row.
    """
    tokens = batch["tokens"]
    if tokens.shape[-1] % multiple:
        raise ValueError(f"a packed row of {tokens.shape[-1]} positions cannot hold samples "
                         f"padded to multiples of {multiple}")
    kept = _kept_lengths(tokens, lengths, keys, placeholder_ids, multiple)
    padded = [_padded(count, multiple) for count in kept]
    padding = tokens.shape[-1] - sum(padded)
    fields = {}
    for name in PACKED_FIELDS:
        parts = []
        for i, (count, natural) in enumerate(zip(kept, lengths)):
            part = batch[name][i, ..., :count]
            if name == "loss_mask" and 0 < count < natural:
                part = part.clone()
                part[-1] = 0
            parts.append(part)
            if padded[i] > count:
                parts.append(_sample_padding(batch[name][i], name, count, padded[i]))
        if name == "position_ids":
            parts.append(torch.arange(padding, dtype=batch[name].dtype).expand(
                *batch[name].shape[1:-1], padding))
        else:
            # No sample was cut when there is padding, so the first sample's own padding (its
            # row beyond its length) is at least that long.
            parts.append(batch[name][0, lengths[0]:lengths[0] + padding])
        fields[name] = torch.cat(parts, dim=-1).unsqueeze(0)
    cut = tuple(key for key, count, natural in zip(keys, kept, lengths) if count < natural)
    return PackedRow(fields=fields, kept=tuple(kept), cut=cut, multiple=multiple)


def _sample_padding(row: torch.Tensor, name: str, start: int, end: int) -> torch.Tensor:
    """A sample's padding up to its CP multiple: token 0 out of the loss, and the positions its
    own row has there (text-like, going on from its last kept position, as
    :func:`.positions.mrope_position_ids` and the sources lay out a sample's padding)."""
    if name == "position_ids":
        return row[..., start:end]
    return torch.zeros(end - start, dtype=row.dtype)


def padding_share(occupied: int, rows: int, seq_length: int) -> float:
    """The share of ``rows`` rows' positions that are padding when ``occupied`` hold samples."""
    return 1.0 - occupied / (rows * seq_length) if rows else 0.0
