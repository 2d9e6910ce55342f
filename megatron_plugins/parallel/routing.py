"""Routing of a colocated encoder's output rows to the language model's first pipeline stage, and
of their gradients back, when the encoder's grid and the language grid cover the same ranks.

Why not the wheel's ``ColocatedBridgeCommunicator``: it narrows or all-gathers the flattened batch
by this rank's own DP indices, so it needs language PP 1 and CP 1 and one row count for every
sample, and pairs the wrong samples wherever a rank's encoder replica does not feed its own
language replica (with language PP > 1, as upstream's extension of it allows). Here a pure
:class:`RoutingPlan` says, from the two placements and the row count of every sample position a
rank holds, which rows it sends to and receives from which peer;
:func:`~megatron_plugins.step.colocated.route_forward` and ``route_backward`` run it with one
``batch_isend_irecv`` each and a local copy of the rows a rank already holds, never padding.
Nothing here imports torch: ``mimo-plan`` prints a layout's :func:`summarize`.

Addressing is the data layer's (:class:`~megatron_plugins.data.addressing.RankSlice`): global
microbatch ``k`` holds ``M = micro_batch_size x language dp`` positions; encoder replica ``e``
computes positions ``e*b .. e*b + b - 1`` (``b = M / encoder dp``), identically on each of its TP
ranks; language replica ``r`` consumes ``r*mbs .. r*mbs + mbs - 1`` on every tp x cp rank of its
pipeline stage 0 (the rows MimoModel merges into the text embeddings). A rank's *computed* buffer
holds its encoder positions' rows and its *consumed* buffer its language positions' rows (empty off
stage 0), microbatch after microbatch, each in position order.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megatron_plugins.parallel.layout import LayoutError, ModulePlacement

__all__ = ["Exchange", "Message", "RoutingPlan", "RoutingSummary", "Span", "summarize"]

Span = tuple[int, int]
"""Rows ``start .. stop - 1`` of a buffer."""


def _merged(spans: Sequence[Span]) -> tuple[Span, ...]:
    """``spans`` without empty ones, adjacent ones joined (the row order stays the same)."""
    out: list[Span] = []
    for start, stop in spans:
        if start == stop:
            continue
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], stop)
        else:
            out.append((start, stop))
    return tuple(out)


def _merged_pairs(pairs: Sequence[tuple[Span, Span]]) -> tuple[tuple[Span, Span], ...]:
    out: list[tuple[Span, Span]] = []
    for source, target in pairs:
        if source[0] == source[1]:
            continue
        if out and out[-1][0][1] == source[0] and out[-1][1][1] == target[0]:
            (first, _), (second, _) = out[-1]
            out[-1] = ((first, source[1]), (second, target[1]))
        else:
            out.append((source, target))
    return tuple(out)


@dataclass(frozen=True)
class Message:
    """Rows this rank exchanges with ``peer`` in one direction: ``spans`` of its own buffer, in
    the order the message carries them (the peer lays out the same rows in the same order)."""

    peer: int
    spans: tuple[Span, ...]

    @property
    def rows(self) -> int:
        """Rows the message carries."""
        return sum(stop - start for start, stop in self.spans)


@dataclass(frozen=True)
class Exchange:
    """One direction of the routing on one rank, from a source buffer into a target buffer.

    ``local``: (source span, target span) pairs of equal length, copied without communication.
    Forward, targets are disjoint and cover the target buffer; backward, several contributions
    (the gradients of one row from every language CP lane) land on the same rows and add up.
    """

    sends: tuple[Message, ...]
    receives: tuple[Message, ...]
    local: tuple[tuple[Span, Span], ...]

    @property
    def received_rows(self) -> int:
        """Rows this rank receives from peers."""
        return sum(message.rows for message in self.receives)

    @property
    def sent_rows(self) -> int:
        """Rows this rank sends to peers."""
        return sum(message.rows for message in self.sends)


def _check_colocated(encoder: ModulePlacement, language: ModulePlacement) -> None:
    if (encoder.rank_offset, encoder.size) != (language.rank_offset, language.size):
        raise LayoutError(
            f"{encoder.source}: colocated with {language.source} (ranks {language.ranks.start}-"
            f"{language.ranks.stop - 1}) but covers ranks {encoder.ranks.start}-"
            f"{encoder.ranks.stop - 1}; choose tp x dp = {language.size} for {encoder.name}"
        )
    for key in ("pp", "cp"):
        if getattr(encoder, key) > 1:
            raise LayoutError(f"{encoder.source}: {key}={getattr(encoder, key)}: a colocated "
                              f"encoder must have {key}=1; scale it with tp or dp")


class _Grids:
    """Rank arithmetic of the two grids (``ModulePlacement.coordinates`` order: tp fastest)."""

    def __init__(self, encoder: ModulePlacement, language: ModulePlacement,
                 micro_batch_size: int) -> None:
        self.encoder, self.language = encoder, language
        self.global_batch = micro_batch_size * language.dp
        if self.global_batch % encoder.dp != 0:
            raise LayoutError(
                f"--micro-batch-size {micro_batch_size} x {language.source}: dp={language.dp} = "
                f"{self.global_batch} samples per microbatch cannot be split over "
                f"{encoder.source}: dp={encoder.dp}; choose a micro batch size that makes it "
                "divisible"
            )
        self.micro_batch_size = micro_batch_size
        self._coordinates: dict[tuple[str, int], dict[str, int]] = {}

    def coordinates(self, module: ModulePlacement, rank: int) -> dict[str, int]:
        """``module.coordinates(rank)``, remembered (a plan asks for few ranks, many times)."""
        key = (module.name, rank)
        if key not in self._coordinates:
            self._coordinates[key] = module.coordinates(rank)
        return self._coordinates[key]

    def positions(self, module: ModulePlacement, dp_rank: int) -> range:
        """The positions replica ``dp_rank`` of ``module`` holds (``RankSlice.positions``)."""
        batch = self.global_batch // module.dp
        return range(dp_rank * batch, (dp_rank + 1) * batch)

    def source_replica(self, position: int) -> int:
        return position // (self.global_batch // self.encoder.dp)

    def destination_replica(self, position: int) -> int:
        return position // self.micro_batch_size

    def encoder_rank(self, replica: int, tp: int) -> int:
        return self.encoder.rank_offset + tp + self.encoder.tp * replica

    def stage0_rank(self, replica: int, cp: int, tp: int) -> int:
        language = self.language
        return language.rank_offset + tp + language.tp * (cp + language.cp * replica)

    def stage0(self, replica: int) -> list[int]:
        """Every tp x cp rank of the language replica's first pipeline stage."""
        return [self.stage0_rank(replica, cp, tp)
                for cp in range(self.language.cp) for tp in range(self.language.tp)]

    def is_stage0_of(self, rank: int, replica: int, cp: int | None = None) -> bool:
        coords = self.coordinates(self.language, rank)
        return (coords["pp"] == 0 and coords["dp"] == replica
                and (cp is None or coords["cp"] == cp))

    def sender(self, destination: int, replica: int) -> int:
        """The rank of encoder ``replica`` that gives ``destination`` its rows: itself when it
        computed them, else the TP rank its stage-local index picks (spreads the senders)."""
        if self.coordinates(self.encoder, destination)["dp"] == replica:
            return destination
        coords = self.coordinates(self.language, destination)
        lane = coords["tp"] + self.language.tp * coords["cp"]
        return self.encoder_rank(replica, lane % self.encoder.tp)

    def gradient_owner(self, source: int, replica: int, cp: int) -> int:
        """The rank of language replica ``replica``'s stage 0 in CP lane ``cp`` that gives encoder
        rank ``source`` that lane's gradient of a row: itself when it holds one, else the TP rank
        matching its encoder TP index (every TP rank of a lane holds the same gradient)."""
        if self.is_stage0_of(source, replica, cp):
            return source
        tp = self.coordinates(self.encoder, source)["tp"] % self.language.tp
        return self.stage0_rank(replica, cp, tp)


