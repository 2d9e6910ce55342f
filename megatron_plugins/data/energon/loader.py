"""The Energon source of a run: Energon's loader per split over one global stream, cut per rank
(:mod:`.inputs`), and the training loader's saved state."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from megatron.energon import (
    WorkerConfig,
    get_loader,
    get_savable_loader,
    get_train_dataset,
    get_val_dataset,
    reraise_exception,
)

from megatron_plugins.data.addressing import RankSlice
from megatron_plugins.data.energon.dataset import DataPathError, check_dataset, split_sizes
from megatron_plugins.data.audio_in_video import AudioInVideo
from megatron_plugins.data.energon.inputs import (
    EncoderInputs,
    RankSliceEncoder,
    SoundOrder,
    TextInputs,
)
from megatron_plugins.data.samples import ConversationKind, SampleKind
from megatron_plugins.data.streams import Microbatch, data_state_path
from megatron_plugins.data.text import media_marker, read_chat_template
from megatron_plugins.data.tokenizer import PromptTokenizer
from megatron_plugins.encoders import EncoderPlugin
from megatron_plugins.parallel.layout import LANGUAGE
from megatron_plugins.weights.flags import checkpoint_image_token, checkpoint_item_wrapping

__all__ = ["EnergonSource", "open_source"]

SHUFFLE_BUFFER = 100
MAX_SAMPLES_PER_SEQUENCE = 100
"""Energon's recommended shuffle settings: a 100-sample buffer over 100-sample shard reads."""

ENERGON_SPLITS = {"train": "train", "valid": "val", "test": "test"}
"""Stock split name -> Energon split part."""


class _GlobalBatches(Iterator[Microbatch]):
    """The microbatches of successive global batches. A finite split (val, test) starts over when
    it ends; the training split's position is its loader's saved state."""

    def __init__(self, loader: Any, skip: int = 0) -> None:
        self._loader = loader
        self._iterator = iter(loader)
        self._pending: list[Microbatch] = []
        for _ in range(skip):
            self._next_global_batch()

    def _next_global_batch(self) -> list[Microbatch]:
        try:
            return list(next(self._iterator))
        except StopIteration:
            self._iterator = iter(self._loader)
            return list(next(self._iterator))

    def __next__(self) -> Microbatch:
        if not self._pending:
            self._pending = self._next_global_batch()
        return self._pending.pop(0)

    def state_dict(self) -> Any:
        """The loader's position; stock saves between steps, so no microbatch is pending."""
        if self._pending:
            raise RuntimeError(f"data state saved with {len(self._pending)} microbatches of a "
                               "global batch still pending")
        return self._loader.save_state_rank()


