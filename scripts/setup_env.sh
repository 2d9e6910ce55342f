#!/usr/bin/env bash
# Create (or reuse) the project virtualenv at .venv with megatron-plugins and its test extra.
# Reuse is keyed on a hash of setup.py: unchanged pins make a second run take seconds.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.megatron-plugins-pins"

find_python312() {
  local candidate
  for candidate in "${PYTHON312:-}" python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 \
                   /usr/local/bin/python3.12 /usr/bin/python3.12; do
    [ -n "$candidate" ] || continue
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
      command -v "$candidate" || echo "$candidate"
      return 0
    fi
  done
  echo "setup_env: no working Python 3.12 found; install it or set PYTHON312=/path/to/python3.12" >&2
  return 1
}

want="$(sha256sum "$root/setup.py" | cut -d' ' -f1)"
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup_env: reusing $venv (pins unchanged)"
  exit 0
fi

py="$(find_python312)"
echo "setup_env: creating $venv with $py"
rm -rf "$venv"
"$py" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip setuptools wheel
# No bytecode at install: pip would compile every module of torch and transformers (most never
# imported); the suite's interpreters write bytecode for what they import (scripts/test.sh).
"$venv/bin/python" -m pip install --quiet --no-compile -e "$root[test]"
echo "$want" > "$stamp"
echo "setup_env: ready ($("$venv/bin/python" -c 'import megatron.core, torch; print("megatron-core", megatron.core.__version__, "torch", torch.__version__)'))"
