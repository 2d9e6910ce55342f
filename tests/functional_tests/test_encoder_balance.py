"""--balance-encoder-work trains identically: encoder replicas of a fan-in group embed other
samples than their fixed slices, and the language puts the rows back in sample order.

Native-resolution vit (images of varied sizes, 0..2 per sample), fp32 SGD on the CPU simulation,
10 iterations: per-iteration ``lm loss``, gradient norm and the trained encoder must match the
one-rank-per-module run to 1e-5 relative, on the same language samples.
"""

from __future__ import annotations

import pytest

from tests.functional_tests.test_mimo_layout_invariance import NATIVE, _assert_same_training
from tests.harness.mimo_runs import MimoLaunch, shared_run

pytestmark = pytest.mark.multirank

BALANCE = "--balance-encoder-work"
LANGUAGE1 = ("--grid", "language:")


def _replica_keys(results: list, module: str) -> dict[int, list[list[str]]]:
    """Per DP replica of ``module`` (its tensor rank 0), the keys of each microbatch it held."""
    return {r["dp_rank"]: r["keys"] for r in results
            if r["module"] == module and r["tp_rank"] == 0}


def _assert_balanced_run_trains_identically(nproc: int, encoder_dp: int,
                                            extra: tuple[str, ...]) -> None:
    grid = ("--grid", f"vision:dp={encoder_dp}", *LANGUAGE1)
    reference = shared_run(MimoLaunch(2, (*NATIVE, *extra, "--grid", "vision:", *LANGUAGE1)))
    balanced = shared_run(MimoLaunch(nproc, (*NATIVE, *extra, *grid, BALANCE)))
    _assert_same_training(reference, balanced, ("vision",))
    fixed = shared_run(MimoLaunch(nproc, (*NATIVE, *extra, *grid)))
    moved = _replica_keys(balanced[1], "vision")
    assert moved != _replica_keys(fixed[1], "vision")
    # Some replica held other than its fixed share of samples in some microbatch.
    per = int(extra[extra.index("--micro-batch-size") + 1]) // encoder_dp if extra else 1
    assert any(len(keys) != per for replica in moved.values() for keys in replica)


def test_encoder_dp2_balanced_into_language_dp1_trains_as_one_rank_per_module() -> None:
    _assert_balanced_run_trains_identically(3, 2, ())


def test_encoder_dp4_balanced_into_language_dp1_trains_as_one_rank_per_module() -> None:
    _assert_balanced_run_trains_identically(5, 4, ("--micro-batch-size", "4"))
