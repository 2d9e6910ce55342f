#!/usr/bin/env bash
# Fine-tune a whole Qwen3.5-VL-27B folder on 2 nodes x 8 GPUs, the image encoder colocated on the
# language ranks (the advisor's 16-GPU pick, docs/performance.md):
#   language (Gated DeltaNet + gated attn)  ranks 0-15  tp=4 pp=1 dp=4
#   image (vision tower + merger)           ranks 0-15  tp=4 dp=4, on the language ranks
# Every step the tower embeds the step's images on all 16 GPUs, then the language model runs;
# --colocated-encoder-recompute keeps one microbatch of the tower's activations at a time.
# Run on every node with NODE_RANK and MASTER_ADDR set (or through torchrun_node.sh with
# NODE_SIZES=8,8); HF_MODEL and DATA as in train_slurm.sbatch. MIMO_PLAN_ONLY=1 prints the plan.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$HERE/../../../.."
NNODES=2
NPROC=8
HF_MODEL="${HF_MODEL:-$HERE/qwen3_5_vl_27b_config}"
LAYOUT=(--hf-model "$HF_MODEL" --grid image:tp=4,dp=4@language --grid language:tp=4,pp=1,dp=4
        --colocated-encoder-recompute)
source "$HERE/finetune_flags.sh"
TRAINING+=(--micro-batch-size 2)
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
