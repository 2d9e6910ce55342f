"""The flags of what a run measures about its own speed, and their checks.

Stock ``--log-throughput`` turns on the MiMo throughput figures (stock's own field then counts
the MiMo model, compat Gap 28); ``--peak-tflops`` sets the peak MFU is measured against;
``--mimo-timeline DIR`` with ``--mimo-timeline-steps A:B`` writes a step timeline;
``--mimo-profile FILE`` the run's profile (what ``mimo-plan --advise --profile`` calibrates
from). A bad value is one line naming the flag, before any process group exists.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from megatron_plugins.errors import FlagError
from megatron_plugins.performance.profile import WARM_UP

__all__ = ["DEFAULT_TIMELINE_STEPS", "add_performance_args", "check_performance_args",
           "measures", "timeline_steps"]

DEFAULT_TIMELINE_STEPS = "3:4"
"""Steps the timeline records by default: after the first two (warm-up), two steps."""


def add_performance_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the measurement flags (stock's ``--log-throughput`` is stock's)."""
    group = parser.add_argument_group("megatron-plugins throughput, timeline and profile")
    group.add_argument("--peak-tflops", type=float, default=None, metavar="X",
                       help="Peak TFLOP/s of one device, for the MFU that --log-throughput "
                            "shows (default: the dense bf16 peak of a known GPU, none on the "
                            "CPU simulation).")
    group.add_argument("--mimo-timeline", default=None, metavar="DIR",
                       help="Write the recorded steps' phases of every rank to "
                            "DIR/timeline.json (Chrome trace, opens in Perfetto) and "
                            "DIR/timeline.png.")
    group.add_argument("--mimo-timeline-steps", default=DEFAULT_TIMELINE_STEPS, metavar="A:B",
                       help="The training steps (iterations, from 1, both included) "
                            f"--mimo-timeline records (default {DEFAULT_TIMELINE_STEPS}).")
    group.add_argument("--mimo-profile", default=None, metavar="FILE",
                       help="Write the run's measured per-module FLOPs and timings to FILE "
                            "(JSON) at the end of training, for mimo-plan --advise --profile.")
    return parser


def timeline_steps(text: str) -> range:
    """``A:B`` (1 <= A <= B) as the range of steps it names."""
    first, colon, last = text.partition(":")
    try:
        steps = range(int(first), int(last) + 1) if colon else None
    except ValueError:
        steps = None
    if steps is None or steps.start < 1 or len(steps) == 0:
        raise FlagError(f"--mimo-timeline-steps {text}: give the first and last step to record "
                        f"as A:B with 1 <= A <= B, e.g. --mimo-timeline-steps "
                        f"{DEFAULT_TIMELINE_STEPS}")
    return steps


def _writable_folder(flag: str, value: str, folder: Path) -> None:
    """Create ``folder`` (the flag's own or its file's) now, so a path that cannot be written is
    refused before training rather than after it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise FlagError(f"{flag} {value}: cannot create folder {folder} ({error.strerror}); give a "
                        "path this user can write") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise FlagError(f"{flag} {value}: folder {folder} is not writable; give a path this user "
                        "can write")


def measures(args: Any) -> bool:
    """Whether the run measures anything (else nothing of this room is installed)."""
    return bool(args.log_throughput or args.mimo_timeline or args.mimo_profile)


def check_performance_args(args: Any) -> None:
    """Every measurement flag's value, as one :class:`FlagError` line naming the flag."""
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise FlagError(f"--peak-tflops {args.peak_tflops}: the peak must be a positive number "
                        "of TFLOP/s per device, e.g. --peak-tflops 989 for an H100 SXM in bf16")
    if args.log_progress and not args.log_throughput:
        raise FlagError("--log-progress records stock's FLOPs count, which on a MiMo run is "
                        "counted only with --log-throughput; add --log-throughput")
    steps = timeline_steps(args.mimo_timeline_steps)
    if args.mimo_timeline is not None:
        if args.train_iters is not None and steps.start > args.train_iters:
            raise FlagError(f"--mimo-timeline-steps {args.mimo_timeline_steps}: the run trains "
                            f"{args.train_iters} steps (--train-iters); record steps within them")
        _writable_folder("--mimo-timeline", args.mimo_timeline, Path(args.mimo_timeline))
    if args.mimo_profile is not None:
        if args.train_iters is not None and args.train_iters <= WARM_UP:
            raise FlagError(f"--mimo-profile measures the steps after the first {WARM_UP} "
                            f"(warm-up), and --train-iters {args.train_iters} trains no more; "
                            f"train at least {WARM_UP + 1} steps")
        path = Path(args.mimo_profile)
        if path.is_dir():
            raise FlagError(f"--mimo-profile {path}: it is a folder; give the file to write, "
                            "e.g. --mimo-profile runs/profile.json")
        _writable_folder("--mimo-profile", args.mimo_profile, path.parent)