def _row_count(rows: Sequence[Sequence[int] | Mapping[int, int]], microbatch: int,
               position: int) -> int:
    try:
        count = rows[microbatch][position]
    except (IndexError, KeyError):
        raise ValueError(f"no row count for microbatch {microbatch}, position {position}: the "
                         "routing needs every position of this rank's encoder and language "
                         "slices") from None
    try:
        number = -1 if isinstance(count, bool) else operator.index(count)
    except TypeError:
        number = -1
    if number < 0:
        raise ValueError(f"row count {count!r} of microbatch {microbatch}, position {position} "
                         "must be a non-negative integer")
    return number


def _layout_rows(rows: Sequence[Sequence[int] | Mapping[int, int]], positions: Sequence[int],
                 ) -> tuple[dict[tuple[int, int], Span], tuple[Span, ...]]:
    """Where each (microbatch, position) lies in a buffer of ``positions`` per microbatch, and
    each microbatch's span."""
    where: dict[tuple[int, int], Span] = {}
    microbatches = []
    offset = 0
    for microbatch in range(len(rows)):
        first = offset
        for position in positions:
            count = _row_count(rows, microbatch, position)
            where[microbatch, position] = (offset, offset + count)
            offset += count
        microbatches.append((first, offset))
    return where, tuple(microbatches)


