#!/usr/bin/env bash
# The README's main command: a small MiMo model (ViT encoder + GPT language model) trained on
# disjoint grids (vision on rank 0, language data-parallel on ranks 1-2) through Megatron's stock
# pretrain(), on the CPU simulation with mock data. Writes TensorBoard logs and a checkpoint
# under runs/default/ (or $MIMO_RUN_DIR). Extra arguments are appended to the flags below.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
out="${MIMO_RUN_DIR:-$root/runs/default}"
rm -rf "$out"
python="$root/.venv/bin/python"
cd "$root"
exec "$python" -m torch.distributed.run --standalone --nproc-per-node 3 \
  examples/mimo/pretrain_mimo.py --cpu-simulation \
  --encoder vision=vit --grid vision:tp=1,dp=1 --grid language:tp=1,pp=1,dp=2 \
  --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 \
  --seq-length 32 --max-position-embeddings 32 --vocab-size 128 --tokenizer-type NullTokenizer \
  --make-vocab-size-divisible-by 1 --transformer-impl local --use-cpu-initialization \
  --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion \
  --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm \
  --attention-dropout 0 --hidden-dropout 0 \
  --micro-batch-size 2 --global-batch-size 8 --train-iters 60 \
  --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 5 --lr-decay-style cosine --clip-grad 1.0 \
  --log-interval 5 --eval-interval 30 --eval-iters 2 --seed 1234 \
  --distributed-backend gloo --num-workers 0 \
  --tensorboard-dir "$out/tensorboard" --save "$out/checkpoints" --save-interval 1000 \
  "$@"
