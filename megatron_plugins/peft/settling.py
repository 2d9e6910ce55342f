"""The launch's PEFT step: the values a LoRA / per-part-optimizer run records, and its checks
against the rest of the run, all before any process group.

:func:`peft_values` gives what goes into ``args`` (and so into every checkpoint): each frozen
part's reference and every part's scheduler values. :func:`check_peft_run` refuses what LoRA
cannot run on (Transformer Engine's fused layers, meta-device init, an encoder network that is a
plain torch module) and, when ``--load`` resumes, a run that would not continue its checkpoint
(:func:`megatron_plugins.peft.checkpoint.check_resume`).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_plugins.compat.gdn_spec import is_gated_delta_net
from megatron_plugins.errors import FlagError
from megatron_plugins.parallel.layout import ParallelLayout
from megatron_plugins.peft.checkpoint import (
    BASE_ATTR,
    SETTINGS_ATTR,
    base_references,
    check_resume,
    saved_args,
)
from megatron_plugins.peft.flags import LORA_FLAG, PROJECTION, lora_specs
from megatron_plugins.peft.optimizer import part_settings
from megatron_plugins.weights.megatron_folder import read_tracker

__all__ = ["check_peft_run", "peft_values"]


def peft_values(args: argparse.Namespace, layout: ParallelLayout,
                plugins: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` attribute -> value: the frozen parts' references and the parts' settings."""
    return {BASE_ATTR: base_references(args, layout, plugins),
            SETTINGS_ATTR: part_settings(args, layout)}


def _check_encoders(specs: Mapping[str, Any], plugins: Mapping[str, Any], language: Any) -> None:
    """An adapted encoder network must be a Megatron module (its linears are Megatron's)."""
    for part in specs:
        plugin = plugins.get(part)
        if plugin is None:
            continue
        spec = plugin.encoder_spec(plugin.transformer_config(language), None)
        if isinstance(spec.module, type) and not hasattr(spec.module, "sharded_state_dict"):
            raise FlagError(
                f"{LORA_FLAG} {part}: encoder {part}'s network ({spec.module.__name__}) is a plain "
                "torch module; LoRA adapts Megatron's ColumnParallelLinear / RowParallelLinear "
                f"layers only: train it (drop {LORA_FLAG} {part}), freeze it (--freeze-encoder "
                f"{part}) or adapt its projection ({LORA_FLAG} {part}{PROJECTION}:...)")


def _resumed(args: argparse.Namespace) -> Path | None:
    """The iteration folder ``--load`` resumes from (the launch's choice, else the tracker's)."""
    if args.load is None:
        return None
    step = getattr(args, "ckpt_step", None)
    tracker = read_tracker(Path(args.load))
    if step is None and tracker == "release":
        return Path(args.load) / "release"
    if step is None and tracker is not None and tracker.isdigit():
        step = int(tracker)
    return None if step is None else Path(args.load) / f"iter_{int(step):07d}"


def check_peft_run(args: argparse.Namespace, layout: ParallelLayout,
                   plugins: Mapping[str, Any], language: Any) -> None:
    """Refuse a LoRA run this build cannot train (a target the language model does not have
    among them), or a resume that would not continue its checkpoint; ``language`` is the
    language model's TransformerConfig."""
    specs = lora_specs(args.lora, layout, is_gated_delta_net(language))
    if specs and args.transformer_impl != "local":
        raise FlagError(f"{LORA_FLAG} adapts the local spec's linear layers; Transformer Engine's "
                        "fused ones are not supported yet: add --transformer-impl local")
    if specs and args.init_model_with_meta_device:
        raise FlagError(f"{LORA_FLAG} with --init-model-with-meta-device: adapters are made on "
                        "the built weights' device; drop --init-model-with-meta-device")
    _check_encoders(specs, plugins, language)
    folder = _resumed(args)
    if folder is None:
        return
    saved = saved_args(folder)
    if saved is None:
        return
    check_resume(args, saved, f"--load {folder}", layout,
                 continues=not (args.finetune or args.no_load_optim))
