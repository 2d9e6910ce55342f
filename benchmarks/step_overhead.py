"""Fixed per-step cost of the heterogeneous MiMo path on the CPU simulation, against stock Megatron.

    python benchmarks/step_overhead.py [--steps 30] [--warmup 5] [--rounds 5] [--out-dir runs/step-overhead]
    python benchmarks/step_overhead.py --smoke          # seconds of stepping, for CI

In one invocation, never more processes than cores (two), each on one thread: the language model
alone through stock ``examples/gpt/pretrain_gpt.py`` (one rank), the encoder alone (one rank,
its data and forward + backward of every microbatch at its micro-batch size, wrapped as the MiMo
build trains it) and the MiMo step (a 1-layer, 32-wide ViT on rank 0, the same language model on
rank 1, 4 microbatches per step). Reports

(a) median MiMo step / (median language step + median encoder step), steps after warm-up, and
    the same with the encoder's data left out of its step;
(b) collectives per step by kind and group (world-wide = the default group) against stock's;
(c) a breakdown of each process's step (forward, backward, transfers including waiting for the
    other grid, gradient finalization, optimizer, the rest), from the probe and Megatron's
    ``optimizer`` timer.

Writes ``step_overhead.json`` and ``step_overhead.md`` in ``--out-dir`` and prints the table.
The machine's load average is recorded beside the figures: timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent

LANGUAGE_MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
    "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--clip-grad", "1.0",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--make-vocab-size-divisible-by", "1", "--transformer-impl", "local",
    "--use-cpu-initialization", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm", "--seed", "1234",
    "--distributed-backend", "gloo", "--num-workers", "0", "--cpu-simulation",
    "--eval-iters", "0", "--eval-interval", "1000000", "--log-interval", "1000000",
    "--timing-log-level", "1", "--no-barrier-with-level-1-timing",
]
"""The language model of every run (same shapes as tests/models/tiny.py), 4 microbatches/step."""

MIMO_LAYOUT = [
    "--encoder", "vision=vit", "--grid", "vision:dp=1",
    "--vit-num-layers", "1", "--vit-hidden-size", "32", "--vit-num-attention-heads", "4",
    "--vit-img-size", "16", "--vit-patch-size", "8",
]
"""A 1-layer, 32-wide ViT (4 patches per image) on rank 0; the language grid follows."""

STATIC_ITEMS = "1"
"""One image per sample: every transfer has one shape, the steady state the figures measure."""


def mimo_flags(language_grid: str = "dp=1", items: str = STATIC_ITEMS) -> list[str]:
    """The MiMo layout with the language grid given as ``--grid language:`` takes it and
    ``--mock-items-per-sample items``."""
    return [*MIMO_LAYOUT, "--grid", f"language:{language_grid}", "--mock-items-per-sample", items]


THREADS_PER_PROCESS = 1
"""Every measured process computes on one core, as every rank owns one GPU: torchrun gives each
of several ranks one thread, and a lone process (stock GPT, the encoder alone) would otherwise
take every core for its kernels."""

PARTS = ("forward", "backward", "transfers", "grad sync")
"""Parts of a step the probe times (besides Megatron's ``optimizer`` timer)."""


Launcher = Callable[[Path, list[str], int, dict[str, str], float], None]
"""Runs ``script args`` on ``nproc`` ranks as torchrun would, in ``env``, within ``timeout``
seconds; raises on a failed rank."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(script: Path, args: list[str], nproc: int, env: dict[str, str],
             timeout: float) -> None:
    """The benchmark's launcher: ``torchrun --nproc-per-node nproc script args``."""
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
          "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(script), *args],
         env, timeout, args[0])


def _run(command: list[str], env: dict[str, str], timeout: float, what: str) -> None:
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"{what} run failed ({process.returncode}):\n{output[-4000:]}")


def _launch(nproc: int, worker_args: list[str], probe_out: str, timeout: float,
            launch: Launcher = torchrun) -> None:
    """Run step_worker.py by ``launch`` on ``nproc`` ranks; ``nproc=0``: one plain process that
    parses the MiMo flags as rank 0 of the 2-rank layout (the encoder-alone measurement)."""
    env = {**os.environ, "STEP_PROBE_OUT": probe_out, "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": str(THREADS_PER_PROCESS),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])}
    worker = HERE / "step_worker.py"
    if nproc:
        launch(worker, worker_args, nproc, env, timeout)
        return
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    _run([sys.executable, str(worker), *worker_args], env, timeout, worker_args[0])


