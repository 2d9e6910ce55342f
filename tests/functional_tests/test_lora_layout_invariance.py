"""LoRA trains the same adapters at every layout, and trains exactly what the flags say.

From one checkpoint's weights (base and adapters; a pipelined layout changes the random init),
fp32, plain SGD, 10 iterations with LoRA on the language model and on the vision tower (its
projection trained fully): the per-iteration ``lm loss`` and grad norm, every trained adapter and
the projection agree to 1e-5 relative with one rank per module at encoder TP 2 + language TP 2,
language PP 2, language CP 2 and with the encoder colocated on the language ranks (adapters
sharded over TP as their base layers, split over pipeline stages, under context parallelism and
routed rows). On an MoE language model the experts are adapted too: EP 2 trains as EP 1, every
expert's adapters included.

Qwen3.5's Gated DeltaNet layers (a tiny whole folder, 3 SGD steps): LoRA on their fused ``in_proj``
(its ``B`` split over TP by section, as the weight) and ``out_proj`` beside attention and MLP
trains identically at language TP 2, its checkpoint exporting the same adapters.

The mixed case the issue names, so it cannot silently regress (a peer froze a tower users asked
to train): LoRA on the language model, the vision tower trained fully, its projection frozen.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.harness.mimo_runs import MimoLaunch, shared_run, train_mimo
from tests.harness.tensorboard_scalars import read_scalars
from tests.models.hf import safetensors_of
from tests.models.qwen3_5_whole import LORA_LAYOUTS, lora_runs

pytestmark = pytest.mark.multirank

SGD = ("--optimizer", "sgd", "--lr", "0.05", "--min-lr", "0.005")
LORA = ("--lora", "language:rank=4,alpha=8", "--lora", "vision:rank=4,alpha=8")
VISION = (*SGD, "--encoder", "vision=vit", "--untie-embeddings-and-output-weights", "--grid")
ONE = (*VISION, "vision:", "--grid", "language:")
LAYOUTS = {  # name: (processes, --grid values)
    "encoder-tp2-language-tp2": (4, ("vision:tp=2", "language:tp=2")),
    "language-pp2": (3, ("vision:", "language:pp=2")),
    "language-cp2": (3, ("vision:", "language:cp=2")),
    "colocated-encoder-tp2-language-dp2": (2, ("vision:tp=2@language", "language:dp=2")),
}
LAYERS = 2
"""The tiny model's language layers (tests.models.tiny), split evenly over pipeline stages."""


