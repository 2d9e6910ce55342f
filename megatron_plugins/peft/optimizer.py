"""Learning rate, minimum learning rate and weight decay per part, on the run's one scheduler.

Stock's scheduler already reads ``max_lr`` / ``min_lr`` / ``start_wd`` / ``end_wd`` from each
parameter group, so a part with its own settings is a parameter group of its own: its
learning rate follows the run's warmup and decay shape between its own maximum and minimum. Once
any part has settings of its own, every trainable part gets a group carrying its name
(:data:`PART_KEY`), so the rank that logs sees every part's learning rate (each module's
optimizer holds every rank's group keys, stock's rule for checkpoints) and writes it to the log
and to TensorBoard as ``learning-rate/PART``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from megatron_plugins.compat import optimizer
from megatron_plugins.errors import FlagError
from megatron_plugins.parallel.layout import LANGUAGE, ParallelLayout
from megatron_plugins.peft.flags import PROJECTION, encoder_of, part_optims, parts_of

__all__ = ["PART_KEY", "install", "part_settings"]

PART_KEY = "mimo_part"
"""The parameter-group entry naming the part a group belongs to."""

_PATTERNS = {"network": "*.encoders.*", "projection": "*.input_projections.*"}
"""Names of an encoder's network and projection parameters inside its wrapped module."""

_rates: dict[str, float] = {}
"""The learning rate of every part, as the logging rank's optimizer last reported them."""


def part_settings(args: argparse.Namespace, layout: ParallelLayout) -> dict[str, dict[str, float]]:
    """Every part's scheduler values (``max_lr``, ``min_lr``, and ``start_wd`` / ``end_wd`` where
    its weight decay is its own) once any ``--module-*`` flag is given, else ``{}``. A part's
    minimum learning rate follows ``--min-lr`` in proportion to its learning rate unless given."""
    optims = part_optims(args, layout)
    if not optims:
        return {}
    if any(o.weight_decay is not None for o in optims.values()) and (
            args.weight_decay_incr_style != "constant"):
        raise FlagError(f"--module-weight-decay needs --weight-decay-incr-style constant (got "
                        f"{args.weight_decay_incr_style}): a part's weight decay is one value")
    if getattr(args, "decoupled_lr", None) is not None:
        raise FlagError("--decoupled-lr and --module-lr both set the embedding's learning rate; "
                        "give the language model's with --module-lr language=LR instead")
    settings = {}
    for part in parts_of(layout):
        optim = optims.get(part)
        lr = optim.lr if optim and optim.lr is not None else args.lr
        min_lr = optim.min_lr if optim and optim.min_lr is not None else (
            args.min_lr * lr / args.lr if args.lr else args.min_lr)
        if min_lr > lr:
            raise FlagError(f"{part}'s minimum learning rate {min_lr:g} is above its learning "
                            f"rate {lr:g}; give --module-min-lr {part}=LR at most {lr:g}")
        settings[part] = {"max_lr": lr, "min_lr": min_lr}
        if optim and optim.weight_decay is not None:
            settings[part].update(start_wd=optim.weight_decay, end_wd=optim.weight_decay)
    return settings


def _overrides(settings: Mapping[str, Mapping[str, float]], model: Any,
               modules: Iterable[str]) -> dict[Any, dict[Any, dict]]:
    """Per module chunk of ``model`` this rank runs (``modules``): ``ParamKey`` (by name inside
    the chunk) -> the part's group override."""
    from megatron.core.optimizer import ParamKey

    overrides: dict[Any, dict[Any, dict]] = {}
    for part, values in settings.items():
        module = encoder_of(part)
        if module not in modules:
            continue
        chunk = model.language_model if module == LANGUAGE else model.modality_submodules[module]
        pattern = ("*" if part == LANGUAGE else
                   _PATTERNS["projection" if part.endswith(PROJECTION) else "network"])
        overrides.setdefault(chunk, {})[ParamKey(name=pattern)] = {**values, PART_KEY: part}
    return overrides


def _canonical_rate(stock: Any) -> Any:
    def get_canonical_lr_for_logging(param_groups: list[dict]) -> float | None:
        _rates.update({group[PART_KEY]: group["lr"] for group in param_groups
                       if PART_KEY in group})
        found = stock(param_groups)
        return found if found is not None else _rates.get(LANGUAGE)

    return get_canonical_lr_for_logging


def _logged(stock: Any) -> Any:
    def training_log(loss_dict: Any, total_loss_dict: Any, learning_rate: Any, iteration: int,
                     *args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist
        from megatron.training import get_args
        from megatron.training.global_vars import get_tensorboard_writer

        result = stock(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs)
        run = get_args()
        writer = get_tensorboard_writer()
        if writer and iteration % run.tensorboard_log_interval == 0:
            for part, rate in sorted(_rates.items()):
                writer.add_scalar(f"learning-rate/{part}", rate, iteration)
        if iteration % run.log_interval == 0 and dist.get_rank() == dist.get_world_size() - 1:
            rates = " | ".join(f"{part} {rate:.6E}" for part, rate in _rates.items())
            print(f" [{iteration}] learning rate per part: {rates}", file=sys.stdout, flush=True)
        return result

    return training_log


def install(settings: Mapping[str, Mapping[str, float]], model: Any,
            modules: Iterable[str]) -> None:
    """Give each part of the ``modules`` of ``model`` (this rank's ``MimoModel``, wrapped) its
    parameter group (compat Gap 29) and log every part's learning rate."""
    if not settings:
        return
    import megatron.training.training as training

    optimizer.module_overrides(_overrides(settings, model, modules))
    if not getattr(training.training_log, "logs_part_rates", False):
        training.get_canonical_lr_for_logging = _canonical_rate(
            training.get_canonical_lr_for_logging)
        training.training_log = _logged(training.training_log)
        training.training_log.logs_part_rates = True
