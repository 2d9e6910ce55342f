"""``mimo-plan --advise``: which layout to launch a MiMo run with on the GPUs at hand.

Takes a launch's command line without (or with) its layout flags, plus ``--gpus N``,
``--gpus-per-node G`` and ``--gpu NAME`` (or the GPU's figures). Mistakes in these come first, one
line each, before anything heavy is imported. Then the launch's own parse reads the model, batch
and data flags (on a probe layout of one rank per module, so every check the launch makes on them
applies), the advisor describes the data, counts each module's work and hands them to
:mod:`megatron_plugins.performance` to enumerate, estimate and rank the layouts. A layout the
command line gives is estimated beside them; ``--profile FILE`` calibrates the efficiencies from a
measured run first. The command line is planned for the GPUs it names, not settled for this
machine: stock's checks see a Transformer Engine there (compat Gap 34).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_plugins.compat import planning
from megatron_plugins.errors import FlagError, UsageError, report
from megatron_plugins.launch.command_line import given_flag, raise_flag_errors
from megatron_plugins.launch.preflight import CommandLine, check_run, read_command_line
from megatron_plugins.parallel.flags import add_layout_args, required_world_size
from megatron_plugins.parallel.layout import LANGUAGE, ParallelLayout
from megatron_plugins.performance.advisor import OBJECTIVES, advise, format_advice
from megatron_plugins.performance.assumptions import add_assumption_args, assumptions_from_args
from megatron_plugins.performance.calibration import calibrate, read_profile
from megatron_plugins.performance.candidates import (
    CHECKED_FLAGS,
    MICRO_BATCHES,
    Space,
    enumerate_candidates,
    layout_candidate,
)
from megatron_plugins.performance.data import (
    DataDescription,
    add_data_description_args,
    given_description,
)
from megatron_plugins.performance.gpus import FIGURES, Hardware, hardware
from megatron_plugins.performance.memory import candidate_memory
from megatron_plugins.performance.workload import Workload

__all__ = ["FLAG", "Planned", "advisor_flags", "layout_memory", "main", "plan_inputs"]

FLAG = "--advise"

PLAN_FLAGS = {"--nproc-per-node": 1, "--nproc_per_node": 1, "--nnodes": 1, "--ranks": 0}
"""``mimo-plan``'s own flags (with how many values they take), not the launch's."""

STOCK_PARALLEL_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                        "--context-parallel-size", "--expert-model-parallel-size",
                        "--expert-tensor-parallel-size")
"""Stock flags that set the language grid, which the advisor chooses."""
COLOCATED_RECOMPUTE = "--colocated-encoder-recompute"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mimo-plan --advise", add_help=False,
                                     allow_abbrev=False)
    group = parser.add_argument_group("mimo-plan --advise: the GPUs")
    group.add_argument(FLAG, action="store_true")
    group.add_argument("--gpus", type=int, default=None, help="GPUs to plan for.")
    group.add_argument("--gpus-per-node", type=int, default=8)
    group.add_argument("--gpu", default=None, help="A known GPU by name (e.g. h100-sxm).")
    for field, flag in FIGURES:
        group.add_argument(flag, dest=field, type=float, default=None)
    group.add_argument("--profile", default=None, metavar="FILE",
                       help="A run's --mimo-profile file: calibrate the efficiencies from it.")
    group.add_argument("--advise-top", type=int, default=5, help="Layouts to show.")
    group.add_argument("--advise-objective", choices=sorted(OBJECTIVES), default="per-gpu")
    add_data_description_args(parser)
    add_assumption_args(parser)
    return raise_flag_errors(parser)


def _layout_flags() -> dict[str, int]:
    """The layout flags (the ``--encoder`` names aside) with the values each takes."""
    parser = add_layout_args(argparse.ArgumentParser(add_help=False))
    return {option: 1 for action in parser._actions if action.dest != "mimo_encoders"
            for option in action.option_strings}


def _without(argv: Sequence[str], flags: dict[str, int]) -> list[str]:
    """``argv`` without ``flags`` (and the values each takes)."""
    kept, skip = [], 0
    for token in argv:
        if skip:
            skip -= 1
            continue
        name, sep, _ = token.partition("=")
        if name in flags:
            skip = 0 if sep else flags[name]
            continue
        kept.append(token)
    return kept


def _given_layout(command_line: CommandLine) -> ParallelLayout | None:
    """The layout the command line gives, checked as the launch checks it; None without one."""
    argv = list(command_line.argv)
    if not given_flag(argv, _layout_flags()):
        return None
    return check_run(argv, required_world_size(command_line.flags), quiet=True).layout


def _providers(command_line: CommandLine) -> dict[str, str]:
    """Encoder name -> provider from ``--encoder`` or ``--hf-model`` (or the alias flags'
    implicit encoder)."""
    providers = dict(command_line.flags.mimo_encoders)
    if not providers and given_flag(command_line.argv, _layout_flags()):
        providers = command_line.providers
    if not providers:
        raise FlagError("mimo-plan --advise: no encoder; name each with --encoder NAME=PROVIDER "
                        "(or give --hf-model)")
    return providers


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Hide what the launch's parse prints for a launch (stock's argument dump, its notices,
    warnings about absent GPU libraries); errors still raise."""
    with (contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()),
          warnings.catch_warnings()):
        warnings.simplefilter("ignore")
        logging.disable(logging.INFO)
        try:
            yield
        finally:
            logging.disable(logging.NOTSET)


