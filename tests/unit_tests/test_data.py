"""Data addressing, the alignment guard and the mock source: grids agree on every microbatch."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron_plugins.data.addressing import AlignmentGuard, RankSlice, _first_difference
from megatron_plugins.data.mock import MockSource
from megatron_plugins.encoders.audio import AudioFrameEncoder
from megatron_plugins.encoders.vit import ViTEncoder
from megatron_plugins.layout import (
    LANGUAGE,
    LayoutError,
    ModulePlacement,
    ParallelLayout,
    encoder_micro_batch_size,
)


def _layout(encoder_dp: int, language_dp: int) -> ParallelLayout:
    return ParallelLayout((
        ModulePlacement(name="vision", tp=1, pp=1, cp=1, dp=encoder_dp, rank_offset=0, provider="vit"),
        ModulePlacement(name="audio", tp=1, pp=1, cp=1, dp=1, rank_offset=encoder_dp,
                        provider="audio"),
        ModulePlacement(name=LANGUAGE, tp=1, pp=1, cp=1, dp=language_dp, rank_offset=encoder_dp + 1),
    ))


def _source(layout: ParallelLayout) -> MockSource:
    parser = argparse.ArgumentParser()
    ViTEncoder.add_arguments(parser)
    AudioFrameEncoder.add_arguments(parser)
    args = parser.parse_args([])
    plugins = {"vision": ViTEncoder("vision", args, layout.module("vision")),
               "audio": AudioFrameEncoder("audio", args, layout.module("audio"))}
    return MockSource(seed=1234, seq_length=32, vocab_size=128, plugins=plugins)


def _streams(layout: ParallelLayout, module: str, start: int = 0) -> list:
    source = _source(layout)
    return [source.open("train", RankSlice.of(layout, module, r, 2), start)
            for r in range(layout.module(module).dp)]


@pytest.mark.parametrize("encoder_dp, language_dp", [(1, 2), (2, 1), (4, 2), (2, 2), (1, 1)],
                         ids=["fan-out", "fan-in", "fan-in-2", "same", "single"])
def test_encoder_replicas_feed_exactly_the_samples_their_language_replicas_hold(
        encoder_dp, language_dp):
    layout = _layout(encoder_dp, language_dp)
    vision, language = _streams(layout, "vision", 16), _streams(layout, LANGUAGE, 16)
    for _ in range(3):  # three consecutive microbatches
        # The bridge concatenates encoder replicas in DP order, then splits evenly over
        # language replicas in DP order (fan-in and fan-out alike).
        encoder_keys = [key for stream in vision for key in next(stream)[0]]
        language_keys = [key for stream in language for key in next(stream)[0]]
        assert encoder_keys == language_keys
        assert len(set(language_keys)) == 2 * language_dp


def test_a_sample_is_the_same_wherever_it_is_built():
    source, again = _source(_layout(1, 1)), _source(_layout(2, 2))
    for index in (0, 7, 1000):
        for key, value in source.text("train", index).items():
            assert torch.equal(value, again.text("train", index)[key]), key
        for name in ("vision", "audio"):
            first, second = source.media(name, "train", index), again.media(name, "train", index)
            assert (first == second).all() if name == "vision" else (
                first.samples == second.samples).all()
    assert not torch.equal(source.text("train", 3)["tokens"], source.text("valid", 3)["tokens"])


def test_mock_media_go_through_each_encoders_preprocessing():
    layout = _layout(1, 1)
    [vision] = _streams(layout, "vision")
    [audio] = _streams(layout, "audio")
    [language] = _streams(layout, LANGUAGE)
    _, batch = next(vision)
    assert batch["modality_inputs"]["vision"]["vision"]["x"].shape == (2, 3, 16, 16)
    _, batch = next(audio)
    assert batch["modality_inputs"]["audio"]["audio"]["frames"].shape == (2, 8, 16)
    _, batch = next(language)
    assert batch["tokens"].shape == (2, 32) and batch["attention_mask"].shape == (2, 1, 32, 32)


def test_text_never_uses_special_tokens_and_labels_skip_encoder_positions():
    source = _source(_layout(1, 1))
    special = source.special_token_ids
    assert special == {"vision": 127, "audio": 126}
    for index in range(20):
        sample = source.text("train", index)
        tokens, labels, mask = sample["tokens"], sample["labels"], sample["loss_mask"]
        for name, token in special.items():
            assert int((tokens == token).sum()) == source.plugins[name].tokens_per_item
        text = tokens < source.text_vocab_size
        assert torch.equal(mask[:-1].bool(), text[1:])  # predict only text tokens
        assert mask[-1] == 0
        assert torch.equal(labels[:-1][mask[:-1].bool()], tokens[1:][text[1:]])


def test_encoder_micro_batch_size_follows_the_dp_ratio_or_names_the_flags():
    assert encoder_micro_batch_size(_layout(4, 2), "vision", 2) == 1
    assert encoder_micro_batch_size(_layout(1, 2), "vision", 2) == 4
    with pytest.raises(LayoutError, match="--micro-batch-size 1 x --grid language: dp=2 = 2"):
        encoder_micro_batch_size(_layout(4, 2), "vision", 1)


def _guard_sums(layout: ParallelLayout, keys_of: dict[tuple[str, int], list[list[str]]]
                ) -> tuple[torch.Tensor, list[AlignmentGuard]]:
    """Each (module, dp rank)'s guard fed its keys per microbatch; the all-reduced sums."""
    guards = []
    total = None
    for (module, dp_rank), microbatches in keys_of.items():
        guard = AlignmentGuard(layout, module, RankSlice.of(layout, module, dp_rank, 2), True)
        for keys in microbatches:
            guard.record(keys)
        part = guard.contribution()
        total = part if total is None else total + part
        guards.append(guard)
    return total, guards


@pytest.mark.parametrize("encoder_dp, language_dp", [(1, 2), (2, 1), (1, 1)])
def test_guard_sums_vanish_when_aligned_and_not_when_a_sample_moves(encoder_dp, language_dp):
    layout = _layout(encoder_dp, language_dp)
    streams = {(m, r): stream for m in ("vision", "audio", LANGUAGE)
               for r, stream in enumerate(_streams(layout, m))}
    keys_of = {rank: [next(stream)[0] for _ in range(3)] for rank, stream in streams.items()}
    total, _ = _guard_sums(layout, keys_of)
    assert total.shape == (2 * language_dp,) and not total.any()
    late = keys_of[("vision", 0)]  # one microbatch late: every key lands in the wrong step slot
    total, _ = _guard_sums(layout, {**keys_of, ("vision", 0): late[1:] + late[:1]})
    assert total[:language_dp].any() and not total[language_dp:].any()  # vision only


def test_misalignment_message_names_both_ranks_and_the_first_differing_key():
    layout = _layout(1, 1)
    held = {("vision", 0): [["train/0", "train/1"]], (LANGUAGE, 0): [["train/0", "train/2"]]}
    total, guards = _guard_sums(layout, held)
    witnesses = [(0, "vision", 0, guards[0]._step_held), (2, LANGUAGE, 0, guards[1]._step_held)]
    message = _first_difference(witnesses, total, ["vision", "audio"], 1)
    assert "encoder 'vision' dp rank 0 (global rank 0) embedded sample 'train/1'" in message
    assert "language global rank 2 holds 'train/2'" in message
