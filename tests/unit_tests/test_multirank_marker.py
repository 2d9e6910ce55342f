"""A test that starts processes without ``@pytest.mark.multirank`` fails, so the fast subset
(``pytest -m "not multirank"``) cannot silently start ranks again; plain forks stay allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.multirank import MARKER

INNER_TESTS = '''
import multiprocessing
import subprocess
import sys

import pytest

PYTHON = [sys.executable, "-c", "pass"]


@pytest.fixture(scope="module")
def launched():
    subprocess.run(PYTHON, check=True)


def test_unmarked_subprocess():
    subprocess.run(PYTHON, check=True)


def test_unmarked_rank():
    process = multiprocessing.get_context("spawn").Process(target=int)
    process.start()
    process.join()


def test_unmarked_fixture_launch(launched):
    pass


def test_forked_worker():
    process = multiprocessing.get_context("fork").Process(target=int)
    process.start()
    process.join()


@pytest.mark.multirank
def test_marked_subprocess():
    subprocess.run(PYTHON, check=True)


def test_in_process():
    subprocess.run(["true"], check=True)  # a probe, not an interpreter
    assert sum([1, 2]) == 3
'''


def test_starting_processes_without_the_marker_fails_the_test(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nmarkers =\n    multirank: starts processes\n")
    pytester.makepyfile(test_inner=INNER_TESTS)
    result = pytester.runpytest_inprocess("-p", "tests.harness.multirank", "-p",
                                          "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=2, errors=1)
    result.stdout.fnmatch_lines([  # errors (setup) are reported before failures
        "*test_unmarked_fixture_launch started 1 process(es) in its setup *",
        "*test_unmarked_subprocess started 1 process(es) in its call without "
        "@pytest.mark.multirank (first: */python* -c pass)*",
        "*test_unmarked_rank started 1 process(es) in its call * (first: spawn SpawnProcess-* *",
    ])


def test_the_readme_fast_subset_command_names_the_registered_marker(
        pytestconfig: pytest.Config) -> None:
    registered = [line.split(":")[0].strip() for line in pytestconfig.getini("markers")]
    assert MARKER in registered
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert f'bash scripts/test.sh -m "not {MARKER}"' in readme
