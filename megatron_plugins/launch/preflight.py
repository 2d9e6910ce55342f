"""The checks that run before torch or Megatron is imported, shared by the launch and ``mimo-plan``;
what they read and build is handed on, never computed again.

Importing Megatron's argument parser costs ~5 s per process on a small machine, 20-30 s under
torchrun with several ranks. A refused layout must not wait for it. :func:`read_command_line`
parses the MiMo flags of the raw command line once (the layout, freezing, HF and Megatron-checkpoint
weights, ``--cpu-simulation``; ``--hf-model``'s encoder written in) and leaves every other flag to
stock's parser. :func:`check_run` checks them with the few stock model flags the layout checks
read, raising one :class:`FlagError` / ``LayoutError``; then, for a launch, it switches the CPU
simulation on (with ``--cpu-simulation``) before anything imports Megatron, and builds the plugins
of the encoders at tp > 1, whose head counts the layout checks need. The launch takes the result
(:class:`Preflight`) as it is.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_plugins import cpu_simulation
from megatron_plugins.errors import FlagError, UsageError, report
from megatron_plugins.launch.command_line import given_flag, raise_flag_errors
from megatron_plugins.parallel.flags import add_layout_args, encoder_providers, layout_from_args
from megatron_plugins.parallel.layout import ModulePlacement, ParallelLayout, encoder_micro_batch_size
from megatron_plugins.peft.flags import add_peft_args, check_peft
from megatron_plugins.weights.flags import add_weights_args, expand_hf_model, fill_layout_flags
from megatron_plugins.weights.megatron_init import add_checkpoint_init_args

if TYPE_CHECKING:
    from megatron_plugins.encoders import EncoderPlugin

__all__ = [
    "CommandLine", "EVERY_ENCODER", "MIMO_FLAGS", "Preflight", "add_mimo_args", "asks_help",
    "check_parser", "check_run", "read_command_line", "resolve_freeze", "run",
    "world_size_from_env"
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
    group.add_argument("--reference-attention", action="store_true",
                       help="With --transformer-impl local: attention through the reference "
                            "implementations (Megatron's local DotProductAttention, the packed "
                            "and context-parallel references), which keep every s x s score "
                            "matrix, instead of the default fast attention on torch's "
                            "scaled_dot_product_attention kernels (same results up to rounding).")
    group.add_argument("--dataset-provider", choices=["mock"], default="mock",
                       help="Upstream examples/mimo flag; the mock data is the only provider.")
    return parser


MIMO_FLAGS: tuple[Callable[[argparse.ArgumentParser], argparse.ArgumentParser], ...] = (
    add_layout_args, add_mimo_args, add_weights_args, add_checkpoint_init_args, add_peft_args,
    cpu_simulation.add_cli_flag)
"""The flag groups :func:`read_command_line` parses; stock's parser lists them in ``--help`` but
never reads their values."""


@dataclass(frozen=True)
class CommandLine:
    """The raw command line, split once: the MiMo flags parsed, the rest for stock's parser."""

    argv: tuple[str, ...]
    flags: argparse.Namespace
    """The :data:`MIMO_FLAGS` values (per-module flags as ``NAME -> VALUE`` dicts); the launch adds
    stock's values to this namespace, which becomes the run's ``args``."""
    stock_argv: tuple[str, ...]
    """``argv`` without the MiMo flags, in order: what stock's parser reads."""

    @property
    def providers(self) -> dict[str, str]:
        """Encoder name -> provider (``--encoder``, or the alias flags' one encoder)."""
        return encoder_providers(self.flags)


@dataclass(frozen=True)
class Preflight:
    """What the pre-import checks settled: the command line, the checked layout, the projections to
    freeze by name, and the plugins of the encoders at tp > 1 (built for their head counts, on the
    namespace that becomes the run's ``args``)."""

    command_line: CommandLine
    layout: ParallelLayout
    freeze_projection: list[str]
    plugins: dict[str, EncoderPlugin]


def _parser(*groups: Callable[[argparse.ArgumentParser], Any]) -> argparse.ArgumentParser:
    """A parser of ``groups`` that takes no abbreviations and raises FlagError."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for add in groups:
        add(parser)
    return raise_flag_errors(parser)


def _add_checked_stock_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The stock model (and data) flags the layout checks read; stock's parser reads them too."""
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
    return parser


def check_parser() -> argparse.ArgumentParser:
    """The MiMo flags and the stock flags the checks read, in one parser (``mimo-plan``'s)."""
    return _parser(*MIMO_FLAGS, _add_checked_stock_flags)


