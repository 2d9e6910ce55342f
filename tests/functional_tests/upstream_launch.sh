#!/usr/bin/env bash
# Launch one functional case the way upstream Megatron-LM's training launcher does, to show our
# case files run under its conventions: fill ${VAR}s with envsubst, export ENV_VARS, turn every
# MODEL_ARGS key into exactly one flag (`true` -> bare flag, a value with spaces -> one quoted
# argument), then torchrun the entry point. (Upstream reads the YAML with yq; Python's yaml
# module prints the same key/value lines here.)
#
#   bash tests/functional_tests/upstream_launch.sh <case dir> <output dir> [python]
set -euo pipefail
case_dir=$(cd "$1" && pwd)
out=$2
python=${3:-python}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

export TENSORBOARD_PATH=$out/tensorboard CHECKPOINT_SAVE_PATH=$out/checkpoints \
       CHECKPOINT_LOAD_PATH=$out/checkpoints DATA_PATH=$out/data OUTPUT_PATH=$out
mkdir -p "$out"
envsubst < "$case_dir/model_config.yaml" > "$out/model_config.yaml"

entries() {  # <section>: one "key: value" line per entry, true spelled "true"
  "$python" -c 'import sys, yaml
for key, value in (yaml.safe_load(open(sys.argv[1])).get(sys.argv[2]) or {}).items():
    print(f"{key}: {str(value).lower() if isinstance(value, bool) else value}")' \
    "$out/model_config.yaml" "$1"
}

while IFS= read -r line; do
  [ -n "$line" ] && export "${line%%: *}=${line#*: }"
done < <(entries ENV_VARS)

params=()
while IFS= read -r line; do
  [ -n "$line" ] || continue
  key=${line%%:*}
  value=${line#*: }
  if [ "$value" = "true" ]; then
    params+=("$key")
  else
    params+=("$key" "$value")
  fi
done < <(entries MODEL_ARGS)

nproc=$(cd "$root" && "$python" -c 'import sys
from tools.functional_tests.runner import load_case, CASES_ROOT
from pathlib import Path
print(load_case(str(Path(sys.argv[1]).relative_to(CASES_ROOT))).nproc)' "$case_dir")

# Upstream's launcher passes MASTER_ADDR/MASTER_PORT; without them, torchrun's agent binds a port
# itself (--standalone), so concurrent launches on one host never pick the same one.
if [ -n "${MASTER_PORT:-}" ]; then
  rendezvous=(--master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "$MASTER_PORT")
else
  rendezvous=(--standalone)
fi
cd "$root"
exec "$python" -m torch.distributed.run --nproc_per_node "$nproc" "${rendezvous[@]}" \
  examples/mimo/pretrain_mimo.py "${params[@]}"
