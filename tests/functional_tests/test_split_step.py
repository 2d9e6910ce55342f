"""The split train step (begin / microbatch / finish / abort) against stock ``train_step``.

A GPT launch trains the same tiny model from the same start on the same batches once per plan
(see tests/harness/split_step_runs.py): stock ``train_step`` (twice: the second run checks that the
in-place restore between plans is exact), the split API fed the same microbatches with aborted
steps in between, and the split API with uneven microbatch counts per replica. MiMo plans run in
launches of their own, compared across launches (fp32 CPU runs are bit-reproducible).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
import pytest

from tests.harness.split_step_runs import run_plans

pytestmark = pytest.mark.multirank

STOCK = (("stock",), ("stock",), ("stock",))
SPLIT_WITH_ABORTS = (("abort", 1, False), ("split", None), ("abort", 1, True), ("split", None),
                     ("abort", 0, True), ("split", None))
SPLIT_WITH_ABORTS_PP = (("abort", 1, False), ("split", None), ("abort", 2, False),
                        ("split", None), ("split", None))
"""A forward that raises on one pipeline stage would leave the other waiting for its activations:
under PP the aborted steps abandon microbatches that completed."""

# name: (model kind, processes, flags, plans)
SPLIT_WITH_ABORTS_CROSS_GRID = (("abort", 1, False), ("split", None), ("abort", 2, False),
                                ("split", None), ("split", None))
"""Across grids a raising encoder forward leaves the language ranks waiting for its output, too."""
MOE = ("--num-experts", "2", "--moe-router-load-balancing-type", "aux_loss",
       "--moe-aux-loss-coeff", "0.01", "--disable-bias-linear")
VISION = ("--encoder", "vision=vit", "--grid")

# name: (model kind, processes, flags, plans)
LAUNCHES: dict[str, tuple[str, int, tuple[str, ...], dict[str, tuple]]] = {
    "gpt-dp2-distopt": ("gpt", 2, ("--use-distributed-optimizer",), {
        "stock": STOCK, "split": SPLIT_WITH_ABORTS, "misuse": (("misuse",),),
        "stock-again": STOCK}),
    "gpt-dp2-bf16": ("gpt", 2, ("--bf16",), {"stock": STOCK, "split": SPLIT_WITH_ABORTS}),
    "gpt-dp2-moe": ("gpt", 2, MOE, {"stock": STOCK, "split": SPLIT_WITH_ABORTS,
                                   "uneven": (("split", (3, 1)), ("split", (4, 0)),
                                              ("split", (1, 3)))}),
    "gpt-tp2-pp2": ("gpt", 4, ("--tensor-model-parallel-size", "2",
                               "--pipeline-model-parallel-size", "2"), {
        "stock": STOCK, "split": SPLIT_WITH_ABORTS_PP}),
    "gpt-dp2-uneven-sgd": ("gpt", 2, ("--optimizer", "sgd"), {
        "stock": (("stock",), ("stock",)),
        "3-1": (("split", (3, 1)), ("split", (1, 3))),
        "4-0": (("split", (4, 0)), ("split", (0, 4))),
        "sequences-2-2": (("sequences", (2, 2)),),
        "sequences-4-0": (("sequences", (4, 0)),),
    }),
    **{f"mimo-{layout}-{plan}": ("mimo", nproc, flags, {plan: steps})
       for layout, nproc, flags in (
           ("encoder-dp2-language-dp1", 3, (*VISION, "vision:dp=2", "--grid", "language:")),
           ("language-pp2", 3, (*VISION, "vision:", "--grid", "language:pp=2")),
           # Vision on the language ranks: each microbatch runs its forward, the language
           # schedule and its backward.
           ("colocated", 2, (*VISION, "vision:tp=2@language", "--grid", "language:dp=2")))
       for plan, steps in (("stock", STOCK), ("split", SPLIT_WITH_ABORTS_CROSS_GRID))},
}


@lru_cache(maxsize=None)
def launch(name: str) -> list[dict[str, Any]]:
    kind, nproc, flags, plans = LAUNCHES[name]
    return run_plans(kind, nproc, flags, plans)


def assert_params(ranks: list[dict[str, Any]], plan: str, reference: str = "stock",
                  rtol: float = 0.0, reference_ranks: list[dict[str, Any]] | None = None) -> None:
    for rank, result in enumerate(ranks):
        expected_result = (reference_ranks or ranks)[rank][reference]
        assert result[plan]["params"].keys() == expected_result["params"].keys()
        for name, expected in expected_result["params"].items():
            actual = result[plan]["params"][name]
            if rtol == 0.0:
                np.testing.assert_array_equal(actual, expected, err_msg=f"rank {rank} {name}")
            else:
                np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.abs(
                    expected).max(), err_msg=f"rank {rank} {name}")


def split_steps(result: dict[str, Any], plan: str) -> list[dict[str, Any]]:
    return [step for step in result[plan]["steps"] if step["kind"] in ("split", "sequences")]


def test_restoring_the_start_between_plans_is_exact() -> None:
    assert_params(launch("gpt-dp2-distopt"), "stock-again")


def assert_matches_stock(ranks: list[dict[str, Any]], stock_ranks: list[dict[str, Any]],
                         rtol: float = 0.0) -> None:
    assert_params(ranks, "split", rtol=rtol, reference_ranks=stock_ranks)
    for result, stock_result in zip(ranks, stock_ranks):
        stock = stock_result["stock"]["steps"]
        assert len(split_steps(result, "split")) == len(stock)
        for ours, theirs in zip(split_steps(result, "split"), stock):
            assert ours["metrics"].grad_norm == pytest.approx(theirs["grad_norm"], rel=rtol, abs=0)
            if "lm loss" in theirs["loss"]:
                assert ours["metrics"].loss == pytest.approx(theirs["loss"]["lm loss"], rel=1e-6)
            assert ours["metrics"].samples == 8 and not ours["metrics"].skipped


@pytest.mark.parametrize("name", ["gpt-dp2-distopt", "gpt-tp2-pp2", "gpt-dp2-moe"])
def test_split_steps_are_bit_identical_to_stock_train_step(name: str) -> None:
    ranks = launch(name)
    assert_matches_stock(ranks, ranks)
    for result in ranks:
        for step in split_steps(result, "split"):
            assert step["metrics"].count == 8 * 32  # global batch x sequence length


@pytest.mark.parametrize("layout", ["encoder-dp2-language-dp1", "language-pp2"])
def test_mimo_split_steps_are_bit_identical_to_stock_train_step(layout: str) -> None:
    assert_matches_stock(launch(f"mimo-{layout}-split"), launch(f"mimo-{layout}-stock"))


def test_colocated_split_steps_match_stock_train_step() -> None:
    """Stock runs one encoder backward for the step's microbatches, the split step one per
    microbatch: the same sums in another order."""
    assert_matches_stock(launch("mimo-colocated-split"), launch("mimo-colocated-stock"),
                         rtol=1e-6)


def test_bf16_split_steps_match_stock_train_step() -> None:
    ranks = launch("gpt-dp2-bf16")
    assert_matches_stock(ranks, ranks, rtol=1e-6)


@pytest.mark.parametrize("name", ["gpt-dp2-distopt", "gpt-tp2-pp2",
                                  "mimo-encoder-dp2-language-dp1-split"])
def test_one_gradient_reduction_per_module_per_step_none_in_microbatches(name: str) -> None:
    for result in launch(name):
        for step in split_steps(result, "split"):
            assert step["microbatch_reductions"] == 0
            assert step["finish_reductions"] == result["bucket_groups"] == 1


@pytest.mark.parametrize("name", ["gpt-dp2-distopt", "gpt-tp2-pp2", "gpt-dp2-bf16",
                                  "mimo-language-pp2-split", "mimo-colocated-split"])
def test_abort_restores_bit_identical_state(name: str) -> None:
    for result in launch(name):
        aborts = [step for step in result["split"]["steps"] if step["kind"] == "abort"]
        assert aborts and all(step["restored"] for step in aborts)
        raised = [step for step in aborts if step.get("raised")]
        assert all(step["state_before_abort"] == "failed" for step in raised)
    # the steps after each abort match stock's: see the bit-identity tests on the same launch


def test_moe_aux_loss_is_averaged_over_the_true_microbatch_count() -> None:
    for result in launch("gpt-dp2-moe"):
        even = split_steps(result, "split")[0]["metrics"].moe_losses
        uneven = split_steps(result, "uneven")[0]["metrics"].moe_losses
        assert even.keys() == uneven.keys() == {"load_balancing_loss"}
        assert uneven["load_balancing_loss"] == pytest.approx(even["load_balancing_loss"],
                                                              rel=1e-6)


def test_misuse_names_the_call_and_the_state() -> None:
    errors = launch("gpt-dp2-distopt")[0]["misuse"]["steps"][0]["errors"]
    assert errors[0].startswith("SplitTrainStep.microbatch() in state 'idle': call begin()")
    assert errors[1].startswith("SplitTrainStep.finish() in state 'idle'")
    assert errors[2].startswith("SplitTrainStep.begin() in state 'open'")
    assert "0 valid tokens" in errors[3] and "state 'open'" in errors[3]
    assert errors[4].startswith("SplitTrainStep.microbatch() in state 'failed'")
    assert "call abort()" in errors[4]
    assert errors[5].startswith("SplitTrainStep.finish() in state 'failed'")
    assert "loss_kind='bytes'" in errors[6]


@pytest.mark.parametrize("plan", ["3-1", "4-0"])
def test_uneven_microbatch_counts_match_the_even_split(plan: str) -> None:
    ranks = launch("gpt-dp2-uneven-sgd")
    assert_params(ranks, plan, rtol=1e-6)
    for result in ranks:
        for ours, theirs in zip(split_steps(result, plan), result["stock"]["steps"]):
            assert ours["metrics"].grad_norm == pytest.approx(theirs["grad_norm"], rel=1e-6)
            assert ours["metrics"].microbatches == 4 and ours["metrics"].count == 256


def test_sequence_normalizer_is_layout_invariant() -> None:
    ranks = launch("gpt-dp2-uneven-sgd")
    assert_params(ranks, "sequences-4-0", reference="sequences-2-2", rtol=1e-6)
    for result in ranks:
        [even] = split_steps(result, "sequences-2-2")
        [uneven] = split_steps(result, "sequences-4-0")
        assert even["metrics"].count == uneven["metrics"].count == 8
        assert uneven["metrics"].loss == pytest.approx(even["metrics"].loss, rel=1e-6)
