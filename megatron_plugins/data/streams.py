"""What every data source shares: batching, the per-rank microbatch stream, stock's provider.

A source (:mod:`~megatron_plugins.data.mock`, :mod:`~megatron_plugins.data.energon`) yields, per
microbatch, this rank's sample keys and its batch (built by :func:`collate_text` or
:func:`collate_items`, in a loader worker where there is one). A sample holds 0..N items per
encoder; every batch carries each sample's item token counts (:data:`ITEM_TOKENS`), which the
language ranks read from the samples' metadata and the encoder ranks from the items they embed.
:class:`MicrobatchStream` hands batches to the forward step, reports the keys and counts of
training microbatches to the :class:`~megatron_plugins.data.addressing.AlignmentGuard`, and saves
the source's position into checkpoints. With ``--balance-encoder-work`` a language stream also
tells the forward step how to put each balanced encoder's received rows in sample order
(:data:`RECEIVED_ORDER`). A rank hosting colocated encoders reads one stream per module, each
from its own replica's slice, zipped by a :class:`ColocatedStream` (:data:`COLOCATED`).
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from megatron_plugins.data.addressing import AlignmentGuard, GuardSet, RankSlice
from megatron_plugins.data.balance import balanced_encoders, received_order
from megatron_plugins.data.packing import pack_row, padding_share
from megatron_plugins.encoders.base import MediaPreprocessor
from megatron_plugins.parallel.layout import LANGUAGE
from megatron_plugins.parallel.topology import HeteroTopology

__all__ = [
    "COLOCATED", "ColocatedStream", "DataSource", "ITEM_SIZES", "ITEM_TOKENS", "LENGTH",
    "Microbatch",
    "MicrobatchStream", "POSITIONS", "Packing", "REAL_TOKENS", "RECEIVED_ORDER", "SPLITS",
    "TRUNCATED",
    "alignment_guard", "collate_items", "collate_text", "data_provider", "data_state_path",
    "is_witness", "rank_slice"
]

SPLITS = ("train", "valid", "test")

Microbatch = tuple[list[str], dict[str, Any]]
"""A rank's sample keys and the batch its forward step reads."""

ITEM_TOKENS = "item_tokens"
"""Batch entry: per encoder (every encoder on language ranks, its own on encoder ranks), each
sample's item token counts, a tuple per sample (empty for a sample without such items)."""

ITEM_SIZES = "item_sizes"
"""Batch entry (encoder ranks, and each hosted encoder's batch on a colocated rank): per encoder,
each sample's items' sizes (a list of size tuples per sample, as ``item_tokens(size)`` takes
them), from which the encoder's FLOPs are counted."""

POSITIONS = "positions"
"""Batch entry (set by every source, read by the stream): the positions of the global microbatch
the batch's samples hold, in the batch's order."""

RECEIVED_ORDER = "received_order"
"""Batch entry (language ranks, ``--balance-encoder-work``): per balanced encoder, a ``long``
tensor indexing the rows received from its fan-in group into this batch's sample order
(:func:`.balance.received_order`)."""

TRUNCATED = "truncated_keys"
"""Batch entry (language ranks) naming samples whose text was cut to ``--seq-length``."""

COLOCATED = "colocated"
"""Batch entry (ranks hosting colocated encoders): per hosted encoder, the batch its own stream
yields for its replica's positions (``modality_inputs``, :data:`ITEM_TOKENS`), which need not be
the language replica's positions."""

LENGTH = "length"
"""Language sample field (a 0-d tensor) and batch entry (``[samples]``): the positions each
sample fills before its padding."""

REAL_TOKENS = "real_tokens"
"""Batch entry (language ranks, an ``int``): the positions of the microbatch's rows its samples
fill, padding excluded (packed or not); what throughput counts as tokens."""


