"""Which samples a rank holds, and the runtime check that encoder and language ranks agree.

Every data source reads one global sample stream, identical on every rank. Global microbatch
``k`` holds ``M = micro_batch_size x language dp`` consecutive samples of it; DP replica ``r`` of
a module whose replicas hold ``b`` samples each takes positions ``r*b .. r*b + b - 1``. That is
the order Megatron's bridge communicator concatenates encoder DP replicas in and splits them over
language DP replicas, for encoder DP equal to, larger or smaller than language DP, so the samples
an encoder replica embeds are by construction those of the language positions it fills. With
``--balance-encoder-work`` the replicas of an encoder that fill one language replica share its
positions by work instead (:mod:`.balance`), and :meth:`RankSlice.held_positions` says which.

:class:`AlignmentGuard` checks it anyway, at no extra collective: each step, every module's
witness rank (tensor and context-parallel rank 0 of the first pipeline stage) turns the keys of
the samples it held, with the token count of each of the sample's items, into per-position hashes,
encoders adding and the language model subtracting them per (encoder, language replica); the sums
ride in the global token-count all-reduce and must be zero. A sample whose items an encoder
counts otherwise than its language replica lays them out (a wrong size, a lost item) fails it as
a wrong key does; so does a balanced replica that sent its rows in another assignment than the
one the language's received order reads (same samples, other rows). A rank hosting a colocated
encoder holds one guard per module, summed and checked as one (:class:`GuardSet`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_plugins.data.balance import assign_samples, balanced_encoders
from megatron_plugins.parallel.layout import LANGUAGE, ParallelLayout, encoder_micro_batch_size

__all__ = ["AlignmentGuard", "DataMisalignmentError", "GuardSet", "RankSlice"]

_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class RankSlice:
    """The positions of every global microbatch that one DP replica of one module holds."""

    module: str
    dp_rank: int
    batch: int
    """Samples this replica holds per microbatch."""
    language_batch: int
    """Samples one language DP replica holds per microbatch (``--micro-batch-size``)."""
    global_batch: int
    """Samples per global microbatch, ``micro_batch_size x language dp``."""
    balance_replicas: int = 1
    """Replicas sharing this replica's language positions by work (``--balance-encoder-work``
    on an encoder with more DP replicas than the language); 1: the fixed slice."""

    @classmethod
    def of(cls, layout: ParallelLayout, module: str, dp_rank: int,
           micro_batch_size: int, balance: bool = False) -> RankSlice:
        """The slice of DP replica ``dp_rank`` of ``module``; with ``balance``, balanced within
        its fan-in group where the module has one."""
        batch = (micro_batch_size if module == LANGUAGE
                 else encoder_micro_batch_size(layout, module, micro_batch_size))
        replicas = balanced_encoders(layout).get(module, 1) if balance else 1
        return cls(module, dp_rank, batch, micro_batch_size,
                   micro_batch_size * layout.language.dp, replicas)

    @property
    def positions(self) -> range:
        """Positions within a global microbatch, in the order the bridge sends them."""
        return range(self.dp_rank * self.batch, (self.dp_rank + 1) * self.batch)

    def held_positions(self, item_tokens: Callable[[int], Sequence[int]]) -> list[int]:
        """The positions this replica holds in a global microbatch, in the order it sends them:
        its fixed slice, or (balanced) the samples :func:`.balance.assign_samples` gives it from
        its fan-in group, whose item token counts ``item_tokens(position)`` reads."""
        if self.balance_replicas == 1:
            return list(self.positions)
        first = self.dp_rank // self.balance_replicas * self.language_batch
        group = [item_tokens(first + index) for index in range(self.language_batch)]
        mine = assign_samples(group, self.balance_replicas)[self.dp_rank % self.balance_replicas]
        return [first + index for index in mine]

    def language_replica(self, position: int) -> int:
        """The language DP replica that holds ``position``."""
        return position // self.language_batch


class DataMisalignmentError(RuntimeError):
    """An encoder replica embedded samples that are not the ones its language replica holds."""


_Record = tuple[int, int, str, dict[str, tuple[int, ...]], dict[str, tuple[int, int]]]
"""One held sample: microbatch, position, key, per encoder its item token counts and (balanced
encoders) the (replica, row block) it travels in."""


def _position_hash(microbatch: int, position: int, key: str, encoder: str,
                   item_tokens: tuple[int, ...], sender: tuple[int, ...]) -> int:
    text = (f"{microbatch}|{position}|{key}|{encoder}|{','.join(map(str, item_tokens))}|"
            f"{','.join(map(str, sender))}")
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _as_int64(value: int) -> int:
    value &= _MASK
    return value - (1 << 64) if value >= 1 << 63 else value


class AlignmentGuard:
    """Per-step witness of the sample keys each module consumed (see the module docstring).

    :meth:`record` is called by the training stream for every microbatch; :meth:`contribution`
    is this module's share of the step's all-reduce, and its :class:`GuardSet` checks the
    reduced sums.
    """

    def __init__(self, layout: ParallelLayout, module: str, rank_slice: RankSlice,
                 witness: bool, balance: bool = False) -> None:
        self._encoders = [m.name for m in layout.encoders]
        self._language_dp = layout.language.dp
        self._module = module
        self._slice = rank_slice
        self._witness = witness
        self._balanced = balanced_encoders(layout) if balance and module == LANGUAGE else {}
        self._held: list[_Record] = []
        self._step_held: list[_Record] = []
        self._microbatch = 0

    @property
    def size(self) -> int:
        """Entries this guard adds to the all-reduce: one per (encoder, language replica)."""
        return len(self._encoders) * self._language_dp

    def record(self, keys: Sequence[str], positions: Sequence[int],
               item_tokens: Mapping[str, Sequence[tuple[int, ...]]]) -> None:
        """The keys of one training microbatch and the positions they hold (in the batch's
        order), and per encoder (this rank's, or every encoder on language ranks) each sample's
        item token counts."""
        if len(positions) != len(keys):
            raise ValueError(f"{len(keys)} keys recorded at {len(positions)} positions")
        if self._witness:
            senders = self._senders(len(keys), item_tokens)
            self._held += [
                (self._microbatch, position, key,
                 {name: tuple(counts[index]) for name, counts in item_tokens.items()},
                 {name: sent[index] for name, sent in senders.items()})
                for index, (position, key) in enumerate(zip(positions, keys))]
        self._microbatch += 1

    def _senders(self, samples: int, item_tokens: Mapping[str, Sequence[tuple[int, ...]]]
                 ) -> dict[str, list[tuple[int, int]]]:
        """Per balanced encoder, each sample's (replica within the fan-in group, row block within
        that replica's output): on an encoder replica the blocks it sends, on a language replica
        those its received order reads, so a replica that sent another assignment than the
        language assumes (same samples, other rows) fails the check too."""
        replicas = self._slice.balance_replicas
        if self._module != LANGUAGE:
            if replicas == 1:
                return {}
            return {self._module: [(self._slice.dp_rank % replicas, index)
                                   for index in range(samples)]}
        senders = {}
        for name, group_replicas in self._balanced.items():
            sent = [(0, 0)] * samples
            for replica, indices in enumerate(assign_samples(item_tokens[name], group_replicas)):
                for block, index in enumerate(indices):
                    sent[index] = (replica, block)
            senders[name] = sent
        return senders

    def contribution(self) -> torch.Tensor:
        """This rank's signed hash sums for the step (zeros off witnesses); starts a new step."""
        sums = [0] * self.size
        sign = -1 if self._module == LANGUAGE else 1
        for microbatch, position, key, item_tokens, senders in self._held:
            replica = self._slice.language_replica(position)
            for name, counts in item_tokens.items():
                value = _position_hash(microbatch, position, key, name, counts,
                                       senders.get(name, ()))
                sums[self._encoders.index(name) * self._language_dp + replica] += sign * value
        self._step_held, self._held, self._microbatch = self._held, [], 0
        return torch.tensor([_as_int64(value) for value in sums], dtype=torch.int64)

    @property
    def module(self) -> str:
        """The module whose stream records into this guard."""
        return self._module

    def witness_records(self) -> tuple[str, int, list | None]:
        """What :meth:`GuardSet.check` gathers from this guard after a failing step: the module,
        its DP rank and the last step's records (None off witnesses)."""
        return self._module, self._slice.dp_rank, self._step_held if self._witness else None


class GuardSet:
    """The alignment guards of every module active on this rank (two on a rank hosting a
    colocated encoder), seen by the gradient sync as one: one share of the all-reduce, one check.
    """

    def __init__(self, layout: ParallelLayout, guards: Sequence[AlignmentGuard]) -> None:
        self._encoders = [m.name for m in layout.encoders]
        self._language_dp = layout.language.dp
        self._guards = {guard.module: guard for guard in guards}

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules with a guard here, in the order they were given."""
        return tuple(self._guards)

    def __getitem__(self, module: str) -> AlignmentGuard:
        """The guard ``module``'s training stream records into."""
        return self._guards[module]

    def contribution(self) -> torch.Tensor:
        """This rank's signed hash sums for the step, every member's summed (wrapping like each
        member's); starts a new step."""
        parts = [guard.contribution().tolist() for guard in self._guards.values()]
        return torch.tensor([_as_int64(sum(column)) for column in zip(*parts)], dtype=torch.int64)

    def check(self, reduced: torch.Tensor) -> None:
        """Raise on every rank, naming both ranks and the first differing sample, if the step's
        encoder and language keys differ anywhere. Only a failing step gathers keys."""
        if not bool(reduced.ne(0).any()):
            return
        rank = dist.get_rank()
        mine = [(rank, *guard.witness_records()) for guard in self._guards.values()]
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        witnesses = [entry for entries in everyone for entry in entries]
        raise DataMisalignmentError(_first_difference(witnesses, reduced, self._encoders,
                                                      self._language_dp))


def _first_difference(witnesses: list, reduced: torch.Tensor, encoders: list[str],
                      language_dp: int) -> str:
    """The first (microbatch, position) whose key, item token counts or (balanced) sending
    replica differ between an encoder and the language."""
    held = {(module, dp): (rank, {(k, p): (key, counts, senders)
                                  for k, p, key, counts, senders in records})
            for rank, module, dp, records in witnesses if records is not None}
    language = {}
    for (module, dp), (rank, samples) in held.items():
        if module == LANGUAGE:
            language.update({slot: (rank, sample) for slot, sample in samples.items()})
    for (module, dp), (rank, samples) in sorted(held.items()):
        if module == LANGUAGE:
            continue
        for slot in sorted(samples):
            key, counts, senders = samples[slot]
            other_rank, (other_key, other_counts, other_senders) = language.get(
                slot, (None, (None, {}, {})))
            where = (f"data misalignment at microbatch {slot[0]} of this step: encoder "
                     f"{module!r} dp rank {dp} (global rank {rank}) embedded sample {key!r}")
            if other_key != key:
                return (f"{where} at position {slot[1]}, but language global rank {other_rank} "
                        f"holds {other_key!r} there")
            if other_counts.get(module) != counts[module]:
                return (f"{where} as items of {list(counts[module])} tokens, but language global "
                        f"rank {other_rank} laid out runs of {list(other_counts.get(module, ()))}")
            if other_senders.get(module) != senders.get(module):
                return (f"{where} and sent it as row block {senders[module][1]} of fan-in "
                        f"replica {senders[module][0]}, but language global rank {other_rank} "
                        f"reads it from block {other_senders[module][1]} of replica "
                        f"{other_senders[module][0]} (--balance-encoder-work assigned the "
                        "samples differently on the two sides)")
    bad = [(encoders[i // language_dp], i % language_dp)
           for i in range(reduced.numel()) if reduced[i] != 0]
    return f"data misalignment between (encoder, language replica) pairs {bad}"