def _messages(spans: Mapping[int, list[Span]]) -> tuple[Message, ...]:
    messages = (Message(peer, _merged(spans[peer])) for peer in sorted(spans))
    return tuple(message for message in messages if message.spans)


@dataclass(frozen=True)
class RoutingPlan:
    """What one rank sends and receives to route one step's encoder rows (see the module doc).

    ``forward`` moves rows from the computed buffer into the consumed buffer; ``backward`` moves
    row gradients from the consumed buffer into the computed buffer, summing the language CP
    lanes. ``*_microbatches``: each microbatch's span of the buffer (Phase 2 takes its views of
    the consumed rows, Phase 1 concatenates the encoder's outputs in this order).
    """

    rank: int
    computed_rows: int
    consumed_rows: int
    computed_microbatches: tuple[Span, ...]
    consumed_microbatches: tuple[Span, ...]
    forward: Exchange
    backward: Exchange
    minimum_received_rows: int
    """Rows this rank must receive at least (both directions): forward the rows it consumes but
    did not compute; backward one gradient per language CP lane of each row it computed, less
    the one it holds itself."""

    @classmethod
    def build(cls, encoder: ModulePlacement, language: ModulePlacement, rank: int,
              micro_batch_size: int,
              rows: Sequence[Sequence[int] | Mapping[int, int]]) -> RoutingPlan:
        """The plan of global ``rank`` for a step of ``len(rows)`` microbatches, where
        ``rows[k][p]`` is the row count of position ``p`` of global microbatch ``k`` (zero for a
        sample without this encoder's items). Only the positions of the rank's encoder slice and
        (on language stage 0) language slice are read: a rank passes the counts its batches
        carry, a list per microbatch or a mapping from position to count."""
        _check_colocated(encoder, language)
        grids = _Grids(encoder, language, micro_batch_size)
        if rank not in encoder.ranks:
            raise ValueError(f"rank {rank} is not in {encoder.source} (ranks {encoder.ranks})")
        source_replica = encoder.coordinates(rank)["dp"]
        lane = language.coordinates(rank)
        stage0 = lane["pp"] == 0
        replica = lane["dp"]
        computed_positions = list(grids.positions(encoder, source_replica))
        consumed_positions = list(grids.positions(language, replica)) if stage0 else []
        computed, computed_microbatches = _layout_rows(rows, computed_positions)
        consumed, consumed_microbatches = _layout_rows(rows, consumed_positions)
        microbatches = range(len(rows))

        sends: dict[int, list[Span]] = defaultdict(list)
        receives: dict[int, list[Span]] = defaultdict(list)
        local: list[tuple[Span, Span]] = []
        for k in microbatches:
            for p in computed_positions:
                for destination in grids.stage0(grids.destination_replica(p)):
                    if grids.sender(destination, source_replica) != rank:
                        continue
                    if destination == rank:
                        local.append((computed[k, p], consumed[k, p]))
                    else:
                        sends[destination].append(computed[k, p])
            for p in consumed_positions:
                sender = grids.sender(rank, grids.source_replica(p))
                if sender != rank:
                    receives[sender].append(consumed[k, p])
        forward = Exchange(_messages(sends), _messages(receives), _merged_pairs(local))

        sends, receives, local = defaultdict(list), defaultdict(list), []
        for k in microbatches:
            for p in computed_positions:
                destination = grids.destination_replica(p)
                for cp in range(language.cp):
                    owner = grids.gradient_owner(rank, destination, cp)
                    if owner == rank:
                        local.append((consumed[k, p], computed[k, p]))
                    else:
                        receives[owner].append(computed[k, p])
            for p in consumed_positions:
                source = grids.source_replica(p)
                for tp in range(encoder.tp):
                    peer = grids.encoder_rank(source, tp)
                    if peer != rank and grids.gradient_owner(peer, replica, lane["cp"]) == rank:
                        sends[peer].append(consumed[k, p])
        backward = Exchange(_messages(sends), _messages(receives), _merged_pairs(local))

        # What no routing can avoid, whichever ranks send: rows of other encoder replicas, and
        # the gradient of every CP lane but the rank's own (when it consumed the row itself).
        minimum = sum(stop - start for (k, p), (start, stop) in consumed.items()
                      if grids.source_replica(p) != source_replica)
        minimum += sum((stop - start) * (language.cp - (stage0 and grids.destination_replica(p)
                                                         == replica))
                       for (k, p), (start, stop) in computed.items())
        return cls(rank, computed_microbatches[-1][1] if rows else 0,
                   consumed_microbatches[-1][1] if rows else 0, computed_microbatches,
                   consumed_microbatches, forward, backward, minimum)

    def bytes_moved(self, width: int, dtype: "torch.dtype") -> int:
        """Bytes this rank receives from peers in the step, forward and backward, for rows of
        ``width`` elements of ``dtype``."""
        rows = self.forward.received_rows + self.backward.received_rows
        return rows * width * dtype.itemsize

    def bytes_minimum(self, width: int, dtype: "torch.dtype") -> int:
        """Bytes this rank must receive at least (:attr:`minimum_received_rows`)."""
        return self.minimum_received_rows * width * dtype.itemsize


@dataclass(frozen=True)
class RoutingSummary:
    """How much of a colocated encoder's output crosses the network, per sample of one row (what
    ``mimo-plan`` prints for a layout, before any data exists)."""

    local_share: float
    """Share of the rows the language first stage merges that its ranks computed themselves."""
    rows_per_sample: float
    """Rows each sample sends forward, over all destination ranks."""
    gradients_per_sample: float
    """Row gradients each sample sends backward, over all encoder TP ranks and CP lanes."""


def summarize(encoder: ModulePlacement, language: ModulePlacement,
              micro_batch_size: int) -> RoutingSummary:
    """The :class:`RoutingSummary` of every rank's plan for one microbatch of one-row samples."""
    samples = micro_batch_size * language.dp
    plans = [RoutingPlan.build(encoder, language, rank, micro_batch_size, [[1] * samples])
             for rank in language.ranks]
    consumed = sum(plan.consumed_rows for plan in plans)
    routed = sum(plan.forward.received_rows for plan in plans)
    return RoutingSummary((consumed - routed) / consumed, routed / samples,
                          sum(plan.backward.received_rows for plan in plans) / samples)