def record(mode: str, steps: int, warmup: int, probe_out: str, timeout: float = 600.0,
           language_grid: str = "dp=1", items: str = STATIC_ITEMS,
           extra: list[str] | None = None,
           launch: Launcher = torchrun) -> list[list[dict[str, Any]]]:
    """Train the ``gpt`` (one rank) or ``mimo`` (the encoder's rank, then the language grid's:
    ``language_grid`` as ``--grid language:`` takes it; ``items`` per sample) configuration under
    the probe, with ``extra`` flags last, launched by ``launch``; per rank, the recorded steps
    after warm-up."""
    if mode == "gpt":
        nproc, flags = 1, ["--mock-data"]
    else:
        flags = mimo_flags(language_grid, items)
        nproc = 1 + math.prod(int(size) for size in re.findall(r"=(\d+)", language_grid))
    iters = ["--train-iters", str(steps + warmup)]
    _launch(nproc, [mode, *LANGUAGE_MODEL, *flags, *iters, *(extra or [])], probe_out, timeout,
            launch)
    return [json.loads(Path(f"{probe_out}.rank{r}.json").read_text())["steps"][warmup:]
            for r in range(nproc)]


def collective_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Collectives of one rank's step (they are the same every step: the first is taken)."""
    calls = steps[0]["collectives"]
    for step in steps[1:]:
        if len(step["collectives"]) != len(calls):
            raise RuntimeError("collective count differs between steps: "
                               f"{len(calls)} vs {len(step['collectives'])}")
    kinds = Counter(
        (c["kind"], "world" if c["world"] else f"ranks {c['ranks']}", c["bytes"]) for c in calls)
    return {"total": len(calls), "world": sum(c["world"] for c in calls),
            "by_kind": [{"kind": k, "group": g, "bytes": b, "count": n}
                        for (k, g, b), n in sorted(kinds.items())]}


def _median(steps: list[dict[str, Any]], key: str) -> float:
    return statistics.median(s[key] for s in steps)


