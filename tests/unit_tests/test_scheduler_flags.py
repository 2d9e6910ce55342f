"""Stock's learning-rate and weight-decay schedule asserts its flags only once the optimizer is
built, on every rank, without naming a flag; the launch says it first, in one line."""

from __future__ import annotations

import argparse
import shutil
from types import SimpleNamespace

import pytest

from megatron_plugins.errors import FlagError
from tests.harness.mimo_runs import TINY_MIMO
from tests.harness.multiprocess import REPO_ROOT

LAYOUT = ["--encoder", "vision=vit", "--grid", "vision:dp=1", "--grid", "language:dp=2"]
ITERATIONS = [flag for index, flag in enumerate(TINY_MIMO)
              if "--train-iters" not in TINY_MIMO[max(index - 1, 0):index + 1]]
"""The tiny run without its --train-iters (it gives them twice: 20, then 10)."""


def _parse(monkeypatch, flags: list[str]) -> argparse.Namespace:
    from megatron_plugins.launch.pretrain import parse_mimo_args

    monkeypatch.setenv("WORLD_SIZE", "3")
    return parse_mimo_args([*flags, *LAYOUT]).args


CASES = [
    ([*TINY_MIMO, "--lr-warmup-iters", "10"],
     "--lr-warmup-iters 10 must be below --train-iters 10 (the iterations the learning rate "
     "decays over); warm up for fewer iterations or train longer"),
    ([*TINY_MIMO, "--lr-warmup-iters", "3", "--lr-decay-iters", "2"],
     "--lr-warmup-iters 3 must be below --lr-decay-iters 2 (the iterations the learning rate "
     "decays over); warm up for fewer iterations or train longer"),
    ([*TINY_MIMO, "--lr-warmup-fraction", "1.0"],
     "--lr-warmup-fraction 1.0 must be below 1: the warmup would fill the whole decay of the "
     "learning rate (--train-iters 10)"),
    ([*ITERATIONS, "--train-samples", "80", "--lr-warmup-samples", "80"],
     "--lr-warmup-samples 80 must be below --train-samples 80 (the samples the learning rate "
     "decays over); warm up for fewer samples or train longer"),
    ([*TINY_MIMO, "--lr-decay-iters", "0"],
     "--lr-decay-iters 0 leaves nothing to decay the learning rate over; give a positive number"),
    ([*TINY_MIMO, "--lr-decay-style", "WSD"],
     "--lr-decay-style WSD needs the length of its final decay: add --lr-wsd-decay-iters N"),
    ([*TINY_MIMO, "--lr-warmup-init", "0.01"],
     "--lr-warmup-init 0.01 is above --lr 0.001; warmup starts at or below the peak learning "
     "rate"),
    ([*TINY_MIMO, "--min-lr=-0.0001"], "--min-lr -0.0001 is negative; give 0 or more"),
    ([*TINY_MIMO, "--weight-decay=-0.1"], "--weight-decay -0.1 is negative; give 0 or more"),
    ([*TINY_MIMO, "--weight-decay-incr-style", "linear", "--start-weight-decay", "0.1",
      "--end-weight-decay", "0.01"],
     "--end-weight-decay 0.01 is below --start-weight-decay 0.1; weight decay only grows "
     "(--weight-decay-incr-style linear)"),
    ([*TINY_MIMO, "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
     "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict each "
     "other (this run's schedule or the checkpoint's); give one"),
    ([flag for flag in TINY_MIMO if flag not in ("--lr", "1e-3")],
     "--lr is missing: stock's learning-rate schedule needs its peak; give e.g. --lr 1e-4"),
]


@pytest.mark.parametrize("flags, message", CASES, ids=[
    "warmup-iters", "warmup-decay-iters", "warmup-fraction", "warmup-samples", "decay-zero",
    "wsd", "warmup-init", "min-lr", "weight-decay", "end-weight-decay", "override-and-keep",
    "no-lr"])
def test_a_schedule_stock_would_assert_on_is_one_line_naming_the_flags(monkeypatch, flags,
                                                                        message):
    with pytest.raises(FlagError) as error:
        _parse(monkeypatch, flags)
    assert str(error.value) == message


def test_the_schedule_is_derived_from_the_flags_as_stock_derives_it(monkeypatch):
    """A canary for the one copy of stock logic here: the inputs stock's
    ``get_optimizer_param_scheduler`` builds its scheduler from equal :func:`scheduler_inputs`."""
    from megatron.training import global_vars, training

    from megatron_plugins.launch.scheduler_flags import scheduler_inputs

    fields = ("init_lr", "max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps",
              "lr_decay_style", "start_wd", "end_wd", "wd_incr_steps", "wd_incr_style",
              "wsd_decay_steps")
    for flags in ([*TINY_MIMO, "--lr-warmup-iters", "2", "--lr-decay-iters", "8",
                   "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "3",
                   "--lr-warmup-init", "1e-4"],
                  [*TINY_MIMO, "--lr-warmup-fraction", "0.25", "--weight-decay-incr-style",
                   "cosine", "--start-weight-decay", "0.01", "--end-weight-decay", "0.1"],
                  [*ITERATIONS, "--train-samples", "80", "--lr-warmup-samples", "16",
                   "--lr-decay-samples", "64"]):
        args = _parse(monkeypatch, flags)
        ours = scheduler_inputs(args)
        monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", argparse.Namespace(**vars(args)))
        stock = training.get_optimizer_param_scheduler(SimpleNamespace(param_groups=[]))
        assert {name: getattr(ours, name) for name in fields} == {
            name: getattr(stock, name) for name in fields}


SAVED = REPO_ROOT / "tests" / "fixtures" / "checkpoint_before_rooms"
"""A checkpoint saved at iteration 2 of 4 (global batch 4, --lr 1e-3, linear decay)."""
RESUMED = [
    "--encoder", "vision=vit", "--grid", "vision:dp=1", "--grid", "language:dp=1",
    "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length",
    "16", "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size",
    "4", "--vit-img-size", "16", "--vit-patch-size", "8", "--vit-hidden-size", "16",
    "--vit-num-layers", "1", "--vit-num-attention-heads", "2", "--lr", "1e-3", "--vocab-size",
    "64", "--use-cpu-initialization", "--eval-iters", "0", "--log-interval", "1",
]
"""Its run's flags but --train-iters."""


def test_a_schedule_changed_on_resume_is_one_line_naming_the_flag_and_the_ways_out(
        monkeypatch, tmp_path):
    from megatron_plugins.launch.pretrain import parse_mimo_args

    load = tmp_path / "checkpoint"
    shutil.copytree(SAVED, load)
    monkeypatch.setenv("WORLD_SIZE", "2")
    resumed = [*RESUMED, "--load", str(load)]
    assert parse_mimo_args([*resumed, "--train-iters", "4"]).args.train_iters == 4
    with pytest.raises(FlagError) as error:
        parse_mimo_args([*resumed, "--train-iters", "6"])
    assert str(error.value) == (
        f"--train-iters 6 x --global-batch-size 4 gives a learning-rate decay (samples) of 24, "
        f"but --load {load} was saved with 16 and stock refuses to change the schedule on "
        "resume; give the saved value, or add --override-opt_param-scheduler (this run's "
        "schedule) or --use-checkpoint-opt_param-scheduler (the checkpoint's)")
    for way_out in ("--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler",
                    "--finetune"):
        assert parse_mimo_args([*resumed, "--train-iters", "6", way_out]).args.train_iters == 6
