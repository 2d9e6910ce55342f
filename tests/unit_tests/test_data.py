"""Mock data: samples are functions of their global index, and grids agree on every microbatch."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from megatron_plugins.data import MicrobatchStream, MockMultimodalSamples, encoder_micro_batch_size
from megatron_plugins.encoders.audio import AudioFrameEncoder
from megatron_plugins.encoders.vit import ViTEncoder
from megatron_plugins.layout import LANGUAGE, LayoutError, ModulePlacement, ParallelLayout


def _layout(encoder_dp: int, language_dp: int) -> ParallelLayout:
    return ParallelLayout((
        ModulePlacement(name="vision", tp=1, pp=1, cp=1, dp=encoder_dp, rank_offset=0, provider="vit"),
        ModulePlacement(name="audio", tp=1, pp=1, cp=1, dp=1, rank_offset=encoder_dp,
                   provider="audio"),
        ModulePlacement(name=LANGUAGE, tp=1, pp=1, cp=1, dp=language_dp, rank_offset=encoder_dp + 1),
    ))


def _samples(layout: ParallelLayout) -> MockMultimodalSamples:
    parser = argparse.ArgumentParser()
    ViTEncoder.add_arguments(parser)
    AudioFrameEncoder.add_arguments(parser)
    args = parser.parse_args([])
    plugins = {"vision": ViTEncoder("vision", args, layout.module("vision")),
               "audio": AudioFrameEncoder("audio", args, layout.module("audio"))}
    return MockMultimodalSamples(seed=1234, seq_length=32, vocab_size=128, plugins=plugins)


def _stream(samples, layout, module: str, dp_rank: int, start: int = 0) -> MicrobatchStream:
    """A stream as rank (module, dp_rank) builds it; only the DP rank of the topology is read."""
    pgc = SimpleNamespace(dp=SimpleNamespace(rank=lambda: dp_rank))
    topology = SimpleNamespace(layout=layout, active_modules=(module,), module_pgs={module: pgc})
    return MicrobatchStream(samples, topology, "train", start, micro_batch_size=2)


@pytest.mark.parametrize("encoder_dp, language_dp", [(1, 2), (2, 1), (4, 2), (2, 2), (1, 1)],
                         ids=["fan-out", "fan-in", "fan-in-2", "same", "single"])
def test_encoder_replicas_feed_exactly_the_samples_their_language_replicas_hold(
        encoder_dp, language_dp):
    layout = _layout(encoder_dp, language_dp)
    samples = _samples(layout)
    streams = {(m, r): _stream(samples, layout, m, r, start=16)
               for m, dp in (("vision", encoder_dp), (LANGUAGE, language_dp)) for r in range(dp)}
    for _ in range(3):  # three consecutive microbatches
        batches = {key: next(stream) for key, stream in streams.items()}
        # The bridge concatenates encoder replicas in DP order, then splits evenly over
        # language replicas in DP order (fan-in and fan-out alike).
        encoder_ids = torch.cat([batches[("vision", r)]["sample_ids"] for r in range(encoder_dp)])
        language_ids = torch.cat([batches[(LANGUAGE, r)]["sample_ids"]
                                  for r in range(language_dp)])
        assert encoder_ids.tolist() == language_ids.tolist()
        assert len(set(language_ids.tolist())) == 2 * language_dp


def test_a_sample_is_the_same_wherever_it_is_built():
    layout = _layout(1, 1)
    samples = _samples(layout)
    again = _samples(_layout(2, 2))
    for index in (0, 7, 1000):
        for key, value in samples.text("train", index).items():
            assert torch.equal(value, again.text("train", index)[key]), key
        for name in ("vision", "audio"):
            for key, value in samples.encoder_inputs(name, "train", index).items():
                assert torch.equal(value, again.encoder_inputs(name, "train", index)[key])
    assert not torch.equal(samples.text("train", 3)["tokens"], samples.text("valid", 3)["tokens"])


def test_text_never_uses_special_tokens_and_labels_skip_encoder_positions():
    samples = _samples(_layout(1, 1))
    special = samples.special_token_ids
    assert special == {"vision": 127, "audio": 126}
    for index in range(20):
        sample = samples.text("train", index)
        tokens, labels, mask = sample["tokens"], sample["labels"], sample["loss_mask"]
        for name, token in special.items():
            assert int((tokens == token).sum()) == samples.plugins[name].tokens_per_sample
        text = tokens < samples.text_vocab_size
        assert torch.equal(mask[:-1].bool(), text[1:])  # predict only text tokens
        assert mask[-1] == 0
        assert torch.equal(labels[:-1][mask[:-1].bool()], tokens[1:][text[1:]])


def test_encoder_micro_batch_size_follows_the_dp_ratio_or_names_the_flags():
    assert encoder_micro_batch_size(_layout(4, 2), "vision", 2) == 1
    assert encoder_micro_batch_size(_layout(1, 2), "vision", 2) == 4
    with pytest.raises(LayoutError, match="--micro-batch-size 1 x --grid language: dp=2 = 2"):
        encoder_micro_batch_size(_layout(4, 2), "vision", 1)