def breakdown(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Median seconds per part of one rank's step; ``other`` is the step minus the parts."""
    parts = {part: statistics.median(s["regions"].get(part, 0.0) for s in steps)
             for part in PARTS}
    parts["optimizer"] = statistics.median(s["timers"].get("optimizer", 0.0) for s in steps)
    step = _median(steps, "seconds")
    parts["other"] = step - sum(parts.values())
    parts["step"] = step
    return parts


def measure_round(steps: int, warmup: int, timeout: float,
                  launch: Launcher = torchrun) -> dict[str, Any]:
    """One stock, encoder-alone and MiMo measurement, back to back (the stock and MiMo runs
    launched by ``launch``): their seconds, ratios and every recorded step."""
    iters = ["--train-iters", str(steps + warmup)]
    with tempfile.TemporaryDirectory(prefix="step-overhead-") as tmp:
        [stock] = record("gpt", steps, warmup, f"{tmp}/gpt", timeout, launch=launch)
        _launch(0, ["encoder", str(steps), str(warmup), *LANGUAGE_MODEL, *mimo_flags(), *iters],
                f"{tmp}/enc", timeout)
        hetero = record("mimo", steps, warmup, f"{tmp}/mimo", timeout, launch=launch)
        encoder = json.loads(Path(f"{tmp}/enc.encoder.json").read_text())
    seconds = {"mimo_step": statistics.median(max(r[i]["seconds"] for r in hetero)
                                              for i in range(steps)),
               "language_step": _median(stock, "seconds"), "encoder_step": encoder["median"],
               "encoder_data": encoder["data_median"]}
    alone = seconds["language_step"] + seconds["encoder_step"]
    return {"seconds": seconds, "ratio": seconds["mimo_step"] / alone,
            "ratio_encoder_model_only": seconds["mimo_step"] / (alone - seconds["encoder_data"]),
            "stock": stock, "hetero": hetero}


def measure(steps: int, warmup: int, timeout: float, rounds: int = 1) -> dict[str, Any]:
    """Run the three measurements ``rounds`` times, interleaved, and return the report: the
    ratio is the median of the rounds' ratios (each from measurements minutes apart at most);
    collectives and breakdown come from that median round."""
    done = sorted((measure_round(steps, warmup, timeout) for _ in range(rounds)),
                  key=lambda measured: measured["ratio"])
    median = done[len(done) // 2]
    stock, hetero = median["stock"], median["hetero"]
    return {
        "load_average": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "threads_per_process": THREADS_PER_PROCESS,
        "steps": steps, "warmup": warmup,
        "ratio": median["ratio"],
        "seconds": median["seconds"],
        "ratio_encoder_model_only": statistics.median(
            measured["ratio_encoder_model_only"] for measured in done),
        "rounds": [{"ratio": measured["ratio"],
                    "ratio_encoder_model_only": measured["ratio_encoder_model_only"],
                    **measured["seconds"]} for measured in done],
        "collectives": {"stock": collective_summary(stock),
                        **{f"mimo rank {r}": collective_summary(s) for r, s in enumerate(hetero)}},
        "breakdown": {"stock": breakdown(stock),
                      **{f"mimo rank {r}": breakdown(s) for r, s in enumerate(hetero)}},
    }


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown tables."""
    load = ", ".join(f"{x:.2f}" for x in report["load_average"])
    lines = [
        f"Load average {load} on {report['cpu_count']} cores, "
        f"{report['threads_per_process']} thread per process; medians of {report['steps']} "
        f"steps after {report['warmup']} warm-up steps.", "",
        "| MiMo step (ms) | language step, stock (ms) | encoder step (ms) | of which its data "
        "(ms) | ratio (a) | ratio, encoder data left out |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
        *(f"| {r['mimo_step'] * 1e3:.1f} | {r['language_step'] * 1e3:.1f} | "
          f"{r['encoder_step'] * 1e3:.1f} | {r['encoder_data'] * 1e3:.1f} | {r['ratio']:.2f} | "
          f"{r['ratio_encoder_model_only']:.2f} |" for r in report["rounds"]), "",
        f"Ratio (a), median of {len(report['rounds'])} rounds: {report['ratio']:.2f} "
        f"({report['ratio_encoder_model_only']:.2f} with the encoder's data left out of its "
        "step)", "",
        "| collectives per step | total | world-wide |", "| --- | ---: | ---: |",
    ]
    lines += [f"| {name} | {c['total']} | {c['world']} |"
              for name, c in report["collectives"].items()]
    lines += ["", "| process | kind | group | bytes | calls |", "| --- | --- | --- | ---: | ---: |"]
    lines += [f"| {name} | {k['kind']} | {k['group']} | {k['bytes']} | {k['count']} |"
              for name, c in report["collectives"].items() for k in c["by_kind"]]
    parts = list(next(iter(report["breakdown"].values())))
    lines += ["", "| breakdown (ms) | " + " | ".join(parts) + " |",
              "| --- |" + " ---: |" * len(parts)]
    lines += [f"| {name} | " + " | ".join(f"{b[p] * 1e3:.1f}" for p in parts) + " |"
              for name, b in report["breakdown"].items()]
    return "\n".join(lines) + "\n"


def write_report(out_dir: Path, stem: str, report: dict[str, Any], table: str) -> None:
    """``stem.json`` and ``stem.md`` in ``out_dir``; the table printed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (out_dir / f"{stem}.md").write_text(table)
    print(table)


def main(argv: list[str] | None = None) -> int:
    """Measure, print the tables, write JSON and markdown."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps discarded first")
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved repetitions; the ratio is their median")
    parser.add_argument("--smoke", action="store_true",
                        help="one round of 3 steps after 1 warm-up (CI)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "step-overhead")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    args = parser.parse_args(argv)
    steps, warmup, rounds = (3, 1, 1) if args.smoke else (args.steps, args.warmup, args.rounds)
    report = measure(steps, warmup, args.timeout, rounds)
    write_report(args.out_dir, "step_overhead", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