class DataSource(Protocol):
    """Where samples come from; every rank opens the same global stream (see addressing)."""

    special_token_ids: dict[str, int]
    static_shapes: bool
    """Every sample fills the same number of positions per encoder (fixed item counts and
    sizes): cross-grid transfers then keep one shape, exchanged once."""

    def open(self, split: str, rank_slice: RankSlice, start: int,
             resume: Path | None) -> Iterator[Microbatch] | None:
        """This rank's microbatches of ``split`` (None if the dataset has no such split), from
        global sample ``start`` or from the loader state saved in ``resume``."""


def collate_text(samples: list[dict[str, torch.Tensor]],
                 item_tokens: list[dict[str, tuple[int, ...]]]) -> dict[str, Any]:
    """Language ranks: the samples' fields stacked (their :data:`LENGTH` too) and every encoder's
    item token counts per sample (``item_tokens``, one dict per sample). No dense mask: the
    language layers' causal mask type needs none, and an ``s x s`` one would cost ``s^2`` bytes
    per row and a host-to-device copy every step (1 GiB at 32k tokens)."""
    batch: dict[str, Any] = {key: torch.stack([sample[key] for sample in samples])
                             for key in samples[0]}
    batch[ITEM_TOKENS] = {name: [counts[name] for counts in item_tokens]
                          for name in item_tokens[0]}
    return batch


def collate_items(module: str, preprocessor: MediaPreprocessor,
                  samples: list[list[dict[str, torch.Tensor]]],
                  item_tokens: list[tuple[int, ...]],
                  item_sizes: list[list[tuple[int, ...]]]) -> dict[str, Any]:
    """Encoder ranks: every item of the microbatch's samples, in sample then item order, as the
    preprocessor collates them (no inputs when no sample holds an item: the model then hands
    the language an empty output), and each sample's item token counts and sizes."""
    items = [item for sample in samples for item in sample]
    inputs = {module: {module: preprocessor.collate(items)}} if items else None
    return {"modality_inputs": inputs, ITEM_TOKENS: {module: [tuple(c) for c in item_tokens]},
            ITEM_SIZES: {module: [[tuple(size) for size in sizes] for sizes in item_sizes]}}


def data_state_path(iteration_dir: Path, module: str, dp_rank: int) -> Path:
    """Where one module replica's loader state lives inside a checkpoint iteration folder."""
    return Path(iteration_dir) / "dataloader" / f"{module}_dp{dp_rank:03d}.pt"


@dataclass(frozen=True)
class Packing:
    """The language side's ``--pack-sequences`` and what it needs (see :mod:`.packing`)."""

    placeholder_ids: Collection[int]
    """The encoders' placeholder token ids: text may be cut, never their runs."""
    multiple: int = 1
    """Each packed sample is padded to a multiple of this: the language grid's ``cp_chunks``."""


class _PaddingTally:
    """Counts a language stream's training rows and the positions its samples fill, and prints
    the padding share unpacked and packed once ``microbatches`` were counted."""

    def __init__(self, microbatches: int, seq_length: int) -> None:
        self.left = microbatches
        self.seq_length = seq_length
        self.microbatches = 0
        self.samples = 0
        self.natural = 0
        self.packed = 0

    def count(self, lengths: list[int], packed: int) -> None:
        """One microbatch: its samples' natural lengths and the positions its packed row fills."""
        self.microbatches += 1
        self.samples += len(lengths)
        self.natural += sum(lengths)
        self.packed += packed
        self.left -= 1
        if self.left == 0:
            unpacked = padding_share(self.natural, self.samples, self.seq_length)
            packed_share = padding_share(self.packed, self.microbatches, self.seq_length)
            print(f"pretrain_mimo.py: padding share of language DP replica 0's training rows "
                  f"({self.microbatches} microbatches of {self.samples} samples, --seq-length "
                  f"{self.seq_length}): {unpacked:.1%} unpacked ({self.samples} rows), "
                  f"{packed_share:.1%} packed ({self.microbatches} rows, --pack-sequences)",
                  file=sys.stderr, flush=True)


