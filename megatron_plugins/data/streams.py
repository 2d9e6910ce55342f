"""What every data source shares: batching, the per-rank microbatch stream, stock's provider.

A source (:mod:`~megatron_plugins.data.mock`, :mod:`~megatron_plugins.data.energon`) yields, per
microbatch, this rank's sample keys and its batch (built by :func:`collate_text` or
:func:`collate_items`, in a loader worker where there is one). A sample holds 0..N items per
encoder; every batch carries each sample's item token counts (:data:`ITEM_TOKENS`), which the
language ranks read from the samples' metadata and the encoder ranks from the items they embed.
:class:`MicrobatchStream` hands batches to the forward step, reports the keys and counts of
training microbatches to the :class:`~megatron_plugins.data.addressing.AlignmentGuard`, and saves
the source's position into checkpoints.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from megatron_plugins.data.addressing import AlignmentGuard, RankSlice
from megatron_plugins.encoders.base import MediaPreprocessor
from megatron_plugins.topology import HeteroTopology

__all__ = [
    "DataSource", "ITEM_TOKENS", "Microbatch", "MicrobatchStream", "SPLITS", "TRUNCATED",
    "alignment_guard", "collate_items", "collate_text", "data_provider", "data_state_path"
]

SPLITS = ("train", "valid", "test")

Microbatch = tuple[list[str], dict[str, Any]]
"""A rank's sample keys and the batch its forward step reads."""

ITEM_TOKENS = "item_tokens"
"""Batch entry: per encoder (every encoder on language ranks, its own on encoder ranks), each
sample's item token counts, a tuple per sample (empty for a sample without such items)."""

TRUNCATED = "truncated_keys"
"""Batch entry (language ranks) naming samples whose text was cut to ``--seq-length``."""


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
    """Language ranks: the samples' fields stacked, a causal mask, and every encoder's item
    token counts per sample (``item_tokens``, one dict per sample)."""
    batch: dict[str, Any] = {key: torch.stack([sample[key] for sample in samples])
                             for key in samples[0]}
    length = batch["tokens"].shape[1]
    causal = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
    batch["attention_mask"] = causal.expand(len(samples), 1, length, length)
    batch[ITEM_TOKENS] = {name: [counts[name] for counts in item_tokens]
                          for name in item_tokens[0]}
    return batch


def collate_items(module: str, preprocessor: MediaPreprocessor,
                  samples: list[list[dict[str, torch.Tensor]]],
                  item_tokens: list[tuple[int, ...]]) -> dict[str, Any]:
    """Encoder ranks: every item of the microbatch's samples, in sample then item order, as the
    preprocessor collates them (no inputs when no sample holds an item: the model then hands
    the language an empty output), and each sample's item token counts."""
    items = [item for sample in samples for item in sample]
    inputs = {module: {module: preprocessor.collate(items)}} if items else None
    return {"modality_inputs": inputs, ITEM_TOKENS: {module: [tuple(c) for c in item_tokens]}}


def data_state_path(iteration_dir: Path, module: str, dp_rank: int) -> Path:
    """Where one module replica's loader state lives inside a checkpoint iteration folder."""
    return Path(iteration_dir) / "dataloader" / f"{module}_dp{dp_rank:03d}.pt"


class MicrobatchStream(Iterator[dict[str, Any]]):
    """One split's batches on this rank, as stock ``pretrain()`` iterates them."""

    def __init__(self, source: Iterator[Microbatch], rank_slice: RankSlice,
                 guard: AlignmentGuard | None, writes_state: bool) -> None:
        self._source = source
        self._slice = rank_slice
        self._guard = guard
        self._writes_state = writes_state
        self._noticed_truncation = False

    def __next__(self) -> dict[str, Any]:
        keys, batch = next(self._source)
        if self._guard is not None:
            self._guard.record(keys, batch[ITEM_TOKENS])
        truncated = batch.pop(TRUNCATED, [])
        if truncated and self._writes_state and not self._noticed_truncation:
            self._noticed_truncation = True
            print(f"pretrain_mimo.py: notice: sample {truncated[0]!r} is longer than "
                  "--seq-length; its text is cut to fit and the loss covers what is left (a "
                  "sample with no answer token left adds nothing to the loss); later cut "
                  "samples are not reported", file=sys.stderr, flush=True)
        return batch

    def save_data_state(self, iteration_dir: Path) -> None:
        """Write the source's position (one file per module DP replica) if it has one."""
        state = getattr(self._source, "state_dict", None)
        if state is None or not self._writes_state:
            return
        path = data_state_path(iteration_dir, self._slice.module, self._slice.dp_rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state(), path)


def rank_slice(topology: HeteroTopology, micro_batch_size: int) -> RankSlice:
    """This rank's slice of every global microbatch."""
    [module] = topology.active_modules
    return RankSlice.of(topology.layout, module, topology.module_pgs[module].dp.rank(),
                        micro_batch_size)


def is_witness(topology: HeteroTopology) -> bool:
    """Tensor rank 0 of the first pipeline stage: the one rank per replica that speaks for it."""
    [module] = topology.active_modules
    pgc = topology.module_pgs[module]
    return pgc.tp.rank() == 0 and pgc.pp.rank() == 0


def alignment_guard(topology: HeteroTopology, micro_batch_size: int) -> AlignmentGuard:
    """The guard of this rank's training stream."""
    [module] = topology.active_modules
    return AlignmentGuard(topology.layout, module, rank_slice(topology, micro_batch_size),
                          is_witness(topology))


def data_provider(source: DataSource, topology: HeteroTopology, guard: AlignmentGuard | None,
                  get_args: Callable[[], Any]) -> Callable[..., tuple]:
    """The ``train_valid_test_dataset_provider`` for stock ``pretrain()``.

    Run with ``--dataloader-type external``: stock passes the returned iterators through. It is
    called on every rank (``is_distributed``); a resumed run starts where the checkpoint's
    consumed-sample counters (mock) or saved loader states (Energon) say.
    """

    def provider(train_valid_test_num_samples: Any, vp_stage: int | None = None) -> tuple:
        args = get_args()
        this = rank_slice(topology, args.micro_batch_size)
        resume = None
        if args.load and args.iteration:
            from megatron.training.checkpointing import get_checkpoint_name

            resume = Path(get_checkpoint_name(args.load, args.iteration, return_base_dir=True))
        starts = (args.consumed_train_samples, args.consumed_valid_samples, 0)
        streams = []
        for split, start in zip(SPLITS, starts):
            opened = source.open(split, this, start, resume if split == "train" else None)
            streams.append(None if opened is None else MicrobatchStream(
                opened, this, guard if split == "train" else None,
                writes_state=is_witness(topology)))
        return tuple(streams)

    provider.is_distributed = True
    return provider
