"""LoRA vs full fine-tuning: trainable parameters, optimizer bytes and memory per rank.

    python benchmarks/peft_memory.py [--rank 16] [--json PATH] [--skip-measured]

Part 1 (computed) counts the Qwen2.5-VL-7B recipe's parameters from its ``config.json``
(``examples/mimo/recipes/qwen2_5_vl/qwen2_5_vl_7b_config``: transformers builds the model on the
meta device, nothing is downloaded) and places them on the recipe's 8-GPU layout (image TP 2 x
DP 1, language TP 2 x DP 3): per rank, the trainable parameters, the optimizer's bytes and the
static memory (weights, gradient buffer and optimizer state; activations are the same either way
but for LoRA's rank-wide ones, and are left out), for stock bf16 training (bf16 weights, fp32
gradient buffer, fp32 master weights and Adam moments sharded over DP: 2 + 4 + 12/d bytes per
trainable parameter) and the recipe's precision-aware optimizer (2 + 2 + 8/d). A frozen weight
costs its 2 bytes and nothing else; LoRA's adapters are sharded as :mod:`megatron_plugins.peft.layers`
shards them (a column-parallel layer's ``A`` and a row-parallel layer's ``B`` whole on every TP
rank).

Part 2 (measured) trains a small MiMo model (vit + a 4-layer GPT) on the CPU simulation, one rank
per module, full fine-tuning and LoRA on both modules, and reads on every rank the trainable
parameters, the optimizer state's bytes (Adam moments), the DDP gradient buffer's bytes and the
process's peak resident memory. Results: docs/peft.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIG = REPO / "examples/mimo/recipes/qwen2_5_vl/qwen2_5_vl_7b_config/config.json"
LAYOUT = {"image": (2, 1), "language": (2, 3)}
"""The recipe's 8-GPU layout: module -> (TP, DP)."""
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv", "mlp.0")
"""HF linears Megatron fuses or keeps column parallel (their output split over TP)."""
FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "fc1", "up_proj": "fc1"}
"""HF linears Megatron fuses into one layer (one ``A`` for the fused output)."""


def _linears(model: Any, prefix: str) -> dict[str, tuple[int, int, bool]]:
    """Megatron's linears of one part: name -> (in, out, column parallel), fused as Megatron
    fuses them (q/k/v into linear_qkv, gate/up into linear_fc1)."""
    import torch

    found: dict[str, list] = {}
    for name, module in model.named_modules():
        if not name.startswith(prefix) or not isinstance(module, torch.nn.Linear):
            continue
        parent, _, leaf = name.rpartition(".")
        key = f"{parent}.{FUSED.get(leaf, leaf)}"
        column = leaf in COLUMN or name.endswith(COLUMN)
        entry = found.setdefault(key, [module.in_features, 0, column])
        entry[1] += module.out_features
    return {name: (i, o, c) for name, (i, o, c) in found.items()}


def computed(rank: int) -> dict[str, Any]:
    """Part 1: the recipe's shapes on its layout, full fine-tuning vs LoRA of ``rank``."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(CONFIG.parent)
    with torch.device("meta"):
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    parts = {"image": "model.visual.", "language": "model.language_model."}
    total = {part: sum(p.numel() for n, p in model.named_parameters()
                       if n.startswith(prefix) or (part == "language" and n == "lm_head.weight"))
             for part, prefix in parts.items()}
    result: dict[str, Any] = {"rank": rank, "modules": {}}
    for part, prefix in parts.items():
        tp, dp = LAYOUT[part]
        linears = _linears(model, prefix)
        replicated = sum(p.numel() for n, p in model.named_parameters()
                         if n.startswith(prefix) and p.dim() == 1)
        per_rank = (total[part] - replicated) / tp + replicated
        adapters = sum(rank * (i + o) for i, o, _ in linears.values())
        adapters_rank = sum(rank * i + rank * o / tp if column else rank * i / tp + rank * o
                            for i, o, column in linears.values())
        figures = {"parameters": total[part], "parameters_per_rank": per_rank,
                   "adapters": adapters, "adapters_per_rank": adapters_rank, "tp": tp, "dp": dp}
        for name, (weights, grads, state) in {"stock_bf16": (2, 4, 12),
                                              "precision_aware": (2, 2, 8)}.items():
            full = per_rank * (weights + grads + state / dp)
            lora = per_rank * weights + adapters_rank * (weights + grads + state / dp)
            figures[name] = {"full": {"optimizer_bytes": per_rank * state / dp,
                                      "static_bytes": full},
                             "lora": {"optimizer_bytes": adapters_rank * state / dp,
                                      "static_bytes": lora}}
        result["modules"][part] = figures
    return result


SMALL = ["--num-layers", "4", "--hidden-size", "512", "--ffn-hidden-size", "2048",
         "--num-attention-heads", "8", "--seq-length", "64", "--max-position-embeddings", "64",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
         "--lr", "1e-4", "--tokenizer-type", "NullTokenizer", "--vocab-size", "16384",
         "--untie-embeddings-and-output-weights", "--use-cpu-initialization",
         "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
         "--encoder", "vision=vit", "--grid", "vision:", "--grid", "language:", "--cpu-simulation"]
LORA = ["--lora", "language:rank=16,alpha=32", "--lora", "vision:rank=16,alpha=32"]


def measure_rank(argv: list[str]) -> dict[str, Any]:
    """One rank of a training run: its module's trainable parameters, optimizer state and
    gradient buffer bytes, peak resident memory."""
    import resource

    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    import megatron.training.training as training
    import torch

    from megatron_plugins.launch.pretrain import parse_mimo_args, train

    built: dict[str, Any] = {}
    stock = training.get_megatron_optimizer

    def capture(*args: Any, **kwargs: Any) -> Any:
        built["optimizer"] = stock(*args, **kwargs)
        return built["optimizer"]

    training.get_megatron_optimizer = capture

    def observe(session: Any) -> None:
        built["module"] = session.topology.active_modules[0]
        session.config.model.post_wrap_hooks.append(
            lambda chunks: built.setdefault("model", chunks[0]) and chunks)

    train(parse_mimo_args(argv), observe)
    model, module = built["model"], built["module"]
    part = model.language_model if module == "language" else model.modality_submodules[module]
    state = sum(t.numel() * t.element_size() for opt in built["optimizer"]._active_optimizers
                for values in opt.optimizer.state.values() for t in values.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)
    grads = sum(buffer.grad_data.numel() * buffer.grad_data.element_size()
                for buffer in getattr(part, "buffers", []))
    return {"module": module,
            "trainable": sum(p.numel() for p in part.parameters() if p.requires_grad),
            "parameters": sum(p.numel() for p in part.parameters()),
            "optimizer_bytes": state, "grad_buffer_bytes": grads,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def measured() -> dict[str, Any]:
    """Part 2: the small model, full fine-tuning and LoRA, on the CPU simulation."""
    from tests.harness.multiprocess import run_in_processes

    return {name: run_in_processes(measure_rank, 2, args=([*SMALL, *flags],), timeout=1200,
                                   simulated=True)
            for name, flags in (("full", []), ("lora", LORA))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip-measured", action="store_true")
    args = parser.parse_args()
    results = {"computed": computed(args.rank)}
    if not args.skip_measured:
        results["measured"] = measured()
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
