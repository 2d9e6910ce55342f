"""What measuring costs a MiMo step on the CPU simulation: ``--log-throughput``,
``--mimo-timeline`` and ``--mimo-profile`` on against off (issue 39).

    python benchmarks/measurement_overhead.py [--steps 30] [--warmup 5] [--rounds 3]
        [--out-dir runs/measurement-overhead]

On ``benchmarks/step_overhead.py``'s MiMo layout (a 1-layer ViT on rank 0, the tiny GPT on rank
1, 4 microbatches per step, one thread per process), logging every step (the measurement's worst
case: one gather per step), without and with the three flags, interleaved ``--rounds`` times.
Reports

(a) per round the median step (the slower rank's), off and on, and their ratio; the median ratio;
(b) each rank's collectives inside a step, off and on (the measurement adds none there; its one
    all-reduce per log interval runs after the step, where stock computes its FLOPs);
(c) the recorder's own cost per phase, timed in this process: a phase mark with nothing
    listening (a run that measures nothing) and one recorded inside a step; and how many phases
    a step of each rank records (from the run's timeline).

Writes ``measurement_overhead.json`` and ``.md`` in ``--out-dir``. The load average is recorded
beside the figures: timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import step_overhead  # noqa: E402

LOG_EVERY_STEP = ["--log-interval", "1"]


def _measured(folder: str, steps: int, warmup: int) -> list[str]:
    return ["--log-throughput", "--mimo-timeline", f"{folder}/timeline",
            "--mimo-timeline-steps", f"{warmup + 1}:{warmup + steps}",
            "--mimo-profile", f"{folder}/profile.json"]


def _slowest_step(ranks: list[list[dict[str, Any]]]) -> float:
    return statistics.median(max(rank[i]["seconds"] for rank in ranks)
                             for i in range(len(ranks[0])))


def _phases_per_step(timeline: Path, steps: int) -> dict[str, float]:
    """Recorded phases (the step itself left out) per step, by rank."""
    events = json.loads(timeline.read_text())["traceEvents"]
    counts: dict[str, int] = {}
    for event in events:
        if event["ph"] == "X" and event["name"] != "step":
            key = f"rank {event['tid']}"
            counts[key] = counts.get(key, 0) + 1
    return {rank: count / steps for rank, count in sorted(counts.items())}


def _round(steps: int, warmup: int, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="measurement-overhead-") as tmp:
        off = step_overhead.record("mimo", steps, warmup, f"{tmp}/off", timeout,
                                   extra=LOG_EVERY_STEP)
        on = step_overhead.record("mimo", steps, warmup, f"{tmp}/on", timeout,
                                  extra=[*LOG_EVERY_STEP, *_measured(tmp, steps, warmup)])
        phases = _phases_per_step(Path(tmp) / "timeline" / "timeline.json", steps)
    seconds = {"off": _slowest_step(off), "on": _slowest_step(on)}
    return {"seconds": seconds, "ratio": seconds["on"] / seconds["off"], "phases": phases,
            "collectives": {
                f"rank {rank} {name}": step_overhead.collective_summary(runs[rank])["total"]
                for rank in range(len(off)) for name, runs in (("off", off), ("on", on))}}


def phase_costs(repeat: int = 200_000) -> dict[str, float]:
    """Microseconds per phase mark: nobody listening, and recorded inside a step."""
    from megatron_plugins.performance.recorder import Consumed, Recorder
    from megatron_plugins.step import phases

    def per_phase() -> float:
        start = time.perf_counter()
        for _ in range(repeat):
            with phases.phase(phases.LANGUAGE_FORWARD, None, 0):
                pass
        return (time.perf_counter() - start) / repeat * 1e6

    off = per_phase()
    recorder = Recorder(0, {"language": 0}, "language", lambda module, batch: Consumed())
    phases.listen(recorder)
    try:
        recorder.begin_step(1)
        on = per_phase()
        recorder.end_step()
    finally:
        phases.listen(None)
    return {"off": off, "on": on}


def markdown(report: dict[str, Any]) -> str:
    load = ", ".join(f"{x:.2f}" for x in report["load_average"])
    lines = [f"Load average {load} on {report['cpu_count']} cores; medians of {report['steps']} "
             f"steps after {report['warmup']} warm-up steps, logged every step.", "",
             "| round | step off (ms) | step on (ms) | on / off |", "| ---: | ---: | ---: | ---: |",
             *(f"| {i + 1} | {r['seconds']['off'] * 1e3:.1f} | {r['seconds']['on'] * 1e3:.1f} | "
               f"{r['ratio']:.3f} |" for i, r in enumerate(report["rounds"])), "",
             f"On / off, median of {len(report['rounds'])} rounds: {report['ratio']:.3f}", "",
             "| collectives inside a step | count |", "| --- | ---: |",
             *(f"| {name} | {count} |" for name, count in report["collectives"].items()), "",
             "| phases recorded per step | count |", "| --- | ---: |",
             *(f"| {rank} | {count:g} |" for rank, count in report["phases"].items()), "",
             f"A phase mark costs {report['phase_us']['off']:.2f} us with nothing listening and "
             f"{report['phase_us']['on']:.2f} us recorded (this process, no device to wait "
             "for)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps discarded first")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "measurement-overhead")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    args = parser.parse_args(argv)
    rounds = sorted((_round(args.steps, args.warmup, args.timeout) for _ in range(args.rounds)),
                    key=lambda measured: measured["ratio"])
    median = rounds[len(rounds) // 2]
    report = {"load_average": os.getloadavg(), "cpu_count": os.cpu_count(),
              "steps": args.steps, "warmup": args.warmup, "ratio": median["ratio"],
              "rounds": rounds, "collectives": median["collectives"],
              "phases": median["phases"], "phase_us": phase_costs()}
    step_overhead.write_report(args.out_dir, "measurement_overhead", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
