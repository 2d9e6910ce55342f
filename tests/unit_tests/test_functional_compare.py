"""The functional-test rules (upstream Megatron's format and comparison), on synthetic metrics."""

from __future__ import annotations

import math
import re

import pytest
import yaml

from tools.functional_tests.comparison import compare, golden_values, resume_failures
from tools.functional_tests.runner import (
    CASES_ROOT,
    CaseError,
    all_cases,
    flags,
    load_case,
    main,
    resolve_case,
)
from tools.functional_tests.signature import signature_differences

STEPS = range(1, 21)
LOSS = {s: 5.0 - 0.1 * s + 1.234e-7 * s for s in STEPS}
PATHS = {"TENSORBOARD_PATH": "/tb", "CHECKPOINT_SAVE_PATH": "/ckpt", "CHECKPOINT_LOAD_PATH": "/ckpt",
         "DATA_PATH": "/data", "OUTPUT_PATH": "/out"}


def _golden(values: dict[int, float], metric: str = "lm loss") -> dict:
    return golden_values({metric: values}, [metric])


def test_goldens_are_recorded_as_upstream_records_them():
    golden = _golden(LOSS)
    assert list(golden) == ["lm loss"], "upstream's loader takes metric keys only"
    entry = golden["lm loss"]
    assert (entry["start_step"], entry["end_step"], entry["step_interval"]) == (1, 20, 1)
    assert entry["values"]["7"] == round(LOSS[7], 5) != LOSS[7]


def test_same_platform_is_exact_after_rounding_to_five_decimals():
    assert compare(_golden(LOSS), {"lm loss": dict(LOSS)}, ["lm loss"]) == []
    assert compare(_golden(LOSS), {"lm loss": {**LOSS, 7: LOSS[7] + 1e-7}}, ["lm loss"]) == []
    [failure] = compare(_golden(LOSS), {"lm loss": {**LOSS, 7: LOSS[7] + 1e-5}}, ["lm loss"])
    assert "1 steps differ exactly, first step 7" in failure


def test_other_platform_uses_the_cross_host_tolerance():
    drift = {s: v + (1e-5 if s % 3 == 0 else -1e-6) for s, v in LOSS.items()}
    assert compare(_golden(LOSS), {"lm loss": drift}, ["lm loss"], same_platform=False) == []
    assert compare(_golden(LOSS), {"lm loss": drift}, ["lm loss"], same_platform=True)
    bug = {**LOSS, 3: LOSS[3] + 3.6e-5}
    [failure] = compare(_golden(LOSS), {"lm loss": bug}, ["lm loss"], same_platform=False)
    assert "1 of 20 steps outside the cross-host atol 2e-05, first step 3" in failure


def test_num_zeros_across_hosts_has_upstreams_approximate_tolerance():
    zeros = {s: 100.0 for s in STEPS}
    close = {"num-zeros": {s: 118.0 for s in STEPS}}
    assert compare(_golden(zeros, "num-zeros"), close, ["num-zeros"], same_platform=False) == []
    assert compare(_golden(zeros, "num-zeros"), close, ["num-zeros"], same_platform=True)
    far = {"num-zeros": {s: 125.0 for s in STEPS}}
    assert compare(_golden(zeros, "num-zeros"), far, ["num-zeros"], same_platform=False)


def test_missing_metric_missing_steps_and_nan_goldens_fail():
    assert compare(_golden(LOSS), {}, ["lm loss"]) == ["lm loss: missing from the run"]
    short = {s: v for s, v in LOSS.items() if s < 15}
    assert "missing from the run" in compare(_golden(LOSS), {"lm loss": short}, ["lm loss"])[0]
    assert compare({}, {"lm loss": LOSS}, ["lm loss"]) == ["lm loss: no golden values"]
    broken = {**LOSS, 5: math.nan}
    assert "NaN/inf at steps [5] (rejected)" in compare(_golden(broken), {"lm loss": LOSS},
                                                        ["lm loss"])[0]


def test_iteration_time_compares_the_steady_window_median():
    golden = {s: 100.0 for s in STEPS}
    warmup_noise = {**golden, 1: 900.0, 2: 400.0}
    assert compare(_golden(golden, "iteration-time"), {"iteration-time": warmup_noise},
                   ["iteration-time"]) == []
    slower = {s: 110.0 for s in STEPS}
    [failure] = compare(_golden(golden, "iteration-time"), {"iteration-time": slower},
                        ["iteration-time"])
    assert failure.startswith("iteration-time: median 110")


def test_resume_must_equal_the_uninterrupted_run_bit_for_bit():
    original = {"lm loss": dict(LOSS)}
    resumed = {"lm loss": {s: v for s, v in LOSS.items() if s > 10}}
    assert resume_failures(original, resumed, 10, 20) == []
    resumed["lm loss"][12] += 1e-9
    assert resume_failures(original, resumed, 10, 20) == [
        f"lm loss step 12: resumed {LOSS[12] + 1e-9} != original {LOSS[12]}"]


