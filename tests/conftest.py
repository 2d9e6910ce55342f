"""Suite-wide plugins: the ``multirank`` marker's check (:mod:`tests.harness.multirank`) and
pytester, which tests that check."""

pytest_plugins = ("tests.harness.multirank", "pytester")
