"""The built-in mock source: deterministic multimodal samples, for tests and the first minutes.

Every sample is a pure function of ``(seed, split, global sample index)``: its class, its text (a
class-dependent arithmetic progression the model can learn, of varied length, the rest of the row
padding), how many items each encoder gets
(``--mock-items-per-sample``, text-only samples included) and their sizes, where each item's
placeholder run sits, and each item's media, drawn from seeded streams of their own so a rank
that builds only part of a sample still builds the same part: language ranks draw the item sizes
(and so their token counts, :meth:`EncoderPlugin.item_tokens`) without making the media. Media are
what a real dataset decodes to (an RGB image of varied size and aspect ratio, a waveform) with the
class in them (a bright band's row, a tone's pitch) and go through each encoder's own
preprocessing, exactly as Energon samples do.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from megatron_plugins.data.addressing import RankSlice
from megatron_plugins.media.mock import (
    MOCK_KINDS,
    MOCK_VIDEO_FPS,
    NUM_CLASSES,
    largest_video_size,
    longest_clip_size,
    mock_media,
    mock_size,
)
from megatron_plugins.data.positions import (
    item_layout,
    mrope_position_ids,
    text_after_time_ids,
)
from megatron_plugins.data.streams import (
    LENGTH, POSITIONS, SPLITS, Microbatch, collate_items, collate_text
)
from megatron_plugins.encoders import EncoderPlugin
from megatron_plugins.errors import DataFlagError
from megatron_plugins.parallel.layout import LANGUAGE

__all__ = ["MockSource", "max_encoder_tokens"]

PAD = 0
"""Token after a sample's end, up to ``--seq-length`` (outside the loss)."""

SIZE_STREAM = 1000
"""Generator streams ``SIZE_STREAM + encoder index`` draw item counts and sizes; stream 0 is the
class, 1 the text, ``2 + encoder index`` the media."""


def special_token_ids(vocab_size: int, encoders: Sequence[str],
                      given: Mapping[str, int] | None = None) -> dict[str, int]:
    """Each encoder's placeholder id: the one ``given`` (a checkpoint's image token), else the
    top ids of the vocabulary; never used by mock text."""
    given = given or {}
    return {name: given.get(name, vocab_size - 1 - index) for index, name in enumerate(encoders)}


def _generator(seed: int, split: str, index: int, stream: int) -> torch.Generator:
    entropy = np.random.SeedSequence([seed, SPLITS.index(split), index, stream])
    return torch.Generator().manual_seed(int(entropy.generate_state(1, np.uint64)[0] >> 1))


def _takes_video(plugin: EncoderPlugin) -> bool:
    return getattr(plugin.preprocessor(), "takes_video", False)


def _varied_clips(plugin: EncoderPlugin) -> bool:
    """Whether the mock draws this encoder's clip lengths: audio whose tokens follow them."""
    return plugin.preprocessor().media == "audio" and not plugin.fixed_item_tokens


def _most_item_tokens(plugin: EncoderPlugin, video_frames: int) -> int:
    """The most positions one mock item of ``plugin`` fills."""
    if _varied_clips(plugin):
        return plugin.item_tokens(longest_clip_size(plugin.preprocessor().sample_rate))
    return max(plugin.tokens_per_item, plugin.item_tokens(largest_video_size(video_frames))
               if video_frames and _takes_video(plugin) else 0)


def max_encoder_tokens(plugins: Sequence[EncoderPlugin], items_per_sample: int,
                       video_frames: int = 0) -> int:
    """The most positions the encoders' placeholder runs can take in one sample (with
    ``video_frames``, the mock's videos counted at their largest; clips whose tokens follow
    their length at the longest the mock draws)."""
    return items_per_sample * sum(_most_item_tokens(plugin, video_frames) for plugin in plugins)


