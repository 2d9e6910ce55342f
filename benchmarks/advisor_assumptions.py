"""Measure on one GPU what the layout advisor assumes (megatron_plugins/performance/assumptions.py):
how much of the dense bf16 peak a transformer layer's matrix products reach at the per-rank widths
tensor parallelism leaves (the ``w / (w + knee)`` rule), and how long the host takes to launch a
layer's forward and backward when the GPU work is negligible (the per-layer launch floor).
Results are in docs/performance.md ("Advisor").

Run on a CUDA machine with plain PyTorch (no Megatron needed)::

    python benchmarks/advisor_assumptions.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

SHAPES = [
    # (label, tokens, hidden, ffn): a Qwen3.5-27B-like language layer and its vision tower.
    ("language", 2048, 5120, 17408),
    ("vision", 2304, 1152, 4304),
    ("vision, 1 image of 576 patches", 576, 1152, 4304),
]
TPS = (1, 2, 4, 8)


def _time(fn, repeats: int = 20, warmup: int = 3) -> float:
    """Mean seconds per call, timed with CUDA events after warm-up calls."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def gemm_efficiency(peak: float) -> list[dict]:
    """TFLOP/s of one layer's four products (QKV, output, MLP up, MLP down) per TP shard."""
    rows = []
    for label, tokens, hidden, ffn in SHAPES:
        for tp in TPS:
            if hidden % tp or ffn % tp:
                continue
            shapes = [(tokens, hidden, 3 * hidden // tp), (tokens, hidden // tp, hidden),
                      (tokens, hidden, ffn // tp), (tokens, ffn // tp, hidden)]
            flops = sum(2 * m * k * n for m, k, n in shapes)
            mats = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                     torch.randn(k, n, device="cuda", dtype=torch.bfloat16)) for m, k, n in shapes]
            seconds = _time(lambda: [a @ b for a, b in mats])
            rows.append({"shape": label, "tokens": tokens, "hidden": hidden, "tp": tp,
                         "width": hidden // tp, "tflops": flops / seconds / 1e12,
                         "efficiency": flops / seconds / 1e12 / peak})
    return rows


class Layer(torch.nn.Module):
    """A plain pre-norm transformer layer: what a Megatron layer launches, without TE's wrappers."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.fc1 = torch.nn.Linear(hidden, 4 * hidden)
        self.fc2 = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, hidden = x.shape[-2:]
        q, k, v = self.qkv(self.norm1(x)).view(1, tokens, 3, self.heads, -1).unbind(2)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                  v.transpose(1, 2))
        x = x + self.proj(attended.transpose(1, 2).reshape(1, tokens, hidden))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def launch_floor(layers: int = 32) -> dict:
    """Host seconds per layer of a forward and of a backward, at a size the GPU finishes at once."""
    stack = torch.nn.Sequential(*[Layer(64, 4) for _ in range(layers)]).cuda().to(torch.bfloat16)
    x = torch.randn(1, 16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(5):
        stack(x).sum().backward()
    torch.cuda.synchronize()
    repeats, forward, backward = 20, 0.0, 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        out = stack(x).sum()
        middle = time.perf_counter()
        out.backward()
        torch.cuda.synchronize()
        forward += middle - start
        backward += time.perf_counter() - middle
    return {"layers": layers, "forward_ms_per_layer": forward / repeats / layers * 1e3,
            "backward_ms_per_layer": backward / repeats / layers * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="Also write the results here.")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="Dense bf16 peak the efficiencies are relative to (H100 SXM).")
    args = parser.parse_args()
    properties = torch.cuda.get_device_properties(0)
    results = {"device": torch.cuda.get_device_name(0),
               "memory_gib": properties.total_memory / 1024 ** 3,
               "torch": torch.__version__, "peak_tflops": args.peak_tflops,
               "gemm": gemm_efficiency(args.peak_tflops), "launch": launch_floor()}
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
