"""A run SIGKILLed in the middle of a save, relaunched with the same command, never trains from
iteration 1 silently: it refuses (nothing complete was saved) or resumes from the newest complete
checkpoint, and no complete checkpoint is written over."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.harness.mimo_runs import TINY_MIMO
from tests.harness.multiprocess import (
    REPO_ROOT,
    launch_preforked,
    run_preforked,
    start_simulation_server,
)

pytestmark = pytest.mark.multirank

SCRIPT = REPO_ROOT / "examples" / "mimo" / "pretrain_mimo.py"
PYTHONPATH = f"{REPO_ROOT / 'tests' / 'fixtures'}{os.pathsep}{REPO_ROOT}"


def _argv(folder: Path) -> list[str]:
    return [*TINY_MIMO, "--encoder", "vision=blocking_save:BlockingSaveViT",
            "--grid", "vision:dp=1", "--grid", "language:dp=2", "--train-iters", "6",
            "--eval-iters", "0", "--save-interval", "2", "--save", str(folder),
            "--load", str(folder)]


def _kill_during_save(folder: Path, rank: int, iteration: int, tmp: Path,
                      also_wait_for: Path | None = None) -> str:
    """Launch, wait until ``rank`` is frozen inside the save of ``iteration`` (and, if given,
    the JSON file ``also_wait_for`` is written whole), SIGKILL that rank; returns the launch's
    output. The ranks are preforked (what is tested is the checkpoint left behind, not torchrun's
    supervision, which the failure-behaviour tests cover); the first rank's death ends the
    others, as under torchrun."""
    blocked = tmp / "blocked"
    blocked.unlink(missing_ok=True)
    log = tmp / "launch.log"
    env = {**os.environ, "PYTHONPATH": PYTHONPATH,
           "MIMO_TEST_BLOCK_SAVE": f"{rank}:{iteration}:{tmp}"}
    start_simulation_server()
    codes: list[int] = []
    launch = threading.Thread(target=lambda: codes.append(launch_preforked(
        SCRIPT, _argv(folder), 3, env=env, log=log, timeout=240)), daemon=True)
    launch.start()
    try:
        deadline = time.monotonic() + 150
        while not (blocked.exists() and (also_wait_for is None or _whole_json(also_wait_for))):
            assert launch.is_alive(), "the run ended before the save was interrupted"
            assert time.monotonic() < deadline, "the save was not reached in time"
            time.sleep(0.2)
        os.kill(int(blocked.read_text()), signal.SIGKILL)
    finally:  # the launch ends its ranks once one dies, or at its timeout
        launch.join(timeout=300)
    assert codes and codes[0] != 0, "the launch did not end with the killed rank"
    return log.read_text()


def _whole_json(path: Path) -> bool:
    """Whether ``path`` exists and holds a complete JSON document (not one still being written)."""
    try:
        json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return True


def _digest(iteration: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in iteration.iterdir()}


def _relaunch(folder: Path):
    return run_preforked(SCRIPT, _argv(folder), 3, timeout=150, env={"PYTHONPATH": PYTHONPATH})


def test_killed_during_the_first_save_the_relaunch_refuses(tmp_path):
    folder = tmp_path / "checkpoints"
    _kill_during_save(folder, rank=0, iteration=2, tmp=tmp_path)
    iteration = folder / "iter_0000002"
    assert iteration.is_dir() and not (iteration / "metadata.json").exists()
    assert not (folder / "latest_checkpointed_iteration.txt").exists()
    before = _digest(iteration)

    run = _relaunch(folder)
    assert run.returncode != 0
    errors = re.findall(r"^pretrain_mimo\.py: error: (.*)$", run.output, flags=re.M)
    # Every rank that prints says the same; torchrun may stop a rank before it prints.
    assert errors and len(set(errors)) == 1, run.output[-3000:]
    assert errors[0].startswith(f"--load {folder}: no complete checkpoint to resume from "
                                "(iter_0000002 lack metadata.json")
    assert not re.search(r"iteration\s+1/", run.output)
    assert _digest(iteration) == before


def test_killed_during_saves_the_relaunch_resumes_from_the_last_complete_checkpoint(tmp_path):
    folder = tmp_path / "checkpoints"
    first = folder / "iter_0000002"
    # Killed after iteration 2's save completed but before the tracker was written.
    _kill_during_save(folder, rank=1, iteration=2, tmp=tmp_path,
                      also_wait_for=first / "metadata.json")
    assert not (folder / "latest_checkpointed_iteration.txt").exists()
    complete = _digest(first)

    # Relaunch: resumes from 2, then is killed while saving iteration 4.
    output = _kill_during_save(folder, rank=0, iteration=4, tmp=tmp_path)
    assert (f"pretrain_mimo.py: notice: --load {folder}: resuming from iteration 2, the newest "
            "complete checkpoint; latest_checkpointed_iteration.txt is absent") in output
    assert "loading distributed checkpoint from" in output and "at iteration 2" in output
    assert re.search(r"iteration\s+3/", output) and not re.search(r"iteration\s+1/", output)
    assert not (folder / "iter_0000004" / "metadata.json").exists()

    run = _relaunch(folder)
    assert run.returncode == 0, run.output[-4000:]
    assert ("resuming from iteration 2, the newest complete checkpoint; iter_0000004 incomplete"
            in run.output)
    assert not re.search(r"iteration\s+1/", run.output)
    assert re.search(r"iteration\s+6/", run.output)
    assert (folder / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert (folder / "iter_0000004" / "metadata.json").exists()
    assert _digest(first) == complete
