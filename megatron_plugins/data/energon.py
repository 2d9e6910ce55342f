"""Energon datasets (stock ``--data-path``): image-caption, VQA, audio-transcript and
conversation samples.

Every rank opens the same global stream: Energon with one data rank, the run's ``--seed`` and
``--num-workers``, batched into global microbatches of ``micro_batch_size x language dp``
samples, so sample order never depends on the layout. Energon's decoder is off; in the loader
workers each rank keeps only its positions of the microbatch (:class:`RankSlice`) and does only
its own work on them: language ranks tokenize text (read as UTF-8 where a ``field_map`` hands
its parts over as bytes) and never decode media, an encoder rank decodes and preprocesses only its
own modality. Errors are never skipped (Energon would skip a failing sample on one rank only,
which is silent misalignment): a sample that cannot be used stops training with its key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml
from braceexpand import braceexpand
from megatron.energon import (
    DefaultTaskEncoder,
    WorkerConfig,
    get_loader,
    get_savable_loader,
    get_train_dataset,
    get_val_dataset,
    reraise_exception,
    stateless,
)

from megatron_plugins.data.addressing import RankSlice
from megatron_plugins.media.codec import (
    BadSampleError,
    decode_item,
    decode_text,
    is_video,
    media_size,
    probe_item,
)
from megatron_plugins.data.positions import item_layout, mrope_position_ids
from megatron_plugins.data.streams import (
    POSITIONS,
    TRUNCATED,
    Microbatch,
    collate_items,
    collate_text,
    data_state_path,
)
from megatron_plugins.data.text import (
    ROLES,
    Conversation,
    PromptTokenizer,
    SampleText,
    media_marker,
    read_chat_template,
)
from megatron_plugins.encoders import EncoderPlugin
from megatron_plugins.errors import UsageError
from megatron_plugins.parallel.layout import LANGUAGE
from megatron_plugins.weights.flags import checkpoint_image_token, checkpoint_item_wrapping

__all__ = ["DataPathError", "EnergonSource", "SAMPLE_KINDS", "open_source"]

SHUFFLE_BUFFER = 100
MAX_SAMPLES_PER_SEQUENCE = 100
"""Energon's recommended shuffle settings: a 100-sample buffer over 100-sample shard reads."""

ENERGON_SPLITS = {"train": "train", "valid": "val", "test": "test"}
"""Stock split name -> Energon split part."""

@dataclasses.dataclass(frozen=True)
class SampleKind:
    """What one sample type carries: its media fields and the text fields its loss target (and
    prompt) come from."""

    media: tuple[str, ...]
    target: str
    prompt: str | None = None

    @property
    def fields(self) -> tuple[str, ...]:
        """Every field training reads, so every field a dataset's ``field_map`` must fill."""
        return (*self.media, *([self.prompt] if self.prompt else []), self.target)

    @property
    def one_item_each(self) -> bool:
        """Every sample holds exactly one item of each of its media kinds."""
        return True

    def items(self, sample: Any, media: str) -> list[tuple[str, Any]]:
        """The sample's undecoded items of ``media`` in order, each with the field it came from
        (for messages); a missing or empty one stops naming the sample."""
        data = getattr(sample, media, None)
        if not data:
            raise BadSampleError(sample.__key__, media, "is missing or empty")
        return [(media, data)]

    def text(self, sample: Any) -> SampleText:
        """The sample's text as ``str``: a ``field_map`` hands text parts over as raw bytes."""
        key = sample.__key__
        prompt = decode_text(getattr(sample, self.prompt), key, self.prompt) if self.prompt else ""
        target = getattr(sample, self.target)
        if isinstance(target, (list, tuple)):  # VQA answers: the first one is the target.
            if not target:
                raise BadSampleError(key, self.target, "is an empty list")
            target = target[0]
        return SampleText(prompt, decode_text(target, key, self.target))


