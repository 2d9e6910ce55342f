#!/usr/bin/env bash
# The Qwen2.5-VL recipe on the CPU simulation: a whole Qwen2.5-VL folder (e.g. a tiny one a test
# saved) trained with --hf-model for a few steps on the mock data, images of native, varied sizes
# (0 to 3 per sample). The folder's config.json sets the model's shape, multimodal RoPE and image
# token; its preprocessor_config.json the tower's pixel range. Usage:
#   bash examples/mimo/recipes/qwen2_5_vl/cpu_simulation.sh HF_MODEL_DIR [extra flags...]
# Writes TensorBoard logs and a checkpoint under runs/qwen2_5_vl_cpu/ (or $MIMO_RUN_DIR).
# MIMO_GRIDS replaces the --grid flags (another recipe's twin: its modules and layout).
set -euo pipefail
hf_model="${1:?usage: cpu_simulation.sh HF_MODEL_DIR [extra flags...]}"
shift
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../.." && pwd)"
bash "$root/scripts/setup_env.sh"
out="${MIMO_RUN_DIR:-$root/runs/qwen2_5_vl_cpu}"
rm -rf "$out"
python="$root/.venv/bin/python"
cd "$root"
exec "$python" -m torch.distributed.run --standalone --nproc-per-node 2 \
  examples/mimo/pretrain_mimo.py --cpu-simulation \
  --hf-model "$hf_model" ${MIMO_GRIDS:---grid image:dp=1 --grid language:dp=1} \
  --tokenizer-type NullTokenizer --make-vocab-size-divisible-by 1 \
  --transformer-impl local --use-cpu-initialization \
  --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-swiglu-fusion \
  --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm \
  --attention-dropout 0 --hidden-dropout 0 \
  --seq-length 96 --mock-items-per-sample 0:3 \
  --micro-batch-size 2 --global-batch-size 4 --train-iters 8 \
  --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 1 --lr-decay-style cosine --clip-grad 1.0 \
  --log-interval 1 --eval-interval 8 --eval-iters 1 --seed 1234 \
  --distributed-backend gloo --num-workers 0 \
  --tensorboard-dir "$out/tensorboard" --save "$out/checkpoints" --save-interval 8 \
  "$@"
