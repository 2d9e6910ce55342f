"""Stock's throughput FLOPs count (Gap 28): the canary that the wheel still counts a GPT of the
language flags over the world, and the bridge's test."""

from __future__ import annotations

import argparse
import inspect

import megatron.training.training as training

from megatron_plugins.compat import throughput


def _gpt_args(**changes: object) -> argparse.Namespace:
    """The stock flags of the tests' tiny language model, as ``num_floating_point_operations``
    reads them (every field it may read, at stock's defaults)."""
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size",
                              "128", "--num-attention-heads", "4", "--seq-length", "32",
                              "--max-position-embeddings", "32", "--micro-batch-size", "2"])
    args.padded_vocab_size, args.kv_channels, args.num_query_groups = 128, 16, 4
    args.world_size = 3
    for name, value in changes.items():
        setattr(args, name, value)
    return args


def test_gap28_canary_stock_throughput_counts_a_gpt_of_the_flags_over_the_world():
    """Gap 28: the count takes the flags and a batch size only (no model, no encoder, no batch
    content), every row counted at ``--seq-length``, and ``training_log`` divides it by every
    rank of the world."""
    count = training.num_floating_point_operations
    assert list(inspect.signature(count).parameters) == [
        "args", "batch_size", "seqlen_squared_sum_in_batch", "total_real_tokens_in_batch"]
    args = _gpt_args()
    assert count(args, 8) == 2 * count(args, 4) > 0  # linear in rows of --seq-length
    assert count(_gpt_args(vision_encoder="vit", freeze_encoder=["vision"]), 8) == count(args, 8)
    source = inspect.getsource(training.training_log)
    assert "num_floating_point_operations(" in source
    assert "args.world_size)" in source.split("throughput = num_floating_point_operations(")[1]


def test_gap28_bridge_answers_the_counter_until_undone():
    stock = training.num_floating_point_operations
    calls = []

    def counter(args, batch_size):
        calls.append(batch_size)
        return 1234.0

    undo = throughput.count_flops_with(counter)
    try:
        assert training.num_floating_point_operations(
            None, 8, seqlen_squared_sum_in_batch=None, total_real_tokens_in_batch=None) == 1234.0
        assert calls == [8]
    finally:
        undo()
    assert training.num_floating_point_operations is stock
