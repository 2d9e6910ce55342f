"""What real data costs a MiMo step on the CPU simulation: Energon loading against mock samples.

    python benchmarks/data_throughput.py [--steps 40] [--workers 2] [--out-dir runs/data-throughput]
    python benchmarks/data_throughput.py --smoke          # a few steps, for CI

On the README's generated image + audio + caption set (300 samples, made on the fly) it reports

(a) the loader alone, in this process, on each kind of rank (language: tokenize text; vision:
    decode + resize + normalize images; audio: decode + log-mel), samples/s with ``--workers``
    Energon worker processes, against the mock source on the same rank kind;
(b) the median training step of the same MiMo model (ViT on rank 0, GPT on rank 1, 4
    microbatches per step, never more training processes than cores) reading the mock data and
    reading the Energon dataset with ``--workers`` workers, and their ratio.

Writes ``data_throughput.json`` / ``.md`` in ``--out-dir``. Timings on a shared machine are
noisy: the load average is recorded beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.step_overhead import LANGUAGE_MODEL  # noqa: E402

MIMO = ["--encoder", "vision=vit", "--grid", "vision:dp=1", "--grid", "language:dp=1"]
STEP_TIME = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")


def _dataset(root: Path) -> Path:
    from tools.make_synthetic_dataset import make_synthetic, prepare

    make_synthetic(root, 300, "image_audio_caption", seed=0)
    prepare(root, "image_audio_caption", seed=0, quiet=True)
    return root


def _sources(root: Path, workers: int) -> tuple[Any, Any, Any]:
    """The mock and Energon sources of the benchmark model, and its layout."""
    from megatron_plugins.data.sources import build_source
    from megatron_plugins.encoders.audio import AudioFrameEncoder
    from megatron_plugins.encoders.vit import ViTEncoder
    from megatron_plugins.parallel.layout import LANGUAGE, ModulePlacement, ParallelLayout

    layout = ParallelLayout((
        ModulePlacement(name="vision", tp=1, pp=1, cp=1, dp=1, rank_offset=0, provider="vit"),
        ModulePlacement(name="audio", tp=1, pp=1, cp=1, dp=1, rank_offset=1, provider="audio"),
        ModulePlacement(name=LANGUAGE, tp=1, pp=1, cp=1, dp=1, rank_offset=2),
    ))
    parser = argparse.ArgumentParser()
    ViTEncoder.add_arguments(parser)
    AudioFrameEncoder.add_arguments(parser)
    args = parser.parse_args([])
    common = dict(seed=1234, seq_length=32, num_workers=workers, global_batch_size=8,
                  micro_batch_size=2, eval_iters=0, eval_interval=0, rampup_batch_size=None,
                  special_tokens=None, padded_vocab_size=None,
                  position_embedding_type="learned_absolute")
    plugins = {"vision": ViTEncoder("vision", args, layout.module("vision")),
               "audio": AudioFrameEncoder("audio", args, layout.module("audio"))}
    mock = build_source(SimpleNamespace(**vars(args), **common, data_path=None, vocab_size=128),
                        plugins)
    energon = build_source(SimpleNamespace(
        **vars(args), **common, data_path=[str(root / "energon")], vocab_size=None,
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(root / "tokenizer")), plugins)
    return mock, energon, layout


def loader_rates(root: Path, workers: int, microbatches: int) -> dict[str, dict[str, float]]:
    """Samples/s of each source's stream on each rank kind (first microbatch excluded)."""
    from megatron_plugins.data.addressing import RankSlice

    mock, energon, layout = _sources(root, workers)
    rates: dict[str, dict[str, float]] = {}
    for module in ("language", "vision", "audio"):
        this = RankSlice.of(layout, module, 0, 2)
        for name, source in (("mock", mock), ("energon", energon)):
            stream = source.open("train", this, 0, None)
            next(stream)
            start = time.perf_counter()
            for _ in range(microbatches):
                next(stream)
            rates.setdefault(module, {})[name] = this.batch * microbatches / (
                time.perf_counter() - start)
    return rates


def step_times(extra: list[str], steps: int, out: Path) -> list[float]:
    """Per-iteration times (ms) of a 2-rank MiMo run, read from stock's log lines."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(29500 + os.getpid() % 1000),
            str(ROOT / "examples" / "mimo" / "pretrain_mimo.py"), *LANGUAGE_MODEL, *MIMO,
            "--train-iters", str(steps), "--log-interval", "1", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out.write_text(log.stdout + log.stderr)
    if log.returncode != 0:
        raise RuntimeError(f"training run failed (exit {log.returncode}); log in {out}")
    return [float(ms) for _, ms in STEP_TIME.findall(log.stdout + log.stderr)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "data-throughput")
    parser.add_argument("--smoke", action="store_true", help="a few steps only (CI)")
    options = parser.parse_args()
    steps, warmup = (8, 2) if options.smoke else (options.steps, options.warmup)
    options.out_dir.mkdir(parents=True, exist_ok=True)
    root = _dataset(Path(tempfile.mkdtemp(prefix="data-throughput-")))
    rates = loader_rates(root, options.workers, 8 if options.smoke else 40)
    data = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
            str(root / "tokenizer"), "--data-path", str(root / "energon"),
            "--num-workers", str(options.workers)]
    times = {"mock": step_times([], steps, options.out_dir / "mock.log"),
             "energon": step_times(data, steps, options.out_dir / "energon.log")}
    medians = {name: statistics.median(values[warmup:]) for name, values in times.items()}
    result = {"workers": options.workers, "steps": steps, "warmup": warmup,
              "load_average": os.getloadavg(), "loader_samples_per_s": rates,
              "step_ms_median": medians, "step_ratio": medians["energon"] / medians["mock"]}
    lines = ["| rank kind | mock samples/s | Energon samples/s |", "| --- | --- | --- |",
             *(f"| {module} | {r['mock']:.0f} | {r['energon']:.0f} |"
               for module, r in rates.items()),
             "", f"Median step ({steps - warmup} steps after {warmup} warm-up, "
             f"--num-workers {options.workers}): mock {medians['mock']:.1f} ms, Energon "
             f"{medians['energon']:.1f} ms, ratio {result['step_ratio']:.3f}; load average "
             f"{result['load_average'][0]:.2f}."]
    (options.out_dir / "data_throughput.json").write_text(json.dumps(result, indent=2))
    (options.out_dir / "data_throughput.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
