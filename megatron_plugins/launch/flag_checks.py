"""Checks of the parsed flags that set nothing: each refuses, in one line naming the flag, what
stock or the data would fail on later without a word. :mod:`megatron_plugins.launch.settle` runs
them as its steps; :func:`megatron_plugins.launch.pretrain.train` runs :func:`check_training`,
what stock refuses only once it trains."""

from __future__ import annotations

import argparse

from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
from megatron.core.transformer.enums import AttnBackend

from megatron_plugins.data.streams import DataSource
from megatron_plugins.data.text import check_tokenizer_folder
from megatron_plugins.errors import FlagError
from megatron_plugins.parallel.layout import ModulePlacement
from megatron_plugins.weights.flags import HF_MODEL_FLAG, checkpoint_image_token

__all__ = ["check_image_token", "check_mock_tokenizer", "check_mrope", "check_packing",
           "check_training"]


def check_mock_tokenizer(args: argparse.Namespace) -> None:
    """The mock data (no ``--data-path``) draws ids below ``--vocab-size``; a HuggingFace
    tokenizer it is given must still be a readable folder (stock builds it)."""
    if args.data_path or args.tokenizer_type != "HuggingFaceTokenizer":
        return
    if args.tokenizer_model:
        check_tokenizer_folder(args.tokenizer_model)
    if args.vocab_size is None:
        raise FlagError("--vocab-size is missing: the mock data (no --data-path) draws token ids "
                        "below it; add --vocab-size N, or train on a dataset with --data-path")


def check_image_token(args: argparse.Namespace, source: DataSource) -> None:
    """The data's placeholder for each of ``--hf-model``'s encoders must be the checkpoint's
    token for it: the language model reads features where HF put them."""
    for name, want in checkpoint_image_token(args).items():
        have = source.special_token_ids.get(name)
        if have != want:
            raise FlagError(f"{HF_MODEL_FLAG} {args.hf_model}: its {name} token is id {want}, but "
                            f"the data marks encoder {name}'s positions with id {have}; give a "
                            f"tokenizer whose <{name}> token is id {want} (the checkpoint's own "
                            "tokenizer)")


def check_packing(args: argparse.Namespace) -> None:
    """``--pack-sequences`` needs an attention that reads THD segments."""
    if not args.pack_sequences:
        return
    if args.attention_backend == AttnBackend.local:
        raise FlagError("--pack-sequences needs an attention that reads packed (THD) segments, "
                        "which --attention-backend local's DotProductAttention does not; drop "
                        "--attention-backend local (with --transformer-impl local the local path's "
                        "packed attention is used)")


def check_mrope(args: argparse.Namespace) -> None:
    """``--mrope-section`` splits a head's rotary frequency pairs over (t, h, w): three counts
    summing to half the rotary dims, else Megatron fails deep in the first forward.
    ``--mrope-interleaved`` lays those pairs out, so it needs mrope."""
    if args.position_embedding_type != "mrope":
        if getattr(args, "mrope_interleaved", False):
            raise FlagError(f"--mrope-interleaved lays out multimodal RoPE's frequency pairs; it "
                            f"needs --position-embedding-type mrope (got "
                            f"{args.position_embedding_type})")
        return
    pairs = int(args.kv_channels * args.rotary_percent) // 2
    section = list(args.mrope_section or [])
    if len(section) != 3 or sum(section) != pairs:
        raise FlagError(f"--mrope-section {' '.join(map(str, section))} must be three counts "
                        f"(temporal, height, width) summing to the {pairs} rotary frequency pairs "
                        f"of a head (--kv-channels {args.kv_channels} x --rotary-percent "
                        f"{args.rotary_percent} / 2)")


def check_training(args: argparse.Namespace, language: ModulePlacement) -> None:
    """Stock's MoE layers refuse to train under tensor parallelism without sequence parallelism,
    in the first forward of every rank; the launch says so in one line before any process group.
    A model only built (weights in and out) runs without it, so parsing does not refuse it."""
    if language.tp == 1 or not args.num_experts or args.sequence_parallel:
        return
    pattern = args.hybrid_layer_pattern
    if pattern is not None and Symbols.MOE not in pattern:
        return
    what = (f"the MoE language model ({args.num_experts} experts) at {language.source}: "
            f"tp={language.tp} needs --sequence-parallel to train (stock's MoE layers refuse "
            "tensor parallelism without it)")
    raise FlagError(f"{what}; add --sequence-parallel")
