# The one-GPU MiMo both GPU benchmarks launch: a colocated MiMo (the ViT on the language model's
# rank) in bf16, the whole step on one device; sourced by gpu_mimo_measured.sh and
# gpu_lora_measured.sh.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" CUDA_DEVICE_MAX_CONNECTIONS=1
model=(--encoder vision=vit --grid vision:dp=1@language --grid language:dp=1
  --num-layers 16 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 5632 --swiglu
  --normalization RMSNorm --disable-bias-linear --position-embedding-type rope
  --untie-embeddings-and-output-weights --seq-length 2048 --max-position-embeddings 2048
  --vocab-size 32000 --vit-num-layers 24 --vit-hidden-size 1024 --vit-num-attention-heads 16
  --vit-img-size 336 --vit-patch-size 14 --mock-items-per-sample 1 --micro-batch-size 2
  --global-batch-size 8
  --lr 1e-4 --bf16 --use-distributed-optimizer --transformer-impl local
  --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-persist-layer-norm
  --no-rope-fusion
  --attention-dropout 0 --hidden-dropout 0 --eval-iters 0 --log-interval 2 --train-iters 12)
launch() { timeout 200 python3 -m torch.distributed.run --nproc-per-node 1 examples/mimo/pretrain_mimo.py "$@"; }
