#!/usr/bin/env bash
# One GPU, one NCCL rank: a colocated MiMo (the ViT on the language model's rank) in bf16, the
# whole step on one device, measured by the launch's own --log-throughput / --mimo-timeline /
# --mimo-profile, then the same launch without them (the measurement's cost on a real GPU).
# Figures: docs/performance.md ("On one H100"). Usage: OUT=dir bash benchmarks/gpu_mimo_measured.sh
set -uo pipefail
out=${OUT:-/tmp/gpu_mimo_measured}
mkdir -p "$out"
source "$(dirname "$0")/gpu_mimo_model.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__)'
launch "${model[@]}" --log-throughput --mimo-timeline "$out/timeline" \
  --mimo-timeline-steps 10:11 --mimo-profile "$out/profile.json" > "$out/measured.log" 2>&1
echo "measured: rc=$?"
launch "${model[@]}" > "$out/plain.log" 2>&1
echo "plain: rc=$?"
grep -E "iteration +(2|4|6|8|10|12)/" "$out/measured.log" | cut -c1-900
grep -E "iteration +(2|4|6|8|10|12)/" "$out/plain.log" | cut -c1-260
grep -E "gaps bridged|notice|[Ee]rror" "$out/measured.log" | head -20
