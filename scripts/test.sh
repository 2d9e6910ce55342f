#!/usr/bin/env bash
# The README's test command: create or reuse .venv, then run the whole pytest suite.
# pytest exits 5 when it collects no test; that is a failure here, never a pass.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The suite's last lines give its wall time, the virtualenv's share included (tests/harness/suite_time.py).
MIMO_TEST_SH_STARTED="$(date +%s)"
bash "$root/scripts/setup_env.sh" || exit 1
MIMO_TEST_SH_VIRTUALENV_SECONDS=$(($(date +%s) - MIMO_TEST_SH_STARTED))
export MIMO_TEST_SH_STARTED MIMO_TEST_SH_VIRTUALENV_SECONDS
cd "$root"
# Every fresh interpreter of the suite (pytest itself, torchrun ranks, entry-point launches) would
# otherwise compile the package and the tests from source again: keep their bytecode.
unset PYTHONDONTWRITEBYTECODE
# Two workers: while one worker's ranks wait on each other or on a launch, the other's compute.
# tests/conftest.py groups the tests (the in-process ones in order on one worker, each file's
# multi-process ones together). A later -n in "$@" wins.
"$root/.venv/bin/python" -m pytest -n 2 --dist loadgroup "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; failing" >&2
  exit 1
fi
exit "$status"
