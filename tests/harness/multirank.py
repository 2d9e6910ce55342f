"""The ``multirank`` marker and the check that keeps it true (a pytest plugin, loaded by
``tests/conftest.py``).

A test starts processes when it runs gloo ranks, a torchrun or entry-point launch, a shell
script, or any other fresh interpreter (``run_in_processes``, ``run_script``, ``launch_preforked``, ``subprocess``):
each costs seconds of imports or a preloaded server's start on a 2-core machine. Such a test, or
a fixture it uses, must carry ``@pytest.mark.multirank``, so that ``pytest -m "not multirank"``
is the fast, in-process subset. Forgetting the marker cannot go unnoticed: a test phase that
starts one (a ``subprocess.Popen`` audit event, a ``multiprocessing`` start by spawn or
forkserver) without it fails, naming what it started. Plain forks of the test process (Energon's
indexing pool, data loader workers) start nothing new and are allowed.
"""

from __future__ import annotations

import multiprocessing.process
import sys
from collections.abc import Generator
from typing import Any

import pytest

__all__ = ["MARKER", "pytest_configure", "pytest_runtest_call", "pytest_runtest_setup",
           "pytest_runtest_teardown"]

MARKER = "multirank"

_watching: list[list[str]] = []
"""What the running test phase started, innermost phase last (a pytester run nests one)."""


def _record(what: str) -> None:
    if _watching:
        _watching[-1].append(what)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "subprocess.Popen":  # arguments: executable, args, cwd, env
        command = args[1] if isinstance(args[1], (list, tuple)) else [args[1] or args[0]]
        if _launches(str(command[0])):
            _record(" ".join(map(str, command))[:200])


LAUNCHERS = ("python", "torchrun", "bash", "sh")
"""Programs whose start costs an interpreter (or runs a script that starts one). Tools that
imports probe for themselves (``git rev-parse`` in megatron.core, ``ldconfig -p`` in ctypes)
cost milliseconds and are not watched."""


def _launches(program: str) -> bool:
    name = program.rsplit("/", 1)[-1]
    return program == sys.executable or name in LAUNCHERS or name.startswith("python")


_stock_start = multiprocessing.process.BaseProcess.start


def _start(self: multiprocessing.process.BaseProcess) -> None:
    method = getattr(self, "_start_method", None) or multiprocessing.get_start_method()
    if method != "fork":
        _record(f"{method} {self.name} running {getattr(self, '_target', None)!r}")
    _stock_start(self)


def _install() -> None:
    """Watch process starts in this interpreter, once (audit hooks cannot be removed)."""
    if multiprocessing.process.BaseProcess.start is not _start:
        sys.addaudithook(_audit)
        multiprocessing.process.BaseProcess.start = _start  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    """The marker itself is registered in ``pytest.ini``."""
    _install()


def _watched(item: pytest.Item, phase: str) -> Generator[None, Any, Any]:
    started: list[str] = []
    _watching.append(started)
    try:
        result = yield
    finally:
        _watching.remove(started)
    if started and item.get_closest_marker(MARKER) is None:
        pytest.fail(f"{item.nodeid} started {len(started)} process(es) in its {phase} without "
                    f"@pytest.mark.{MARKER} (first: {started[0]}); mark the test, so that "
                    f"pytest -m 'not {MARKER}' stays in-process", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _watched(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _watched(item, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _watched(item, "teardown"))
