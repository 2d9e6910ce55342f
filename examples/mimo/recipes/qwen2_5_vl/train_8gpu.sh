#!/usr/bin/env bash
# Fine-tune a whole Qwen2.5-VL-7B(-Instruct) folder on one node of 8 GPUs, disjoint grids:
#   image (Qwen2.5-VL vision tower, its merger as the projection)  ranks 0-1  tp=2 dp=1
#   language (Qwen2.5-7B with multimodal RoPE)                      ranks 2-7  tp=2 dp=3
# The one tower replica embeds the images of all three language replicas (fan-out 3); its
# 0.67B parameters at native resolution cost about a fifth of the step, so 2 of 8 GPUs.
# HF_MODEL: the HF folder (config.json, safetensors, tokenizer, preprocessor_config.json).
# DATA: an Energon conversation dataset (tools/make_energon_dataset --kind conversation).
# MIMO_PLAN_ONLY=1 prints the rank map (HF_MODEL defaults to the shipped 7B config.json).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$HERE/../../../.."
NPROC=8
HF_MODEL="${HF_MODEL:-$HERE/qwen2_5_vl_7b_config}"
LAYOUT=(--hf-model "$HF_MODEL" --grid image:tp=2,dp=1 --grid language:tp=2,pp=1,dp=3)
source "$HERE/finetune_flags.sh"
if [ "${MIMO_PLAN_ONLY:-0}" = 1 ]; then
  exec python -m megatron_plugins.launch.plan --nproc-per-node "$NPROC" --ranks \
    "${LAYOUT[@]}" "${TRAINING[@]}"
fi
: "${DATA:?set DATA to an Energon conversation dataset (tools/make_energon_dataset --kind conversation)}"
export CUDA_DEVICE_MAX_CONNECTIONS=1
exec torchrun --nproc-per-node "$NPROC" examples/mimo/pretrain_mimo.py \
  "${LAYOUT[@]}" "${TRAINING[@]}" "${DATA_FLAGS[@]}" "$@"