def _parse_run(argv: list[str], providers: dict[str, str]) -> tuple[Any, ParallelLayout]:
    """The launch's parse of ``argv`` on a probe layout of one rank per module; returns the
    parsed run and the probe layout. ``--colocated-encoder-recompute`` is kept off the probe,
    which hosts no encoder, and set on the parsed run as given: the layouts priced may host
    one."""
    probe = _without(argv, {**_layout_flags(), **{flag: 1 for flag in STOCK_PARALLEL_FLAGS},
                            COLOCATED_RECOMPUTE: 0})
    probe += [token for name in providers for token in ("--grid", f"{name}:dp=1")]
    probe += ["--grid", f"{LANGUAGE}:dp=1"]
    checked = check_run(probe, len(providers) + 1, quiet=True)
    from megatron_plugins.launch.pretrain import parse_mimo_args

    run = parse_mimo_args(probe, checked, planning=True)
    run.args.colocated_encoder_recompute = given_flag(argv, [COLOCATED_RECOMPUTE]) is not None
    return run, checked.layout


def _check_given_data(own: argparse.Namespace, providers: dict[str, str],
                      argv: list[str]) -> None:
    """Before the launch's parse: a data description given in full (every encoder's item tokens)
    must fit the ``--seq-length`` rows."""
    seq = argparse.ArgumentParser(add_help=False)
    seq.add_argument("--seq-length", type=int)
    seq_length = seq.parse_known_args(argv)[0].seq_length
    tokens = dict(text.partition("=")[::2] for text in own.advise_item_tokens)
    if seq_length is not None and set(providers) <= set(tokens):
        given_description(own, {name: 0 for name in providers}, seq_length)


def _space(args: argparse.Namespace, plugins: dict, providers: dict[str, str],
           gpus: Hardware) -> Space:
    linear = args.experimental_attention_variant == "gated_delta_net"
    return Space(heads=args.num_attention_heads, layers=args.num_layers,
                 encoder_heads={name: plugin.num_attention_heads
                                for name, plugin in plugins.items()},
                 providers=providers, experts=args.num_experts or 0,
                 global_batch=args.global_batch_size,
                 gpus_per_node=gpus.gpus_per_node, fewest=gpus.fewest_gpus, most=gpus.gpus,
                 checks={flag: getattr(args, flag, None) for flag in CHECKED_FLAGS},
                 linear_heads=((args.linear_num_key_heads, args.linear_num_value_heads)
                               if linear else None))


@dataclass(frozen=True)
class Planned:
    """What the advisor reads of a command line: the parsed run (stock args, encoder plugins,
    data source), the data described, each module's work, and the layout the command line gives
    (None without one)."""

    run: Any
    data: DataDescription
    workload: Workload
    given: ParallelLayout | None
    providers: dict[str, str]


