"""What each rank makes of its positions of an Energon sample: a language rank tokenizes the text
after the encoders' placeholder runs (sized from the media headers, never decoded), an encoder
rank decodes and preprocesses its own items; :class:`RankSliceEncoder` keeps, prepares and
collates only this rank's positions of each global microbatch."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import torch
from megatron.energon import DefaultTaskEncoder, stateless

from megatron_plugins.data.addressing import RankSlice
from megatron_plugins.data.audio_in_video import AudioInVideo
from megatron_plugins.data.positions import (
    ItemLayout,
    WithSound,
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
from megatron_plugins.data.text import (
    Conversation,
    marker_sequence,
    media_marker,
    place_markers,
)
from megatron_plugins.data.tokenizer import PromptTokenizer
from megatron_plugins.encoders import EncoderPlugin
from megatron_plugins.media import codec
from megatron_plugins.media.codec import (
    BadSampleError,
    Waveform,
    decode_item,
    is_video,
    media_size,
    probe_item,
)

__all__ = ["EncoderInputs", "RankSliceEncoder", "SoundOrder", "TextInputs"]


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


def _video_turns(turns: tuple[tuple[str, str], ...], marker: str) -> list[tuple[str, str]]:
    """The turns with each ``<video>`` marker as the video-taking encoder's ``marker``."""
    video = media_marker("video")
    return [(role, content.replace(video, marker)) for role, content in turns]


class _HeldSounds:
    """The sound tracks decoded while one global microbatch is built (:meth:`SoundOrder.held`),
    each by its sample's key, its field and its item: balancing, sizing and embedding a sample
    read its sound once, and no track outlives the microbatch (each loader worker holds its own).
    Each track keeps its item object, so no other item can take that object's id meanwhile."""

    def __init__(self) -> None:
        self.open = False
        self.tracks: dict[tuple[str, str, int], tuple[Any, Waveform]] = {}


