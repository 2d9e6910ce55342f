"""Does a fused attention kernel skip a causal mask's upper triangle? (GPU only.)

    python benchmarks/flash_causal_skip.py

torch's flash ``scaled_dot_product_attention`` in bf16 (2 rows, 16 heads of 128), forward and
backward, with and without ``is_causal``, at three sequence lengths: the causal run's share of
the unmasked run's time, and each run's TFLOP/s counted on the whole score matrix (QK^T and PV,
backward 2.5x forward). Prints JSON: what docs/performance.md quotes for its ``FLASH`` kernel
convention (causal scores counted as ``L (L + 1) / 2`` pairs).
"""

from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

LENGTHS = (2048, 8192, 16384)
ROWS, HEADS, HEAD_DIM = 2, 16, 128
WARMUP, TIMED = 3, 10


def _milliseconds(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  causal: bool) -> float:
    """Mean time of one forward and backward."""
    def step() -> None:
        F.scaled_dot_product_attention(query, key, value, is_causal=causal).sum().backward()

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for _ in range(WARMUP):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(TIMED):
            step()
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / TIMED * 1e3


def main() -> None:
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for length in LENGTHS:
        query, key, value = (torch.randn(ROWS, HEADS, length, HEAD_DIM, device="cuda",
                                         dtype=torch.bfloat16, requires_grad=True)
                             for _ in range(3))
        whole_matrix = 4 * ROWS * HEADS * length * length * HEAD_DIM * 3.5
        row = {"L": length}
        for causal in (False, True):
            ms = _milliseconds(query, key, value, causal)
            row["causal" if causal else "full"] = {
                "ms": round(ms, 3), "TFLOPs_full_matrix": round(whole_matrix / ms / 1e9, 1)}
        row["causal/full time"] = round(row["causal"]["ms"] / row["full"]["ms"], 3)
        result["rows"].append(row)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