def plan_inputs(own: argparse.Namespace, argv: Sequence[str]) -> Planned:
    """The launch's parse of ``argv`` (a launch's command line; ``own`` the advisor's flags),
    the data described and each module's work."""
    launch = _without(argv, PLAN_FLAGS)
    command_line = read_command_line(launch)
    providers = _providers(command_line)
    _check_given_data(own, providers, launch)
    given = _given_layout(command_line)
    with _quiet():
        from megatron_plugins.launch.advise_workload import describe_data, run_workload

        run, probe = _parse_run(launch, providers)
        for name in ("advise_items_per_sample", "advise_item_tokens", "advise_clip_seconds",
                     "advise_text_tokens", "advise_samples"):
            setattr(run.args, name, getattr(own, name))
        data = describe_data(run.args, run.plugins, run.source, probe)
        workload = run_workload(run.args, run.plugins, data)
    return Planned(run, data, workload, given, providers)


def advisor_flags(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The advisor's own flags, checked, and the rest of the command line (the launch's)."""
    own, rest = _parser().parse_known_args(list(argv))
    if own.gpus is None:
        raise FlagError("mimo-plan --advise needs --gpus N, the GPUs to plan for")
    if own.advise_top < 1 or own.advise_samples < 1:
        raise FlagError("--advise-top and --advise-samples must be at least 1")
    return own, rest


def layout_memory(argv: Sequence[str], layout: ParallelLayout, nodes: int,
                  per_node: int) -> str:
    """What ``mimo-plan --gpu NAME`` (without ``--advise``) adds to the rank map: the advisor's
    memory per rank of ``layout`` (the command line's, checked) on ``nodes`` nodes of
    ``per_node`` such GPUs, the model read as the launch reads it (the data as the advisor's data
    flags describe it, else sampled from the run's source)."""
    own, rest = _parser().parse_known_args(list(argv))
    gpus = hardware(nodes * per_node, per_node, own.gpu,
                    {field: getattr(own, field) for field, _ in FIGURES})
    with planning.transformer_engine_assumed():
        planned = plan_inputs(own, rest)
        args = planned.run.args
        candidate = layout_candidate(layout, args.micro_batch_size,
                                     args.recompute_granularity == "full",
                                     args.colocated_encoder_recompute)
        memory = candidate_memory(candidate, planned.workload, gpus, assumptions_from_args(own))
    fits = "fits" if memory.fits else "does NOT fit"
    offloaded = planned.workload.optimizer_offloaded
    cpu = f", optimizer state {offloaded:.0%} on the CPU" if offloaded else ""
    return (f"memory per rank (GiB, the advisor's model; {gpus.gpu.name}: "
            f"{gpus.gpu.memory_gib:g} GiB, {memory.capacity:.1f} usable{cpu}): "
            f"{memory.per_rank()}; {fits}")


def advise_main(argv: Sequence[str]) -> int:
    """Parse, estimate and print; raises :class:`UsageError` for bad input."""
    own, rest = advisor_flags(argv)
    gpus = hardware(own.gpus, own.gpus_per_node, own.gpu,
                    {field: getattr(own, field) for field, _ in FIGURES})
    assumptions = assumptions_from_args(own)
    profile = read_profile(own.profile) if own.profile else None
    with planning.transformer_engine_assumed():
        planned = plan_inputs(own, rest)
        args, workload = planned.run.args, planned.workload
        extra = []
        if profile is not None:
            assumptions = calibrate(profile, workload, gpus, assumptions)
            extra.append(profile.candidate())
        if planned.given is not None:
            extra.insert(0, layout_candidate(planned.given, args.micro_batch_size,
                                             args.recompute_granularity == "full",
                                             args.colocated_encoder_recompute))
        micro_batches = sorted({*MICRO_BATCHES, args.micro_batch_size})
        space = _space(args, planned.run.plugins, planned.providers, gpus)
        candidates = enumerate_candidates(space, micro_batches, homogeneous_fewest=1)
        advice = advise(candidates, extra, workload, gpus, assumptions, own.advise_objective)
    print(format_advice(advice, workload, planned.data, assumptions, own.advise_top))
    return 0 if advice.ranked else 1


def main(argv: Sequence[str]) -> int:
    """``mimo-plan --advise``; returns the exit code (2 and one line for bad input)."""
    try:
        return advise_main(argv)
    except UsageError as error:
        return report("mimo-plan", error)
