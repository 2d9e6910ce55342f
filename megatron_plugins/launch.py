"""What ``examples/mimo/pretrain_mimo.py`` does around stock ``pretrain()``.

:func:`parse_mimo_args` reads stock and plugin flags and checks the whole run before any process
group exists (every rank computes the same verdict); :func:`start` brings up torch.distributed
without Megatron's global model-parallel state, the topology, the cross-grid communicator, the
data provider and the build config; :func:`pretrain_kwargs` is what stock ``pretrain()`` takes.
"""

from __future__ import annotations

import argparse
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
from megatron.training import get_args
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.arguments import parse_args, validate_args
from megatron.training.global_vars import set_global_variables

from megatron_plugins import checkpoints, cpu_simulation, megatron_compat
from megatron_plugins.builder import MimoBuildConfig
from megatron_plugins.data import MockMultimodalSamples, data_provider, encoder_micro_batch_size
from megatron_plugins.encoders import (
    EncoderPlugin,
    EncoderPluginError,
    add_encoder_args,
    check_hooks,
    instantiate,
    resolve,
)
from megatron_plugins.language import LanguageModelError, language_config_from_args
from megatron_plugins.layout import (
    ALIAS_ENCODER,
    LayoutError,
    ParallelLayout,
    add_layout_args,
    apply_language_grid,
    layout_from_args,
)
from megatron_plugins.optimizer_config import (
    OptimizerConfigError,
    add_optimizer_args,
    apply_optimizer_args,
)
from megatron_plugins.topology import HeteroTopology, build_topology, pipeline_communicator
from megatron_plugins.training_step import forward_step

USAGE_ERRORS = (LayoutError, EncoderPluginError, LanguageModelError, OptimizerConfigError)
"""Errors that mean a bad flag: reported in one line, exit code 2, on every rank."""


def add_mimo_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """MiMo training flags beyond the layout: freezing and encoder DDP overlap."""
    group = parser.add_argument_group("megatron-plugins MiMo training")
    group.add_argument("--freeze-language-model", action="store_true")
    group.add_argument("--freeze-encoder", action="append", default=[], metavar="NAME",
                       help="Do not train this encoder (projection included). Repeatable.")
    group.add_argument("--freeze-projection", action="append", default=[], metavar="NAME",
                       help="Do not train this encoder's projection to the LM. Repeatable.")
    group.add_argument("--encoder-overlap-grad-reduce", action=argparse.BooleanOptionalAction,
                       default=None, help="Overlap encoder grad reduction with backward "
                       "(default: follow --overlap-grad-reduce).")
    return parser


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
    samples: MockMultimodalSamples


def _check_freeze(args: argparse.Namespace, layout: ParallelLayout) -> None:
    names = {module.name for module in layout.encoders}
    for flag, values in (("--freeze-encoder", args.freeze_encoder),
                         ("--freeze-projection", args.freeze_projection)):
        for name in values:
            if name not in names:
                raise LayoutError(f"{flag} {name}: no such encoder; encoders are "
                                  f"{', '.join(sorted(names))}")


def parse_mimo_args(argv: Sequence[str] | None = None) -> MimoRun:
    """Parse and check every flag; raises one of :data:`USAGE_ERRORS` naming the flag to fix."""
    argv = sys.argv[1:] if argv is None else list(argv)
    providers = _encoder_providers(argv)
    for name, provider in providers.items():
        resolve(provider, name)

    def extra_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for add in (add_layout_args, add_mimo_args, add_optimizer_args, cpu_simulation.add_cli_flag):
            add(parser)
        return add_encoder_args(parser, providers)

    saved, sys.argv = sys.argv, [sys.argv[0], *argv]
    try:
        args = parse_args(extra_args)
    finally:
        sys.argv = saved
    layout = layout_from_args(args, args.world_size)
    plugins = {module.name: instantiate(module.provider, module.name, args, module)
               for module in layout.encoders}
    layout = layout_from_args(
        args, args.world_size, {name: p.num_attention_heads for name, p in plugins.items()}
    )
    _check_freeze(args, layout)
    notice = checkpoints.check_checkpoint_flags(args, layout)
    if notice and args.rank == 0:
        print(f"pretrain_mimo.py: notice: {notice}", flush=True)
    for module in layout.encoders:
        encoder_micro_batch_size(layout, module.name, args.micro_batch_size)
    samples = MockMultimodalSamples(seed=args.seed, seq_length=args.seq_length,
                                    vocab_size=args.vocab_size, plugins=plugins)
    apply_optimizer_args(args, argv)
    args.calculate_per_token_loss = True
    args.dataloader_type = "external"
    with apply_language_grid(args, layout):
        try:
            validate_args(args)
        except AssertionError as error:
            raise LayoutError(f"stock Megatron argument check failed: {error}") from None
    # The cross-grid schedule requires variable sequence lengths, which Megatron's allgather MoE
    # dispatcher (the stock default) does not support.
    args.variable_seq_lengths = True
    if args.moe_token_dispatcher_type == "allgather":
        args.moe_token_dispatcher_type = "alltoall"
    language = language_config_from_args(args).transformer
    for plugin in plugins.values():
        notice = check_hooks(plugin, language)
        if notice and args.rank == 0:
            print(f"pretrain_mimo.py: notice: {notice}", flush=True)
    return MimoRun(args, layout, plugins, samples)


@dataclass
class MimoSession:
    """The live pieces of one run; :meth:`close` tears them down."""

    run: MimoRun
    topology: HeteroTopology
    communicator: MultiModulePipelineCommunicator
    config: Any

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
    checkpoints.write_layout(args.save, run.layout, dist.get_rank())
    megatron_compat.ensure_global_memory_buffer()
    language = language_config_from_args(args)
    model = MimoBuildConfig(
        language=language,
        encoders={m.name: m.provider for m in run.layout.encoders},
        special_token_ids=run.samples.special_token_ids,
        seed=args.seed,
        inference_rng_tracker=args.inference_rng_tracker,
        freeze_language_model=args.freeze_language_model,
        freeze_encoders=list(args.freeze_encoder),
        freeze_projections=list(args.freeze_projection),
        encoder_overlap_grad_reduce=args.encoder_overlap_grad_reduce,
        _topology=topology,
        _plugins=run.plugins,
    )
    communicator = pipeline_communicator(topology, language.transformer)
    config = pretrain_cfg_container_from_args(args, model)
    return MimoSession(run, topology, communicator, config)


def pretrain_kwargs(session: MimoSession) -> dict[str, Any]:
    """Arguments of stock ``pretrain()`` for this session."""
    provider: Callable = data_provider(session.run.samples, session.topology, get_args)
    return {
        "cfg_container": session.config,
        "train_valid_test_dataset_provider": provider,
        "model_type": ModelType.encoder_or_decoder,
        "forward_step_func": forward_step,
        "p2p_communicator": session.communicator,
        "pg_collection": session.topology.pg_collection,
        "skip_model_parallel_init": True,
    }
