#!/usr/bin/env bash
# Fine-tune a whole Qwen3-Omni-30B-A3B folder's thinker on one node of 8 GPUs at the advisor's
# layout (mimo-plan --advise --gpus 8 with the optimizer state on the CPU, as Megatron-Bridge's
# 8-GPU preset has it):
#   language (48-layer MoE, 128 experts)     ranks 0-7  tp=1 pp=1 dp=8, experts over ep=8
#   image (vision tower + DeepStack mergers) ranks 0-7  tp=1 dp=8, colocated on the language's
#   audio (AuT tower + projection)           ranks 0-7  tp=1 dp=8, colocated on the language's
# micro-batch 2, the towers recomputed in their backward (--colocated-encoder-recompute), Adam's
# state on the CPU (--optimizer-cpu-offload, which stock allows only with the precision-aware
# optimizer: Transformer Engine's FusedAdam).
# HF_MODEL: the HF folder (config.json, safetensors, tokenizer, preprocessor_config.json).
# DATA: an Energon conversation dataset (tools/make_energon_dataset --kind conversation).
# MIMO_PLAN_ONLY=1 prints the rank map and each rank's memory by the advisor's model (HF_MODEL
# defaults to the shipped config-only folder).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$HERE/../../../.."
NPROC=8
HF_MODEL="${HF_MODEL:-$HERE/qwen3_omni_30b_a3b_config}"
LAYOUT=(--hf-model "$HF_MODEL" --grid image:tp=1,dp=8@language --grid audio:tp=1,dp=8@language
        --grid language:tp=1,pp=1,dp=8,ep=8 --micro-batch-size 2 --colocated-encoder-recompute
        --optimizer-cpu-offload --use-precision-aware-optimizer)
source "$HERE/finetune_flags.sh"
if [ "${MIMO_PLAN_ONLY:-0}" = 1 ]; then
  exec python -m megatron_plugins.launch.plan --nproc-per-node "$NPROC" "${PLAN_FLAGS[@]}" \
    "${LAYOUT[@]}" "${TRAINING[@]}"
fi
: "${DATA:?set DATA to an Energon conversation dataset (tools/make_energon_dataset --kind conversation)}"
export CUDA_DEVICE_MAX_CONNECTIONS=1
exec torchrun --nproc-per-node "$NPROC" examples/mimo/pretrain_mimo.py \
  "${LAYOUT[@]}" "${TRAINING[@]}" "${DATA_FLAGS[@]}" "$@"