def refuse_upstream_flags(argv: Sequence[str]) -> None:
    """One line for the first upstream ``examples/mimo`` flag that has no meaning here."""
    flag = given_flag(argv, UPSTREAM_REFUSED)
    if flag is not None:
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


def read_command_line(argv: Sequence[str]) -> CommandLine:
    """Parse the MiMo flags of ``argv`` once (``--hf-model`` expanded); refuses upstream
    examples/mimo flags that mean nothing here."""
    refuse_upstream_flags(argv)
    flags, rest = _parser(*MIMO_FLAGS).parse_known_args(list(argv))
    expand_hf_model(flags)
    return CommandLine(tuple(argv), flags, tuple(rest))


def _sharded_plugins(command_line: CommandLine, layout: ParallelLayout,
                     quiet: bool) -> dict[str, EncoderPlugin]:
    """The plugins of the encoders whose tp must divide their heads (tp > 1), built on the
    command line's flags namespace with their own flags parsed into it; imports them."""
    sharded: list[ModulePlacement] = [module for module in layout.encoders if module.tp > 1]
    if not sharded:
        return {}
    flags = command_line.flags
    if quiet or flags.cpu_simulation:
        cpu_simulation.quiet_gpu_library_warnings()
    from megatron_plugins.encoders import add_encoder_args, instantiate, resolve

    classes = {module.name: resolve(module.provider, module.name) for module in sharded}
    add_encoder_args(_parser(), classes.values()).parse_known_args(
        list(command_line.stock_argv), namespace=flags)
    return {module.name: instantiate(module.provider, module.name, flags, module,
                                     classes[module.name])
            for module in sharded}


def check_run(argv: Sequence[str], world_size: int, *, quiet: bool = False,
              simulate: bool = False) -> Preflight:
    """Every check that needs no Megatron import, on a raw command line.

    Flags it does not know are ignored, so the launch's and a pasted torchrun command line both
    work. Raises :class:`FlagError` or ``LayoutError`` with one line naming the flag. Then the
    encoders at tp > 1 are built for their head counts, which imports Megatron: ``simulate`` (the
    entry point's) switches the CPU simulation on first when ``--cpu-simulation`` is given;
    ``quiet`` (``mimo-plan``'s) hides Megatron's warnings about absent GPU libraries.
    """
    command_line = read_command_line(argv)
    # The checks read stock model flags too, and fill some from config.json: on a copy, so the
    # flags handed on hold only what the command line gives.
    args = argparse.Namespace(**vars(command_line.flags))
    _parser(_add_checked_stock_flags).parse_known_args(list(command_line.stock_argv),
                                                      namespace=args)
    fill_layout_flags(args)
    layout = layout_from_args(args, world_size)
    freeze_projection = resolve_freeze(args, layout)
    check_peft(args, layout, freeze_projection)
    if args.micro_batch_size is not None:
        for module in layout.encoders:
            encoder_micro_batch_size(layout, module.name, args.micro_batch_size)
    if given_flag(argv, ["--encoder-ddp-overlap"]) and not args.overlap_grad_reduce:
        raise FlagError("--encoder-ddp-overlap needs --overlap-grad-reduce (as upstream); add it "
                        "or use --encoder-overlap-grad-reduce alone")
    if simulate and args.cpu_simulation:
        from megatron_plugins.cpu_simulation import patches

        patches.activate()
    plugins = _sharded_plugins(command_line, layout, quiet)
    if plugins:
        heads = {name: plugin.num_attention_heads for name, plugin in plugins.items()}
        layout = layout_from_args(args, world_size, heads)
    return Preflight(command_line, layout, freeze_projection, plugins)


def world_size_from_env() -> int:
    """The world size the launch will have: ``WORLD_SIZE`` as torchrun sets it (stock default 1)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def asks_help(argv: Sequence[str]) -> bool:
    """Whether the command line asks for --help, which stock's parser answers before any check."""
    return "-h" in argv or "--help" in argv


def run(argv: Sequence[str], prog: str) -> Preflight | int | None:
    """The entry point's first step: 2 after printing the one-line error, else what it checked
    to hand to the launch, the CPU simulation on when asked for (None when --help is asked for:
    stock's parser prints it, nothing runs)."""
    if asks_help(argv):
        return None
    try:
        return check_run(argv, world_size_from_env(), simulate=True)
    except UsageError as error:
        return report(prog, error)