@dataclasses.dataclass(frozen=True)
class EnergonSource:
    """An Energon dataset read by every rank of a MiMo run (see :mod:`megatron_plugins.data.energon`)."""

    path: Path
    seed: int
    num_workers: int
    seq_length: int
    global_batch_size: int
    """Samples per Energon batch: one training step, so sample order is the same whatever the
    layout (micro-batch size, DP sizes) and the number of loader workers."""
    tokenizer: PromptTokenizer
    plugins: dict[str, EncoderPlugin]
    kind: SampleKind | None = None
    """The folder's sample kind; None for a metadataset (its datasets' kinds are not known)."""
    mrope: bool = False
    """The language model uses multimodal RoPE (:mod:`.positions`)."""
    audio_in_video: AudioInVideo | None = None
    """``--use-audio-in-video``: the videos' sound tracks feed the audio encoder too."""

    @property
    def special_token_ids(self) -> dict[str, int]:
        return dict(self.tokenizer.placeholder_ids)

    @property
    def static_shapes(self) -> bool:
        """Exactly one item per encoder in every sample (the kind says so), of one token count."""
        return (self.kind is not None and self.kind.one_item_each
                and all(plugin.fixed_item_tokens for plugin in self.plugins.values()))

    def _inputs(self, module: str) -> TextInputs | EncoderInputs:
        if module == LANGUAGE:
            markers = tuple((name, media_marker(p.preprocessor().media))
                            for name, p in self.plugins.items())
            return TextInputs(self.tokenizer, self.plugins, markers, self.seq_length,
                              self.mrope, self._sounds())
        plugin = self.plugins[module]
        sounds = (self._sounds() if self.audio_in_video is not None
                  and module == self.audio_in_video.audio else None)
        return EncoderInputs(plugin, plugin.preprocessor(), sounds)

    def _sounds(self) -> SoundOrder | None:
        return None if self.audio_in_video is None else SoundOrder(self.audio_in_video,
                                                                   self.plugins)

    def open(self, split: str, rank_slice: RankSlice, start: int,
             resume: Path | None) -> Iterator[Microbatch] | None:
        part = ENERGON_SPLITS[split]
        if self.path.is_dir() and split_sizes(self.path).get(part, 0) == 0:
            return None  # Stock then skips that split (no validation or no test run).
        worker_config = WorkerConfig(rank=0, world_size=1, num_workers=self.num_workers,
                                     seed_offset=self.seed,
                                     global_error_handler=reraise_exception)
        encoder = RankSliceEncoder(rank_slice, self._inputs(rank_slice.module))
        if split != "train":
            dataset = get_val_dataset(str(self.path), split_part=part,
                                      worker_config=worker_config,
                                      batch_size=self.global_batch_size, batch_drop_last=True,
                                      task_encoder=encoder)
            loader = get_loader(dataset)
            return _GlobalBatches(loader, (start // self.global_batch_size) % max(len(loader), 1))
        dataset = get_train_dataset(str(self.path), split_part=part, worker_config=worker_config,
                                    batch_size=self.global_batch_size, batch_drop_last=True,
                                    shuffle_buffer_size=SHUFFLE_BUFFER,
                                    max_samples_per_sequence=MAX_SAMPLES_PER_SEQUENCE,
                                    task_encoder=encoder)
        loader = get_savable_loader(dataset)
        if resume is not None:
            state_file = data_state_path(resume, rank_slice.module, rank_slice.dp_rank)
            if not state_file.is_file():
                raise DataPathError(
                    f"--load {resume.parent}: iteration folder {resume.name} has no data loader "
                    f"state {state_file.relative_to(resume)} for this --data-path run; it was "
                    "saved by a mock-data run or another layout. Load weights only "
                    "(--no-load-optim --no-load-rng --finetune) to start the data afresh"
                )
            loader.restore_state_rank(torch.load(state_file, weights_only=False))
        return _GlobalBatches(loader)


def open_source(path: Path, args: Any, plugins: dict[str, EncoderPlugin],
                audio_in_video: AudioInVideo | None = None) -> EnergonSource:
    """The Energon source of a run, every configuration problem raised as one line first."""
    if args.tokenizer_type != "HuggingFaceTokenizer" or not args.tokenizer_model:
        raise DataPathError(
            "--data-path needs a real tokenizer: add --tokenizer-type HuggingFaceTokenizer "
            "--tokenizer-model <local tokenizer folder>")
    if args.rampup_batch_size:
        raise DataPathError("--rampup-batch-size cannot be used with --data-path: an Energon "
                            "batch is one global batch of fixed size")
    kind = check_dataset(path, plugins, args)
    # Without an explicit (or checkpoint-restored) --padded-vocab-size stock pads the vocabulary
    # to hold the placeholders, so only an explicit size can be too small.
    tokenizer = PromptTokenizer.load(args.tokenizer_model, list(plugins),
                                     getattr(args, "padded_vocab_size", None) or sys.maxsize,
                                     args.special_tokens,
                                     read_chat_template(getattr(args, "chat_template", None)),
                                     checkpoint_image_token(args),
                                     checkpoint_item_wrapping(args))
    if isinstance(kind, ConversationKind):
        tokenizer.require_chat_template(f"--data-path {path}")
    return EnergonSource(path, args.seed, args.num_workers, args.seq_length,
                         args.global_batch_size, tokenizer, plugins, kind,
                         args.position_embedding_type == "mrope", audio_in_video)
