"""Suite-wide plugins: the ``multirank`` marker's check (:mod:`tests.harness.multirank`), the
suite's wall time beside its slowest tests (:mod:`tests.harness.suite_time`), runs shared by
xdist workers (:mod:`tests.harness.worker_cache`), pytester (which
tests the marker's check), and stock's flag help texts read once per class in this process too
(:mod:`tests.harness.stock_arguments`)."""

import sys

import pytest

pytest_plugins = ("tests.harness.multirank", "tests.harness.suite_time", "tests.harness.worker_cache",
                  "pytester")


def pytest_collection_finish(session) -> None:
    """Once the test modules have imported Megatron (never before: the CPU simulation must patch
    torch first where a test activates it)."""
    if "megatron.training.argument_utils" in sys.modules:
        from tests.harness.stock_arguments import remember_field_docstrings

        remember_field_docstrings()


def pytest_collection_modifyitems(config, items) -> None:
    """Under pytest-xdist (``scripts/test.sh``, ``--dist loadgroup``): the in-process tests stay
    together on one worker, in their order, as ``-m "not multirank"`` runs them (some switch this
    process to the CPU simulation for the tests after them); each file's multi-process tests are
    one group, so its module fixtures are made once."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        group = (item.nodeid.split("::")[0] if item.get_closest_marker("multirank")
                 else "in-process")
        item.add_marker(pytest.mark.xdist_group(group))
