# Shared by the Qwen3-Omni recipes (sourced): fine-tuning flags for the thinker. The model's shape
# (48-layer MoE language model, 128 experts of which 8 per token; the AuT audio tower; the vision
# tower with DeepStack), TMRoPE and token ids come from --hf-model's config.json; the towers'
# pixel range and log-mel settings from its preprocessor_config.json. This recipe's data: one
# image (576 positions) and one 20-s clip (260) per 4096-token row, global batch 32 (an assumption
# for the plan, not Megatron-Bridge's operating point, which it does not publish with the presets).
TRAINING=(--seq-length 4096 --global-batch-size 32 --train-iters 2000
          --lr 1e-5 --min-lr 1e-6 --lr-warmup-iters 50 --lr-decay-style cosine
          --weight-decay 0.1 --clip-grad 1.0 --bf16 --optimizer adam
          --use-distributed-optimizer --overlap-grad-reduce --log-throughput
          --log-interval 10 --eval-interval 500 --eval-iters 10
          --save "${SAVE_DIR:-runs/qwen3_omni}/checkpoints" --save-interval 500
          --tensorboard-dir "${SAVE_DIR:-runs/qwen3_omni}/tensorboard")
DATA_FLAGS=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$HF_MODEL"
            --data-path "${DATA:-}" --num-workers 4)
# MIMO_PLAN_ONLY=1: the rank map and each rank's memory by the advisor's model on MIMO_PLAN_GPU,
# for this recipe's data (the clip's positions counted by AuT's own formula: 13 per second).
PLAN_FLAGS=(--ranks --gpu "${MIMO_PLAN_GPU:-h100-sxm}"
            --advise-items-per-sample image=1 --advise-item-tokens image=576
            --advise-items-per-sample audio=1 --advise-clip-seconds audio=20)
