#!/usr/bin/env bash
# The README's test command: create or reuse .venv, then run the whole pytest suite.
# pytest exits 5 when it collects no test; that is a failure here, never a pass.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh" || exit 1
cd "$root"
"$root/.venv/bin/python" -m pytest "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; failing" >&2
  exit 1
fi
exit "$status"
