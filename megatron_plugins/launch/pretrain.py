"""What ``examples/mimo/pretrain_mimo.py`` does around stock ``pretrain()``.

:func:`parse_mimo_args` reads stock and plugin flags, settles the run's values
(:mod:`megatron_plugins.launch.settle`) and checks the whole run before any process group exists
(every rank computes the same verdict); :func:`start` brings up torch.distributed without
Megatron's global model-parallel state, the topology, the cross-grid communicator and the build
config; :func:`pretrain_kwargs` is what stock ``pretrain()`` takes, the data provider included;
:func:`train` is the whole sequence after parsing, which the entry point and the tests run.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel.multimodule_communicator import (
    MultiModulePipelineCommunicator,
)
from megatron.training import get_args, pretrain
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.arguments import parse_args
from megatron.training.global_vars import set_global_variables

from megatron_plugins import cpu_simulation
from megatron_plugins.launch import checkpoint_guards
from megatron_plugins.model.builder import MimoBuildConfig
from megatron_plugins.step.colocated import ColocatedSchedule
from megatron_plugins.compat import checkpointing, colocation, model_build, startup
from megatron_plugins.data.addressing import GuardSet
from megatron_plugins.data.sources import add_data_args
from megatron_plugins.data.streams import DataSource, alignment_guard, data_provider
from megatron_plugins.encoders import EncoderPlugin, add_encoder_args, resolve
from megatron_plugins.launch.command_line import raise_flag_errors
from megatron_plugins.launch.flag_checks import check_training
from megatron_plugins.launch.optimizer_flags import add_optimizer_args
from megatron_plugins.launch.preflight import (
    MIMO_FLAGS,
    CommandLine,
    Preflight,
    asks_help,
    check_run,
    read_command_line,
    world_size_from_env,
)
from megatron_plugins.launch.settle import settle
from megatron_plugins.parallel.layout import ParallelLayout
from megatron_plugins.parallel.topology import HeteroTopology, build_topology, pipeline_communicator
from megatron_plugins.peft.checkpoint import BASE_ATTR, SETTINGS_ATTR
from megatron_plugins.performance import measurement
from megatron_plugins.performance.flags import add_performance_args
from megatron_plugins.step.forward import forward_step

__all__ = ["MimoRun", "MimoSession", "parse_mimo_args", "pretrain_kwargs", "start", "train"]

HELP_DESCRIPTION = (
    "Heterogeneous MiMo pretraining through stock Megatron pretrain(). MiMo flags come first, "
    "then each named encoder's (name one with --encoder NAME=PROVIDER before --help to see its "
    "flags), then stock Megatron's."
)

HELP_USAGE = ("%(prog)s [--encoder NAME=PROVIDER ...] --grid NAME:tp=T,pp=P,dp=D ... "
              "[MiMo, encoder and stock Megatron flags]")
"""Stock's usage line lists ~800 flags; this one says what a launch needs."""


@dataclass(frozen=True)
class MimoRun:
    """A checked run: stock args (language grid applied), layout, encoder plugins, data source and
    the language model's config, each built once."""

    args: argparse.Namespace
    layout: ParallelLayout
    plugins: dict[str, EncoderPlugin]
    source: DataSource
    language: Any
    command: tuple[str, ...] = ()
    """The command line as the launch was given it."""


def _suggest(message: str, parser: argparse.ArgumentParser) -> str:
    """argparse's 'unrecognized arguments' as one line: each flag and its closest known one."""
    prefix = "unrecognized arguments: "
    if not message.startswith(prefix):
        return message
    tokens = message[len(prefix):].split()
    flags = [token.partition("=")[0] for token in tokens if token.startswith("-")] or tokens
    known = list(parser._option_string_actions)
    named = []
    for flag in flags:
        close = difflib.get_close_matches(flag, known, n=1)
        named.append(f"{flag} (did you mean {close[0]}?)" if close else flag)
    return f"unknown flag{'s' if len(named) > 1 else ''} {', '.join(named)}; see --help"


def _plugin_classes(command_line: CommandLine,
                    resolved: Mapping[str, EncoderPlugin]) -> dict[str, type[EncoderPlugin]]:
    """Every encoder's plugin class: those of the plugins the pre-import checks built, the
    others resolved now."""
    return {name: type(resolved[name]) if name in resolved else resolve(provider, name)
            for name, provider in command_line.providers.items()}


def _parse_flags(command_line: CommandLine, classes: Mapping[str, type[EncoderPlugin]]
                 ) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    """Stock parse_args over the flags the MiMo parse left, with every flag group registered
    (ours first in --help) and parse errors raised as FlagError; stock's values are added to the
    MiMo flags' namespace, which becomes the run's ``args``."""
    parsers: list[argparse.ArgumentParser] = []

    def extra_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        stock_groups = len(parser._action_groups)
        for add in (*MIMO_FLAGS, add_data_args, add_optimizer_args, add_performance_args):
            add(parser)
        add_encoder_args(parser, classes.values())
        # argparse prints groups in creation order: ours (made last) go first, after "options".
        groups = parser._action_groups
        parser._action_groups = groups[:2] + groups[stock_groups:] + groups[2:stock_groups]
        parser.description = HELP_DESCRIPTION
        parser.usage = HELP_USAGE
        startup.escape_unformattable_help(parser)
        parsers.append(raise_flag_errors(parser, lambda message: _suggest(message, parser)))
        return parser

    saved, sys.argv = sys.argv, [sys.argv[0], *command_line.stock_argv]
    try:
        stock = parse_args(extra_args)
    finally:
        sys.argv = saved
    args = command_line.flags
    for attr, value in vars(stock).items():
        if not hasattr(args, attr):
            setattr(args, attr, value)
    return args, parsers[0]


