#!/usr/bin/env bash
# The Qwen3.5-VL recipe on the CPU simulation: a whole Qwen3.5-VL folder, dense or MoE (e.g. a
# tiny one a test saved), trained with --hf-model for 8 steps on the mock data, the same run as
# the Qwen2.5-VL recipe's twin (its flags: 2 CPU processes, image dp 1 + language dp 1, 0 to 3
# images of native, varied sizes per sample). The folder's config.json sets the model: Gated
# DeltaNet and gated attention layers, multimodal RoPE, image token. Usage:
#   bash examples/mimo/recipes/qwen3_5_vl/cpu_simulation.sh HF_MODEL_DIR [extra flags...]
# Writes TensorBoard logs and a checkpoint under runs/qwen3_5_vl_cpu/ (or $MIMO_RUN_DIR).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export MIMO_RUN_DIR="${MIMO_RUN_DIR:-$(cd "$here/../../../.." && pwd)/runs/qwen3_5_vl_cpu}"
exec bash "$here/../qwen2_5_vl/cpu_simulation.sh" "$@"