@dataclass(frozen=True)
class MockSource:
    """Deterministic samples: text with each encoder's token block inside it, and media.

    Text follows a per-class arithmetic progression, so the language model can learn to continue
    it and must read the encoders to know the class (its first token and step).
    """

    seed: int
    seq_length: int
    vocab_size: int
    plugins: dict[str, EncoderPlugin]
    items_per_sample: tuple[int, int] = (0, 2)
    """Fewest and most items per encoder in a sample, drawn uniformly for each."""
    mrope: bool = False
    """The language model uses multimodal RoPE: ``position_ids`` are ``[3, seq_length]``
    (:mod:`.positions`)."""
    placeholder_ids: Mapping[str, int] = field(default_factory=dict)
    """Encoders whose placeholder id is given: ``--hf-model``'s image token, where the
    checkpoint's language model reads image features (the others take the top ids)."""
    wrapping: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """Encoder -> (start, end) ids put around each of its runs: ``--hf-model``'s
    ``<|vision_start|>`` / ``<|vision_end|>``, as the checkpoint's processor puts them."""
    video_frames: int = 0
    """``--mock-video-frames``: an item of an encoder that takes videos is, one time in two, a
    video of this many frames instead of an image (0: images only)."""
    video_fps: float = MOCK_VIDEO_FPS
    """``--mock-video-fps``: the mock videos' frames per second (Qwen's temporal positions
    follow it)."""

    def __post_init__(self) -> None:
        if self.video_frames and not any(map(_takes_video, self.plugins.values())):
            raise DataFlagError(f"--mock-video-frames {self.video_frames}: no --encoder takes "
                                "videos (qwen2_5_vl does); drop the flag or add such an encoder")
        if self.text_vocab_size < NUM_CLASSES:
            raise DataFlagError(
                f"--vocab-size {self.vocab_size} is too small: {len(self.plugins)} ids are "
                f"reserved for encoder tokens and text needs at least {NUM_CLASSES}"
            )
        for name, plugin in self.plugins.items():
            media = plugin.preprocessor().media
            if media not in MOCK_KINDS:
                raise DataFlagError(
                    f"--encoder {name}={plugin.grid.provider}: its preprocessor reads {media!r} "
                    f"media, which the mock data cannot make ({', '.join(MOCK_KINDS)}); train it "
                    "on a dataset with --data-path"
                )

    @property
    def static_shapes(self) -> bool:
        fewest, most = self.items_per_sample
        return fewest == most and all(p.fixed_item_tokens for p in self.plugins.values())

    @property
    def text_vocab_size(self) -> int:
        """Ids below this are text; the encoders' special tokens are at or above it."""
        return min([self.vocab_size - len(self.plugins), *self.placeholder_ids.values(),
                    *(token for ids in self.wrapping.values() for token in ids)])

    @property
    def special_token_ids(self) -> dict[str, int]:
        return special_token_ids(self.vocab_size, list(self.plugins), self.placeholder_ids)

    def label(self, split: str, index: int) -> int:
        """The sample's class."""
        return int(torch.randint(NUM_CLASSES, (1,), generator=_generator(self.seed, split, index, 0)))

    def item_sizes(self, name: str, split: str, index: int) -> list[tuple[int, ...]]:
        """The size of each of one sample's items for encoder ``name`` (every rank draws them)."""
        encoder = list(self.plugins).index(name)
        generator = _generator(self.seed, split, index, SIZE_STREAM + encoder)
        fewest, most = self.items_per_sample
        count = int(torch.randint(fewest, most + 1, (1,), generator=generator))
        preprocessor = self.plugins[name].preprocessor()
        frames = self.video_frames if getattr(preprocessor, "takes_video", False) else 0
        varied = _varied_clips(self.plugins[name])
        return [mock_size(preprocessor.media, generator, preprocessor.sample_rate, frames, varied,
                          self.video_fps) for _ in range(count)]

    def item_tokens(self, split: str, index: int) -> dict[str, tuple[int, ...]]:
        """Each encoder's item token counts in one sample, from the items' sizes alone."""
        return {name: tuple(plugin.item_tokens(size)
                            for size in self.item_sizes(name, split, index))
                for name, plugin in self.plugins.items()}

    def text(self, split: str, index: int) -> dict[str, torch.Tensor]:
        """Tokens, labels, loss mask and position ids of one sample (language ranks), padded to
        ``seq_length``, and its length before the padding."""
        label = self.label(split, index)
        generator = _generator(self.seed, split, index, 1)
        text_vocab = self.text_vocab_size
        step = 1 + label % 3
        first = label * (text_vocab // NUM_CLASSES) + int(torch.randint(2, (1,), generator=generator))
        blocks = [(name, count)
                  for name, counts in self.item_tokens(split, index).items() for count in counts]
        placeholders = sum(count + 2 * (name in self.wrapping) for name, count in blocks)
        # Real samples are shorter than the row: text of 2 up to half a row less the media.
        most = max(2, self.seq_length // 2 - placeholders)
        text_length = int(torch.randint(2, most + 1, (1,), generator=generator))
        # Where each placeholder run starts in the text (runs may sit side by side).
        cuts = sorted(torch.randint(text_length + 1, (len(blocks),), generator=generator).tolist())
        progression = [(first + step * k) % text_vocab for k in range(text_length)]
        tokens: list[int] = []
        previous = 0
        for cut, (name, count) in zip(cuts, blocks):
            run = [self.special_token_ids[name]] * count
            if name in self.wrapping:
                start, end = self.wrapping[name]
                run = [start, *run, end]
            tokens += progression[previous:cut] + run
            previous = cut
        tokens += progression[previous:]
        length = len(tokens)
        tokens_t = torch.tensor(tokens + [PAD] * (self.seq_length - length), dtype=torch.long)
        following = torch.cat([tokens_t[1:length], torch.full((self.seq_length - length + 1,), -1)])
        is_text = (following >= 0) & (following < text_vocab)
        return {
            "tokens": tokens_t,
            "labels": torch.where(is_text, following, torch.zeros_like(following)),
            "loss_mask": is_text.float(),
            "position_ids": self.position_ids(tokens_t, split, index),
            LENGTH: torch.tensor(length),
        }

    def position_ids(self, tokens: torch.Tensor, split: str, index: int) -> torch.Tensor:
        """``[seq_length]`` consecutive positions, or with :attr:`mrope` ``[3, seq_length]``
        from the tokens and the items' grids."""
        if not self.mrope:
            return torch.arange(self.seq_length, dtype=torch.long)
        return mrope_position_ids(tokens, {
            self.special_token_ids[name]: [item_layout(plugin, size)
                                           for size in self.item_sizes(name, split, index)]
            for name, plugin in self.plugins.items()},
            text_after_time_ids(self.plugins, self.special_token_ids))

    def media(self, name: str, split: str, index: int) -> list[object]:
        """One encoder's decoded items of one sample (encoder ranks)."""
        generator = _generator(self.seed, split, index, 2 + list(self.plugins).index(name))
        kind, label = self.plugins[name].preprocessor().media, self.label(split, index)
        return [mock_media(kind, generator, label, size)
                for size in self.item_sizes(name, split, index)]

    def open(self, split: str, rank_slice: RankSlice, start: int,
             resume: Path | None = None) -> Iterator[Microbatch]:
        """This rank's microbatches from global sample ``start`` on (the mock needs no saved
        state: a sample is a function of its index)."""
        module = rank_slice.module
        preprocess = None if module == LANGUAGE else self.plugins[module].preprocessor()
        first = start
        while True:
            positions = rank_slice.held_positions(
                lambda position, first=first: self.item_tokens(split, first + position)[module])
            indices = [first + position for position in positions]
            first += rank_slice.global_batch
            keys = [f"{split}/{index}" for index in indices]
            if preprocess is None:
                batch = collate_text([self.text(split, index) for index in indices],
                                     [self.item_tokens(split, index) for index in indices])
            else:
                batch = collate_items(
                    module, preprocess,
                    [[preprocess(item) for item in self.media(module, split, index)]
                     for index in indices],
                    [self.item_tokens(split, index)[module] for index in indices],
                    [self.item_sizes(module, split, index) for index in indices])
            yield keys, {**batch, POSITIONS: positions}
