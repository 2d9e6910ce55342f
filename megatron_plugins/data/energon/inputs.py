"""What each rank makes of its positions of an Energon sample: a language rank tokenizes the text
after the encoders' placeholder runs (sized from the media headers, never decoded), an encoder
rank decodes and preprocesses its own items; :class:`RankSliceEncoder` keeps, prepares and
collates only this rank's positions of each global microbatch."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from megatron.energon import DefaultTaskEncoder, stateless

from megatron_plugins.data.addressing import RankSlice
from megatron_plugins.data.positions import (
    item_layout,
    mrope_position_ids,
    text_after_time_ids,
)
from megatron_plugins.data.samples import sample_kind
from megatron_plugins.data.streams import (
    POSITIONS,
    TRUNCATED,
    Microbatch,
    collate_items,
    collate_text,
)
from megatron_plugins.data.text import Conversation, media_marker
from megatron_plugins.data.tokenizer import PromptTokenizer
from megatron_plugins.encoders import EncoderPlugin
from megatron_plugins.media.codec import (
    BadSampleError,
    decode_item,
    is_video,
    media_size,
    probe_item,
)

__all__ = ["EncoderInputs", "RankSliceEncoder", "TextInputs"]


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
    items = sample_kind(sample).items(sample, preprocessor.media)
    for field, data in items:
        if is_video(data) and not getattr(preprocessor, "takes_video", False):
            raise BadSampleError(sample.__key__, field, f"is a video, which "
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
class TextInputs:
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
            return mrope_position_ids(tokens, items, text_after_time_ids(
                self.plugins, self.tokenizer.placeholder_ids))
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
            kind = sample_kind(sample)
            fields = dict(zip(kind.media, kind.fields))  # the media fields come first
            held = dict.fromkeys(fields[self.plugins[name].preprocessor().media]
                                 for name, items in counts.items() if items)
            raise BadSampleError(sample.__key__, "+".join(held),
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
        text = sample_kind(sample).text(sample)
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
class EncoderInputs:
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

    def __init__(self, rank_slice: RankSlice, inputs: TextInputs | EncoderInputs) -> None:
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
            if isinstance(self._inputs, EncoderInputs):
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
