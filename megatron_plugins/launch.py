"""What ``examples/mimo/pretrain_mimo.py`` does around stock ``pretrain()``.

:func:`parse_mimo_args` reads stock and plugin flags and checks the whole run before any process
group exists (every rank computes the same verdict); :func:`start` brings up torch.distributed
without Megatron's global model-parallel state, the topology, the cross-grid communicator, the
data provider and the build config; :func:`pretrain_kwargs` is what stock ``pretrain()`` takes;
:func:`train` is the whole sequence after parsing, which the entry point and the tests run.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel.multimodule_communicator import (
    MultiModulePipelineCommunicator,
)
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer, vocab_size_with_padding
from megatron.training import get_args, pretrain
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.arguments import parse_args, validate_args
from megatron.training.global_vars import set_global_variables

from megatron_plugins import checkpoint_guards, cpu_simulation, megatron_compat
from megatron_plugins.builder import MimoBuildConfig
from megatron_plugins.data.addressing import AlignmentGuard
from megatron_plugins.data.sources import add_data_args, build_source
from megatron_plugins.data.streams import DataSource, alignment_guard, data_provider
from megatron_plugins.encoders import (
    EncoderPlugin,
    add_encoder_args,
    check_hooks,
    instantiate,
)
from megatron_plugins.language import language_config_from_args
from megatron_plugins.layout import (
    ALIAS_ENCODER,
    ParallelLayout,
    add_layout_args,
    apply_language_grid,
)
from megatron_plugins.preflight import (
    FlagError,
    add_mimo_args,
    check_run,
    refuse_upstream_flags,
    resolve_freeze,
)
from megatron_plugins.optimizer_config import (
    add_optimizer_args,
    apply_optimizer_args,
)
from megatron_plugins.topology import HeteroTopology, build_topology, pipeline_communicator
from megatron_plugins.weights.flags import (
    add_weights_args,
    apply_language_config,
    encoder_folders,
)
from megatron_plugins.weights.megatron_init import add_checkpoint_init_args, check_init_flags
from megatron_plugins.training_step import forward_step

HELP_DESCRIPTION = (
    "Heterogeneous MiMo pretraining through stock Megatron pretrain(). MiMo flags come first, "
    "then each named encoder's (name one with --encoder NAME=PROVIDER before --help to see its "
    "flags), then stock Megatron's."
)

HELP_USAGE = ("%(prog)s [--encoder NAME=PROVIDER ...] --grid NAME:tp=T,pp=P,dp=D ... "
              "[MiMo, encoder and stock Megatron flags]")
"""Stock's usage line lists ~800 flags; this one says what a launch needs."""

CPU_SIMULATION_VALUES = (
    ("transformer_impl", "local", "--transformer-impl local", "Transformer Engine needs a GPU"),
    ("gradient_accumulation_fusion", False, "--no-gradient-accumulation-fusion",
     "a fused CUDA kernel"),
    ("masked_softmax_fusion", False, "--no-masked-softmax-fusion", "a fused CUDA kernel"),
    ("bias_gelu_fusion", False, "--no-bias-gelu-fusion", "a fused CUDA kernel"),
    ("bias_swiglu_fusion", False, "--no-bias-swiglu-fusion", "a fused CUDA kernel"),
    ("bias_dropout_fusion", False, "--no-bias-dropout-fusion", "a fused CUDA kernel"),
    ("apply_rope_fusion", False, "--no-rope-fusion", "a fused CUDA kernel"),
    ("no_persist_layer_norm", True, "--no-persist-layer-norm",
     "the persistent layer norm needs Apex on a GPU"),
    ("distributed_backend", "gloo", "--distributed-backend gloo", "NCCL needs GPUs"),
    ("moe_grouped_gemm", False, "drop the flag", "it needs Transformer Engine on a GPU"),
    ("moe_permute_fusion", False, "drop the flag",
     "it needs Transformer Engine on a GPU"),
    ("moe_router_fusion", False, "drop the flag", "it needs Transformer Engine on a GPU"),
    ("sequence_parallel", False, "drop the flag",
     "the local spec's torch norms cannot split the sequence; MoE at TP > 1, which stock allows "
     "only with it, needs a GPU too"),
)
"""(args attribute, CPU-capable value, the flag that sets it, why the stock value cannot run)."""