@dataclasses.dataclass(frozen=True)
class SoundOrder:
    """``--use-audio-in-video``: the audio encoder's items are its clips and the videos' sound
    tracks, in the order the conversation holds them (each sound where its video is)."""

    audio_in_video: AudioInVideo
    plugins: dict[str, EncoderPlugin]
    _held: _HeldSounds = dataclasses.field(default_factory=_HeldSounds, init=False,
                                           compare=False, repr=False)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Within it, each video's sound track is decoded once and kept until it ends (the
        building of one global microbatch); outside, each :meth:`sound` decodes afresh."""
        self._held.open = True
        try:
            yield
        finally:
            self._held.open = False
            self._held.tracks.clear()

    @property
    def names(self) -> tuple[str, str]:
        """The video-taking encoder's name and the audio encoder's."""
        return self.audio_in_video.vision, self.audio_in_video.audio

    @property
    def audio(self) -> EncoderPlugin:
        return self.plugins[self.audio_in_video.audio]

    @property
    def vision(self) -> EncoderPlugin:
        return self.plugins[self.audio_in_video.vision]

    def items(self, sample: Any) -> list[tuple[str, Any, bool]]:
        """The audio encoder's undecoded items in sequence order: ``(field, data, is_sound)``,
        a sound's data its video item's."""
        visual, clips = _media_items(self.vision, sample), _media_items(self.audio, sample)
        text = sample_kind(sample).text(sample)
        if not isinstance(text, Conversation):
            return [(field, data, False) for field, data in clips]
        markers = {name: media_marker(plugin.preprocessor().media)
                   for name, plugin in self.plugins.items()}
        vision = self.audio_in_video.vision
        turns = _video_turns(text.turns, markers[vision])
        try:
            placed = place_markers(turns, markers, {vision: len(visual),
                                                    self.audio_in_video.audio: len(clips)})
        except ValueError as error:
            raise BadSampleError(sample.__key__, "conversation", str(error)) from None
        order, pending = [], {vision: iter(visual), self.audio_in_video.audio: iter(clips)}
        for name in marker_sequence(placed, markers):
            if name not in pending:
                continue
            field, data = next(pending[name])
            if name == self.audio_in_video.audio:
                order.append((field, data, False))
            elif is_video(data):
                order.append((field, data, True))
        return order

    def sound(self, data: Any, key: str, field: str) -> Waveform:
        """A video item's sound track (kept while :meth:`held`: the sample's key, the field and
        the item object, alive as long as its sample, name it); a video without one stops
        naming it."""
        slot = (key, field, id(data))
        if (held := self._held.tracks.get(slot)) is not None and held[0] is data:
            return held[1]
        sound = codec.decode_sound(data, key, field)
        if sound is None:
            raise BadSampleError(key, field, "is a video without a sound track, but "
                                 "--use-audio-in-video feeds each video's sound to encoder "
                                 f"{self.audio_in_video.audio}; give videos with sound or drop "
                                 "--use-audio-in-video")
        if self._held.open:
            self._held.tracks[slot] = (data, sound)
        return sound

    def sizes(self, sample: Any) -> list[tuple[str, tuple[int, ...], bool]]:
        """Each audio item's field, size (a clip's from its header, a sound's decoded) and
        whether it is a sound."""
        key = sample.__key__
        return [(field, media_size(self.sound(data, key, field)) if sound
                 else probe_item("audio", data, key, field), sound)
                for field, data, sound in self.items(sample)]


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
    sounds: SoundOrder | None = None
    """``--use-audio-in-video``: the videos' sound tracks among the audio encoder's items."""

    def _counts(self, sample: Any, sounds: list[tuple[str, tuple[int, ...], bool]] | None
                ) -> dict[str, tuple[int, ...]]:
        """Each encoder's item token counts, from the media parts' headers (never decoded);
        with :attr:`sounds`, the audio encoder's from ``sounds`` (its :meth:`SoundOrder.sizes`)."""
        counts = {name: _header_item_tokens(plugin, sample)
                  for name, plugin in self.plugins.items()}
        if sounds is not None:
            audio = self.sounds.audio
            counts[self.sounds.audio_in_video.audio] = tuple(
                _item_tokens(audio, size, sample.__key__, field)
                                       for field, size, _ in sounds)
        return counts

    def _layouts(self, sample: Any, sounds: list[tuple[str, tuple[int, ...], bool]] | None
                 ) -> dict[str, list[ItemLayout | WithSound]]:
        """Each encoder's items' layouts (headers only); with ``sounds``, each video with its
        sound interleaved (:class:`WithSound`) and the audio encoder's clips alone."""
        sizes = {name: [size for _, size in _header_sizes(plugin, sample)]
                 for name, plugin in self.plugins.items()}
        layouts = {name: [item_layout(self.plugins[name], size) for size in items]
                   for name, items in sizes.items()}
        if sounds is None:
            return layouts
        audio, (vision, audio_name) = self.sounds.audio, self.sounds.names
        sound_tokens = iter([audio.item_tokens(size) for _, size, sound in sounds if sound])
        merged: list[ItemLayout | WithSound] = []
        for size, layout in zip(sizes[vision], layouts[vision]):
            if len(size) != 4:  # an image
                merged.append(layout)
                continue
            tokens = next(sound_tokens)
            merged.append(self.sounds.audio_in_video.with_sound(
                layout, self.tokenizer.placeholder_ids[audio_name], tokens))
        layouts[vision] = merged
        layouts[audio_name] = [item_layout(audio, size) for _, size, sound in sounds
                               if not sound]
        return layouts

    def _blocks(self, layouts: dict[str, list[ItemLayout | WithSound]]
                ) -> tuple[tuple[str, int | tuple[int, ...]], ...]:
        """Each item's placeholder run for the tokenizer: its token count, or a video with its
        sound as its explicit ids (``<|audio_bos|>``, the interleaved runs, ``<|audio_eos|>``)."""
        blocks = []
        for name, items in layouts.items():
            for layout in items:
                if not isinstance(layout, WithSound):
                    blocks.append((name, layout[0]))
                    continue
                video_id = self.tokenizer.placeholder_ids[name]
                start, end = self.tokenizer.wrapping[self.sounds.names[1]]
                runs = [token for is_video, size in layout.order
                        for token in [video_id if is_video else layout.sound_id] * size]
                blocks.append((name, (start, *runs, end)))
        return tuple(blocks)

    def _mrope_position_ids(self, sample: Any, tokens: torch.Tensor,
                            layouts: dict[str, list[ItemLayout | WithSound]]) -> torch.Tensor:
        """``[3, seq_length]`` positions from the tokens and the items' layouts."""
        items = {self.tokenizer.placeholder_ids[name]: items for name, items in layouts.items()}
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
            return Conversation(tuple(_video_turns(conversation.turns, marker)))
        return conversation

    def __call__(self, sample: Any) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, ...]],
                                             bool]:
        text = sample_kind(sample).text(sample)
        sounds = None if self.sounds is None else self.sounds.sizes(sample)
        counts = self._counts(sample, sounds)
        self._check_room(sample, counts)
        layouts = self._layouts(sample, sounds) if self.mrope or sounds is not None else {}
        blocks = (self._blocks(layouts) if self.sounds is not None
                  else tuple((name, count) for name, items in counts.items() for count in items))
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
            fields["position_ids"] = self._mrope_position_ids(sample, encoded.tokens, layouts)
        return fields, counts, encoded.truncated


