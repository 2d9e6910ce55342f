#!/usr/bin/env bash
# Fine-tune a whole Qwen2.5-VL-7B(-Instruct) folder on 2 nodes x 8 GPUs, disjoint grids:
#   image (vision tower + merger)   ranks 0-3   tp=2 dp=2   (node 0)
#   language (mrope Qwen2.5-7B)     ranks 4-15  tp=2 dp=6   (node 0: 4-7, node 1: 8-15)
# Each tower replica serves three language replicas (fan-out 3); every TP pair stays inside a
# node. Run on every node with NODE_RANK and MASTER_ADDR set; HF_MODEL and DATA as in
# train_8gpu.sh. MIMO_PLAN_ONLY=1 prints the rank map.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$HERE/../../../.."
NNODES=2
NPROC=8
HF_MODEL="${HF_MODEL:-$HERE/qwen2_5_vl_7b_config}"
LAYOUT=(--hf-model "$HF_MODEL" --grid image:tp=2,dp=2 --grid language:tp=2,pp=1,dp=6)
source "$HERE/finetune_flags.sh"
TRAINING+=(--global-batch-size 96)
if [ "${MIMO_PLAN_ONLY:-0}" = 1 ]; then
  exec python -m megatron_plugins.launch.plan --nproc-per-node "$NPROC" --nnodes "$NNODES" --ranks \
    "${LAYOUT[@]}" "${TRAINING[@]}"
fi
: "${DATA:?set DATA to an Energon conversation dataset (tools/make_energon_dataset --kind conversation)}"
export CUDA_DEVICE_MAX_CONNECTIONS=1
exec torchrun --nnodes "$NNODES" --node-rank "${NODE_RANK:?set NODE_RANK}" \
  --nproc-per-node "$NPROC" --master-addr "${MASTER_ADDR:?set MASTER_ADDR}" \
  --master-port "${MASTER_PORT:-29500}" examples/mimo/pretrain_mimo.py \
  "${LAYOUT[@]}" "${TRAINING[@]}" "${DATA_FLAGS[@]}" "$@"