DEFAULT_EVAL_INTERVAL = 1000
"""--eval-interval when none is given (0.19.2 leaves it unset, then fails); earlier releases' default."""


def _encoder_providers(argv: Sequence[str]) -> dict[str, str]:
    """``--encoder`` values (or the alias flags' implicit encoder) before the full parse."""
    scan = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_layout_args(scan)
    known, _ = scan.parse_known_args(list(argv))
    providers = dict(text.partition("=")[::2] for text in known.mimo_encoders or [])
    return providers or dict([ALIAS_ENCODER])


@dataclass(frozen=True)
class MimoRun:
    """A checked run: stock args (language grid applied), layout and encoder plugins."""

    args: argparse.Namespace
    layout: ParallelLayout
    plugins: dict[str, EncoderPlugin]
    source: DataSource


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


def _parse_flags(argv: list[str], providers: dict[str, str]
                 ) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    """Stock parse_args with our flags, their help first, and parse errors raised as FlagError."""
    parsers: list[argparse.ArgumentParser] = []

    def extra_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        stock_groups = len(parser._action_groups)
        for add in (add_layout_args, add_mimo_args, add_data_args, add_optimizer_args,
                    add_weights_args, add_checkpoint_init_args, cpu_simulation.add_cli_flag):
            add(parser)
        add_encoder_args(parser, providers)
        # argparse prints groups in creation order: ours (made last) go first, after "options".
        groups = parser._action_groups
        parser._action_groups = groups[:2] + groups[stock_groups:] + groups[2:stock_groups]
        parser.description = HELP_DESCRIPTION
        parser.usage = HELP_USAGE
        megatron_compat.escape_unformattable_help(parser)

        def error(message: str) -> None:
            raise FlagError(_suggest(message, parser))

        parser.error = error  # type: ignore[method-assign]
        parsers.append(parser)
        return parser

    saved, sys.argv = sys.argv, [sys.argv[0], *argv]
    try:
        args = parse_args(extra_args)
    finally:
        sys.argv = saved
    return args, parsers[0]


def _given(parser: argparse.ArgumentParser, argv: Sequence[str], attr: str) -> str | None:
    """The flag of ``attr`` as the command line spells it, or None when it was not given."""
    spellings = {option for action in parser._actions if action.dest == attr
                 for option in action.option_strings}
    return next((token.partition("=")[0] for token in argv
                 if token.partition("=")[0] in spellings), None)


def apply_run_defaults(args: argparse.Namespace, argv: Sequence[str],
                       parser: argparse.ArgumentParser) -> list[str]:
    """Fill what 0.19.2 leaves unset and, on the CPU simulation, what only a GPU can run.

    Returns the flags it set, for one notice line. A GPU-only value the user gave explicitly is
    a :class:`FlagError` naming the flag.
    """
    chosen = []
    if args.tokenizer_type is None:
        if args.vocab_size is None:
            raise FlagError("--tokenizer-type is missing: the mock data needs only a vocabulary "
                            "size; add --vocab-size N (the NullTokenizer is then used) or give "
                            "--tokenizer-type")
        args.tokenizer_type = "NullTokenizer"
        chosen.append("--tokenizer-type NullTokenizer")
    if args.eval_interval is None:
        args.eval_interval = DEFAULT_EVAL_INTERVAL
        chosen.append(f"--eval-interval {DEFAULT_EVAL_INTERVAL}")
    if cpu_simulation.is_active():
        for attr, value, flag, reason in CPU_SIMULATION_VALUES:
            if getattr(args, attr) == value:
                continue
            given = _given(parser, argv, attr)
            if given is not None:
                raise FlagError(f"{given} cannot run on the CPU simulation ({reason}); "
                                f"{'use ' + flag if flag.startswith('--') else flag}")
            setattr(args, attr, value)
            chosen.append(flag)
    return chosen


def _notice(args: argparse.Namespace, text: str) -> None:
    """One line that something was chosen for the user, shown once (rank 0)."""
    if args.rank == 0:
        print(f"pretrain_mimo.py: notice: {text}", file=sys.stderr, flush=True)


