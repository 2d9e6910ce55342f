"""bf16 training with Megatron's precision-aware optimizer: bf16 main grads and Adam moments.

Stock bf16 training keeps main grads, the DDP grad buffer and both Adam moments in fp32. Megatron
can hold them in bf16 (``--use-precision-aware-optimizer`` with ``--main-grads-dtype``,
``--exp-avg-dtype`` and ``--exp-avg-sq-dtype``), but only with Adam, only with the distributed
optimizer, only on Transformer Engine's FusedAdam, and only when the DDP grad buffer dtype
(``--accumulate-allreduce-grads-in-fp32``, DDP ``grad_reduce_in_fp32``) agrees with the main grads
dtype, a rule stock checks one way round on flags and not at all on config objects. This module
derives that consistent set from the training precision, in two places:

* on parsed flags: :func:`add_optimizer_args` registers ``--bf16-precision-aware-optimizer`` (an
  ``extra_args_provider``) and :func:`apply_optimizer_args` fills in the stock flags before stock
  ``validate_args`` runs (:func:`implied_stock_flags` returns them instead; the MiMo launch
  applies them with its other settings). Stock ``parse_and_validate_args`` validates straight after parsing, so
  call its steps yourself::

      args = parse_args(extra_args_provider=add_optimizer_args)
      apply_optimizer_args(args)
      validate_args(args)
      set_global_variables(args)

* on config objects: :func:`derive_optimizer_configs` returns derived copies of an
  ``OptimizerConfig`` and a ``DistributedDataParallelConfig``, e.g. those of a
  ``PretrainConfigContainer``: ``cfg.optimizer, cfg.ddp = derive_optimizer_configs(cfg.optimizer,
  cfg.ddp)``.

fp16 and fp32 runs are left exactly as stock has them. Settings the user chose explicitly are
never overwritten; a chosen setting that cannot work with the rest raises
:class:`OptimizerConfigError` naming the stock flag. Importing this module imports no Megatron
module and changes nothing in torch or Megatron.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
from typing import TYPE_CHECKING, Any, Collection, Mapping, Sequence

import torch

from megatron_plugins.launch.command_line import given_flag
from megatron_plugins.errors import UsageError

__all__ = [
    "FLAG", "OptimizerConfigError", "add_optimizer_args", "apply_optimizer_args",
    "derive_optimizer_configs", "implied_stock_flags", "require_te_fused_adam"
]

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

FLAG = "--bf16-precision-aware-optimizer"

# The dtypes of the derivation, by OptimizerConfig field. Master weights stay fp32: TE's FusedAdam
# rejects bf16 master weights ("FusedAdam only supports fp32/fp16 master weights").
_BF16_DTYPES = {
    "main_grads_dtype": torch.bfloat16,
    "exp_avg_dtype": torch.bfloat16,
    "exp_avg_sq_dtype": torch.bfloat16,
    "main_params_dtype": torch.float32,
}

# The stock flags whose explicit use must survive the derivation, by the config field each sets.
# Both grad-buffer flags set DDP grad_reduce_in_fp32, args.accumulate_allreduce_grads_in_fp32 in
# stock's args.
_ACCUMULATE_FP32 = "--accumulate-allreduce-grads-in-fp32"
_REDUCE_BF16 = "--grad-reduce-in-bf16"
_FIELD_OF_FLAG = {
    "--use-precision-aware-optimizer": "use_precision_aware_optimizer",
    "--main-grads-dtype": "main_grads_dtype",
    "--main-params-dtype": "main_params_dtype",
    "--exp-avg-dtype": "exp_avg_dtype",
    "--exp-avg-sq-dtype": "exp_avg_sq_dtype",
    _ACCUMULATE_FP32: "grad_reduce_in_fp32",
    _REDUCE_BF16: "grad_reduce_in_fp32",
}
_ARG_OF_FIELD = {"grad_reduce_in_fp32": "accumulate_allreduce_grads_in_fp32"}

# Before stock validate_args the dtype flags are the strings of their argparse choices.
_DTYPE_OF_NAME = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                  "fp8": torch.uint8}

# TE FusedAdam keyword arguments stock OptimizerConfig checks for before it allows the
# precision-aware optimizer (megatron/core/optimizer/optimizer_config.py).
_FUSED_ADAM_KWARGS = ("master_weight_dtype", "exp_avg_dtype", "exp_avg_sq_dtype",
                      "use_decoupled_grad")


class OptimizerConfigError(UsageError):
    """The requested optimizer settings contradict each other; the message names the flag."""


def require_te_fused_adam() -> None:
    """Fail early and clearly where Transformer Engine's FusedAdam cannot run this optimizer.

    Stock imports FusedAdam the same way; without it the optimizer falls back to Apex or torch,
    which have no precision-aware state, and stock only notices when the OptimizerConfig is built.
    """
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam
    except ImportError as error:
        raise ImportError(
            "The bf16 precision-aware optimizer (--use-precision-aware-optimizer, enabled by "
            f"{FLAG}) runs only on Transformer Engine's FusedAdam, and "
            f"'from transformer_engine.pytorch.optimizers import FusedAdam' failed ({error}). "
            f"Install Transformer Engine, or drop {FLAG} to keep stock fp32 optimizer state."
        ) from error
    missing = [name for name in _FUSED_ADAM_KWARGS
               if name not in inspect.signature(FusedAdam).parameters]
    if missing:
        raise ImportError(
            f"The installed Transformer Engine's FusedAdam takes no {', '.join(missing)}, so it "
            "cannot run the precision-aware optimizer; upgrade Transformer Engine."
        )


def _as_dtype(value: torch.dtype | str) -> torch.dtype:
    return value if isinstance(value, torch.dtype) else _DTYPE_OF_NAME[value]


def _bf16_settings(current: Mapping[str, Any], explicit: Collection[str]) -> dict[str, Any]:
    """The settings bf16 training needs, by config field, given the current values and the fields
    the user chose; checks every requirement first."""
    if current["optimizer"] != "adam":
        raise OptimizerConfigError(
            f"{FLAG} needs --optimizer adam (got {current['optimizer']!r}): the precision-aware "
            "optimizer is Transformer Engine's FusedAdam."
        )
    if not current["use_distributed_optimizer"]:
        raise OptimizerConfigError(
            f"{FLAG} needs --use-distributed-optimizer: stock supports the precision-aware "
            "optimizer only with the distributed optimizer."
        )
    if current["use_megatron_fsdp"]:
        raise OptimizerConfigError(
            f"{FLAG} does not support --use-megatron-fsdp: Megatron-FSDP sets its buffer dtypes "
            "with --megatron-fsdp-main-grads-dtype and --megatron-fsdp-main-params-dtype instead."
        )
    if "use_precision_aware_optimizer" in explicit and not current["use_precision_aware_optimizer"]:
        raise OptimizerConfigError(
            f"{FLAG} needs --use-precision-aware-optimizer, which was explicitly turned off."
        )
    settings: dict[str, Any] = {"use_precision_aware_optimizer": True}
    for field, dtype in _BF16_DTYPES.items():
        settings[field] = _as_dtype(current[field]) if field in explicit else dtype
    if settings["main_params_dtype"] == torch.bfloat16:
        raise OptimizerConfigError(
            "--main-params-dtype bf16: Transformer Engine's FusedAdam rejects bf16 master weights."
        )
    # DDP reduces grads in its buffer's dtype and the optimizer reads them as main grads.
    grads_fp32 = settings["main_grads_dtype"] == torch.float32
    if "grad_reduce_in_fp32" in explicit and current["grad_reduce_in_fp32"] != grads_fp32:
        flag = _ACCUMULATE_FP32 if current["grad_reduce_in_fp32"] else _REDUCE_BF16
        raise OptimizerConfigError(
            f"{flag} puts the DDP grad buffer in "
            f"{'fp32' if current['grad_reduce_in_fp32'] else 'bf16'}, but main grads are "
            f"{settings['main_grads_dtype']} (--main-grads-dtype); the two must agree under {FLAG}."
        )
    settings["grad_reduce_in_fp32"] = grads_fp32
    return settings


def derive_optimizer_configs(
    optimizer: OptimizerConfig,
    ddp: DistributedDataParallelConfig,
    explicit: Collection[str] = (),
) -> tuple[OptimizerConfig, DistributedDataParallelConfig]:
    """The configs with the bf16 precision-aware optimizer settings, or the same objects unchanged
    unless ``optimizer.bf16`` (stock copies ``--bf16`` there).

    ``explicit`` names the fields of either config the user chose; their values are kept as they
    are. The result is built with ``dataclasses.replace``, so stock ``__post_init__`` validates it
    and recomputes what it derives there (setting the fields in place would leave
    ``use_precision_aware_optimizer_no_fp8_or_ds_fp8`` stale).
    """
    known = {field.name for config in (optimizer, ddp) for field in dataclasses.fields(config)}
    unknown = sorted(set(explicit) - known)
    if unknown:
        raise ValueError(f"explicit names no field of OptimizerConfig or the DDP config: {unknown}")
    if not optimizer.bf16:
        return optimizer, ddp
    current = {
        "optimizer": optimizer.optimizer,
        "use_distributed_optimizer": optimizer.use_distributed_optimizer
        and ddp.use_distributed_optimizer,
        "use_megatron_fsdp": ddp.use_megatron_fsdp,
        "use_precision_aware_optimizer": optimizer.use_precision_aware_optimizer,
        **{field: getattr(optimizer, field) for field in _BF16_DTYPES},
        "grad_reduce_in_fp32": ddp.grad_reduce_in_fp32,
    }
    settings = _bf16_settings(current, explicit)
    require_te_fused_adam()
    # Chosen fields come back with the values they have (conflicting ones raised above). Stock
    # also copies --use-precision-aware-optimizer into this DDP field (get_megatron_ddp_config);
    # only Megatron-FSDP reads it, but the result equals what stock builds from the same flags.
    ddp_settings = {"grad_reduce_in_fp32": settings.pop("grad_reduce_in_fp32"),
                    "megatron_fsdp_use_decoupled_grad": True}
    return dataclasses.replace(optimizer, **settings), dataclasses.replace(ddp, **ddp_settings)


def add_optimizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register ``--bf16-precision-aware-optimizer``; usable as (part of) Megatron's
    ``extra_args_provider``. The flag does nothing by itself: :func:`apply_optimizer_args` acts
    on it."""
    group = parser.add_argument_group("megatron-plugins optimizer precision")
    group.add_argument(
        FLAG, action="store_true",
        help="With --bf16, keep main grads, the DDP grad buffer and both Adam moments in bf16 "
             "(Megatron's precision-aware optimizer on Transformer Engine's FusedAdam; master "
             "weights stay fp32). Needs --use-distributed-optimizer and --optimizer adam. Stock "
             "flags given explicitly win. fp16 and fp32 runs are unaffected.",
    )
    return parser


