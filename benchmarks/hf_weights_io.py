"""HF weights I/O against plain safetensors reading and writing of the same files.

    python benchmarks/hf_weights_io.py            # a ~100M-parameter Llama, fp32, one rank
    python benchmarks/hf_weights_io.py --smoke    # tiny, seconds (CI)

Import: ``load_hf_weights`` into a built stock GPT (one rank, CPU simulation) vs reading every
tensor of the same files into memory with ``safe_open(...).get_tensor``. Export: the streaming pieces of the
loaded model assembled and written as HF safetensors (``iter_hf_weights`` + ``assemble`` +
``tools.export_hf.write_folder``) vs ``save_file`` of the same tensors. Best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = {
    "smoke": dict(vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2),
    "default": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                    num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4),
}


def best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, one repeat")
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    repeats = 1 if options.smoke else options.repeats
    from megatron_plugins import cpu_simulation

    cpu_simulation.activate()
    import torch.distributed as dist
    from safetensors import safe_open
    from safetensors.torch import save_file

    from megatron_plugins.weights.hf_import import load_hf_weights
    from megatron_plugins.weights.language_families import FAMILIES
    from megatron_plugins.weights.streaming import assemble, iter_hf_weights
    from tests.hf_models import build_stock_gpt, save_tiny
    from tools.export_hf import write_folder

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    root = Path(tempfile.mkdtemp(prefix="hf-io-"))
    shape = SIZES["smoke" if options.smoke else "default"]
    folder = save_tiny("llama", root / "hf", max_position_embeddings=64, **shape)
    model, pgc, args = build_stock_gpt(str(folder), 1, 1, [])
    params = sum(p.numel() for p in model.parameters())
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))

    def plain_read() -> dict:
        with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
            # get_tensor maps the file lazily; clone() makes it read the bytes, as import does.
            return {name: handle.get_tensor(name).clone() for name in handle.keys()}

    tensors = plain_read()
    read_s = best(plain_read, repeats)
    import_s = best(lambda: load_hf_weights(model, str(folder), "--language-hf-weights", pgc,
                                            FAMILIES), repeats)
    save_s = best(lambda: save_file(tensors, str(root / "plain.safetensors")), repeats)
    export_s = best(lambda: write_folder(assemble(iter_hf_weights(
        model, FAMILIES[0], pgc, args.vocab_size)), root / "out", 5 * 10**9, None, False), repeats)
    print(f"model: Llama {shape}, {params / 1e6:.1f}M parameters (padded vocab "
          f"{args.padded_vocab_size}), {size / 1e6:.1f} MB fp32 safetensors; threads "
          f"{os.environ.get('OMP_NUM_THREADS', 'default')}; best of {repeats}")
    print(f"import  {import_s:8.3f} s   plain read  {read_s:8.3f} s   ratio {import_s / read_s:5.2f}")
    print(f"export  {export_s:8.3f} s   plain write {save_s:8.3f} s   ratio {export_s / save_s:5.2f}")


if __name__ == "__main__":
    main()
