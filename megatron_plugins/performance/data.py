"""The data a layout is planned for: per encoder the items a sample holds and the language
positions each fills, and the positions a whole sample fills before padding.

Sampled from the run's own source (the mock, or ``--data-path``: its language side reads only
the samples' metadata, the encoders' ``item_tokens`` on the item sizes) by the launch, or given
with flags: ``--advise-items-per-sample NAME=N`` (a mean, e.g. 1.5), ``--advise-item-tokens
NAME=T`` (positions per item) or, for an audio encoder, ``--advise-clip-seconds NAME=S`` (the
positions a clip of S seconds fills, by the encoder's own count) and ``--advise-text-tokens T``
(per sample; default: the rest of a ``--seq-length`` row). A description that cannot fit the
run's rows is one line naming the flags.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from statistics import fmean

from megatron_plugins.errors import FlagError
from megatron_plugins.performance.assumptions import named_numbers

__all__ = ["DataDescription", "EncoderData", "add_data_description_args", "given_description",
           "sampled_description"]


@dataclass(frozen=True)
class EncoderData:
    """One encoder's items: mean items per sample, and the token counts of the items seen (one
    entry per distinct count, with how often it was seen)."""

    items_per_sample: float
    item_tokens: tuple[tuple[int, int], ...]
    """(tokens, how many items) pairs."""
    clip_seconds: float | None = None
    """The clip length the tokens were counted from (``--advise-clip-seconds``)."""

    @property
    def mean_item_tokens(self) -> float:
        count = sum(n for _, n in self.item_tokens)
        return sum(t * n for t, n in self.item_tokens) / count if count else 0.0

    @property
    def tokens_per_sample(self) -> float:
        return self.items_per_sample * self.mean_item_tokens


@dataclass(frozen=True)
class DataDescription:
    """What a mean sample holds, and where the description came from."""

    encoders: dict[str, EncoderData]
    sample_tokens: float
    source: str
    largest_sample: float = 0.0
    """Positions the largest sample seen fills (given: the mean)."""

    def check(self, seq_length: int) -> None:
        """Refuse a description whose samples cannot fit a ``--seq-length`` row."""
        largest = max(self.largest_sample, self.sample_tokens)
        if largest > seq_length:
            raise FlagError(
                f"the data ({self.source}) has samples of {largest:g} positions, more than "
                f"--seq-length {seq_length}: raise --seq-length or describe smaller samples "
                "(--advise-item-tokens, --advise-clip-seconds, --advise-items-per-sample, "
                "--advise-text-tokens)")

    def lines(self) -> list[str]:
        found = [f"data ({self.source}): a sample fills {self.sample_tokens:.1f} positions "
                 "before padding"]
        for name, data in self.encoders.items():
            clips = ("" if data.clip_seconds is None else
                     f" (clips of {data.clip_seconds:g} s, counted by the encoder)")
            found.append(f"  {name}: {data.items_per_sample:.2f} items per sample of "
                         f"{data.mean_item_tokens:.1f} positions on average{clips}")
        return found


def add_data_description_args(parser: argparse.ArgumentParser) -> None:
    """Register the flags that describe the data instead of sampling it."""
    group = parser.add_argument_group("mimo-plan --advise: the data (default: sampled from the "
                                      "run's own source)")
    group.add_argument("--advise-items-per-sample", action="append", default=[],
                       metavar="NAME=N", help="Mean items of encoder NAME per sample.")
    group.add_argument("--advise-item-tokens", action="append", default=[], metavar="NAME=T",
                       help="Language positions one item of encoder NAME fills.")
    group.add_argument("--advise-clip-seconds", action="append", default=[], metavar="NAME=S",
                       help="Mean seconds per clip of audio encoder NAME: its positions per "
                            "clip counted by the encoder's own formula (instead of "
                            "--advise-item-tokens).")
    group.add_argument("--advise-text-tokens", type=float, default=None, metavar="T",
                       help="Text positions per sample (default: the rest of a row).")
    group.add_argument("--advise-samples", type=int, default=256, metavar="N",
                       help="Samples to read from the run's source to describe its data.")


def _per_encoder(values: Sequence[str], flag: str, names: Sequence[str]) -> dict[str, float]:
    found = named_numbers(values, flag, f"NAME=N with N >= 0 (e.g. {flag} {names[0]}=1)",
                          lambda value: value >= 0)
    for name in found:
        if name not in names:
            raise FlagError(f"{flag} {name}={found[name]:g}: no encoder {name!r}; encoders "
                            f"are {', '.join(names)}")
    return found


def given_description(args: argparse.Namespace, default_tokens: Mapping[str, int],
                      seq_length: int,
                      clip_tokens: Callable[[str, float], int] | None = None
                      ) -> DataDescription | None:
    """The description the flags give (None when none is given, or when clips given in seconds
    cannot be counted yet: ``clip_tokens`` None): items per sample default to 1, item tokens to
    the encoder's ``tokens_per_item`` (``default_tokens``) or ``clip_tokens(NAME, seconds)``,
    text to the rest of the row."""
    names = list(default_tokens)
    items = _per_encoder(args.advise_items_per_sample, "--advise-items-per-sample", names)
    tokens = _per_encoder(args.advise_item_tokens, "--advise-item-tokens", names)
    seconds = _per_encoder(args.advise_clip_seconds, "--advise-clip-seconds", names)
    both = sorted(tokens.keys() & seconds.keys())
    if both:
        name = both[0]
        raise FlagError(f"--advise-item-tokens {name}={tokens[name]:g} and --advise-clip-seconds "
                        f"{name}={seconds[name]:g}: give one of them")
    if not items and not tokens and not seconds and args.advise_text_tokens is None:
        return None
    if seconds and clip_tokens is None:
        return None
    if args.advise_text_tokens is not None and args.advise_text_tokens < 0:
        raise FlagError(f"--advise-text-tokens {args.advise_text_tokens:g} must be >= 0")
    tokens.update({name: clip_tokens(name, value) for name, value in seconds.items()})
    encoders = {name: EncoderData(items.get(name, 1.0),
                                  ((round(tokens.get(name, default_tokens[name])), 1),),
                                  seconds.get(name))
                for name in names}
    media = sum(data.tokens_per_sample for data in encoders.values())
    text = seq_length - media if args.advise_text_tokens is None else args.advise_text_tokens
    description = DataDescription(encoders, media + max(text, 0.0), "given by flags")
    description.check(seq_length)
    return description


def sampled_description(lengths: Sequence[int], item_tokens: Mapping[str, Sequence[Sequence[int]]],
                        source: str) -> DataDescription:
    """The description of the samples seen: each one's positions before padding (``lengths``)
    and per encoder each one's item token counts."""
    encoders = {}
    for name, per_sample in item_tokens.items():
        counts: dict[int, int] = {}
        for sample in per_sample:
            for tokens in sample:
                counts[tokens] = counts.get(tokens, 0) + 1
        encoders[name] = EncoderData(fmean(len(sample) for sample in per_sample),
                                     tuple(sorted(counts.items())))
    return DataDescription(encoders, fmean(lengths), f"{source}: {len(lengths)} samples",
                           max(lengths))
