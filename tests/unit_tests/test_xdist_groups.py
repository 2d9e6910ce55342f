"""Two xdist workers share the suite as ``tests/harness/xdist_groups.py`` says: a file's fixture
wider than one test is made once, and the in-process tests run on one worker in their order."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]

RECORD = '''
import os
from pathlib import Path


def record(event):
    with open(Path(__file__).parent / "events.txt", "a") as events:
        events.write(f"{os.environ['PYTEST_XDIST_WORKER']} {event}\\n")
'''

SHARED_FIXTURE = '''
import pytest

from record import record


@pytest.fixture(scope="module")
def trained():
    record("fixture")
    return 1


@pytest.mark.multirank
@pytest.mark.parametrize("layout", range(4))
def test_layout(trained, layout):
    record(f"layout {layout}")
'''

IN_PROCESS = '''
import pytest

from record import record


@pytest.mark.parametrize("order", range(6))
def test_in_process(order):
    record(f"in-process {order}")


@pytest.mark.multirank
@pytest.mark.parametrize("alone", range(4))
def test_alone(alone):
    record(f"alone {alone}")
'''


@pytest.mark.multirank
def test_a_file_fixture_is_made_once_and_in_process_tests_keep_one_worker_and_their_order(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeini("[pytest]\nmarkers =\n    multirank: starts processes\n")
    pytester.makepyfile(record=RECORD, test_a_shared=SHARED_FIXTURE, test_b_in_process=IN_PROCESS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(REPOSITORY), str(pytester.path), os.environ.get("PYTHONPATH")])))
    result = pytester.runpytest_subprocess(
        "-p", "tests.harness.xdist_groups", "-p", "no:cacheprovider", "-n", "2",
        "--dist", "loadgroup", timeout=120)
    result.assert_outcomes(passed=14)
    events = [line.split(" ", 1) for line in
              (pytester.path / "events.txt").read_text().splitlines()]
    assert [event for _, event in events].count("fixture") == 1
    assert len({worker for worker, event in events
                if event == "fixture" or event.startswith("layout")}) == 1
    in_process = [(worker, event) for worker, event in events if event.startswith("in-process")]
    assert len({worker for worker, _ in in_process}) == 1
    assert [event for _, event in in_process] == [f"in-process {n}" for n in range(6)]
    # Tests without a shared fixture go to whichever worker is free: both take some.
    assert {worker for worker, _ in events} == {"gw0", "gw1"}