@dataclasses.dataclass(frozen=True)
class ConversationKind(SampleKind):
    """Multi-turn samples: ``target`` holds the turns as JSON text, rendered with the chat
    template; each media kind's 0..N items are in a list field (``image`` -> ``images``)."""

    @property
    def fields(self) -> tuple[str, ...]:
        return (*(f"{media}s" for media in self.media), self.target)

    @property
    def one_item_each(self) -> bool:
        return False

    def items(self, sample: Any, media: str) -> list[tuple[str, Any]]:
        field = f"{media}s"
        data = getattr(sample, field, None)
        if data is None:
            raise BadSampleError(sample.__key__, field, "is missing")
        if isinstance(data, (bytes, bytearray, memoryview)):  # a field_map's single part
            data = [data]
        for index, item in enumerate(data):
            if not item:
                raise BadSampleError(sample.__key__, f"{field}[{index}]", "is empty")
        return [(f"{field}[{index}]", item) for index, item in enumerate(data)]

    def text(self, sample: Any) -> Conversation:  # type: ignore[override]
        """The sample's turns, each a ``(role, content)`` of a known role."""
        key = sample.__key__
        raw = decode_text(getattr(sample, self.target), key, self.target)
        try:
            turns = json.loads(raw)
        except json.JSONDecodeError as error:
            raise BadSampleError(key, self.target, f"is not JSON ({error.msg})") from None
        if not isinstance(turns, list) or not all(
                isinstance(turn, dict) and turn.get("role") in ROLES
                and isinstance(turn.get("content"), str) for turn in turns):
            raise BadSampleError(key, self.target, "is not a list of {role, content} turns "
                                 f"with role one of {', '.join(ROLES)}")
        return Conversation(tuple((turn["role"], turn["content"]) for turn in turns))


SAMPLE_KINDS: dict[str, SampleKind] = {
    "CaptioningSample": SampleKind(("image",), "caption"),
    "VQASample": SampleKind(("image",), "answers", prompt="context"),
    "AudioTranscriptSample": SampleKind(("audio",), "transcript"),
    "ImageAudioCaptionSample": SampleKind(("image", "audio"), "caption"),
    "ConversationSample": ConversationKind(("image",), "conversation"),
}
"""Sample types read here, by class name."""


class DataPathError(UsageError):
    """A ``--data-path`` that cannot be trained on; the message says what to fix."""


def _sample_kind(sample: Any) -> SampleKind:
    return SAMPLE_KINDS[type(sample).__name__]


def _item_tokens(plugin: EncoderPlugin, size: tuple[int, ...], key: str, field: str) -> int:
    """An item's token count, a size the encoder cannot take reported with the sample's key."""
    try:
        return plugin.item_tokens(size)
    except ValueError as error:
        raise BadSampleError(key, field, f"cannot be embedded by --encoder {plugin.name}: "
                                         f"{error}") from None


def _media_items(plugin: EncoderPlugin, sample: Any) -> list[tuple[str, Any]]:
    """One encoder's undecoded items of a sample with their fields; a video for an encoder that
    takes none stops naming it."""
    preprocessor = plugin.preprocessor()
    items = _sample_kind(sample).items(sample, preprocessor.media)
    for field, data in items:
        if is_video(data) and not getattr(preprocessor, "takes_video", False):
            raise BadSampleError(sample.__key__, field, f"is a video (a list of frames), which "
                                 f"--encoder {plugin.name}={plugin.grid.provider} does not take; "
                                 "give one image, or use an encoder that takes videos")
    return items


def _header_sizes(plugin: EncoderPlugin, sample: Any) -> list[tuple[str, tuple[int, ...]]]:
    """One encoder's items of a sample: each one's field and size, from its media parts'
    headers (never decoded)."""
    media = plugin.preprocessor().media
    return [(field, probe_item(media, data, sample.__key__, field))
            for field, data in _media_items(plugin, sample)]


def _header_item_tokens(plugin: EncoderPlugin, sample: Any) -> tuple[int, ...]:
    """One encoder's item token counts of a sample, from its media parts' headers."""
    return tuple(_item_tokens(plugin, size, sample.__key__, field)
                 for field, size in _header_sizes(plugin, sample))


