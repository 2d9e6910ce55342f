# Shared by the Qwen3.5-VL recipes (sourced): fine-tuning flags. The model's shape (Gated DeltaNet
# and gated attention layers, multimodal RoPE, MTP) and image token come from --hf-model's
# config.json; the tower's min / max pixels from its preprocessor_config.json. Bridge's operating
# point: one image per sample, 4096-token rows, global batch 32. --transformer-impl local: the
# launch builds Gated DeltaNet layers from the local spec only (flash-linear-attention's kernels
# where installed; the precision-aware optimizer still needs Transformer Engine's FusedAdam).
TRAINING=(--seq-length 4096
          --micro-batch-size 1 --global-batch-size 32 --train-iters 2000
          --lr 1e-5 --min-lr 1e-6 --lr-warmup-iters 50 --lr-decay-style cosine
          --weight-decay 0.1 --clip-grad 1.0 --bf16 --optimizer adam
          --use-distributed-optimizer --bf16-precision-aware-optimizer --overlap-grad-reduce
          --transformer-impl local --log-interval 10
          --eval-interval 500 --eval-iters 10
          --save "${SAVE_DIR:-runs/qwen3_5_vl}/checkpoints" --save-interval 500
          --tensorboard-dir "${SAVE_DIR:-runs/qwen3_5_vl}/tensorboard")
DATA_FLAGS=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$HF_MODEL"
            --data-path "${DATA:-}" --num-workers 4)
# MIMO_PLAN_ONLY=1: the rank map and each rank's memory by the advisor's model on MIMO_PLAN_GPU,
# for Bridge's data (one 768x768 image per sample: 576 positions).
PLAN_FLAGS=(--ranks --gpu "${MIMO_PLAN_GPU:-h100-sxm}" --advise-items-per-sample image=1
            --advise-item-tokens image=576)