def parse_mimo_args(argv: Sequence[str] | None = None) -> MimoRun:
    """Parse and check every flag; raises a :class:`~megatron_plugins.errors.UsageError` naming
    the flag to fix."""
    argv = sys.argv[1:] if argv is None else list(argv)
    refuse_upstream_flags(argv)
    args, parser = _parse_flags(argv, _encoder_providers(argv))
    # --language-hf-weights' config.json gives the shape flags, before anything reads them.
    args.language_hf_family = apply_language_config(args, lambda attr: _given(parser, argv, attr))
    # check_run is the launch's and mimo-plan's one layout check (encoder head counts included).
    layout = check_run(argv, args.world_size)
    resolve_freeze(args, layout)
    plugins = {module.name: instantiate(module.provider, module.name, args, module)
               for module in layout.encoders}
    args.encoder_hf_weights = encoder_folders(args.encoder_hf_weights, plugins)
    resume_notice = checkpoint_guards.check_checkpoint_flags(args, layout)
    if resume_notice:
        _notice(args, resume_notice)
    chosen = apply_run_defaults(args, argv, parser)
    if chosen:
        _notice(args, f"defaults set (give the flags to silence this): {', '.join(chosen)}")
    source = build_source(args, plugins)
    if args.data_path:
        # Energon loader states go into each checkpoint (megatron_compat Gap 10).
        args.dataloader_save = args.save
    apply_optimizer_args(args, argv)
    args.calculate_per_token_loss = True
    args.dataloader_type = "external"
    with apply_language_grid(args, layout):
        try:
            validate_args(args)
        except (AssertionError, ValueError) as error:
            raise FlagError(f"stock Megatron argument check failed: {error}") from None
    if args.data_path and args.padded_vocab_size is None:
        # Stock pads the tokenizer's vocabulary only when it builds it, after the language
        # config below is first needed; the same function gives the same size now.
        args.padded_vocab_size = vocab_size_with_padding(source.tokenizer.vocab_size, args,
                                                         logging_enabled=False)
    if args.language_megatron_checkpoint and args.padded_vocab_size is None:
        # The checkpoint's padded vocabulary is compared below; stock's tokenizer sets ours.
        build_tokenizer(args)
    check_init_flags(args, plugins, layout.language.pp)
    # The cross-grid schedule requires variable sequence lengths, which Megatron's allgather MoE
    # dispatcher (the stock default) does not support.
    args.variable_seq_lengths = True
    if args.moe_token_dispatcher_type == "allgather":
        args.moe_token_dispatcher_type = "alltoall"
    language = language_config_from_args(args).transformer
    for plugin in plugins.values():
        notice = check_hooks(plugin, language)
        if notice:
            _notice(args, notice)
    return MimoRun(args, layout, plugins, source)


@dataclass
class MimoSession:
    """The live pieces of one run; :meth:`close` tears them down."""

    run: MimoRun
    topology: HeteroTopology
    communicator: MultiModulePipelineCommunicator
    config: Any
    guard: AlignmentGuard | None

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
    checkpoint_guards.write_layout(args.save, run.layout, dist.get_rank())
    megatron_compat.ensure_global_memory_buffer()
    language = language_config_from_args(args)
    guard = (alignment_guard(topology, args.micro_batch_size) if args.data_alignment_check
             else None)
    model = MimoBuildConfig(
        language=language,
        special_token_ids=run.source.special_token_ids,
        seed=args.seed,
        inference_rng_tracker=args.inference_rng_tracker,
        freeze_language_model=args.freeze_language_model,
        freeze_encoders=list(args.freeze_encoder),
        freeze_projections=list(args.freeze_projection),
        encoder_overlap_grad_reduce=args.encoder_overlap_grad_reduce,
        language_hf_weights=args.language_hf_weights,
        encoder_hf_weights=dict(args.encoder_hf_weights),
        language_megatron_checkpoint=args.language_megatron_checkpoint,
        encoder_megatron_checkpoints=dict(args.encoder_megatron_checkpoint),
        _topology=topology,
        _plugins=run.plugins,
        _alignment=guard,
    )
    communicator = pipeline_communicator(topology, language.transformer)
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
    """Everything after parsing, as the entry point runs it: bridges, grids, stock ``pretrain()``,
    teardown. ``customize`` sees the live session before training (tests observe the model)."""
    megatron_compat.install()
    session = start(run)
    try:
        if customize is not None:
            customize(session)
        pretrain(**pretrain_kwargs(session))
    finally:
        session.close()