def module_params(results: list[dict], module: str) -> dict[str, np.ndarray]:
    """The trained, unsharded parameters of ``module`` under global layer numbers: the first
    DP replica's (CP rank 0's) TP shards joined, each pipeline stage's layers renumbered."""
    joined: dict[str, np.ndarray] = {}
    ranks = [r for r in results if r["module"] == module and r["dp_rank"] == 0
             and r["cp_rank"] == 0]
    stages = max(r["pp_rank"] for r in ranks) + 1
    for stage in range(stages):
        shards = sorted((r for r in ranks if r["pp_rank"] == stage), key=lambda r: r["tp_rank"])
        for name, value in shards[0]["params"].items():
            dim = shards[0]["partition_dims"][name]
            if dim is not None:
                value = np.concatenate([s["params"][name] for s in shards], axis=dim)
            joined[_global(name, stage * LAYERS // stages)] = value
    return joined


def _global(name: str, offset: int) -> str:
    head, found, rest = name.partition("decoder.layers.")
    if not found:
        return name
    index, _, tail = rest.partition(".")
    return f"{head}{found}{int(index) + offset}.{tail}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[tuple[str, ...], list[dict]]:
    """One LoRA step at one rank per module, saved: the load flags every layout starts from and
    that run's parameters (the checkpoint's)."""
    checkpoint = str(tmp_path_factory.mktemp("lora") / "checkpoints")
    _, results = train_mimo(2, (*ONE, *LORA), extra=(
        "--train-iters", "1", "--eval-iters", "0", "--save", checkpoint, "--save-interval", "1"),
        observe_params=True, timeout=400)
    return ("--load", checkpoint, "--finetune", "--no-load-optim", "--no-load-rng"), results


@pytest.fixture(scope="module")
def reference(saved) -> tuple[dict, list[dict]]:
    return train_mimo(2, (*ONE, *LORA), extra=saved[0], observe_params=True, timeout=400)


def _adapters(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: value for name, value in params.items() if ".lora_" in name}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_trains_identically_at_every_layout(saved, reference, name):
    nproc, (encoder, language) = LAYOUTS[name]
    scalars, results = train_mimo(nproc, (*VISION, encoder, "--grid", language, *LORA),
                                  extra=saved[0], observe_params=True, timeout=600)
    ref_scalars, ref_results = reference
    assert sorted(scalars["lm loss"]) == list(range(1, 11))
    for tag, values in ref_scalars.items():
        for iteration, value in values.items():
            assert scalars[tag][iteration] == pytest.approx(value, rel=1e-5), (tag, iteration)
    for module in ("language", "vision"):
        expected, got = module_params(ref_results, module), module_params(results, module)
        assert got.keys() == expected.keys()
        adapters = _adapters(expected)
        assert len(adapters) == 16  # 2 layers x (qkv, proj, fc1, fc2) x (A, B)
        for param, value in (expected if module == "vision" else adapters).items():
            np.testing.assert_allclose(got[param], value, rtol=1e-5, atol=1e-7,
                                       err_msg=f"{name} {module}: {param}")


@pytest.mark.timeout(600)
def test_lora_language_with_a_fully_trained_tower_and_a_frozen_projection(saved, reference):
    """Tower weights move, the projection's do not, the language model's own weights do not,
    its adapters do; and LoRA's own run (tower adapted) left the tower's base untouched."""
    load, start = saved
    _, results = train_mimo(2, (*ONE, "--lora", "language:rank=4,alpha=8",
                                "--freeze-projection", "vision"), extra=load,
                            observe_params=True, timeout=400)
    before = {module: module_params(start, module) for module in ("vision", "language")}
    after = {module: module_params(results, module) for module in ("vision", "language")}
    tower = [name for name in after["vision"] if ".encoders." in name]
    projection = [name for name in after["vision"] if ".input_projections." in name]
    assert tower and projection
    for name in tower:
        assert not np.array_equal(after["vision"][name], before["vision"][name]), name
    for name in projection:
        np.testing.assert_array_equal(after["vision"][name], before["vision"][name], name)
    assert not _adapters(after["vision"])
    language = after["language"]
    adapters = _adapters(language)
    assert len(adapters) == 16
    for name, value in language.items():
        moved = not np.array_equal(value, before["language"][name])
        assert moved == (name in adapters), name
    # the adapted run's tower base stays at its initial weights
    ref_vision = module_params(reference[1], "vision")
    for name in tower:
        if ".lora_" not in name:
            np.testing.assert_array_equal(ref_vision[name], before["vision"][name], name)


def _every_rank(results: list[dict], module: str) -> dict[str, np.ndarray]:
    """``module``'s parameters of every rank (unsharded: TP 1, PP 1) under global names, so
    experts split over EP come together; replicas give the same tensor."""
    params: dict[str, np.ndarray] = {}
    for result in (r for r in results if r["module"] == module):
        for name, value in result["params"].items():
            params.setdefault(result["global_names"][name], value)
    return params


@pytest.mark.timeout(600)
def test_lora_on_an_moe_language_model_trains_identically_at_ep1_and_ep2():
    """LoRA on an MoE language model adapts its attention and every routed expert's MLP: expert
    parallelism changes neither the losses nor any trained adapter. At EP 2 the two DP ranks
    hold different experts, so an expert's adapters reduced over plain DP, as a dense layer's
    are, would mix two experts' gradients. CPU-initialized experts are the same model at EP 1
    and EP 2 (test_language_models.py)."""
    moe = ("--num-experts", "4", "--moe-router-topk", "2", "--lora", "language:rank=4,alpha=8")
    runs = {ep: shared_run(MimoLaunch(3, (*VISION, "vision:", "--grid", language, *moe),
                                      timeout=400))
            for ep, language in ((1, "language:dp=2"), (2, "language:dp=2,ep=2"))}
    (ep1_scalars, ep1), (ep2_scalars, ep2) = runs[1], runs[2]
    assert sorted(ep2_scalars["lm loss"]) == list(range(1, 11))
    for iteration, value in ep1_scalars["lm loss"].items():
        assert ep2_scalars["lm loss"][iteration] == pytest.approx(value, rel=1e-5), iteration
    expected, got = (_adapters(_every_rank(results, "language")) for results in (ep1, ep2))
    # 2 layers x ((qkv, proj) + 4 experts x (fc1, fc2)) x (A, B)
    assert len(expected) == 40 and got.keys() == expected.keys()
    assert all(np.any(value) for name, value in expected.items() if ".lora_b" in name)  # trained
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-7, err_msg=name)


GATED_DELTA_NET = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
"""transformers' Qwen3.5 Gated DeltaNet linears: Megatron's ``in_proj`` rows, then ``out_proj``."""


@pytest.mark.timeout(900)
def test_lora_on_gated_delta_net_trains_identically_at_language_tp2():
    """Every linear of the tiny Qwen3.5 language model adapted, Gated DeltaNet's among them: one
    rank's and language TP 2's per-iteration losses agree, and the adapters each checkpoint
    exports under transformers' names (``B`` in the HF layout, whatever the TP that saved it)
    are the same trained tensors (1e-5)."""
    root, _ = lora_runs()
    losses = [read_scalars(root / f"{name}-tensorboard", "lm loss") for name in LORA_LAYOUTS]
    assert sorted(losses[0]) == [1, 2, 3]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    expected, got = (safetensors_of(root / f"out_{name}" / "adapters") for name in LORA_LAYOUTS)
    assert got.keys() == expected.keys()
    layers = "base_model.model.model.language_model.layers."
    assert {f"{layers}{layer}.linear_attn.{linear}.lora_{kind}.weight" for layer in (0, 2)
            for linear in GATED_DELTA_NET for kind in "AB"} <= expected.keys()
    # 2 Gated DeltaNet layers x (5 + 3 MLP) + 2 attention layers x (4 + 3 MLP) linears, A and B
    assert len(expected) == 60
    for name, value in expected.items():
        assert ".lora_A." in name or torch.count_nonzero(value), name  # every B trained
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-7, msg=name)