@dataclasses.dataclass(frozen=True)
class _TextInputs:
    """Language ranks: a sample's text, tokenized and laid out after the encoders' placeholder
    runs (a conversation's runs where its markers are), each run sized from its item's header."""

    tokenizer: PromptTokenizer
    plugins: dict[str, EncoderPlugin]
    markers: tuple[tuple[str, str], ...]
    seq_length: int
    mrope: bool = False
    """The language model uses multimodal RoPE: ``position_ids`` are ``[3, seq_length]``."""

    def item_tokens(self, sample: Any) -> dict[str, tuple[int, ...]]:
        """Each encoder's item token counts, from the media parts' headers (never decoded)."""
        return {name: _header_item_tokens(plugin, sample) for name, plugin in self.plugins.items()}

    def _mrope_position_ids(self, sample: Any, tokens: torch.Tensor) -> torch.Tensor:
        """``[3, seq_length]`` positions from the tokens and the items' grids (headers only)."""
        items = {self.tokenizer.placeholder_ids[name]: [
                     item_layout(plugin, size) for _, size in _header_sizes(plugin, sample)]
                 for name, plugin in self.plugins.items()}
        try:
            return mrope_position_ids(tokens, items)
        except ValueError as error:
            raise BadSampleError(sample.__key__, "tokens", f"has placeholder runs that do not "
                                 f"match its items ({error})") from None

    def _check_room(self, sample: Any, counts: dict[str, tuple[int, ...]]) -> None:
        """The placeholder runs are never cut, so runs that alone overflow the row stop the run
        naming the sample (text is cut to fit around runs that do fit)."""
        needed = 1 + sum(sum(items) + 2 * len(items) * (name in self.tokenizer.wrapping)
                         for name, items in counts.items())  # a bos token, start / end ids
        if needed > self.seq_length:
            runs = ", ".join(f"{len(items)} {name} item{'s' * (len(items) != 1)} "
                             f"({'+'.join(map(str, items))} tokens)"
                             for name, items in counts.items() if items)
            kind = _sample_kind(sample)
            raise BadSampleError(sample.__key__, "+".join(kind.fields[: len(kind.media)]),
                                 f"needs {needed} positions for its placeholder runs ({runs}) "
                                 f"and a bos token, more than --seq-length {self.seq_length}; "
                                 "raise --seq-length, lower the encoder's tokens per item, or "
                                 "split the sample")

    def _video_markers(self, sample: Any, conversation: Conversation) -> Conversation:
        """A conversation's ``<video>`` markers as the marker of the encoder that takes videos,
        each of its markers (of either kind) at an item of that kind."""
        video = media_marker("video")
        if not any(video in content for _, content in conversation.turns):
            return conversation
        for name, marker in self.markers:
            plugin = self.plugins[name]
            if not getattr(plugin.preprocessor(), "takes_video", False):
                continue
            pattern = f"{re.escape(marker)}|{re.escape(video)}"
            found = [m for _, content in conversation.turns for m in re.findall(pattern, content)]
            kinds = [video if len(size) == 4 else marker
                     for _, size in _header_sizes(plugin, sample)]
            if found != kinds:
                raise BadSampleError(sample.__key__, "conversation",
                                     f"has the markers {' '.join(found)} for the items "
                                     f"{' '.join(kinds) or '(none)'}; give one marker per item "
                                     f"in order, {video} at each video")
            return Conversation(tuple((role, content.replace(video, marker))
                                      for role, content in conversation.turns))
        return conversation

    def __call__(self, sample: Any) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, ...]],
                                             bool]:
        text = _sample_kind(sample).text(sample)
        counts = self.item_tokens(sample)
        self._check_room(sample, counts)
        blocks = tuple((name, count) for name, items in counts.items() for count in items)
        if isinstance(text, Conversation):
            text = self._video_markers(sample, text)
            try:
                encoded = self.tokenizer.encode_conversation(text, blocks, dict(self.markers),
                                                             self.seq_length)
            except ValueError as error:
                raise BadSampleError(sample.__key__, "conversation", str(error)) from None
        else:
            encoded = self.tokenizer.encode(text, blocks, self.seq_length)
        fields = encoded.as_batch_fields()
        if self.mrope:
            fields["position_ids"] = self._mrope_position_ids(sample, encoded.tokens)
        return fields, counts, encoded.truncated


@dataclasses.dataclass(frozen=True)
class _EncoderInputs:
    """Encoder ranks: the media field this encoder reads, decoded and preprocessed, with each
    item's token count."""

    plugin: EncoderPlugin
    preprocessor: Any

    def __call__(self, sample: Any) -> tuple[list[dict[str, torch.Tensor]], tuple[int, ...],
                                             bool]:
        media_kind = self.preprocessor.media
        items, counts = [], []
        for field, data in _media_items(self.plugin, sample):
            media = decode_item(media_kind, data, sample.__key__, field)
            counts.append(_item_tokens(self.plugin, media_size(media), sample.__key__, field))
            try:
                items.append(self.preprocessor(media))
            except ValueError as error:
                raise BadSampleError(sample.__key__, field,
                                     f"cannot be preprocessed: {error}") from None
        return items, tuple(counts), False


