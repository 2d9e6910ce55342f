"""HF weights I/O against plain reading and writing of the same bytes.

    python benchmarks/hf_weights_io.py             # a ~100M-parameter Llama, fp32, one rank
    python benchmarks/hf_weights_io.py --smoke     # tiny, seconds
    python benchmarks/hf_weights_io.py --whole-vlm # a ~100M-parameter Qwen2.5-VL folder, whole

One rank on the CPU simulation, one torch thread, warm page cache. Three measurements, each
against its plain-I/O floor:

- import: ``load_hf_weights`` into a built stock GPT vs ``safe_open(...).get_tensor(...).clone()``
  of every tensor of the same file;
- export: the model's streaming pieces assembled and written (``iter_hf_weights`` + ``assemble``
  + ``tools.export_hf.write_folder``) vs ``save_file`` of the same tensors;
- tool: ``tools.export_hf.export`` of a torch_dist checkpoint of that model vs reading every byte
  of the checkpoint's files plus ``save_file`` of the HF tensors (the I/O floor), and vs
  megatron-core's own ``dist_checkpointing.load`` of the whole checkpoint plus ``save_file``.

``--whole-vlm`` measures what ``--hf-model`` reads instead: a whole Qwen2.5-VL folder's vision
tower + merger (into the encoder and its projection) and language model (mrope), each part
through its own family as the ranks holding it do, vs reading every tensor of the folder.

Each round times every step twice, in mirrored order (import, read, read, import, export, write,
...), and takes the mean of the two, so a burst of load from other jobs, or a slow first step,
hits both sides of a ratio alike; a ratio is the median of ``--rounds`` rounds' ratios. Before
each step (untimed) the previous outputs are deleted and ``os.sync()`` flushes dirty pages, so no
write pays for another's writeback; the setup's Python objects (megatron-core, transformers, the
model) are frozen out of the garbage collector, whose full pass over them took 0.3 s.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import shutil
import statistics
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

VISION_SIZES = {
    "smoke": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                  fullatt_block_indexes=[1]),
    "default": dict(depth=8, hidden_size=512, intermediate_size=1376, num_heads=8,
                    fullatt_block_indexes=[3, 7]),
}
"""Qwen2.5-VL vision towers for ``--whole-vlm`` (patch 14, merge 2, window 112 as the 7B's)."""

MIRRORED = ("import", "read", "read", "import", "export", "write", "write", "export",
            "tool", "read checkpoint", "load checkpoint", "load checkpoint", "read checkpoint",
            "tool")
"""Every step twice per round, each comparison in ABBA order; ``write`` serves two ratios."""


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def read_bytes(folder: Path) -> int:
    """Every byte of every file under ``folder``, read once: the floor of reading it."""
    return sum(len(path.read_bytes()) for path in folder.rglob("*") if path.is_file())


def load_checkpoint(folder: Path) -> dict:
    """Every tensor of a torch_dist checkpoint in one ``dist_checkpointing.load``."""
    from megatron.core import dist_checkpointing

    metadata = dist_checkpointing.load_tensors_metadata(str(folder))
    return dist_checkpointing.load(metadata, str(folder), validate_access_integrity=False)


def whole_vlm(size: str, rounds: int, root: Path) -> None:
    """Import of a whole Qwen2.5-VL folder (tower + merger, language model) vs plain read."""
    import dataclasses

    import transformers
    from megatron.core.transformer.spec_utils import build_module
    from safetensors import safe_open

    from megatron_plugins.weights.encoder_view import EncoderView
    from megatron_plugins.weights.hf_import import load_hf_weights
    from megatron_plugins.weights.language_families import FAMILIES
    from tests.models.hf import build_stock_gpt
    from tests.models.hf_vision import language_config, plugin

    text = {**SIZES[size], "max_position_embeddings": 64,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                # frequency pairs (t, h, w): half the head dim, 64 or 16
                                "mrope_section": [8, 12, 12] if size == "default"
                                else [2, 3, 3]}}
    hidden = text["hidden_size"]
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, image_token_id=text["vocab_size"] - 1,
        vision_config={**VISION_SIZES[size], "out_hidden_size": hidden, "patch_size": 14,
                       "spatial_merge_size": 2, "window_size": 112})
    folder = root / "qwen2_5_vl"
    transformers.Qwen2_5_VLForConditionalGeneration(config).save_pretrained(folder)
    language, pgc, _ = build_stock_gpt(str(folder), 1, 1, [])
    encoder = plugin("qwen2_5_vl", folder)
    vision = encoder.transformer_config(dataclasses.replace(language_config(),
                                                            hidden_size=hidden))
    view = EncoderView(build_module(encoder.encoder_spec(vision, pgc)),
                       build_module(encoder.projection_spec(vision, hidden, pgc)))
    files = sorted(folder.glob("*.safetensors"))

    def import_whole() -> None:
        load_hf_weights(view, str(folder), "--hf-model", pgc, (encoder.hf_family,))
        load_hf_weights(language, str(folder), "--hf-model", pgc, FAMILIES)

    def plain_read() -> dict:
        tensors = {}
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                tensors.update({name: handle.get_tensor(name).clone() for name in handle.keys()})
        return tensors

    params = sum(p.numel() for module in (language, view) for p in module.parameters())
    size_mb = sum(f.stat().st_size for f in files) / 1e6
    gc.collect()
    gc.freeze()
    ratios, imports, reads = [], [], []
    for _ in range(rounds):
        first = seconds(import_whole)
        read = seconds(plain_read) + seconds(plain_read)
        second = seconds(import_whole)
        imports.append((first + second) / 2)
        reads.append(read / 2)
        ratios.append(imports[-1] / reads[-1])
    print(f"model: Qwen2.5-VL (tower {VISION_SIZES[size]}, language {SIZES[size]}), "
          f"{params / 1e6:.1f}M parameters, {size_mb:.1f} MB fp32 safetensors; 1 thread; median "
          f"of {rounds} mirrored rounds; load average {os.getloadavg()[0]:.1f}")
    print(f"whole  {statistics.median(imports):7.3f} s   {'plain read':18s} "
          f"{statistics.median(reads):7.3f} s   ratio {statistics.median(ratios):5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, one round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--whole-vlm", action="store_true",
                        help="a whole Qwen2.5-VL folder's import (--hf-model) instead")
    options = parser.parse_args()
    rounds = 1 if options.smoke else options.rounds
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from safetensors import safe_open
    from safetensors.torch import save_file

    from megatron_plugins.weights.hf_import import load_hf_weights
    from megatron_plugins.weights.language_families import FAMILIES
    from megatron_plugins.weights.streaming import assemble, iter_hf_weights
    from tests.models.hf import build_stock_gpt, save_tiny
    from tools.export_hf import export, write_folder

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    root = Path(tempfile.mkdtemp(prefix="hf-io-"))
    atexit.register(shutil.rmtree, root, True)  # over 1 GB per run at the default size
    shape = SIZES["smoke" if options.smoke else "default"]
    if options.whole_vlm:
        whole_vlm("smoke" if options.smoke else "default", rounds, root)
        return
    folder = save_tiny("llama", root / "hf", max_position_embeddings=64, **shape)
    model, pgc, args = build_stock_gpt(str(folder), 1, 1, [])
    family = load_hf_weights(model, str(folder), "--language-hf-weights", pgc, FAMILIES)
    checkpoint = root / "checkpoint"
    checkpoint.mkdir()
    state = model.sharded_state_dict(prefix="language_model.")
    state["args"] = args
    dist_checkpointing.save(state, str(checkpoint))
    params = sum(p.numel() for p in model.parameters())
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))

    def plain_read() -> dict:
        with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
            # get_tensor maps the file lazily; clone() makes it read the bytes, as import does.
            return {name: handle.get_tensor(name).clone() for name in handle.keys()}

    tensors = plain_read()
    out = root / "out"
    steps: dict[str, Callable[[], object]] = {
        "import": lambda: load_hf_weights(model, str(folder), "--language-hf-weights", pgc,
                                          FAMILIES),
        "read": plain_read,
        "export": lambda: write_folder(assemble(iter_hf_weights(model, family, pgc,
                                                                args.vocab_size)),
                                       out, 5 * 10**9, None, False),
        "write": lambda: save_file(tensors, str(out / "model.safetensors")),
        "tool": lambda: export(checkpoint, out, language_family=family.name, progress=False),
        "read checkpoint": lambda: read_bytes(checkpoint),
        "load checkpoint": lambda: load_checkpoint(checkpoint),
    }
    gc.collect()
    gc.freeze()  # the setup's objects: a full collection in a timed step would walk them all
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        elapsed = dict.fromkeys(steps, 0.0)
        for name in MIRRORED:
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            os.sync()
            elapsed[name] += seconds(steps[name]) / 2
        for name, value in elapsed.items():
            times[name].append(value)
    checkpoint_mb = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file()) / 1e6
    print(f"model: Llama {shape}, {params / 1e6:.1f}M parameters, {size / 1e6:.1f} MB fp32 "
          f"safetensors, {checkpoint_mb:.1f} MB torch_dist checkpoint; 1 thread; median of "
          f"{rounds} mirrored rounds; load average {os.getloadavg()[0]:.1f}")
    rows = (("import", ["read"], "plain read"), ("export", ["write"], "plain write"),
            ("tool", ["read checkpoint", "write"], "read ckpt + write"),
            ("tool", ["load checkpoint", "write"], "mcore load + write"))
    for name, floor, label in rows:
        ratios = [times[name][i] / sum(times[f][i] for f in floor) for i in range(rounds)]
        print(f"{name:6s} {statistics.median(times[name]):7.3f} s   {label:18s} "
              f"{statistics.median(sum(times[f][i] for f in floor) for i in range(rounds)):7.3f} s"
              f"   ratio {statistics.median(ratios):5.2f}")


if __name__ == "__main__":
    main()
