#!/usr/bin/env bash
# One GPU, one NCCL rank: the local path's attention before and after issue 47, side by side in one
# device session. The colocated MiMo of gpu_mimo_model.sh at 2048 tokens with --reference-attention
# (s x s scores kept) and with the default fast attention (SDPA); then the language model at 8192
# tokens per row, fast, in full and with LoRA, and the reference at 8192 (its memory, or its OOM).
# Each launch prints TFLOP/s per module (--log-throughput) and Megatron's memory report.
# Figures: docs/performance.md ("On one H100"). Usage: OUT=dir bash benchmarks/gpu_fast_path.sh
set -uo pipefail
out=${OUT:-/tmp/gpu_fast_path}
mkdir -p "$out"
source "$(dirname "$0")/gpu_mimo_model.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__)'
long=(--seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 4
  --train-iters 6)
lora=(--lora language:rank=16,alpha=32 --lora vision:rank=16,alpha=32
  --lora vision.projection:rank=16,alpha=32)
run() {  # name, flags...
  local name=$1; shift
  local started=$SECONDS
  launch "${model[@]}" --log-throughput "$@" > "$out/$name.log" 2>&1
  echo "== $name: rc=$? in $((SECONDS - started)) s"
  grep -E "iteration +[0-9]+/" "$out/$name.log" | tail -2 | cut -c1-900
  grep -E "memory \(MB\)" "$out/$name.log" | tail -1
  grep -E "OutOfMemory|[Ee]rror" "$out/$name.log" | head -3
}
run reference_2k --reference-attention
run fast_2k
run fast_8k "${long[@]}"
run lora_fast_8k "${long[@]}" "${lora[@]}"
run reference_8k "${long[@]}" --reference-attention