def parse_mimo_args(argv: Sequence[str] | None = None, checked: Preflight | None = None,
                    planning: bool = False) -> MimoRun:
    """Parse, settle and check every flag; raises a :class:`~megatron_plugins.errors.UsageError`
    naming the flag to fix. ``checked`` is what the entry point's pre-import checks found
    (:func:`megatron_plugins.launch.preflight.run`), ``argv`` then unused; without it they run
    here (with --help, stock's parser prints the help and exits). ``planning``: for
    ``mimo-plan``, which loads no weights (a config-only ``--hf-model`` folder passes)."""
    if checked is None:
        argv = list(sys.argv[1:] if argv is None else argv)
        if asks_help(argv):
            command_line = read_command_line(argv)
            _parse_flags(command_line, _plugin_classes(command_line, {}))
        checked = check_run(argv, world_size_from_env())
    classes = _plugin_classes(checked.command_line, checked.plugins)
    args, parser = _parse_flags(checked.command_line, classes)
    settled = settle(args, checked.command_line.argv, parser, checked, classes, planning)
    return MimoRun(args, checked.layout, settled.plugins, settled.source, settled.language,
                   checked.command_line.argv)


@dataclass
class MimoSession:
    """The live pieces of one run; :meth:`close` tears them down."""

    run: MimoRun
    topology: HeteroTopology
    communicator: MultiModulePipelineCommunicator
    config: Any
    guard: GuardSet | None

    def close(self) -> None:
        """Destroy every process group of the run (topology, bridges, the default group)."""
        self.topology.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()


def start(run: MimoRun) -> MimoSession:
    """torch.distributed, topology, communicator and stock config container for ``run``."""
    args = run.args
    set_global_variables(args)
    if torch.cuda.device_count() > 0 and not cpu_simulation.is_active():
        torch.cuda.set_device(args.local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend=args.distributed_backend, rank=args.rank,
                                world_size=args.world_size,
                                timeout=timedelta(minutes=args.distributed_timeout_minutes))
    topology = build_topology(run.layout)
    if run.layout.hosted:
        colocation.wrap_schedules(ColocatedSchedule)
    checkpoint_guards.write_layout(args.save, run.layout, dist.get_rank())
    model_build.ensure_global_memory_buffer()
    language = run.language
    guard = (alignment_guard(topology, args.micro_batch_size, args.balance_encoder_work)
             if args.data_alignment_check else None)
    model = MimoBuildConfig(
        language=language,
        special_token_ids=run.source.special_token_ids,
        seed=args.seed,
        inference_rng_tracker=args.inference_rng_tracker,
        freeze_language_model=args.freeze_language_model,
        freeze_encoders=list(args.freeze_encoder),
        freeze_projections=list(args.freeze_projection),
        encoder_overlap_grad_reduce=args.encoder_overlap_grad_reduce,
        colocated_encoder_recompute=args.colocated_encoder_recompute,
        lora=list(args.lora),
        part_settings=getattr(args, SETTINGS_ATTR),
        peft_base=getattr(args, BASE_ATTR),
        language_hf_weights=args.language_hf_weights,
        encoder_hf_weights=dict(args.encoder_hf_weights),
        hf_model=args.hf_model,
        language_megatron_checkpoint=args.language_megatron_checkpoint,
        encoder_megatron_checkpoints=dict(args.encoder_megatron_checkpoint),
        _topology=topology,
        _plugins=run.plugins,
        _alignment=guard,
    )
    communicator = pipeline_communicator(topology, language.transformer,
                                         run.source.static_shapes)
    config = pretrain_cfg_container_from_args(args, model)
    return MimoSession(run, topology, communicator, config, guard)


def pretrain_kwargs(session: MimoSession) -> dict[str, Any]:
    """Arguments of stock ``pretrain()`` for this session."""
    provider: Callable = data_provider(session.run.source, session.topology, session.guard,
                                       get_args)
    return {
        "cfg_container": session.config,
        "train_valid_test_dataset_provider": provider,
        "model_type": ModelType.encoder_or_decoder,
        "forward_step_func": forward_step,
        "p2p_communicator": session.communicator,
        "pg_collection": session.topology.pg_collection,
        "skip_model_parallel_init": True,
    }


def train(run: MimoRun, customize: Callable[[MimoSession], None] | None = None) -> None:
    """Everything after parsing, as the entry point runs it: what stock refuses only once it
    trains (one line, before any process group), bridges, grids, stock ``pretrain()``, teardown.
    ``customize`` sees the live session before training (tests observe the model)."""
    check_training(run.args, run.layout.language)
    startup.install()
    checkpointing.keep_save_results_in_process(run.args.async_save)
    measurement.install(run)
    session = start(run)
    # One line on rank 0 once the model is built: megatron-core's version and the gaps bridged.
    startup.announce_bridged_gaps(session.config.model, run.args.rank)
    try:
        if customize is not None:
            customize(session)
        pretrain(**pretrain_kwargs(session))
    finally:
        session.close()
