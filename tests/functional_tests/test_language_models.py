"""The language models the README promises train on the CPU simulation: MoE GPT on one expert
rank with biases, MoE GPT whose CPU-initialized experts are the same model at EP 1 and EP 2, and
hybrid attention/MLP/MoE patterns (``compat.model_build`` Gaps 4-4c).

Each run is the tiny MiMo model (vision encoder on rank 0) for 6 iterations.
"""

from __future__ import annotations

import importlib.util
import math
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_plugins.model.language import LanguageModelError, language_config_from_args
from tests.harness.mimo_runs import MimoLaunch, shared_run

SHORT = ("--train-iters", "6", "--eval-interval", "6", "--lr", "3e-3", "--min-lr", "3e-4")
MOE = ("--num-experts", "4", "--moe-router-topk", "2")


def _layout(nproc: int, language: str, *flags: str) -> MimoLaunch:
    return MimoLaunch(nproc, (*SHORT, "--encoder", "vision=vit", "--grid", "vision:", "--grid",
                              language, *flags))


def _language_params(results: list[dict], dp_rank: int) -> dict[str, np.ndarray]:
    [result] = [r for r in results if r["module"] == "language" and r["dp_rank"] == dp_rank]
    return result["params"]


def _assert_trains(losses: dict[int, float]) -> None:
    assert sorted(losses) == list(range(1, 7))
    assert all(math.isfinite(value) for value in losses.values())
    assert losses[6] < losses[1] - 0.1, losses


@pytest.mark.multirank
def test_moe_on_one_expert_rank_with_biases_trains() -> None:
    scalars, results = shared_run(_layout(3, "language:dp=2", *MOE))
    _assert_trains(scalars["lm loss"])
    params = _language_params(results, dp_rank=0)
    # Stock --add-bias-linear: the experts carry the biases whose in-place add used to crash.
    assert "module.decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.bias" in params


@pytest.mark.multirank
def test_cpu_initialized_experts_are_distinct_and_the_same_model_at_ep1_and_ep2() -> None:
    ep1_scalars, _ = shared_run(_layout(3, "language:dp=2", *MOE))
    ep2_scalars, results = shared_run(_layout(3, "language:dp=2,ep=2", *MOE))
    for iteration, value in ep1_scalars["lm loss"].items():
        assert ep2_scalars["lm loss"][iteration] == pytest.approx(value, rel=1e-5), iteration
    ep0, ep1 = _language_params(results, 0), _language_params(results, 1)
    experts = [name for name in ep0 if ".experts." in name]
    assert experts and all(not np.array_equal(ep0[name], ep1[name]) for name in experts)
    dense = [name for name in ep0 if ".experts." not in name]
    assert all(np.array_equal(ep0[name], ep1[name]) for name in dense)


@pytest.mark.multirank
def test_hybrid_attention_and_mlp_pattern_trains() -> None:
    scalars, results = shared_run(_layout(2, "language:", "--hybrid-layer-pattern", "*-"))
    _assert_trains(scalars["lm loss"])
    params = _language_params(results, dp_rank=0)
    assert "module.decoder.layers.1.mlp.linear_fc1.weight" in params
    assert "module.decoder.final_norm.weight" in params


@pytest.mark.multirank
def test_hybrid_moe_pattern_trains() -> None:
    scalars, results = shared_run(
        _layout(2, "language:", "--hybrid-layer-pattern", "*E", *MOE))
    _assert_trains(scalars["lm loss"])
    params = _language_params(results, dp_rank=0)
    assert "module.decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight" in params


def test_hybrid_mamba_pattern_without_mamba_ssm_is_refused_in_one_line() -> None:
    if importlib.util.find_spec("mamba_ssm") is not None:
        pytest.skip("mamba-ssm is installed here")
    with pytest.raises(LanguageModelError, match=r"--hybrid-layer-pattern M\*-.*mamba-ssm"):
        language_config_from_args(SimpleNamespace(hybrid_layer_pattern="M*-"))