def apply_optimizer_args(args: argparse.Namespace, argv: Sequence[str] | None = None) -> None:
    """Set :func:`implied_stock_flags` on parsed ``args``, in place, before stock
    ``validate_args`` runs."""
    for attr, value in implied_stock_flags(args, argv).items():
        setattr(args, attr, value)


def implied_stock_flags(args: argparse.Namespace, argv: Sequence[str] | None = None,
                        planning: bool = False) -> dict[str, Any]:
    """The stock args (attribute -> value) ``--bf16-precision-aware-optimizer`` implies on parsed
    ``args``; empty without the flag or without ``--bf16``. Transformer Engine's FusedAdam must
    be importable, except ``planning`` (``mimo-plan``, often on a machine without it).

    A stock flag counts as chosen when it appears in ``argv`` (default ``sys.argv[1:]``), whatever
    its value: comparing with parser defaults would miss ``--exp-avg-dtype fp32`` chosen on
    purpose. Megatron's parser takes no abbreviations (``allow_abbrev=False``), so a flag is
    given exactly when its name is a token, alone or before ``=``. Values that come from
    ``--yaml-cfg`` or ``--use-checkpoint-args`` are not seen as chosen. Dtypes are written as torch
    dtypes, which stock ``validate_args`` accepts as they are.
    """
    if not (args.bf16_precision_aware_optimizer and args.bf16):
        return {}
    argv = sys.argv[1:] if argv is None else argv
    if given_flag(argv, [_ACCUMULATE_FP32]) and given_flag(argv, [_REDUCE_BF16]):
        raise OptimizerConfigError(f"{_ACCUMULATE_FP32} and {_REDUCE_BF16} contradict each other.")
    explicit = {field for flag, field in _FIELD_OF_FLAG.items() if given_flag(argv, [flag])}
    current = {
        "optimizer": args.optimizer,
        "use_distributed_optimizer": args.use_distributed_optimizer,
        "use_megatron_fsdp": args.use_megatron_fsdp,
        "use_precision_aware_optimizer": args.use_precision_aware_optimizer,
        **{field: getattr(args, field) for field in _BF16_DTYPES},
        # Stock's bf16 rule: --grad-reduce-in-bf16 turns fp32 accumulation off.
        "grad_reduce_in_fp32": args.accumulate_allreduce_grads_in_fp32
        and not args.grad_reduce_in_bf16,
    }
    settings = _bf16_settings(current, explicit)
    if not planning:
        require_te_fused_adam()
    return {_ARG_OF_FIELD.get(field, field): value for field, value in settings.items()
            if field not in explicit}
