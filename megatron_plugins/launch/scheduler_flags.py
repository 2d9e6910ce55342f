"""The learning-rate and weight-decay schedule's flags, checked as one line before any process group.

Stock builds its ``OptimizerParamScheduler`` with the optimizer, after every process group
exists, and checks the inputs with bare ``assert``s there (its constructor;
``training.get_optimizer_param_scheduler`` derives the inputs from the flags); on resume its
``load_state_dict`` asserts them equal to the checkpoint's. Each rank then dies with a traceback
that names no flag (``bash scripts/run_default.sh --train-iters 4`` did: the script warms up for
5 iterations). :func:`scheduler_inputs` derives the inputs as stock does (a test holds the two
equal), :func:`check_scheduler` checks what a flag can break and :func:`check_resumed_scheduler`
compares with the checkpoint ``--load`` resumes from, each failure one line naming the flags.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_plugins.errors import FlagError
from megatron_plugins.weights.megatron_folder import read_tracker

__all__ = ["SchedulerInputs", "check_resumed_scheduler", "check_scheduler", "scheduler_inputs"]

OVERRIDE = "--override-opt_param-scheduler"
USE_CHECKPOINT = "--use-checkpoint-opt_param-scheduler"


@dataclass(frozen=True)
class SchedulerInputs:
    """What stock hands its scheduler (steps count samples), and the flags that give each."""

    init_lr: float
    max_lr: float | None
    min_lr: float
    lr_warmup_steps: float
    lr_decay_steps: int
    lr_decay_style: str
    start_wd: float
    end_wd: float
    wd_incr_steps: int
    wd_incr_style: str
    wsd_decay_steps: int | None
    flags: dict[str, str]
    """Field -> the flag that sets it, with its value (a step count in ``unit``)."""
    unit: str
    """What the step flags count: ``iterations`` or ``samples``."""
    per_step: str
    """How an iteration becomes samples (`` x --global-batch-size N``), or empty."""


def _spelled(args: argparse.Namespace, flag: str) -> str:
    return f"{flag} {getattr(args, flag[2:].replace('-', '_'))}"


def scheduler_inputs(args: argparse.Namespace) -> SchedulerInputs:
    """The scheduler's inputs from validated ``args``, as ``get_optimizer_param_scheduler``
    computes them (without writing ``--lr-decay-iters`` / ``--lr-decay-samples`` as it does)."""
    if args.train_iters:
        unit, batch, train = "iters", args.global_batch_size, "--train-iters"
    elif args.train_samples:
        unit, batch, train = "samples", 1, "--train-samples"
    else:
        raise FlagError("neither --train-iters nor --train-samples is given; stock's learning-rate "
                        "schedule needs one (e.g. --train-iters 100)")
    decay = f"--lr-decay-{unit}" if getattr(args, f"lr_decay_{unit}") is not None else train
    decay_steps = getattr(args, decay[2:].replace("-", "_")) * batch
    if args.lr_warmup_fraction is not None:
        warmup, warmup_steps = "--lr-warmup-fraction", args.lr_warmup_fraction * decay_steps
    else:
        warmup = f"--lr-warmup-{unit}"
        warmup_steps = getattr(args, f"lr_warmup_{unit}") * batch
    wsd = getattr(args, f"lr_wsd_decay_{unit}")
    constant = args.weight_decay_incr_style == "constant"
    start_wd = "--weight-decay" if constant else "--start-weight-decay"
    end_wd = "--weight-decay" if constant else "--end-weight-decay"
    return SchedulerInputs(
        init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=getattr(args, train[2:].replace("-", "_")) * batch,
        wd_incr_style=args.weight_decay_incr_style,
        wsd_decay_steps=None if wsd is None else wsd * batch,
        flags={"init_lr": _spelled(args, "--lr-warmup-init"), "max_lr": _spelled(args, "--lr"),
               "min_lr": _spelled(args, "--min-lr"), "lr_warmup_steps": _spelled(args, warmup),
               "lr_decay_steps": _spelled(args, decay),
               "lr_decay_style": _spelled(args, "--lr-decay-style"),
               "start_wd": f"{start_wd} {args.start_weight_decay}",
               "end_wd": f"{end_wd} {args.end_weight_decay}",
               "wd_incr_steps": _spelled(args, train),
               "wd_incr_style": _spelled(args, "--weight-decay-incr-style")},
        unit="iterations" if args.train_iters else "samples",
        per_step=f" x {_spelled(args, '--global-batch-size')}" if args.train_iters else "")


def _warmup_problem(inputs: SchedulerInputs) -> str:
    warmup, decay = inputs.flags["lr_warmup_steps"], inputs.flags["lr_decay_steps"]
    if warmup.startswith("--lr-warmup-fraction"):
        return (f"{warmup} must be below 1: the warmup would fill the whole decay of the "
                f"learning rate ({decay})")
    return (f"{warmup} must be below {decay} (the {inputs.unit} the learning rate decays over); "
            f"warm up for fewer {inputs.unit} or train longer")


def check_scheduler(args: argparse.Namespace) -> None:
    """The checks of stock's scheduler constructor that flags can fail, as one line each."""
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise FlagError(f"{OVERRIDE} and {USE_CHECKPOINT} contradict each other (this run's "
                        "schedule or the checkpoint's); give one")
    if args.lr is None:
        raise FlagError("--lr is missing: stock's learning-rate schedule needs its peak; give "
                        "e.g. --lr 1e-4")
    inputs = scheduler_inputs(args)
    flag = inputs.flags
    problems: list[tuple[bool, Callable[[], str]]] = [
        (inputs.min_lr < 0, lambda: f"{flag['min_lr']} is negative; give 0 or more"),
        (inputs.init_lr > inputs.max_lr,
         lambda: f"{flag['init_lr']} is above {flag['max_lr']}; warmup starts at or below the "
                 "peak learning rate"),
        (inputs.lr_decay_steps <= 0,
         lambda: f"{flag['lr_decay_steps']} leaves nothing to decay the learning rate over; give "
                 "a positive number"),
        (inputs.lr_warmup_steps >= inputs.lr_decay_steps, lambda: _warmup_problem(inputs)),
        (inputs.lr_decay_style == "WSD" and inputs.wsd_decay_steps is None,
         lambda: f"{flag['lr_decay_style']} needs the length of its final decay: add "
                 f"--lr-wsd-decay-{'iters' if args.train_iters else 'samples'} N"),
        (inputs.start_wd < 0, lambda: f"{flag['start_wd']} is negative; give 0 or more"),
        (inputs.end_wd < inputs.start_wd,
         lambda: f"{flag['end_wd']} is below {flag['start_wd']}; weight decay only grows "
                 f"({flag['wd_incr_style']})"),
    ]
    for failed, message in problems:
        if failed:
            raise FlagError(message())


