"""Which data a run reads: the mock by default, Energon when stock ``--data-path`` is given."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from megatron_plugins.data.mock import MockSource
from megatron_plugins.data.streams import DataSource
from megatron_plugins.encoders import EncoderPlugin
from megatron_plugins.errors import DataFlagError

__all__ = ["add_data_args", "build_source"]


def add_data_args(parser: argparse.ArgumentParser) -> None:
    """The data flags of our own (stock ``--data-path``, ``--num-workers``, tokenizer flags and
    ``--seed`` keep their stock meaning)."""
    group = parser.add_argument_group("megatron-plugins data")
    group.add_argument("--no-data-alignment-check", dest="data_alignment_check",
                       action="store_false",
                       help="Do not check, each step, that every encoder replica embedded the "
                            "samples its language replica holds (on by default; it adds no "
                            "collective).")


def build_source(args: argparse.Namespace, plugins: Mapping[str, EncoderPlugin]) -> DataSource:
    """The run's data: Energon when stock ``--data-path`` names a dataset, else the mock. Checks
    everything that can be checked before any process group (paths, splits, tokenizer)."""
    encoder_tokens = sum(plugin.tokens_per_item for plugin in plugins.values())
    if encoder_tokens + 2 > args.seq_length:
        raise DataFlagError(
            f"--seq-length {args.seq_length} leaves no room for text: the encoders fill "
            f"{encoder_tokens} positions per sample; raise --seq-length above {encoder_tokens + 1}")
    if not args.data_path:
        return MockSource(seed=args.seed, seq_length=args.seq_length,
                          vocab_size=args.vocab_size, plugins=dict(plugins))
    if len(args.data_path) != 1:
        raise DataFlagError(
            f"--data-path takes one Energon dataset (a prepared folder, or a metadataset YAML "
            f"that blends several); got {len(args.data_path)} values")
    from megatron_plugins.data.energon import open_source

    return open_source(Path(args.data_path[0]), args, dict(plugins))