class MicrobatchStream(Iterator[dict[str, Any]]):
    """One split's batches on this rank, as stock ``pretrain()`` iterates them; with
    ``packing`` a language microbatch's samples become one row (:func:`.packing.pack_row`);
    ``balanced`` (language ranks) names each balanced encoder's fan-in replicas."""

    def __init__(self, source: Iterator[Microbatch], rank_slice: RankSlice,
                 guard: AlignmentGuard | None, writes_state: bool,
                 packing: Packing | None = None, tally: _PaddingTally | None = None,
                 balanced: Mapping[str, int] | None = None) -> None:
        self._source = source
        self._slice = rank_slice
        self._guard = guard
        self._balanced = dict(balanced or {})
        self._writes_state = writes_state
        self._packing = packing
        self._tally = tally
        self._noticed_truncation = False
        self._noticed_cut = False

    def __next__(self) -> dict[str, Any]:
        keys, batch = next(self._source)
        positions = batch.pop(POSITIONS)
        if self._guard is not None:
            self._guard.record(keys, positions, batch[ITEM_TOKENS])
        if self._balanced:
            batch[RECEIVED_ORDER] = {
                name: torch.tensor(received_order(batch[ITEM_TOKENS][name], replicas),
                                   dtype=torch.long)
                for name, replicas in self._balanced.items()}
        truncated = batch.pop(TRUNCATED, [])
        if truncated and self._writes_state and not self._noticed_truncation:
            self._noticed_truncation = True
            print(f"pretrain_mimo.py: notice: sample {truncated[0]!r} is longer than "
                  "--seq-length; its text is cut to fit and the loss covers what is left (a "
                  "sample with no answer token left adds nothing to the loss); later cut "
                  "samples are not reported", file=sys.stderr, flush=True)
        lengths = batch.pop(LENGTH, None)
        if lengths is None:
            return batch
        lengths = lengths.tolist()
        batch[REAL_TOKENS] = sum(lengths)
        packed = min(sum(lengths), batch["tokens"].shape[-1])
        if self._packing is not None:
            row = pack_row(batch, lengths, keys, self._packing.placeholder_ids,
                           self._packing.multiple)
            batch = {**batch, **row.fields, "packing_kwargs": row.packing_kwargs()}
            packed = batch[REAL_TOKENS] = sum(row.kept)
            if row.cut and self._writes_state and not self._noticed_cut:
                self._noticed_cut = True
                print(f"pretrain_mimo.py: notice: sample {row.cut[0]!r} does not fit in its "
                      "packed row (--pack-sequences puts a microbatch's --micro-batch-size "
                      "samples in one --seq-length row); its text is cut from the end (never "
                      "an encoder's placeholder run; a text-only sample may be dropped whole) "
                      "and the loss covers what is left; later cut samples are not reported",
                      file=sys.stderr, flush=True)
        if self._tally is not None:
            self._tally.count(lengths, packed)
        return batch

    def save_data_state(self, iteration_dir: Path) -> None:
        """Write the source's position (one file per module DP replica) if it has one."""
        state = getattr(self._source, "state_dict", None)
        if state is None or not self._writes_state:
            return
        path = data_state_path(iteration_dir, self._slice.module, self._slice.dp_rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state(), path)


class ColocatedStream(Iterator[dict[str, Any]]):
    """A colocated rank's batches: the language stream's, each carrying the hosted encoders'
    batches of the same global microbatch under :data:`COLOCATED`."""

    def __init__(self, language: MicrobatchStream,
                 encoders: Mapping[str, MicrobatchStream]) -> None:
        self._language = language
        self._encoders = dict(encoders)

    def __next__(self) -> dict[str, Any]:
        batch = next(self._language)
        batch[COLOCATED] = {name: next(stream) for name, stream in self._encoders.items()}
        return batch

    def save_data_state(self, iteration_dir: Path) -> None:
        """Write every module's source position (one file per module DP replica)."""
        for stream in (self._language, *self._encoders.values()):
            stream.save_data_state(iteration_dir)


