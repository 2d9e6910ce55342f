#!/usr/bin/env bash
# The Qwen3-Omni recipe on the CPU simulation: train_8gpu.sh's layout at tiny shapes. A whole
# Qwen3-Omni-MoE folder (e.g. a tiny one a test saved) trained with --hf-model as the Qwen2.5-VL
# recipe's twin trains (its script and flags: 2 CPU processes, mock data, 8 steps) with this
# layout: both towers colocated on the language ranks at DP 2 (image:dp=2@language,
# audio:dp=2@language), the language model at DP 2 with its experts over EP 2, micro-batch 2,
# --colocated-encoder-recompute, --log-throughput; rows of 128 for 1 to 2 images and clips per
# sample. Left out: --optimizer-cpu-offload and the precision-aware optimizer it needs
# (Transformer Engine's FusedAdam; plain Adam here), bf16, rows of 4096. Usage:
#   bash examples/mimo/recipes/qwen3_omni/cpu_simulation.sh HF_MODEL_DIR [extra flags...]
# Writes TensorBoard logs and a checkpoint under runs/qwen3_omni_cpu/ (or $MIMO_RUN_DIR).
set -euo pipefail
hf_model="${1:?usage: cpu_simulation.sh HF_MODEL_DIR [extra flags...]}"
shift
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export MIMO_RUN_DIR="${MIMO_RUN_DIR:-$(cd "$here/../../../.." && pwd)/runs/qwen3_omni_cpu}"
export MIMO_GRIDS="--grid image:dp=2@language --grid audio:dp=2@language --grid language:dp=2,ep=2"
exec bash "$here/../qwen2_5_vl/cpu_simulation.sh" "$hf_model" --colocated-encoder-recompute \
  --log-throughput --seq-length 128 --mock-items-per-sample 1:2 "$@"
