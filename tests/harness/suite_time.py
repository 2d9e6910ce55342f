"""The suite's cost beside its slowest tests (a pytest plugin, loaded by ``tests/conftest.py``):
every run ends with its wall time, and under ``scripts/test.sh`` (what CI runs) the virtualenv's
share too, so each landing shows what the suite costs."""

from __future__ import annotations

import os
import time

import pytest

__all__ = ["STARTED", "VIRTUALENV_SECONDS", "pytest_sessionstart", "pytest_terminal_summary"]

STARTED = "MIMO_TEST_SH_STARTED"
"""``scripts/test.sh``'s start (seconds since the epoch), before it creates or reuses .venv."""
VIRTUALENV_SECONDS = "MIMO_TEST_SH_VIRTUALENV_SECONDS"
"""What creating or reusing .venv took, in seconds."""

_session_started: list[float] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    _session_started.append(time.time())


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{seconds % 60:04.1f}s"


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """After the durations list: pytest's wall time, and test.sh's whole run when it started us."""
    now = time.time()
    line = f"pytest {_minutes(now - _session_started[0])}"
    if STARTED in os.environ:
        line = (f"scripts/test.sh {_minutes(now - float(os.environ[STARTED]))} in all: virtualenv "
                f"{_minutes(float(os.environ[VIRTUALENV_SECONDS]))}, {line}")
    terminalreporter.write_sep("=", "suite wall time")
    terminalreporter.write_line(line)
