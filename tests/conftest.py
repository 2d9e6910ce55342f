"""Suite-wide plugins: the ``multirank`` marker's check (:mod:`tests.harness.multirank`), the
suite's wall time beside its slowest tests (:mod:`tests.harness.suite_time`), runs shared by
xdist workers (:mod:`tests.harness.worker_cache`), how the tests share those workers
(:mod:`tests.harness.xdist_groups`), pytester (which
tests the marker's check), and stock's flag help texts read once per class in this process too
(:mod:`tests.harness.stock_arguments`)."""

import sys

pytest_plugins = ("tests.harness.multirank", "tests.harness.suite_time", "tests.harness.worker_cache",
                  "tests.harness.xdist_groups", "pytester")


def pytest_collection_finish(session) -> None:
    """Once the test modules have imported Megatron (never before: the CPU simulation must patch
    torch first where a test activates it)."""
    if "megatron.training.argument_utils" in sys.modules:
        from tests.harness.stock_arguments import remember_field_docstrings

        remember_field_docstrings()