def rank_slice(topology: HeteroTopology, module: str, micro_batch_size: int,
               balance: bool = False) -> RankSlice:
    """This rank's slice of ``module`` in every global microbatch (``balance``:
    ``--balance-encoder-work``)."""
    return RankSlice.of(topology.layout, module, topology.module_pgs[module].dp.rank(),
                        micro_batch_size, balance)


def is_witness(topology: HeteroTopology, module: str) -> bool:
    """Whether this rank is ``module``'s tensor and context-parallel rank 0 of the first pipeline
    stage: the one rank per replica that speaks for it (the CP ranks of a replica all hold its
    whole microbatch)."""
    pgc = topology.module_pgs[module]
    return pgc.tp.rank() == 0 and pgc.cp.rank() == 0 and pgc.pp.rank() == 0


def alignment_guard(topology: HeteroTopology, micro_batch_size: int,
                    balance: bool = False) -> GuardSet:
    """The guards of this rank's training streams, one per active module (``balance``:
    ``--balance-encoder-work``, whose assignment they check too)."""
    return GuardSet(topology.layout, [
        AlignmentGuard(topology.layout, module,
                       rank_slice(topology, module, micro_batch_size, balance),
                       is_witness(topology, module), balance)
        for module in topology.active_modules])


def _training_tally(args: Any, this: RankSlice) -> _PaddingTally | None:
    """The padding tally of the microbatches this run trains on (none when ``--train-iters``
    is not given: the end is then not known in microbatches)."""
    if args.train_iters is None:
        return None
    steps = args.train_iters - args.iteration
    per_step = args.global_batch_size // this.global_batch
    return _PaddingTally(steps * per_step, args.seq_length) if steps > 0 else None


def data_provider(source: DataSource, topology: HeteroTopology, guard: GuardSet | None,
                  get_args: Callable[[], Any]) -> Callable[..., tuple]:
    """The ``train_valid_test_dataset_provider`` for stock ``pretrain()``.

    Run with ``--dataloader-type external``: stock passes the returned iterators through. It is
    called on every rank (``is_distributed``); a resumed run starts where the checkpoint's
    consumed-sample counters (mock) or saved loader states (Energon) say. A rank hosting
    colocated encoders gets a :class:`ColocatedStream` per split.
    """

    def open_stream(module: str, split: str, start: int, resume: Path | None,
                    args: Any) -> MicrobatchStream | None:
        this = rank_slice(topology, module, args.micro_batch_size, args.balance_encoder_work)
        language = module == LANGUAGE
        witness = is_witness(topology, module)
        balanced = (balanced_encoders(topology.layout)
                    if language and args.balance_encoder_work else {})
        packing = (Packing(frozenset(source.special_token_ids.values()),
                           topology.layout.language.cp_chunks)
                   if language and args.pack_sequences else None)
        train = split == "train"
        opened = source.open(split, this, start, resume if train else None)
        return None if opened is None else MicrobatchStream(
            opened, this, guard[module] if train and guard is not None else None,
            writes_state=witness, packing=packing,
            tally=_training_tally(args, this) if train and language
            and this.dp_rank == 0 and witness else None,
            balanced=balanced)

    def provider(train_valid_test_num_samples: Any, vp_stage: int | None = None) -> tuple:
        args = get_args()
        resume = None
        if args.load and args.iteration:
            from megatron.training.checkpointing import get_checkpoint_name

            resume = Path(get_checkpoint_name(args.load, args.iteration, return_base_dir=True))
        starts = (args.consumed_train_samples, args.consumed_valid_samples, 0)
        streams: list[Iterator[dict[str, Any]] | None] = []
        for split, start in zip(SPLITS, starts):
            opened = {module: open_stream(module, split, start, resume, args)
                      for module in topology.active_modules}
            if len(opened) == 1:
                [stream] = opened.values()
            elif None in opened.values():
                stream = None
            else:
                language = opened.pop(LANGUAGE)
                stream = ColocatedStream(language, opened)
            streams.append(stream)
        return tuple(streams)

    provider.is_distributed = True
    return provider
