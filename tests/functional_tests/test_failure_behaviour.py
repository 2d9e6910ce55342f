"""Failures on disjoint grids end every rank fast and loudly; SIGTERM saves and exits cleanly."""

from __future__ import annotations

import re
import signal
import subprocess
import time

import psutil
import pytest

from tests.harness.mimo_runs import TINY_MIMO
from tests.harness.multiprocess import REPO_ROOT, kill_session, run_preforked, start_session
from tools.functional_tests.runner import torchrun_command

pytestmark = pytest.mark.multirank

SCRIPT = REPO_ROOT / "examples" / "mimo" / "pretrain_mimo.py"
LAYOUT = ["--encoder", "vision=faulty_encoder:FaultyViT", "--grid", "vision:dp=1",
          "--grid", "language:dp=2"]


def test_a_rank_raising_mid_training_ends_every_rank_with_its_error_visible(tmp_path):
    """Preforked ranks (the launcher ends the others on the first failure, as torchrun's agent
    does): what the failing rank prints, and when, is the point."""
    run = run_preforked(SCRIPT, [*TINY_MIMO, *LAYOUT, "--train-iters", "50",
                                 "--distributed-timeout-minutes", "1"],
                        nproc=3, timeout=150,
                        env={"PYTHONPATH": str(REPO_ROOT / "tests" / "fixtures")})
    assert run.returncode != 0
    assert "ValueError: corrupt image: sample 30 could not be decoded" in run.output
    assert re.search(r"iteration\s+3/", run.output), "it failed mid-training, not at start-up"
    assert "iteration       50/" not in run.output
    assert run.seconds < 120


def _workers(launcher: psutil.Process) -> list[psutil.Process]:
    return [p for p in launcher.children(recursive=True) if "pretrain_mimo.py" in " ".join(p.cmdline())]


def test_sigterm_with_exit_signal_handler_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    save = tmp_path / "checkpoints"
    command = torchrun_command(SCRIPT, 3, [
        *TINY_MIMO, "--encoder", "vision=vit", "--grid", "vision:dp=1", "--grid",
        "language:dp=2", "--train-iters", "100000", "--eval-iters", "0", "--exit-signal-handler",
        "--save", str(save), "--save-interval", "100000"])
    process, started = start_session(command, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
    output = []
    try:
        deadline = time.monotonic() + 120
        for line in process.stdout:
            output.append(line)
            if re.search(r"iteration\s+3/", line) or time.monotonic() > deadline:
                break
        workers = _workers(psutil.Process(process.pid))
        assert len(workers) == 3
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=120)
        output.append(rest)
    finally:
        kill_session(process, started)
    text = "".join(output)
    assert process.returncode == 0, text[-3000:]
    assert "exiting program after receiving SIGTERM" in text
    iteration = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert iteration >= 3
    assert len(list((save / f"iter_{iteration:07d}").glob("*.distcp"))) == 3
