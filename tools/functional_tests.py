"""Megatron-style functional tests for heterogeneous MiMo: run cases, compare with goldens, record.

A case is ``tests/functional_tests/test_cases/<model>/<case>/model_config.yaml`` (``ENV_VARS``,
``MODEL_ARGS``, ``TEST_TYPE`` in {regular, ckpt-resume}, ``METRICS``) with golden values per
platform in ``golden_values_<platform>.json``: ``{metric: {start_step, end_step, step_interval,
values: {step: value}}}``. Metrics are read from TensorBoard. The rules are Megatron's:

* ``lm loss`` and ``num-zeros`` must match exactly in deterministic mode, and within rtol 0.05 /
  0.20 otherwise; memory within rtol 0.05; ``iteration-time`` as the median of the steady window
  (steps after the first quarter) within rtol 0.05 (a step-by-step check would only measure noise);
* approximate checks tolerate ``min(max(n // 100, 1), 50)`` failing steps of ``n``;
* a missing metric fails; NaN or infinite goldens are rejected;
* goldens are rounded to 5 decimals unless the file marks them ``"full_precision": true``, which
  ``--record`` does (the CPU simulation is bit-reproducible).

``ckpt-resume`` cases train twice: run 1 trains ``--train-iters`` saving halfway, run 2 resumes
from the halfway checkpoint, and every step after the resume must equal run 1's exactly.

    python -m tools.functional_tests run mimo_hetero/language_tp2   # one case
    python -m tools.functional_tests run --all [--record]           # every case
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
CASES_ROOT = REPO_ROOT / "tests" / "functional_tests" / "test_cases"
ENTRY_POINT = REPO_ROOT / "examples" / "mimo" / "pretrain_mimo.py"
EXACT_METRICS = {"lm loss": 0.05, "num-zeros": 0.20}
"""Metrics compared exactly in deterministic mode, with their approximate relative tolerance."""
APPROXIMATE_RTOL = 0.05
DEFAULT_PLATFORM = "cpu"


class CaseError(ValueError):
    """A case definition or golden file that cannot be used."""


@dataclass(frozen=True)
class Case:
    """One functional test case."""

    name: str
    path: Path
    env_vars: dict[str, str]
    model_args: list[str]
    test_type: str
    metrics: list[str]

    @property
    def nproc(self) -> int:
        """Ranks the case's ``--grid`` flags need."""
        from megatron_plugins.layout import add_layout_args, required_world_size

        parser = add_layout_args(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
        known, _ = parser.parse_known_args(self.model_args)
        return required_world_size(known)

    @property
    def train_iters(self) -> int:
        return int(self.model_args[self.model_args.index("--train-iters") + 1])

    def golden_path(self, platform: str) -> Path:
        return self.path / f"golden_values_{platform}.json"


def _flags(model_args: dict[str, Any]) -> list[str]:
    """Megatron's MODEL_ARGS mapping as argv: ``true`` is a bare flag, a list repeats the flag."""
    argv: list[str] = []
    for flag, value in model_args.items():
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        else:
            for item in value if isinstance(value, list) else [value]:
                argv += [flag, str(item)]
    return argv


def load_case(name: str) -> Case:
    """Read ``test_cases/<name>/model_config.yaml``."""
    path = CASES_ROOT / name
    config = yaml.safe_load((path / "model_config.yaml").read_text())
    unknown = set(config) - {"ENV_VARS", "MODEL_ARGS", "TEST_TYPE", "METRICS"}
    if unknown:
        raise CaseError(f"{name}: unknown keys {sorted(unknown)} in model_config.yaml")
    test_type = config.get("TEST_TYPE", "regular")
    if test_type not in ("regular", "ckpt-resume"):
        raise CaseError(f"{name}: TEST_TYPE {test_type!r} must be regular or ckpt-resume")
    return Case(name=name, path=path,
                env_vars={k: str(v) for k, v in (config.get("ENV_VARS") or {}).items()},
                model_args=_flags(config["MODEL_ARGS"]), test_type=test_type,
                metrics=list(config["METRICS"]))


def all_cases() -> list[str]:
    """Every case name under ``test_cases``, sorted."""
    return sorted(str(p.parent.relative_to(CASES_ROOT)) for p in CASES_ROOT.rglob("model_config.yaml"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(case: Case, extra: list[str], log: Path, timeout: float) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(case.nproc), "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               str(ENTRY_POINT), *case.model_args, *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **case.env_vars}
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise CaseError(f"{case.name}: ran past {timeout:.0f} s (killed); log: {log}")
    if code != 0:
        tail = log.read_text()[-3000:]
        raise CaseError(f"{case.name}: exited with {code}; log {log} ends:\n{tail}")


def read_metrics(logdir: Path, metrics: list[str]) -> dict[str, dict[int, float]]:
    """``{metric: {step: value}}`` from the TensorBoard events under ``logdir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, dict[int, float]] = {}
    for events in sorted(logdir.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        for metric in metrics:
            if metric in accumulator.Tags()["scalars"]:
                found.setdefault(metric, {}).update(
                    {e.step: e.value for e in accumulator.Scalars(metric)})
    return found


def run_case(case: Case, workdir: Path, timeout: float = 240.0) -> dict[str, dict[int, float]]:
    """Run ``case`` in ``workdir``; returns run 1's metrics (checked against run 2 on resume)."""
    first = workdir / "run1"
    extra = ["--tensorboard-dir", str(first / "tensorboard")]
    if case.test_type == "ckpt-resume":
        half = case.train_iters // 2
        extra += ["--save", str(workdir / "checkpoints"), "--save-interval", str(half)]
    _launch(case, extra, workdir / "run1.log", timeout)
    metrics = read_metrics(first / "tensorboard", case.metrics)
    if case.test_type == "ckpt-resume":
        second = workdir / "run2"
        _launch(case, ["--tensorboard-dir", str(second / "tensorboard"),
                       "--load", str(workdir / "checkpoints"), "--ckpt-step", str(half)],
                workdir / "run2.log", timeout)
        resumed = read_metrics(second / "tensorboard", case.metrics)
        failures = resume_failures(metrics, resumed, half, case.train_iters)
        if failures:
            raise CaseError(f"{case.name}: resumed run differs:\n" + "\n".join(failures))
    return metrics


def resume_failures(original: dict[str, dict[int, float]], resumed: dict[str, dict[int, float]],
                    half: int, end: int) -> list[str]:
    """Steps after the resume that differ (bit for bit) from the uninterrupted run."""
    failures = []
    for metric, values in original.items():
        if metric == "iteration-time":
            continue
        for step in range(half + 1, end + 1):
            got = resumed.get(metric, {}).get(step)
            if got != values.get(step):
                failures.append(f"{metric} step {step}: resumed {got} != original {values.get(step)}")
    return failures


def _tolerated(count: int) -> int:
    return min(max(count // 100, 1), 50)


def compare(golden: dict[str, Any], actual: dict[str, dict[int, float]],
            metrics: list[str], deterministic: bool = True) -> list[str]:
    """Megatron's comparison rules (module docstring); returns one line per failure."""
    failures = []
    full_precision = bool(golden.get("full_precision", False))
    for metric in metrics:
        expected = golden.get(metric)
        if expected is None:
            failures.append(f"{metric}: no golden values")
            continue
        values = {int(step): float(v) for step, v in expected["values"].items()}
        bad = [s for s, v in values.items() if not math.isfinite(v)]
        if bad:
            failures.append(f"{metric}: golden has NaN/inf at steps {bad} (rejected)")
            continue
        got = actual.get(metric)
        if not got:
            failures.append(f"{metric}: missing from the run")
            continue
        missing = sorted(set(values) - set(got))
        if missing:
            failures.append(f"{metric}: steps {missing[:5]} missing from the run")
            continue
        if metric == "iteration-time":
            steady = sorted(values)[len(values) // 4:]
            want, have = median(values[s] for s in steady), median(got[s] for s in steady)
            if abs(have - want) > APPROXIMATE_RTOL * abs(want):
                failures.append(f"{metric}: median {have:.4g} vs golden {want:.4g} (rtol 0.05)")
            continue
        if metric in EXACT_METRICS and deterministic:
            digits = None if full_precision else 5
            wrong = [s for s in sorted(values)
                     if _round(got[s], digits) != _round(values[s], digits)]
            if wrong:
                s = wrong[0]
                failures.append(f"{metric}: {len(wrong)} steps differ exactly, first step {s}: "
                                f"{got[s]!r} vs golden {values[s]!r}")
            continue
        rtol = EXACT_METRICS.get(metric, APPROXIMATE_RTOL)
        wrong = [s for s in sorted(values) if abs(got[s] - values[s]) > rtol * abs(values[s])]
        if len(wrong) > _tolerated(len(values)):
            failures.append(f"{metric}: {len(wrong)} of {len(values)} steps outside rtol {rtol} "
                            f"(tolerated {_tolerated(len(values))}), first step {wrong[0]}")
    return failures


def _round(value: float, digits: int | None) -> float:
    return value if digits is None else round(value, digits)


def golden_values(actual: dict[str, dict[int, float]], metrics: list[str]) -> dict[str, Any]:
    """A golden file for ``actual`` at full precision (what ``--record`` writes)."""
    golden: dict[str, Any] = {"full_precision": True}
    for metric in metrics:
        steps = sorted(actual[metric])
        golden[metric] = {"start_step": steps[0], "end_step": steps[-1], "step_interval": 1,
                          "values": {str(s): actual[metric][s] for s in steps}}
    return golden


def check_case(name: str, *, platform: str = DEFAULT_PLATFORM, record: bool = False,
               workdir: Path | None = None) -> list[str]:
    """Run a case and compare it with its goldens (or write them with ``record``)."""
    case = load_case(name)
    own_dir = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix=f"{case.path.name}-")) if own_dir else workdir
    try:
        actual = run_case(case, workdir)
        if record:
            case.golden_path(platform).write_text(
                json.dumps(golden_values(actual, case.metrics), indent=2) + "\n")
            return []
        if not case.golden_path(platform).exists():
            return [f"no {case.golden_path(platform).name}; record it with --record"]
        golden = json.loads(case.golden_path(platform).read_text())
        return compare(golden, actual, case.metrics)
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """``run CASE...`` or ``run --all``, optionally ``--record``; exit code 1 on any failure."""
    parser = argparse.ArgumentParser(prog="python -m tools.functional_tests")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run cases and compare with (or record) goldens")
    run.add_argument("cases", nargs="*")
    run.add_argument("--all", action="store_true")
    run.add_argument("--record", action="store_true", help="write new goldens (full precision)")
    run.add_argument("--platform", default=DEFAULT_PLATFORM)
    args = parser.parse_args(argv)
    names = all_cases() if args.all else args.cases
    if not names:
        parser.error("name cases or pass --all")
    failed = 0
    for name in names:
        try:
            failures = check_case(name, platform=args.platform, record=args.record)
        except CaseError as error:
            failures = [str(error)]
        status = "recorded" if args.record and not failures else ("ok" if not failures else "FAIL")
        print(f"{name}: {status}")
        for failure in failures:
            print(f"  {failure}")
        failed += bool(failures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
