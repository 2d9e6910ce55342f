"""The functional-test comparison rules, on synthetic metrics (Megatron's conventions)."""

from __future__ import annotations

import math

import pytest

from tools.functional_tests import (
    _flags,
    all_cases,
    compare,
    golden_values,
    load_case,
    resume_failures,
)

STEPS = range(1, 21)
LOSS = {s: 5.0 - 0.1 * s for s in STEPS}


def _golden(values: dict[int, float], metric: str = "lm loss", full: bool = True) -> dict:
    golden = golden_values({metric: values}, [metric])
    golden["full_precision"] = full
    return golden


def test_identical_run_passes_and_golden_round_trips():
    assert compare(_golden(LOSS), {"lm loss": dict(LOSS)}, ["lm loss"]) == []


def test_deterministic_mode_is_exact_at_full_precision():
    off = {**LOSS, 7: LOSS[7] + 1e-6}
    [failure] = compare(_golden(LOSS), {"lm loss": off}, ["lm loss"])
    assert "1 steps differ exactly, first step 7" in failure


def test_rounded_goldens_compare_at_five_decimals():
    off = {**LOSS, 7: LOSS[7] + 1e-7}
    assert compare(_golden(LOSS, full=False), {"lm loss": off}, ["lm loss"]) == []
    off[7] = LOSS[7] + 1e-4
    assert compare(_golden(LOSS, full=False), {"lm loss": off}, ["lm loss"])


def test_approximate_mode_tolerates_one_outlier_in_twenty():
    one = {**LOSS, 3: LOSS[3] * 1.5}
    assert compare(_golden(LOSS), {"lm loss": one}, ["lm loss"], deterministic=False) == []
    two = {**one, 4: LOSS[4] * 1.5}
    [failure] = compare(_golden(LOSS), {"lm loss": two}, ["lm loss"], deterministic=False)
    assert "2 of 20 steps outside rtol 0.05 (tolerated 1)" in failure
    near = {s: v * 1.04 for s, v in LOSS.items()}
    assert compare(_golden(LOSS), {"lm loss": near}, ["lm loss"], deterministic=False) == []


def test_num_zeros_has_the_looser_approximate_tolerance():
    zeros = {s: 100.0 for s in STEPS}
    assert compare(_golden(zeros, "num-zeros"), {"num-zeros": {s: 118.0 for s in STEPS}},
                   ["num-zeros"], deterministic=False) == []
    assert compare(_golden(zeros, "num-zeros"), {"num-zeros": {s: 125.0 for s in STEPS}},
                   ["num-zeros"], deterministic=False)


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


def test_model_args_become_argv_like_megatron_cases():
    assert _flags({"--a": 1, "--b": True, "--c": False, "--grid": ["x:", "y:"]}) == [
        "--a", "1", "--b", "--grid", "x:", "--grid", "y:"]


def test_cases_cover_the_required_layouts():
    cases = {name: load_case(name) for name in all_cases()}
    assert len(cases) >= 7
    assert sum(c.test_type == "ckpt-resume" for c in cases.values()) >= 2
    args = [" ".join(c.model_args) for c in cases.values()]
    for required in ("vision:tp=1,dp=2", "audio=audio", "language:pp=2", "language:tp=2",
                     "ep=2"):
        assert any(required in a for a in args), required
    for case in cases.values():
        assert case.metrics == ["lm loss", "num-zeros"]
        assert case.golden_path("cpu").exists(), f"{case.name}: no CPU goldens"
