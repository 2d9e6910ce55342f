"""The checks that run before torch or Megatron is imported, shared by the launch and ``mimo-plan``.

Importing Megatron's argument parser costs ~5 s per process on a small machine, 20-30 s under
torchrun with several ranks. A refused layout must not wait for it: :func:`check_run` reads the
layout flags, the MiMo flags and the few stock model flags the layout checks need from the raw
command line (ignoring every other flag) and raises one :class:`FlagError` / ``LayoutError``.
Only an encoder with tp > 1 imports its plugin (the head-count check needs it). The result
(:class:`Preflight`) is handed on to the launch, which does not check again.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megatron_plugins import cpu_simulation
from megatron_plugins.launch.command_line import given_flag
from megatron_plugins.errors import FlagError, UsageError, report
from megatron_plugins.parallel.layout import LayoutError, ParallelLayout, encoder_micro_batch_size
from megatron_plugins.parallel.flags import add_layout_args, layout_from_args
from megatron_plugins.peft.flags import add_peft_args, check_peft
from megatron_plugins.weights.flags import expand_hf_model, fill_layout_flags

__all__ = [
    "EVERY_ENCODER", "Preflight", "add_mimo_args", "asks_help", "check_parser", "check_run",
    "resolve_freeze", "run", "world_size_from_env"
]

EVERY_ENCODER = "*"
"""``--freeze-projection`` without a name (upstream's spelling): every encoder's projection."""

UPSTREAM_REFUSED: Mapping[str, str] = {
    "--freeze-vit": "it freezes the ViT backbone but not its projection; here "
                    "--freeze-encoder NAME freezes an encoder with its projection",
    "--llm-only": "train a language model alone with stock pretrain_gpt.py",
    "--model-provider": "name encoders with --encoder NAME=PROVIDER; stock flags describe the "
                        "language model",
    "--language-model-checkpoint": "resume with stock --load",
    "--image-size": "use --vit-img-size",
    "--image-seq-length": "an encoder's tokens per image follow from its flags "
                          "(--vit-img-size / --vit-patch-size) or, with --vit-native-resolution, "
                          "from each image's size",
    "--total-seq-length": "use --seq-length",
    "--image-token-id": "encoders' special token ids are the top ids of --vocab-size",
    "--pad-token-id": "the mock data pads with id 0 outside the loss",
    "--mock-dataset-size": "mock samples are drawn by global index; there is no dataset size",
    "--audio-encoder-model": "use --encoder NAME=audio or your own encoder plugin",
    "--hf-assign-unused-tokens": "encoders' special token ids are the top ids of --vocab-size",
    "--packing-buffer-size": "use --pack-sequences (a microbatch's --micro-batch-size samples "
                             "packed into one --seq-length row)",
    "--mimo-encoder-prefetch": "encoder feature prefetch is not supported",
    "--mimo-encoder-prefetch-depth": "encoder feature prefetch is not supported",
    "--mimo-encoder-prefetch-debug": "encoder feature prefetch is not supported",
    "--class-token-len": "the RADIO encoder is not built in; write an encoder plugin",
    "--pixel-shuffle": "the RADIO encoder is not built in; write an encoder plugin",
    "--disable-vision-class-token": "the RADIO encoder is not built in; write an encoder plugin",
    "--dynamic-resolution": "use --encoder NAME=vit --vit-native-resolution (images at their own "
                            "resolution, packed), or a plugin of your own",
    "--vision-projection-type": "the projection is a two-layer MLP (EncoderPlugin.projection_spec)",
}
"""Upstream Megatron-LM ``examples/mimo`` flags without an equivalent here, and what to use."""


@dataclass(frozen=True)
class Preflight:
    """What the pre-import checks settled: the checked layout and the freeze lists by name."""

    layout: ParallelLayout
    freeze_encoder: list[str]
    freeze_projection: list[str]


def _raise_instead_of_exit(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    def error(message: str) -> None:
        raise FlagError(message)

    parser.error = error  # type: ignore[method-assign]
    return parser


def add_mimo_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """MiMo training flags beyond the layout (freezing, encoder DDP overlap), upstream aliases too."""
    group = parser.add_argument_group("megatron-plugins MiMo training")
    group.add_argument("--freeze-language-model", "--freeze-lm", action="store_true",
                       help="Do not train the language model (--freeze-lm: upstream spelling).")
    group.add_argument("--freeze-encoder", action="append", default=[], metavar="NAME",
                       help="Do not train this encoder (projection included). Repeatable.")
    group.add_argument("--freeze-projection", action="append", default=[], metavar="NAME",
                       nargs="?", const=EVERY_ENCODER,
                       help="Do not train this encoder's projection to the LM; without NAME "
                            "(upstream spelling) every encoder's. Repeatable.")
    group.add_argument("--encoder-overlap-grad-reduce", action=argparse.BooleanOptionalAction,
                       default=None, help="Overlap encoder grad reduction with backward "
                       "(default: follow --overlap-grad-reduce).")
    group.add_argument("--encoder-ddp-overlap", dest="encoder_overlap_grad_reduce",
                       action="store_const", const=True,
                       help="Upstream spelling of --encoder-overlap-grad-reduce; like upstream, "
                            "needs --overlap-grad-reduce.")
    group.add_argument("--colocated-encoder-recompute", action="store_true",
                       help="On ranks hosting an encoder (--grid NAME:...@language), keep only "
                            "each microbatch's encoder inputs until the backward and run the "
                            "encoder forward again there: one more encoder forward per step, one "
                            "microbatch's encoder activations held instead of the whole step's.")
    group.add_argument("--dataset-provider", choices=["mock"], default="mock",
                       help="Upstream examples/mimo flag; the mock data is the only provider.")
    return parser


def check_parser() -> argparse.ArgumentParser:
    """Layout and MiMo flags plus the stock model flags the checks read; errors raise FlagError."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_layout_args(parser)
    add_mimo_args(parser)
    add_peft_args(parser)
    stock = parser.add_argument_group("stock Megatron (and data) flags the layout checks read")
    for flag in ("--num-attention-heads", "--num-query-groups", "--num-experts",
                 "--tensor-parallel-num-weight-shards",
                 "--expert-tensor-parallel-num-weight-shards", "--micro-batch-size",
                 "--seq-length"):
        stock.add_argument(flag, type=int)
    for flag in ("--group-query-attention", "--overlap-grad-reduce", "--sequence-parallel",
                 "--hybrid-context-parallel", "--pack-sequences", "--balance-encoder-work"):
        stock.add_argument(flag, action="store_true")
    stock.add_argument("--cp-comm-type", nargs="+")
    stock.add_argument("--language-hf-weights")
    # An HF encoder (clip, siglip, whisper) reads its head count from this folder's config.json.
    stock.add_argument("--encoder-hf-weights", action="append", default=[])
    stock.add_argument("--hf-model")
    return _raise_instead_of_exit(parser)


def refuse_upstream_flags(argv: Sequence[str]) -> None:
    """One line for the first upstream ``examples/mimo`` flag that has no meaning here."""
    for token in argv:
        flag = token.partition("=")[0]
        if flag in UPSTREAM_REFUSED:
            raise FlagError(f"{flag} is upstream Megatron-LM examples/mimo's flag and has no "
                            f"equivalent here: {UPSTREAM_REFUSED[flag]}")


def resolve_freeze(args: argparse.Namespace, layout: ParallelLayout) -> list[str]:
    """Check the freeze flags against the layout; returns the projections to freeze by name (a
    bare --freeze-projection expanded)."""
    names = [module.name for module in layout.encoders]
    for flag, attr in (("--freeze-encoder", "freeze_encoder"),
                       ("--freeze-projection", "freeze_projection")):
        for name in getattr(args, attr):
            if name != EVERY_ENCODER and name not in names:
                raise FlagError(f"{flag} {name}: no such encoder; encoders are "
                                f"{', '.join(sorted(names))}")
    if args.freeze_language_model and names and set(names) <= set(args.freeze_encoder):
        raise FlagError(
            "--freeze-language-model with --freeze-encoder for every encoder "
            f"({', '.join(names)}) leaves nothing to train; unfreeze one module"
        )
    return list(names) if EVERY_ENCODER in args.freeze_projection else list(args.freeze_projection)


def _encoder_heads(argv: Sequence[str], layout: ParallelLayout, quiet: bool) -> dict[str, int]:
    """Attention heads of the encoders whose tp must divide them (tp > 1); imports their plugins."""
    sharded = [module for module in layout.encoders if module.tp > 1]
    if not sharded:
        return {}
    if quiet or cpu_simulation.FLAG in argv:
        cpu_simulation.quiet_gpu_library_warnings()
    from megatron_plugins.encoders import EncoderPluginError, resolve

    try:
        classes = {module.name: resolve(module.provider, module.name) for module in sharded}
        parser = check_parser()
        for plugin in dict.fromkeys(classes.values()):
            plugin.add_arguments(parser)
        args, _ = parser.parse_known_args(list(argv))
        return {module.name: classes[module.name](module.name, args, module).num_attention_heads
                for module in sharded}
    except EncoderPluginError as error:
        raise FlagError(str(error)) from None


def check_run(argv: Sequence[str], world_size: int, *, quiet: bool = False) -> Preflight:
    """Every check that needs no Megatron import, on a raw command line; returns the layout and
    the freeze lists.

    Flags it does not know are ignored, so the launch's and a pasted torchrun command line both
    work. Raises :class:`FlagError` or ``LayoutError`` with one line naming the flag. ``quiet``
    hides Megatron's warnings about absent GPU libraries when a plugin import needs Megatron (as
    ``--cpu-simulation`` does).
    """
    argv = expand_hf_model(argv)
    refuse_upstream_flags(argv)
    args, _ = check_parser().parse_known_args(argv)
    fill_layout_flags(args)
    layout = layout_from_args(args, world_size)
    heads = _encoder_heads(argv, layout, quiet)
    if heads:
        layout = layout_from_args(args, world_size, heads)
    freeze_projection = resolve_freeze(args, layout)
    check_peft(args, layout, freeze_projection)
    if args.micro_batch_size is not None:
        for module in layout.encoders:
            encoder_micro_batch_size(layout, module.name, args.micro_batch_size)
    if given_flag(argv, ["--encoder-ddp-overlap"]) and not args.overlap_grad_reduce:
        raise FlagError("--encoder-ddp-overlap needs --overlap-grad-reduce (as upstream); add it "
                        "or use --encoder-overlap-grad-reduce alone")
    return Preflight(layout, list(args.freeze_encoder), freeze_projection)


def world_size_from_env() -> int:
    """The world size the launch will have: ``WORLD_SIZE`` as torchrun sets it (stock default 1)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def asks_help(argv: Sequence[str]) -> bool:
    """Whether the command line asks for --help, which stock's parser answers before any check."""
    return "-h" in argv or "--help" in argv


def run(argv: Sequence[str], prog: str) -> Preflight | int | None:
    """The entry point's first step: 2 after printing the one-line error, else what it checked
    to hand to the launch (None when --help is asked for)."""
    if asks_help(argv):
        return None
    try:
        return check_run(argv, world_size_from_env())
    except UsageError as error:
        return report(prog, error)
