#!/usr/bin/env bash
# 2 nodes x 8 GPUs = 16 ranks. Run on every node with NODE_RANK and MASTER_ADDR set.
# Layout (ranks in order):
#   vision encoder (ViT, TE spec)  ranks 0-7   tp=2 dp=4        -> 8 GPUs (node 0)
#   language model (GPT, TE spec)  ranks 8-15  tp=4 pp=2 dp=1   -> 8 GPUs (node 1)
# Four vision DP replicas fan in to the language model's one; bf16 with the precision-aware
# optimizer. MIMO_PLAN_ONLY=1 prints the rank map instead.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
NNODES=2
NPROC=8
LAYOUT=(--encoder vision=vit --grid vision:tp=2,dp=4 --grid language:tp=4,pp=2,dp=1)
MODEL=(--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
       --group-query-attention --num-query-groups 8
       --seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope
       --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights
       --vit-num-layers 24 --vit-hidden-size 1024 --vit-num-attention-heads 16
       --vit-img-size 448 --vit-patch-size 14
       --tokenizer-type NullTokenizer --vocab-size 128000 --transformer-impl transformer_engine)
TRAINING=(--micro-batch-size 4 --global-batch-size 128 --train-iters 5000
          --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 200 --lr-decay-style cosine
          --weight-decay 0.1 --clip-grad 1.0 --bf16 --optimizer adam
          --use-distributed-optimizer --bf16-precision-aware-optimizer
          --overlap-grad-reduce --log-interval 10 --eval-interval 1000 --eval-iters 10
          --save "${SAVE_DIR:-runs/mimo-multinode}/checkpoints" --save-interval 1000
          --tensorboard-dir "${SAVE_DIR:-runs/mimo-multinode}/tensorboard")
if [ "${MIMO_PLAN_ONLY:-0}" = 1 ]; then
  exec python -m megatron_plugins.launch.plan --nproc-per-node "$NPROC" --nnodes "$NNODES" --ranks \
    "${LAYOUT[@]}" "${MODEL[@]}" "${TRAINING[@]}"
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1
exec torchrun --nnodes "$NNODES" --node-rank "${NODE_RANK:?set NODE_RANK}" \
  --nproc-per-node "$NPROC" --master-addr "${MASTER_ADDR:?set MASTER_ADDR}" \
  --master-port "${MASTER_PORT:-29500}" examples/mimo/pretrain_mimo.py \
  "${LAYOUT[@]}" "${MODEL[@]}" "${TRAINING[@]}" "$@"
