#!/usr/bin/env bash
# One GPU: the MiMo of gpu_mimo_model.sh trained in full and with LoRA (rank 16 on every linear
# of the ViT, its projection and the language model), side by side: step time, model TFLOP/s
# (LoRA's count: frozen weights get no weight gradient, adapters counted) and peak memory.
# Figures: docs/peft.md ("On one H100"). Usage: OUT=dir bash benchmarks/gpu_lora_measured.sh
set -uo pipefail
out=${OUT:-/tmp/gpu_lora_measured}
mkdir -p "$out"
source "$(dirname "$0")/gpu_mimo_model.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
lora=(--lora language:rank=16,alpha=32 --lora vision:rank=16,alpha=32
  --lora vision.projection:rank=16,alpha=32)
launch "${model[@]}" --log-throughput > "$out/full.log" 2>&1
echo "full: rc=$?"
launch "${model[@]}" --log-throughput "${lora[@]}" > "$out/lora.log" 2>&1
echo "lora: rc=$?"
for run in full lora; do
  echo "== $run"
  grep -E "iteration +(4|8|12)/" "$out/$run.log" | cut -c1-700
  grep -E "memory \(MB\)" "$out/$run.log" | tail -1
  grep -E "[Ee]rror" "$out/$run.log" | head -5
done