_SAVED_NAMES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("max_lr", ("start_lr", "max_lr"), "peak learning rate"),
    ("min_lr", ("min_lr",), "minimum learning rate"),
    ("lr_warmup_steps", ("warmup_iter", "warmup_steps", "lr_warmup_steps"), "warmup (samples)"),
    ("lr_decay_steps", ("end_iter", "decay_steps", "lr_decay_steps"),
     "learning-rate decay (samples)"),
    ("lr_decay_style", ("decay_style", "lr_decay_style"), "learning-rate decay style"),
    ("start_wd", ("start_wd",), "starting weight decay"),
    ("end_wd", ("end_wd",), "final weight decay"),
    ("wd_incr_steps", ("wd_incr_steps",), "weight-decay schedule (samples)"),
    ("wd_incr_style", ("wd_incr_style",), "weight-decay increment style"),
)
"""What stock's ``load_state_dict`` compares, in its order: field, the checkpoint's key (older
names first, as stock reads them), and what it is."""


def _resumed_iteration(args: argparse.Namespace) -> Path | None:
    """The iteration folder stock's load will read (``--load`` resolved to ``args.ckpt_step`` or
    the tracker's iteration); None for a fresh start or a release checkpoint."""
    if args.load is None:
        return None
    load = Path(args.load)
    step = getattr(args, "ckpt_step", None)
    if step is None:
        tracker = read_tracker(load)
        if tracker is None or not tracker.isdigit():
            return None
        step = int(tracker)
    return load / f"iter_{step:07d}"


def _saved_scheduler(folder: Path) -> dict[str, Any] | None:
    """The scheduler state in a checkpoint's common state (None when it saved none)."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load_common_state_dict(str(folder))
    return state.get("lr_scheduler", state.get("opt_param_scheduler"))


def check_resumed_scheduler(args: argparse.Namespace) -> None:
    """On resume, stock asserts this run's schedule equal to the checkpoint's unless told which
    to keep; a difference is one line naming the flag and both ways out."""
    if (args.finetune or args.no_load_optim or args.override_opt_param_scheduler
            or args.use_checkpoint_opt_param_scheduler):
        return
    folder = _resumed_iteration(args)
    saved = None if folder is None else _saved_scheduler(folder)
    if saved is None:
        return
    inputs = scheduler_inputs(args)
    for field, keys, what in _SAVED_NAMES:
        key = next((key for key in keys if key in saved), None)
        if key is None:
            continue
        ours = getattr(inputs, field)
        if ours != saved[key]:
            steps = (inputs.per_step if field.endswith("_steps")
                     and not inputs.flags[field].startswith("--lr-warmup-fraction") else "")
            raise FlagError(
                f"{inputs.flags[field]}{steps} gives a {what} of {ours}, but --load {args.load} was "
                f"saved with {saved[key]} and stock refuses to change the schedule on resume; "
                f"give the saved value, or add {OVERRIDE} (this run's schedule) or "
                f"{USE_CHECKPOINT} (the checkpoint's)")