class RankSliceEncoder(DefaultTaskEncoder):
    """Cuts each global batch into microbatches and keeps, prepares and collates only this rank's
    positions of each (in a loader worker when there are workers)."""

    decoder = None

    def __init__(self, rank_slice: RankSlice, inputs: Any) -> None:
        super().__init__()
        self._slice = rank_slice
        self._inputs = inputs

    @stateless
    def batch(self, samples: list) -> list:
        return samples

    @stateless
    def encode_batch(self, samples: list) -> list[Microbatch]:
        microbatches = []
        for first in range(0, len(samples), self._slice.global_batch):
            positions = self._slice.held_positions(
                lambda position, first=first: _header_item_tokens(
                    self._inputs.plugin, samples[first + position]))
            mine = [samples[first + position] for position in positions]
            prepared = [self._inputs(sample) for sample in mine]
            inputs = [fields for fields, _, _ in prepared]
            counts = [count for _, count, _ in prepared]
            if isinstance(self._inputs, _EncoderInputs):
                sizes = [[size for _, size in _header_sizes(self._inputs.plugin, sample)]
                         for sample in mine]
                batch = collate_items(self._slice.module, self._inputs.preprocessor, inputs,
                                      counts, sizes)
            else:
                batch = collate_text(inputs, counts)
            batch[POSITIONS] = positions
            truncated = [s.__key__ for s, (_, _, cut) in zip(mine, prepared) if cut]
            if truncated:
                batch[TRUNCATED] = truncated
            microbatches.append(([s.__key__ for s in mine], batch))
        return microbatches


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


def dataset_spec(path: Path) -> dict[str, Any]:
    """A prepared dataset folder's ``.nv-meta/dataset.yaml``."""
    return yaml.safe_load((path / ".nv-meta" / "dataset.yaml").read_text()) or {}


def dataset_sample_type(spec: dict[str, Any]) -> str:
    """The sample class a ``dataset.yaml`` declares."""
    sample_type = spec.get("sample_type") or {}
    return sample_type.get("__class__") or spec.get("__class__", "").replace("Webdataset",
                                                                               "Sample")


def _other_parts(path: Path, parts: list[str]) -> list[str] | None:
    """The part names the folder's samples hold when none holds any of ``parts``; None when one
    does, or without Energon's index to ask (a cheap query: it stops at the first match)."""
    index = path / ".nv-meta" / "index.sqlite"
    if not index.is_file():
        return None
    try:
        with contextlib.closing(sqlite3.connect(f"{index.as_uri()}?mode=ro", uri=True)) as db:
            marks = ",".join("?" * len(parts))
            if db.execute(f"SELECT 1 FROM sample_parts WHERE part_name IN ({marks}) LIMIT 1",
                          parts).fetchone():
                return None
            return [name for (name,) in db.execute(
                "SELECT DISTINCT part_name FROM sample_parts ORDER BY part_name LIMIT 20")]
    except sqlite3.Error:
        return None  # An index of another Energon version: Energon itself reads the parts.


def _check_field_map(path: Path, sample_type: str, spec: dict[str, Any]) -> None:
    """Refuse a ``field_map`` (what ``energon prepare --field-map`` writes) that leaves a field
    training reads unfilled, looks inside a part, or names parts no sample holds: Energon would
    fail on every rank at the first sample."""
    if spec.get("sample_loader"):
        return  # The loader fills the fields itself (tools.make_energon_dataset writes one).
    where = f"--data-path {path}: its .nv-meta/dataset.yaml"
    field_map = spec.get("field_map") or {}
    for field in SAMPLE_KINDS[sample_type].fields:
        if field not in field_map:
            raise DataPathError(
                f"{where} maps no tar part to the {field!r} field of {sample_type}; add "
                f"\"{field}\": \"<part extension>\" to its field_map (or re-run `energon "
                "prepare --force-overwrite` with that entry in --field-map)")
        parts = str(field_map[field]).split(",")
        nested = next((part for part in parts if "[" in part), None)
        if nested is not None:
            raise DataPathError(
                f"{where} maps {field!r} to {nested!r}, inside a part, which needs Energon's "
                "decoder (off in training); map it to a whole part holding just that text, or "
                "write a sample_loader (as python -m tools.make_energon_dataset does)")
        held = _other_parts(path, parts)
        if held is not None:
            raise DataPathError(
                f"{where} maps {field!r} to {field_map[field]!r}, but no sample of its shards "
                f"holds such a part (they hold: {', '.join(held) or 'none'}); map {field!r} to "
                "one of those in its field_map")