def test_signature_differences_name_the_keys():
    here = {"cpu_vendor": "GenuineIntel", "torch_cpu_capability": "AVX512", "torch": "2.14.1"}
    assert signature_differences(dict(here), here) == []
    there = {**here, "cpu_vendor": "AuthenticAMD", "torch_cpu_capability": "AVX2"}
    assert signature_differences(there, here) == ["cpu_vendor", "torch_cpu_capability"]
    assert signature_differences(None, here) == ["no recorded signature"]


def test_model_args_become_argv_as_upstreams_launcher_builds_it():
    args = {"--a": 1, "--b": True, "--grid": "x:dp=1 language:dp=2",
            "--tensorboard-dir": "${TENSORBOARD_PATH}", "--lr": 3.0e-3}
    assert flags(args, PATHS) == ["--a", "1", "--b", "--grid", "x:dp=1 language:dp=2",
                                  "--tensorboard-dir", "/tb", "--lr", "0.003"]
    for bad in ({"--grid": ["x:", "y:"]}, {"--c": False}):
        with pytest.raises(CaseError, match="not a single value; upstream turns each key"):
            flags(bad, PATHS)
    with pytest.raises(CaseError, match=r"uses \$\{NOPE\}"):
        flags({"--save": "${NOPE}"}, PATHS)


def test_upstream_only_keys_are_accepted_and_others_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("tools.functional_tests.runner.CASES_ROOT", tmp_path)
    base = {"MODEL_ARGS": {"--train-iters": 2}, "TEST_TYPE": "regular"}
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "model_config.yaml").write_text(yaml.safe_dump(
        {**base, "MODE": "pretraining", "LAUNCHER": "torchrun", "MODEL_ARGS_2": {"--x": 1},
         "AFTER_SCRIPT": "true"}))
    case = load_case("ok")
    assert case.metrics == ["lm loss", "num-zeros"], "upstream's default metrics"
    assert case.argv(PATHS, run=2) == ["--x", "1"]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model_config.yaml").write_text(yaml.safe_dump({**base, "metrics": []}))
    with pytest.raises(CaseError, match="not upstream case keys"):
        load_case("bad")


def test_a_case_is_named_whole_or_by_its_last_part_and_an_unknown_one_refused_before_any_run(
        capsys):
    with pytest.raises(SystemExit) as refused:
        main(["run", "mimo_hetero/language_tp2", "langauge_tp2"])
    assert refused.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no case 'langauge_tp2' under tests/functional_tests/test_cases" in error
    assert "mimo_hetero/language_tp2," in error  # the cases it could have meant
    assert resolve_case("language_tp2") == resolve_case("mimo_hetero/language_tp2")


def test_cases_are_in_upstreams_format_and_cover_the_required_layouts():
    cases = {name: load_case(name) for name in all_cases()}
    assert len(cases) >= 8
    assert sum(c.test_type == "ckpt-resume" for c in cases.values()) >= 3
    args = {name: " ".join(c.argv(PATHS)) for name, c in cases.items()}
    for required in ("vision:tp=1,dp=2", "audio=audio", "language:pp=2", "language:tp=2",
                     "ep=2"):
        assert any(required in a for a in args.values()), required
    for name, case in cases.items():
        assert "--tensorboard-dir /tb" in args[name], name
        if case.test_type == "ckpt-resume":
            assert "--save /ckpt" in args[name] and "--load /ckpt" in args[name], name
        assert case.golden_path().exists() and case.signature_path().exists(), name


@pytest.mark.parametrize("name", all_cases())
def test_golden_files_load_with_upstreams_schema(name: str):
    """Upstream's loader is a pydantic root model ``{metric: {start_step: int, end_step: int,
    step_interval: int, values: {int: number}}}``: no other keys, every value finite."""
    import json

    golden = json.loads(load_case(name).golden_path().read_text())
    for metric, entry in golden.items():
        assert set(entry) == {"start_step", "end_step", "step_interval", "values"}, metric
        assert all(isinstance(entry[k], int) for k in ("start_step", "end_step", "step_interval"))
        steps = sorted(int(s) for s in entry["values"])
        assert steps == list(range(entry["start_step"], entry["end_step"] + 1,
                                   entry["step_interval"])), metric
        for value in entry["values"].values():
            assert isinstance(value, (int, float)) and math.isfinite(value)
            assert value == round(value, 5), f"{name} {metric}: not rounded to 5 decimals"
    assert not re.search(r"golden_values_[a-z]+\.json", " ".join(
        p.name for p in (CASES_ROOT / name).iterdir())), "old single-label golden file left"
