#!/usr/bin/env bash
# Fine-tune a whole Qwen3.5-VL-27B folder on 2 nodes x 8 GPUs, the image encoder colocated on the
# language ranks of Bridge's reference language layout (16 GPUs instead of 17):
#   language (Gated DeltaNet + gated attn)  ranks 0-15  tp=4 pp=2 dp=2
#   image (vision tower + merger)           ranks 0-15  tp=8 dp=2, on the language ranks
# Every step the tower embeds the step's images on all 16 GPUs (each TP-8 group one node), then
# the language model's pipeline runs; --colocated-encoder-recompute keeps one microbatch of the
# tower's activations at a time.
# Run on every node with NODE_RANK (or under srun), MASTER_ADDR and MASTER_PORT set: one
# torchrun per node through torchrun_node.sh. HF_MODEL and DATA as in train_slurm.sbatch.
# MIMO_PLAN_ONLY=1 prints the plan and each rank's memory by the advisor's model.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$HERE/../../../.."
export NODE_SIZES=8,8
HF_MODEL="${HF_MODEL:-$HERE/qwen3_5_vl_27b_config}"
LAYOUT=(--hf-model "$HF_MODEL" --grid image:tp=8,dp=2@language --grid language:tp=4,pp=2,dp=2
        --colocated-encoder-recompute)
source "$HERE/finetune_flags.sh"
if [ "${MIMO_PLAN_ONLY:-0}" = 1 ]; then
  exec python -m megatron_plugins.launch.plan --nproc-per-node "$NODE_SIZES" "${PLAN_FLAGS[@]}" \
    "${LAYOUT[@]}" "${TRAINING[@]}"
fi
: "${DATA:?set DATA to an Energon conversation dataset (tools/make_energon_dataset --kind conversation)}"
export CUDA_DEVICE_MAX_CONNECTIONS=1
exec bash "$HERE/torchrun_node.sh" examples/mimo/pretrain_mimo.py \
  "${LAYOUT[@]}" "${TRAINING[@]}" "${DATA_FLAGS[@]}" "$@"
