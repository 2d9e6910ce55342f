"""The multi-process harness fails fast and readably instead of hanging the suite."""

from __future__ import annotations

import os
import time

import pytest

from tests.multiprocess import WorkerFailure, run_in_processes


def _rank_one_dies() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()  # would wait forever for the dead rank


def _rank_zero_raises() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        raise ValueError("bad batch on purpose")
    dist.barrier()


def _everyone_hangs() -> None:
    time.sleep(600)


def test_a_killed_rank_fails_the_run_fast() -> None:
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match="rank 1 died with exit code 3"):
        run_in_processes(_rank_one_dies, 2, timeout=60)
    assert time.monotonic() - start < 30


def test_a_raising_rank_reports_its_traceback() -> None:
    with pytest.raises(WorkerFailure, match="(?s)rank 0 raised.*ValueError: bad batch on purpose"):
        run_in_processes(_rank_zero_raises, 2, timeout=60)


def test_a_hung_run_is_killed_at_its_deadline() -> None:
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=r"ranks \[0, 1\] did not finish within 8 s"):
        run_in_processes(_everyone_hangs, 2, timeout=8)
    assert time.monotonic() - start < 20
