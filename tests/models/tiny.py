"""The tiny transformer every multi-process test trains, as stock Megatron flags."""

TINY_TRANSFORMER = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
    "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "20",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--make-vocab-size-divisible-by", "1", "--transformer-impl", "local",
    "--use-cpu-initialization", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
    "--log-interval", "1", "--eval-iters", "1", "--seed", "1234",
    "--distributed-backend", "gloo", "--num-workers", "0", "--cpu-simulation",
]
"""fp32 on CPU (CPU initialization, no dropout, no fused kernels): runs are bit-reproducible."""
