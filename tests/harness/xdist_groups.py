"""How the suite's tests share two pytest-xdist workers (a pytest plugin, loaded by
``tests/conftest.py``; ``scripts/test.sh`` runs ``-n 2 --dist loadgroup``).

- The in-process tests stay together on one worker, in their order, as ``-m "not multirank"``
  runs them (some switch the process to the CPU simulation for the tests after them).
- A file's multi-process tests that use a fixture of that file wider than one test are one group,
  so the fixture (often a trained and saved model) is made once.
- Every other multi-process test is scheduled on its own, to whichever worker is free.
"""

from __future__ import annotations

import pytest

__all__ = ["IN_PROCESS", "pytest_collection_modifyitems"]

IN_PROCESS = "in-process"
"""The group of every test without the ``multirank`` marker."""


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns the marks into work units
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if not item.get_closest_marker("multirank"):
            group = IN_PROCESS
        elif _uses_a_file_wide_fixture(item):
            group = item.nodeid.split("::")[0]
        else:
            continue
        item.add_marker(pytest.mark.xdist_group(group))


def _uses_a_file_wide_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` uses a fixture its own test file defines with a scope wider than a test."""
    fixtures = getattr(item, "_fixtureinfo", None)
    return fixtures is not None and any(
        definitions[-1].scope != "function" and definitions[-1].baseid.endswith(".py")
        for definitions in fixtures.name2fixturedefs.values())
