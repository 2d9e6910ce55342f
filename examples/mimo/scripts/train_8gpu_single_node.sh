#!/usr/bin/env bash
# 8 GPUs, one node. Layout (ranks in order):
#   vision encoder (ViT, TE spec)  ranks 0-3  tp=1 dp=4   -> 4 GPUs
#   language model (GPT, TE spec)  ranks 4-7  tp=2 dp=2   -> 4 GPUs
# Each language DP replica receives the outputs of two vision DP replicas (fan-in 2).
# bf16 with the precision-aware optimizer (bf16 grads and Adam moments, fp32 masters),
# distributed optimizer, mock multimodal data. MIMO_PLAN_ONLY=1 prints the rank map instead.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
NPROC=8
LAYOUT=(--encoder vision=vit --grid vision:tp=1,dp=4 --grid language:tp=2,pp=1,dp=2)
MODEL=(--num-layers 24 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16
       --seq-length 2048 --max-position-embeddings 2048 --position-embedding-type rope
       --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights
       --vit-num-layers 24 --vit-hidden-size 1024 --vit-num-attention-heads 16
       --vit-img-size 448 --vit-patch-size 14
       --tokenizer-type NullTokenizer --vocab-size 32000 --transformer-impl transformer_engine)
TRAINING=(--micro-batch-size 2 --global-batch-size 96 --train-iters 2000
          --lr 2e-4 --min-lr 2e-5 --lr-warmup-iters 100 --lr-decay-style cosine
          --weight-decay 0.1 --clip-grad 1.0 --bf16 --optimizer adam
          --use-distributed-optimizer --bf16-precision-aware-optimizer
          --overlap-grad-reduce --log-interval 10 --eval-interval 500 --eval-iters 10
          --save "${SAVE_DIR:-runs/mimo-8gpu}/checkpoints" --save-interval 500
          --tensorboard-dir "${SAVE_DIR:-runs/mimo-8gpu}/tensorboard")
if [ "${MIMO_PLAN_ONLY:-0}" = 1 ]; then
  exec python -m megatron_plugins.launch.plan --nproc-per-node "$NPROC" --ranks \
    "${LAYOUT[@]}" "${MODEL[@]}" "${TRAINING[@]}"
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1
exec torchrun --nproc-per-node "$NPROC" examples/mimo/pretrain_mimo.py \
  "${LAYOUT[@]}" "${MODEL[@]}" "${TRAINING[@]}" "$@"
