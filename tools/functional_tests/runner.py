"""Run functional test cases: load a case, build its flags as upstream's launcher does, launch it
under torchrun, read its TensorBoard metrics, and check them against its goldens (or record them).

``ckpt-resume`` cases run as upstream runs them: run 1 trains ``--train-iters`` saving every
``--save-interval``; its last checkpoint is removed and the tracker set to the halfway iteration;
run 2 resumes from there, and every step after the resume must equal run 1's bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import string
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from tools.functional_tests.comparison import compare, golden_values, resume_failures
from tools.functional_tests.signature import platform_signature, signature_differences

REPO_ROOT = Path(__file__).resolve().parents[2]
CASES_ROOT = REPO_ROOT / "tests" / "functional_tests" / "test_cases"
ENTRY_POINT = REPO_ROOT / "examples" / "mimo" / "pretrain_mimo.py"
ENVIRONMENT = "dev"
"""Upstream's environment label (its ``dev`` container: current dependency pins)."""
DEFAULT_PLATFORM = "cpu"

UPSTREAM_ONLY_KEYS = re.compile(r"[A-Z][A-Z0-9_]*")
"""Upstream's case files use upper-case keys; those this runner does not use are accepted."""
TEST_TYPES = ("regular", "ckpt-resume")


class CaseError(ValueError):
    """A case definition or golden file that cannot be used."""


@dataclass(frozen=True)
class Case:
    """One functional test case, as its ``model_config.yaml`` says."""

    name: str
    path: Path
    env_vars: dict[str, str]
    model_args: dict[str, Any]
    resume_model_args: dict[str, Any]
    test_type: str
    metrics: list[str]

    def argv(self, paths: dict[str, str], run: int = 1) -> list[str]:
        """The training flags of run ``run``, built the way upstream's launcher builds them."""
        return flags(self.model_args if run == 1 else self.resume_model_args, paths, self.name)

    @property
    def nproc(self) -> int:
        """Ranks the case's ``--grid`` flags need."""
        from megatron_plugins.parallel.flags import add_layout_args, required_world_size

        parser = add_layout_args(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
        known, _ = parser.parse_known_args(self.argv(_placeholder_paths()))
        return required_world_size(known)

    @property
    def reads_data(self) -> bool:
        """Whether ``MODEL_ARGS`` name files under ``${DATA_PATH}`` (the generated dataset)."""
        return any("${DATA_PATH}" in str(value)
                   for args in (self.model_args, self.resume_model_args)
                   for value in args.values())

    def int_arg(self, flag: str) -> int:
        """An integer flag of ``MODEL_ARGS``, required by the runner."""
        if flag not in self.model_args:
            raise CaseError(f"{self.name}: MODEL_ARGS needs {flag}")
        return int(self.model_args[flag])

    def golden_path(self, platform: str = DEFAULT_PLATFORM, environment: str = ENVIRONMENT) -> Path:
        return self.path / f"golden_values_{environment}_{platform}.json"

    def signature_path(self, platform: str = DEFAULT_PLATFORM,
                       environment: str = ENVIRONMENT) -> Path:
        return self.path / f"golden_signature_{environment}_{platform}.json"


RUN_PATHS = ("TENSORBOARD_PATH", "CHECKPOINT_SAVE_PATH", "CHECKPOINT_LOAD_PATH", "DATA_PATH",
             "OUTPUT_PATH")
"""The variables upstream's launcher fills into ``MODEL_ARGS`` for each run."""


def _placeholder_paths() -> dict[str, str]:
    return {name: f"/unused/{name.lower()}" for name in RUN_PATHS}


def flags(model_args: dict[str, Any], paths: dict[str, str], case: str = "case") -> list[str]:
    """``MODEL_ARGS`` as argv, like upstream's launcher: ``true`` is a bare flag, every other
    value is one argument after its flag (spaces included) with ``${VAR}`` filled from ``paths``.

    Upstream turns each key into exactly one flag, so a YAML list or ``false`` cannot be
    expressed; they are errors here rather than something upstream would run differently.
    """
    argv: list[str] = []
    for flag, value in model_args.items():
        if value is True:
            argv.append(flag)
            continue
        if value is False or value is None or isinstance(value, (list, dict)):
            raise CaseError(
                f"{case}: MODEL_ARGS {flag}: {value!r} is not a single value; upstream turns each "
                "key into one flag (give repeated layout flags one space-separated string, drop "
                "false flags)")
        try:
            argv += [flag, string.Template(str(value)).substitute(paths)]
        except KeyError as missing:
            raise CaseError(f"{case}: MODEL_ARGS {flag} uses ${{{missing.args[0]}}}; the runner "
                            f"fills only {', '.join(RUN_PATHS)}") from None
    return argv


def resolve_case(name: str) -> str:
    """A case's name under ``test_cases`` from itself or its last part (``language_tp2`` for
    ``mimo_hetero/language_tp2``), checked before anything runs."""
    cases = all_cases()
    matches = [name] if name in cases else [case for case in cases
                                           if case.rsplit("/", 1)[-1] == name]
    if len(matches) != 1:
        raise CaseError(f"no case {name!r} under {CASES_ROOT.relative_to(REPO_ROOT)}"
                        f"{' (several match: ' + ', '.join(matches) + ')' if matches else ''}; "
                        f"cases: {', '.join(cases)}")
    return matches[0]


def load_case(name: str) -> Case:
    """Read ``test_cases/<name>/model_config.yaml``."""
    path = CASES_ROOT / name
    config = yaml.safe_load((path / "model_config.yaml").read_text())
    unknown = [key for key in config if not UPSTREAM_ONLY_KEYS.fullmatch(str(key))]
    if unknown:
        raise CaseError(f"{name}: keys {unknown} in model_config.yaml are not upstream case keys")
    mode = config.get("MODE", "pretraining")
    if mode != "pretraining":
        raise CaseError(f"{name}: MODE {mode!r}: only pretraining cases run here")
    test_type = config.get("TEST_TYPE", "regular")
    if test_type not in TEST_TYPES:
        raise CaseError(f"{name}: TEST_TYPE {test_type!r} must be one of {', '.join(TEST_TYPES)}")
    model_args = dict(config["MODEL_ARGS"])
    return Case(name=name, path=path,
                env_vars={k: str(v) for k, v in (config.get("ENV_VARS") or {}).items()},
                model_args=model_args,
                resume_model_args=dict(config.get("MODEL_ARGS_2") or model_args),
                test_type=test_type,
                metrics=list(config.get("METRICS") or ["lm loss", "num-zeros"]))


def all_cases() -> list[str]:
    """Every case name under ``test_cases``, sorted."""
    return sorted(str(p.parent.relative_to(CASES_ROOT)) for p in CASES_ROOT.rglob("model_config.yaml"))


def run_environment(case: Case, extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the case's ranks run in (torchrun's one thread per rank made explicit)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **case.env_vars, **(extra_env or {})}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def torchrun_command(script: str | Path, nproc: int, argv: list[str]) -> list[str]:
    """``torchrun --standalone --nproc-per-node nproc script argv``: its agent hosts the
    rendezvous on a port the kernel picks when it binds, so no port is chosen first and taken by
    another launch before it is bound."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), str(script), *argv]


def run_command(command: list[str], env: dict[str, str], log: Path, timeout: float,
                what: str) -> None:
    """Run ``command`` in its own process group with output to ``log``; on timeout kill the whole
    group (every rank), on a non-zero exit raise with the log's tail."""
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise CaseError(f"{what}: ran past {timeout:.0f} s (killed); log: {log}")
    if code != 0:
        tail = log.read_text()[-3000:]
        raise CaseError(f"{what}: exited with {code}; log {log} ends:\n{tail}")


