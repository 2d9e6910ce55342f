"""Tiny random HF causal LMs on disk and their reference logits, for the HF weights tests.

Models are made offline from configs and saved with safetensors. Every weight, norms included, is
redrawn so a mapping that swaps or misses a tensor changes the logits.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-6, tie_word_embeddings=False)
FAMILY_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 24, "norm_topk_prob": True}),
}
TOKENS = torch.tensor([[3, 17, 42, 99, 5, 8, 61, 23, 0, 77, 12, 34],
                       [50, 1, 2, 98, 44, 31, 7, 7, 64, 19, 88, 26]])


def save_tiny(family: str, folder: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32,
              **overrides: Any) -> Path:
    """A tiny random ``family`` model saved to ``folder`` (safetensors, config.json)."""
    import transformers

    config_name, model_name, extra = FAMILY_CLASSES[family]
    config = getattr(transformers, config_name)(**{**SHAPE, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
    model.to(dtype).save_pretrained(folder)
    return Path(folder)


def hf_logits(folder: str | Path, tokens: torch.Tensor = TOKENS) -> np.ndarray:
    """transformers' own forward of the saved model, fp32."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(tokens).logits.float().numpy()


def rel_diff(got: np.ndarray, want: np.ndarray) -> float:
    """Max absolute difference relative to the largest reference magnitude."""
    return float(np.abs(got - want).max() / np.abs(want).max())


def stock_args(argv: list[str]) -> Any:
    """Stock Megatron args for ``argv`` plus ``--language-hf-weights``' shape (nothing given
    contradicts it here), validated."""
    from megatron.training.arguments import parse_args, validate_args

    from megatron_plugins.weights.flags import add_weights_args, apply_language_config

    saved, sys.argv = sys.argv, ["test", *argv]
    try:
        args = parse_args(add_weights_args)
    finally:
        sys.argv = saved
    apply_language_config(args, lambda attr: None)
    validate_args(args)
    return args


BASE_FLAGS = ["--seq-length", "12", "--micro-batch-size", "2", "--global-batch-size", "2",
              "--lr", "1e-3", "--tokenizer-type", "NullTokenizer", "--transformer-impl", "local",
              "--use-cpu-initialization", "--attention-dropout", "0", "--hidden-dropout", "0",
              "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
              "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
              "--no-bias-swiglu-fusion", "--distributed-backend", "gloo", "--seed", "1234"]
"""Stock flags for a stock GPT built from a HF folder: no shape flag (config.json gives them)."""


def stock_gpt_rank(folder: str, tp: int, pp: int, extra: list[str]) -> dict[str, Any]:
    """One rank of a stock GPT (TP x PP) built by our language builder from ``folder``'s config,
    HF weights imported; returns the full-vocabulary logits on the last stage."""
    from megatron_plugins import cpu_simulation

    cpu_simulation.activate()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
    from megatron.training.global_vars import set_global_variables

    from megatron_plugins.language import StockLanguageModel, language_config_from_args
    from megatron_plugins.weights.hf_import import load_hf_weights
    from megatron_plugins.weights.language_families import FAMILIES

    args = stock_args([*BASE_FLAGS, "--tensor-model-parallel-size", str(tp),
                       "--pipeline-model-parallel-size", str(pp),
                       "--language-hf-weights", folder, *extra])
    args.padded_vocab_size = vocab_size_with_padding(args.vocab_size, args, logging_enabled=False)
    set_global_variables(args, build_tokenizer=False)
    parallel_state.initialize_model_parallel(tp, pp)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    config = language_config_from_args(args)
    model = StockLanguageModel(config.transformer, config, pgc, args.seq_length)
    family = load_hf_weights(model, folder, "--language-hf-weights", pgc, FAMILIES)
    logits = forward_logits(model, pgc, TOKENS)
    return {"family": family.name, "logits": logits, "padded_vocab": args.padded_vocab_size}


def forward_logits(model: Any, pgc: Any, tokens: torch.Tensor) -> np.ndarray | None:
    """The language model's logits over its TP x PP ranks (hidden states sent stage to stage);
    the full padded vocabulary on the last stage, None elsewhere."""
    import torch.distributed as dist

    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    pp_rank, pp_size = pgc.pp.rank(), pgc.pp.size()
    ranks = dist.get_process_group_ranks(pgc.pp)
    hidden_shape = (tokens.shape[1], tokens.shape[0], model.config.hidden_size)
    with torch.no_grad():
        if pp_rank > 0:
            received = torch.empty(hidden_shape)
            dist.recv(received, src=ranks[pp_rank - 1], group=pgc.pp)
            model.set_input_tensor(received)
        output = model(tokens, positions, None)
        if pp_rank < pp_size - 1:
            dist.send(output.contiguous(), dst=ranks[pp_rank + 1], group=pgc.pp)
            return None
    shards = [torch.empty_like(output) for _ in range(pgc.tp.size())]
    dist.all_gather(shards, output.contiguous(), group=pgc.tp)
    return torch.cat(shards, dim=-1).float().numpy()


MIMO_FLAGS = [*BASE_FLAGS, "--global-batch-size", "4", "--train-iters", "4", "--eval-interval",
              "2", "--eval-iters", "1", "--log-interval", "1", "--min-lr", "1e-4",
              "--lr-decay-style", "cosine", "--num-workers", "0", "--cpu-simulation",
              "--encoder", "vision=vit", "--grid", "vision:dp=1"]
"""A ViT on rank 0, the language model (``--grid language:...``) after it; no shape flags."""


def unwrap(module: Any) -> Any:
    """The module inside DDP / precision wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


def mimo_language_rank(argv: list[str]) -> dict[str, Any]:
    """Build one rank of a MiMo model through the entry point's code path (HF weights loaded by
    the builder) and return the language model's logits on its last stage."""
    from megatron_plugins import cpu_simulation

    cpu_simulation.activate()
    from megatron_plugins import megatron_compat
    from megatron_plugins.launch import parse_mimo_args, start

    megatron_compat.install()
    session = start(parse_mimo_args(argv))
    try:
        builder = session.config.model.get_builder_cls()(session.config.model)
        [mimo] = builder.build_distributed_models(wrap_with_ddp=False)
        [module] = session.topology.active_modules
        if module != "language":
            return {"module": module}
        pgc = session.topology.module_pgs[module]
        logits = forward_logits(unwrap(mimo.language_model), pgc, TOKENS)
        return {"module": module, "logits": logits}
    finally:
        session.close()


def mimo_logits(nproc: int, folder: str, language_grid: str, extra: tuple[str, ...] = ()
                ) -> list[np.ndarray]:
    """Logits of every language last-stage rank of a MiMo run built from ``folder``."""
    from tests.multiprocess import run_in_processes

    argv = [*MIMO_FLAGS, "--grid", language_grid, "--language-hf-weights", folder, *extra]
    results = run_in_processes(mimo_language_rank, nproc, args=(argv,), timeout=120)
    return [r["logits"] for r in results if r.get("logits") is not None]
