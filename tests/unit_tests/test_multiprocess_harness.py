"""The multi-process harness fails fast and readably instead of hanging the suite."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

from tests.harness.multiprocess import (
    WorkerFailure,
    launch_preforked,
    run_in_processes,
    start_simulation_server,
)

pytestmark = pytest.mark.multirank


def _rank_one_dies(marks: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        (Path(marks) / "died").write_text(str(time.time()))
        os._exit(3)
    dist.barrier()  # would wait forever for the dead rank


def _rank_zero_raises() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        raise ValueError("bad batch on purpose")
    dist.barrier()


def _everyone_hangs() -> None:
    time.sleep(600)


def _when(mark: Path) -> float:
    """The ``time.time()`` a rank wrote into ``mark`` when something happened to it."""
    return float(mark.read_text())


def test_a_killed_rank_fails_the_run_fast(tmp_path: Path) -> None:
    """Forked ranks (the simulation server's); the hung run below keeps spawned ones."""
    with pytest.raises(WorkerFailure, match="rank 1 died with exit code 3"):
        run_in_processes(_rank_one_dies, 2, timeout=300, args=(str(tmp_path),), simulated=True)
    # Counted from the death, not from the start (the server may be starting first).
    assert time.time() - _when(tmp_path / "died") < 10


def test_a_raising_rank_reports_its_traceback() -> None:
    with pytest.raises(WorkerFailure, match="(?s)rank 0 raised.*ValueError: bad batch on purpose"):
        run_in_processes(_rank_zero_raises, 2, timeout=60, simulated=True)


def test_a_hung_run_is_killed_at_its_deadline() -> None:
    """Spawned ranks: fresh interpreters, killed at the deadline all the same."""
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=r"ranks \[0, 1\] did not finish within 8 s"):
        run_in_processes(_everyone_hangs, 2, timeout=8)
    assert time.monotonic() - start < 20


RANK_SCRIPT = """
import os, sys, time, torch
from pathlib import Path
print(f"rank {os.environ['RANK']}/{os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']} "
      f"threads {torch.get_num_threads()} argv {sys.argv[1:]} pid {os.getpid()}", flush=True)
here = Path(__file__).parent
(here / f"printed.{os.environ['RANK']}").touch()
if os.environ["RANK"] == sys.argv[2]:
    # Fail only once every rank has printed its line: the others are killed at once after.
    while len(list(here.glob("printed.*"))) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.01)
    (here / "exited").write_text(str(time.time()))
    sys.exit(3)
time.sleep(600)
"""
"""Each rank prints its torchrun variables and marks that it did; the failing rank exits 3 after
every rank's mark (writing the time to ``exited``), the others wait to be killed."""


@pytest.fixture(scope="module")
def preforked_server() -> None:
    """The forkserver behind preforked launches imports torch and Megatron on its first use:
    start it first, so that the launches' time bounds measure the launches."""
    start_simulation_server()


def _launch(tmp_path: Path, failing_rank: str, **kwargs) -> tuple[int, str]:
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    log = tmp_path / "launch.log"
    code = launch_preforked(script, ["--cpu-simulation", failing_rank], 2, log=log,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, **kwargs)
    return code, log.read_text()


def test_a_preforked_launch_sets_torchruns_variables_and_a_failing_rank_ends_the_others(
        preforked_server: None, tmp_path: Path) -> None:
    code, log = _launch(tmp_path, "1", timeout=300)
    assert code == 3 and time.time() - _when(tmp_path / "exited") < 10
    assert "rank 0/2 local 0 threads 1 argv ['--cpu-simulation', '1']" in log
    assert "rank 1/2 local 1 threads 1 argv ['--cpu-simulation', '1']" in log
    assert "launch_preforked: rank 1 exited with code 3; the other ranks are killed" in log
    waiting = int(log.split("rank 0/2")[1].split(" pid ")[1].split()[0])
    assert not psutil.pid_exists(waiting) or psutil.Process(waiting).status() == "zombie"


def test_a_hung_preforked_launch_is_killed_at_its_deadline(preforked_server: None,
                                                           tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="with 2 ranks ran past 5 s"):
        _launch(tmp_path, "none", timeout=5)
    assert time.monotonic() - start < 20


CAPABILITY_SCRIPT = """
import os, torch
print(f"rank {os.environ['RANK']} kernels {torch.backends.cpu.get_cpu_capability()} "
      f"ATEN_CPU_CAPABILITY {os.environ.get('ATEN_CPU_CAPABILITY')}", flush=True)
"""


def test_a_preforked_launch_under_another_dispatch_runs_that_dispatchs_kernels(
        preforked_server: None, tmp_path: Path) -> None:
    """Torch picks its kernels once, when it loads: ranks launched with another
    ``ATEN_CPU_CAPABILITY`` fork from a server loaded under it, not from the usual one."""
    script, log = tmp_path / "capability.py", tmp_path / "launch.log"
    script.write_text(CAPABILITY_SCRIPT)
    printed = {}
    for capability in (None, "default"):
        env = {name: value for name, value in os.environ.items() if name != "ATEN_CPU_CAPABILITY"}
        if capability:
            env["ATEN_CPU_CAPABILITY"] = capability
        assert launch_preforked(script, ["--cpu-simulation"], 2, env=env, log=log, timeout=60) == 0
        printed[capability] = sorted(line for line in log.read_text().splitlines()
                                     if line.startswith("rank "))
    assert printed["default"] == ["rank 0 kernels DEFAULT ATEN_CPU_CAPABILITY default",
                                  "rank 1 kernels DEFAULT ATEN_CPU_CAPABILITY default"]
    assert all(" kernels DEFAULT " not in line for line in printed[None]), printed[None]
    with pytest.raises(ValueError, match="runs --cpu-simulation scripts; use torchrun"):
        launch_preforked(script, [], 2, env=dict(os.environ), log=log, timeout=5)
