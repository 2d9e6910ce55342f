# Shared by the Qwen2.5-VL recipes (sourced): fine-tuning flags. The model's shape, multimodal
# RoPE and image token come from --hf-model's config.json; the tower's min / max pixels from its
# preprocessor_config.json.
TRAINING=(--seq-length 4096 --pack-sequences
          --micro-batch-size 1 --global-batch-size 48 --train-iters 3000
          --lr 1e-5 --min-lr 1e-6 --lr-warmup-iters 100 --lr-decay-style cosine
          --weight-decay 0.1 --clip-grad 1.0 --bf16 --optimizer adam
          --use-distributed-optimizer --bf16-precision-aware-optimizer --overlap-grad-reduce
          --transformer-impl transformer_engine --log-interval 10
          --eval-interval 500 --eval-iters 10
          --save "${SAVE_DIR:-runs/qwen2_5_vl}/checkpoints" --save-interval 500
          --tensorboard-dir "${SAVE_DIR:-runs/qwen2_5_vl}/tensorboard")
DATA_FLAGS=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$HF_MODEL"
            --data-path "${DATA:-}" --num-workers 4)