Launcher = Callable[[int, list[str], dict[str, str], Path, float, str], None]
"""``launch(nproc, argv, env, log, timeout, what)``: run the entry point on ``nproc`` ranks with
``argv`` and ``env``, output to ``log``; raise :class:`CaseError` on a failure or timeout."""


def torchrun(nproc: int, argv: list[str], env: dict[str, str], log: Path, timeout: float,
             what: str) -> None:
    """The cases' launcher: ``torchrun --nproc-per-node nproc`` on the entry point, as upstream."""
    run_command(torchrun_command(ENTRY_POINT, nproc, argv), env, log, timeout, what)


def read_metrics(logdir: Path, metrics: list[str]) -> dict[str, dict[int, float]]:
    """``{metric: {step: value}}`` from the TensorBoard events under ``logdir``, full precision."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, dict[int, float]] = {}
    for events in sorted(Path(logdir).rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        for metric in metrics:
            if metric in accumulator.Tags()["scalars"]:
                found.setdefault(metric, {}).update(
                    {e.step: e.value for e in accumulator.Scalars(metric)})
    return {metric: dict(sorted(values.items())) for metric, values in found.items()}


CASE_DATA = ("image_audio_caption", 300, 0)
"""The dataset ``${DATA_PATH}`` holds: the README's generated set (kind, samples, seed), as an
Energon dataset in ``energon/`` and its tokenizer in ``tokenizer/``."""


def make_case_data(root: Path) -> None:
    """Generate ``${DATA_PATH}`` (deterministic, a few seconds) with the README's tools."""
    from tools.make_synthetic_dataset import make_synthetic, prepare

    kind, samples, seed = CASE_DATA
    make_synthetic(root, samples, kind, seed=seed)
    prepare(root, kind, seed=seed, quiet=True)


