"""What a rank hosting an encoder holds for backward, and what --colocated-encoder-recompute saves.

Same tiny model, data and seed on three layouts: vision and language on 2 ranks each
(``separate``), vision on the language ranks (``colocated``), and the same with
``--colocated-encoder-recompute`` (``recompute``). Four microbatches per step (global batch 16,
micro-batch 2, language dp 2), two steps, dropout 0.1 in the encoder and the language model (the
recomputed forward must draw the masks phase 1 drew). A colocated rank keeps every microbatch's
encoder activations until the step's encoder backward; with the recompute it keeps one
microbatch's at a time and trains identically. Saved-for-backward bytes are measured per rank by
:class:`tests.harness.activation_memory.HeldActivations`; the per-microbatch reference is the
separate layout's encoder forwards (the same positions per encoder DP rank in every layout).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.harness.mimo_runs import MimoLaunch, module_params, shared_run

pytestmark = pytest.mark.multirank

MICROBATCHES = 4
BASE = ("--optimizer", "sgd", "--lr", "0.05", "--min-lr", "0.005", "--encoder", "vision=vit",
        "--global-batch-size", "16", "--train-iters", "2", "--eval-iters", "0",
        "--hidden-dropout", "0.1")
COLOCATED = ("--grid", "vision:dp=2@language", "--grid", "language:dp=2")
LAYOUTS = {
    "separate": MimoLaunch(4, (*BASE, "--grid", "vision:dp=2", "--grid", "language:dp=2"),
                           observe_memory=True),
    "colocated": MimoLaunch(2, (*BASE, *COLOCATED), observe_memory=True),
    "recompute": MimoLaunch(2, (*BASE, *COLOCATED, "--colocated-encoder-recompute"),
                            observe_memory=True),
}


def _run(name: str) -> tuple[dict[str, dict[int, float]], list[dict[str, Any]]]:
    return shared_run(LAYOUTS[name])


def _vision(name: str) -> dict[int, dict[str, Any]]:
    """The memory report of each rank computing vision rows, by its vision DP rank."""
    return {r["dp_rank"]: r["memory"] for r in _run(name)[1] if r["module"] == "vision"}


def _microbatch_bytes(dp_rank: int) -> list[list[int]]:
    """Per step, the bytes each microbatch's encoder forward saves on vision DP rank
    ``dp_rank`` (the separate layout runs every microbatch through it, with images or not)."""
    forwards = _vision("separate")[dp_rank]["encoder_forwards"]
    assert len(forwards) == 2 * MICROBATCHES
    return [forwards[:MICROBATCHES], forwards[MICROBATCHES:]]


def test_a_colocated_rank_holds_every_microbatch_s_encoder_activations() -> None:
    for dp_rank, memory in _vision("colocated").items():
        steps = _microbatch_bytes(dp_rank)
        assert memory["peak"]["encoder"] == pytest.approx(max(map(sum, steps)), rel=0.01)
        assert memory["peak"]["encoder"] > 2 * max(map(max, steps))


def test_encoder_recompute_holds_one_microbatch_s_encoder_activations() -> None:
    separate_totals = [r["memory"]["peak"]["total"] for r in _run("separate")[1]]
    for dp_rank, memory in _vision("recompute").items():
        largest = max(map(max, _microbatch_bytes(dp_rank)))
        assert memory["peak"]["encoder"] == pytest.approx(largest, rel=0.01)
        # Phase 3 starts once the language model's activations are freed: the rank's peak is
        # no higher than the separate layout's largest rank's.
        assert memory["peak"]["total"] <= max(separate_totals)


def test_encoder_recompute_trains_like_the_colocated_step() -> None:
    colocated_scalars, colocated = _run("colocated")
    recompute_scalars, recompute = _run("recompute")
    separate_scalars, _ = _run("separate")
    losses = colocated_scalars["lm loss"]
    assert sorted(losses) == [1, 2]
    for scalars in (recompute_scalars, separate_scalars):
        np.testing.assert_allclose([scalars["lm loss"][i] for i in losses], list(losses.values()),
                                   rtol=1e-5)
    for module in ("vision", "language"):
        expected = module_params(colocated, module)
        for name, value in module_params(recompute, module).items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-7,
                                       err_msg=f"{module}: {name}")
