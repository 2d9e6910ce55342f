"""Data for a MiMo run: one global sample stream, sliced per rank, from the mock or Energon.

- :mod:`.addressing`: which positions of each global microbatch a rank holds, and the guard
  that checks encoder and language ranks consumed the same samples;
- :mod:`.streams`: batching, the per-rank stream stock ``pretrain()`` iterates, the provider;
- :mod:`.mock`: deterministic synthetic samples (the default, no ``--data-path``);
- :mod:`.energon`: Energon datasets (``--data-path``), with :mod:`.text` (real tokenizer and
  prompt layout), :mod:`.media` (decoding) and :mod:`.samples` (sample types Energon lacks).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from megatron_plugins.data.addressing import AlignmentGuard, DataMisalignmentError, RankSlice
from megatron_plugins.data.mock import MockSource
from megatron_plugins.data.streams import DataSource, alignment_guard, data_provider
from megatron_plugins.encoders import EncoderPlugin
from megatron_plugins.errors import UsageError

__all__ = ["AlignmentGuard", "DataMisalignmentError", "DataSource", "MockSource", "RankSlice",
           "add_data_args", "alignment_guard", "build_source", "data_provider"]


class DataFlagError(UsageError):
    """Data flags that cannot work together; the message names them."""


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
    if not args.data_path:
        return MockSource(seed=args.seed, seq_length=args.seq_length,
                          vocab_size=args.vocab_size, plugins=dict(plugins))
    if len(args.data_path) != 1:
        raise DataFlagError(
            f"--data-path takes one Energon dataset (a prepared folder, or a metadataset YAML "
            f"that blends several); got {len(args.data_path)} values")
    from megatron_plugins.data.energon import open_source

    return open_source(Path(args.data_path[0]), args, dict(plugins))