def run_case(case: Case, workdir: Path, extra_env: dict[str, str] | None = None,
             timeout: float = 240.0, launch: Launcher = torchrun,
             data: Path | None = None) -> dict[str, dict[int, float]]:
    """Run ``case`` in ``workdir``; returns run 1's metrics (checked against run 2 on resume).
    ``data``: a ``${DATA_PATH}`` :data:`CASE_DATA` already made (read only), else one is made
    in ``workdir`` when the case reads data."""
    env = run_environment(case, extra_env)
    checkpoints = workdir / "checkpoints"
    if data is None:
        data = workdir / "data"
        if case.reads_data:
            make_case_data(data)
    paths = {"CHECKPOINT_SAVE_PATH": str(checkpoints), "DATA_PATH": str(data),
             "OUTPUT_PATH": str(workdir)}

    def train(run: int) -> dict[str, dict[int, float]]:
        # Run 1 loads from its own save folder, empty on the first launch (the auto-resume idiom):
        # a --load folder without a checkpoint is refused otherwise.
        tensorboard = workdir / "tensorboard" / f"run_{run}"
        run_paths = {**paths, "TENSORBOARD_PATH": str(tensorboard),
                     "CHECKPOINT_LOAD_PATH": str(checkpoints)}
        launch(case.nproc, case.argv(run_paths, run), env, workdir / f"run_{run}.log", timeout,
               case.name)
        return read_metrics(tensorboard, case.metrics)

    metrics = train(1)
    if case.test_type == "ckpt-resume":
        end, half = case.int_arg("--train-iters"), case.int_arg("--train-iters") // 2
        if not (checkpoints / f"iter_{half:07d}").is_dir():
            raise CaseError(f"{case.name}: run 1 wrote no checkpoint at iteration {half}; "
                            f"ckpt-resume cases need --save-interval dividing {half}")
        shutil.rmtree(checkpoints / f"iter_{end:07d}", ignore_errors=True)
        (checkpoints / "latest_checkpointed_iteration.txt").write_text(f"{half}\n")
        failures = resume_failures(metrics, train(2), half, end)
        if failures:
            raise CaseError(f"{case.name}: resumed run differs:\n" + "\n".join(failures))
    return metrics


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=False) + "\n")


def check_case(name: str, *, platform: str = DEFAULT_PLATFORM, record: bool = False,
               workdir: Path | None = None, extra_env: dict[str, str] | None = None,
               report: list[str] | None = None, launch: Launcher = torchrun,
               data: Path | None = None) -> list[str]:
    """Run a case and compare it with its goldens (or write goldens and signature with
    ``record``); ``report`` receives one line saying which rule was used; ``data`` as
    :func:`run_case` takes it."""
    case = load_case(name)
    own_dir = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix=f"{case.path.name}-")) if own_dir else workdir
    try:
        signature = platform_signature(run_environment(case, extra_env))
        actual = run_case(case, workdir, extra_env, launch=launch, data=data)
        if record:
            _write_json(case.golden_path(platform), golden_values(actual, case.metrics))
            _write_json(case.signature_path(platform), signature)
            return []
        if not case.golden_path(platform).exists():
            return [f"no {case.golden_path(platform).name}; record it with --record"]
        golden = json.loads(case.golden_path(platform).read_text())
        recorded = (json.loads(case.signature_path(platform).read_text())
                    if case.signature_path(platform).exists() else None)
        differences = signature_differences(recorded, signature)
        if report is not None:
            report.append("exact (same platform signature)" if not differences else
                          f"cross-host tolerance (signature differs in {', '.join(differences)})")
        return compare(golden, actual, case.metrics, same_platform=not differences)
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
    run.add_argument("--record", action="store_true",
                     help="write new goldens and their platform signature")
    run.add_argument("--platform", default=DEFAULT_PLATFORM)
    args = parser.parse_args(argv)
    if not args.all and not args.cases:
        parser.error("name cases or pass --all")
    try:
        names = all_cases() if args.all else [resolve_case(name) for name in args.cases]
    except CaseError as error:
        parser.error(str(error))
    failed = 0
    for name in names:
        report: list[str] = []
        try:
            failures = check_case(name, platform=args.platform, record=args.record, report=report)
        except CaseError as error:
            failures = [str(error)]
        status = "recorded" if args.record and not failures else ("ok" if not failures else "FAIL")
        print(f"{name}: {status}" + (f" [{report[0]}]" if report else ""))
        for failure in failures:
            print(f"  {failure}")
        failed += bool(failures)
    return 1 if failed else 0