@dataclasses.dataclass(frozen=True)
class EncoderInputs:
    """Encoder ranks: the media field this encoder reads, decoded and preprocessed, with each
    item's token count."""

    plugin: EncoderPlugin
    preprocessor: Any
    sounds: SoundOrder | None = None
    """``--use-audio-in-video`` on the audio encoder: the videos' sound tracks among its items."""

    def _items(self, sample: Any) -> list[tuple[str, Any, bool]]:
        """The encoder's undecoded items with their fields, in sequence order; whether each is
        a video's sound track."""
        if self.sounds is not None:
            return self.sounds.items(sample)
        return [(field, data, False) for field, data in _media_items(self.plugin, sample)]

    def _sized(self, sample: Any) -> list[tuple[str, tuple[int, ...]]]:
        """Each item's field and size (headers only, but a video's sound track decoded)."""
        if self.sounds is not None:
            return [(field, size) for field, size, _ in self.sounds.sizes(sample)]
        return _header_sizes(self.plugin, sample)

    def sizes(self, sample: Any) -> list[tuple[int, ...]]:
        """Each item's size, as :meth:`__call__` embeds the items."""
        return [size for _, size in self._sized(sample)]

    def item_tokens(self, sample: Any) -> tuple[int, ...]:
        """Each item's token count from its size: what balancing weighs, as the language side
        weighs the same sample's items."""
        return tuple(_item_tokens(self.plugin, size, sample.__key__, field)
                     for field, size in self._sized(sample))

    def __call__(self, sample: Any) -> tuple[list[dict[str, torch.Tensor]], tuple[int, ...],
                                             bool]:
        media_kind = self.preprocessor.media
        items, counts = [], []
        for field, data, sound in self._items(sample):
            media = (self.sounds.sound(data, sample.__key__, field) if sound
                     else decode_item(media_kind, data, sample.__key__, field))
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
        sounds = self._inputs.sounds
        for first in range(0, len(samples), self._slice.global_batch):
            with sounds.held() if sounds is not None else contextlib.nullcontext():
                positions = self._slice.held_positions(
                    lambda position, first=first: self._inputs.item_tokens(
                        samples[first + position]))
                mine = [samples[first + position] for position in positions]
                prepared = [self._inputs(sample) for sample in mine]
                inputs = [fields for fields, _, _ in prepared]
                counts = [count for _, count, _ in prepared]
                if isinstance(self._inputs, EncoderInputs):
                    sizes = [self._inputs.sizes(sample) for sample in mine]
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
