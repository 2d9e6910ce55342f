"""Runs and data that several test files read, made once per pytest run even when pytest-xdist
spreads the files over workers (``scripts/test.sh`` runs two).

:func:`once_per_run` is ``functools.cache`` within a process; under xdist the first worker to ask
computes the value and pickles it into the run's shared folder (the controller's base temporary
directory, which pytest keeps and rotates like any ``tmp_path``), and a worker asking for the same
value meanwhile waits on the file's lock and loads it. Values must pickle, and arguments must
``repr`` alike in every worker (launch dataclasses, flags, kinds).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

__all__ = ["once_per_run", "pytest_configure"]

T = TypeVar("T")

_workers: list[pytest.Config] = []
"""This xdist worker's config; empty without xdist (a process-local cache suffices)."""


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        _workers.append(config)


def _shared_folder() -> Path:
    """The run's folder its workers share: a worker's base temporary directory is
    ``<controller's>/popen-gwN``."""
    factory = _workers[0]._tmp_path_factory  # type: ignore[attr-defined]
    folder = factory.getbasetemp().parent / "shared-by-workers"
    folder.mkdir(exist_ok=True)
    return folder


def once_per_run(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` computed once per argument tuple for the whole pytest run, across xdist workers."""
    memo: dict[str, T] = {}

    @functools.wraps(fn)
    def shared(*args: Any, **kwargs: Any) -> T:
        key = repr((args, sorted(kwargs.items())))
        if key not in memo:
            memo[key] = _across_workers(fn, key, args, kwargs)
        return memo[key]

    return shared


def _across_workers(fn: Callable[..., T], key: str, args: tuple, kwargs: dict[str, Any]) -> T:
    if not _workers:
        return fn(*args, **kwargs)
    digest = hashlib.sha256(f"{fn.__module__}.{fn.__qualname__}{key}".encode()).hexdigest()
    path = _shared_folder() / f"{fn.__name__}-{digest[:32]}.pickle"
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker computing it: wait, then load
        if path.exists():
            return pickle.loads(path.read_bytes())
        value = fn(*args, **kwargs)
        partial = path.with_suffix(f".{os.getpid()}")
        partial.write_bytes(pickle.dumps(value))
        partial.rename(path)
        return value