def split_sizes(path: Path) -> dict[str, int | None]:
    """Samples per Energon split part of a prepared dataset folder, from its metadata (None where
    a part names shards the metadata does not count)."""
    meta = path / ".nv-meta"
    info_file = next((meta / name for name in (".info.json", ".info.yaml")
                      if (meta / name).is_file()), None)
    counts = yaml.safe_load(info_file.read_text()).get("shard_counts", {}) if info_file else {}
    parts = yaml.safe_load((meta / "split.yaml").read_text()).get("split_parts", {})
    sizes: dict[str, int | None] = {}
    for part, patterns in parts.items():
        shards = [shard for pattern in patterns or [] for shard in braceexpand(pattern)]
        known = all(shard in counts for shard in shards)
        sizes[part] = sum(counts[shard] for shard in shards) if known else None
    return sizes


@dataclasses.dataclass(frozen=True)
class EnergonSource:
    """An Energon dataset read by every rank of a MiMo run (see the module docstring)."""

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

    @property
    def special_token_ids(self) -> dict[str, int]:
        return dict(self.tokenizer.placeholder_ids)

    @property
    def static_shapes(self) -> bool:
        """Exactly one item per encoder in every sample (the kind says so), of one token count."""
        return (self.kind is not None and self.kind.one_item_each
                and all(plugin.fixed_item_tokens for plugin in self.plugins.values()))

    def _inputs(self, module: str) -> Any:
        if module == LANGUAGE:
            markers = tuple((name, media_marker(p.preprocessor().media))
                            for name, p in self.plugins.items())
            return _TextInputs(self.tokenizer, self.plugins, markers, self.seq_length,
                               self.mrope)
        plugin = self.plugins[module]
        return _EncoderInputs(plugin, plugin.preprocessor())

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


def _check_dataset(path: Path, plugins: dict[str, EncoderPlugin], args: Any) -> SampleKind | None:
    """Refuse, in one line, a dataset folder this run cannot read (before any process group);
    returns its sample kind (None for a metadataset, whose datasets Energon resolves)."""
    flag = f"--data-path {path}"
    if not path.exists():
        raise DataPathError(f"{flag} does not exist; give a folder prepared with `energon "
                            "prepare` (or tools.make_energon_dataset) or a metadataset YAML")
    if path.is_file():
        return None  # A metadataset: Energon resolves and checks the datasets it blends.
    if not (path / ".nv-meta" / "dataset.yaml").is_file():
        raise DataPathError(
            f"{flag} is not a prepared Energon dataset (no .nv-meta/dataset.yaml); prepare it "
            f"with `energon prepare {path}` or `python -m tools.make_energon_dataset`")
    spec = dataset_spec(path)
    sample_type = dataset_sample_type(spec)
    if sample_type not in SAMPLE_KINDS:
        raise DataPathError(f"{flag} holds {sample_type or 'unknown'} samples; supported: "
                            f"{', '.join(SAMPLE_KINDS)}")
    _check_field_map(path, sample_type, spec)
    carried = SAMPLE_KINDS[sample_type].media
    for name, plugin in plugins.items():
        media = plugin.preprocessor().media
        if media not in carried:
            raise DataPathError(
                f"{flag} holds {sample_type} samples, which carry no {media!r} media for "
                f"--encoder {name}={plugin.grid.provider}; use a dataset with "
                f"{media} or drop that encoder")
    sizes = split_sizes(path)
    needed = {"train": "or lower --global-batch-size"}
    if args.eval_iters and args.eval_interval:
        needed["val"] = "or set --eval-iters 0"
    for part, fix in needed.items():
        size = sizes.get(part, 0)
        # A finite split is dealt out evenly to the loader workers: one must fill a batch.
        workers = max(1, args.num_workers) if part == "val" else 1
        if size is not None and -(-size // workers) < args.global_batch_size:
            per = (f" in any of its {workers} loader workers' shares (--num-workers)"
                   if workers > 1 else "")
            raise DataPathError(
                f"{flag}: its {part} split holds {size} samples, fewer than one global batch "
                f"(--global-batch-size {args.global_batch_size}){per}; add samples to it {fix}"
                + (" or lower --num-workers" if workers > 1 else ""))
    return SAMPLE_KINDS[sample_type]


def open_source(path: Path, args: Any, plugins: dict[str, EncoderPlugin]) -> EnergonSource:
    """The Energon source of a run, every configuration problem raised as one line first."""
    if args.tokenizer_type != "HuggingFaceTokenizer" or not args.tokenizer_model:
        raise DataPathError(
            "--data-path needs a real tokenizer: add --tokenizer-type HuggingFaceTokenizer "
            "--tokenizer-model <local tokenizer folder>")
    if args.rampup_batch_size:
        raise DataPathError("--rampup-batch-size cannot be used with --data-path: an Energon "
                            "batch is one global batch of fixed size")
    kind = _check_dataset(path, plugins, args)
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
                         args.position_embedding_type == "mrope")
