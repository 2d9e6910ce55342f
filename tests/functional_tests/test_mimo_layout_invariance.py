"""The same MiMo model, data and seed train identically on every encoder/language layout.

fp32 on the CPU simulation, 10 iterations, same global batch: the per-iteration ``lm loss`` and
global gradient norm, and the encoder's trained parameters, must agree to 1e-5 relative with the
one-rank-per-module run. This is what catches encoder gradients scaled by encoder_dp/llm_dp,
samples crossing the grid misaligned, and reductions applied twice. Plain SGD keeps the check
sharp: Adam divides each update by its own gradient scale, which would hide a wrongly scaled
encoder gradient, and it turns last-bit differences of near-zero gradients into whole steps.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness.mimo_runs import (
    LOCAL_EXPERT,
    MimoLaunch,
    consumed_keys,
    expert_parallel_params,
    module_params,
    shared_run,
    train_mimo,
)
from tests.harness.multiprocess import WorkerFailure

pytestmark = pytest.mark.multirank

SGD = ("--optimizer", "sgd", "--lr", "0.05", "--min-lr", "0.005")
VISION = (*SGD, "--encoder", "vision=vit", "--grid")
ONE_ENCODER = {  # name: launch
    "encoder1-language1": MimoLaunch(2, (*VISION, "vision:", "--grid", "language:")),
    "encoder-dp2-language-dp2": MimoLaunch(4, (*VISION, "vision:dp=2", "--grid",
                                               "language:dp=2")),
    "encoder-dp1-language-dp2": MimoLaunch(3, (*VISION, "vision:", "--grid", "language:dp=2")),
    "encoder-dp2-language-dp1": MimoLaunch(3, (*VISION, "vision:dp=2", "--grid", "language:")),
    "encoder1-language-tp2": MimoLaunch(3, (*VISION, "vision:", "--grid", "language:tp=2")),
    "upstream-alias-flags": MimoLaunch(3, (*SGD, "--encoder-dp", "1", "--llm-dp", "2")),
    # Language CP: every CP rank gets the whole microbatch and keeps its zigzag chunks; the
    # bridge sums the CP ranks' encoder-row gradients (Gap 18), so the encoder trains as at cp=1.
    "encoder1-language-cp2": MimoLaunch(3, (*VISION, "vision:", "--grid", "language:cp=2")),
    "encoder1-language-cp2-tp2": MimoLaunch(5, (*VISION, "vision:", "--grid",
                                                "language:cp=2,tp=2")),
    "encoder-dp2-language-cp2": MimoLaunch(4, (*VISION, "vision:dp=2", "--grid",
                                               "language:cp=2")),
    "encoder1-language-cp2-dp2": MimoLaunch(5, (*VISION, "vision:", "--grid",
                                                "language:cp=2,dp=2")),
}
TWO = (*SGD, "--encoder", "vision=vit", "--encoder", "audio=audio", "--grid")
TWO_ENCODERS = {
    "1+1+language1": MimoLaunch(3, (*TWO, "vision:", "--grid", "audio:", "--grid", "language:")),
    "dp2+tp2+language1": MimoLaunch(5, (*TWO, "vision:dp=2", "--grid", "audio:tp=2", "--grid",
                                        "language:")),
    "1+1+language-dp2": MimoLaunch(4, (*TWO, "vision:", "--grid", "audio:", "--grid",
                                       "language:dp=2")),
    "1+1+language-cp2": MimoLaunch(4, (*TWO, "vision:", "--grid", "audio:", "--grid",
                                       "language:cp=2")),
}


NATIVE = (*SGD, "--encoder", "vision=vit", "--vit-native-resolution", "--vit-max-pixels", "1024",
          "--seq-length", "64", "--max-position-embeddings", "64")
NATIVE_RESOLUTION = {  # images of varied sizes at their own token counts, 0..2 per sample
    "1+language1": MimoLaunch(2, (*NATIVE, "--grid", "vision:", "--grid", "language:")),
    "dp2+language1": MimoLaunch(3, (*NATIVE, "--grid", "vision:dp=2", "--grid", "language:")),
    "1+language-dp2": MimoLaunch(3, (*NATIVE, "--grid", "vision:", "--grid", "language:dp=2")),
    "tp2+language1": MimoLaunch(3, (*NATIVE, "--grid", "vision:tp=2", "--grid", "language:")),
    "with-audio-dp2+language-dp2": MimoLaunch(5, (*NATIVE, "--encoder", "audio=audio", "--grid",
                                                  "vision:", "--grid", "audio:dp=2", "--grid",
                                                  "language:dp=2")),
}
MROPE = (*NATIVE, "--position-embedding-type", "mrope", "--mrope-section", "2", "3", "3")
"""Multimodal RoPE: each image's tokens at its patch grid's (1, rows, columns) positions."""


def _assert_same_training(reference: tuple, other: tuple, encoders: tuple[str, ...]) -> None:
    ref_scalars, ref_results = reference
    scalars, results = other
    assert sorted(scalars["lm loss"]) == list(range(1, 11))
    assert consumed_keys(results, "language") == consumed_keys(ref_results, "language")
    for tag, values in ref_scalars.items():
        for iteration, value in values.items():
            assert scalars[tag][iteration] == pytest.approx(value, rel=1e-5), (tag, iteration)
    for encoder in encoders:
        expected = module_params(ref_results, encoder)
        got = module_params(results, encoder)
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-7,
                                       err_msg=f"{encoder}: {name}")


@pytest.mark.parametrize("name", list(ONE_ENCODER)[1:])
def test_one_encoder_layouts_train_identically(name: str) -> None:
    reference = shared_run(ONE_ENCODER["encoder1-language1"])
    _assert_same_training(reference, shared_run(ONE_ENCODER[name]), ("vision",))


@pytest.mark.parametrize("name", list(TWO_ENCODERS)[1:])
def test_two_encoder_layouts_train_identically(name: str) -> None:
    reference = shared_run(TWO_ENCODERS["1+1+language1"])
    _assert_same_training(reference, shared_run(TWO_ENCODERS[name]), ("vision", "audio"))


@pytest.mark.parametrize("name", list(NATIVE_RESOLUTION)[1:3] + list(NATIVE_RESOLUTION)[3:4])
def test_native_resolution_layouts_train_identically(name: str) -> None:
    reference = shared_run(NATIVE_RESOLUTION["1+language1"])
    _assert_same_training(reference, shared_run(NATIVE_RESOLUTION[name]), ("vision",))


def test_mrope_native_resolution_trains_identically_at_language_tp2() -> None:
    """The [3, S] positions reach every language rank and split with the heads' rotary dims."""
    reference = shared_run(MimoLaunch(2, (*MROPE, "--grid", "vision:", "--grid", "language:")))
    _assert_same_training(reference, shared_run(MimoLaunch(
        3, (*MROPE, "--grid", "vision:", "--grid", "language:tp=2"))), ("vision",))


def test_native_resolution_with_a_second_encoder_trains_identically_across_layouts() -> None:
    one = (*NATIVE, "--encoder", "audio=audio", "--grid", "vision:", "--grid", "audio:",
           "--grid", "language:")
    reference = shared_run(MimoLaunch(3, one))
    _assert_same_training(reference, shared_run(NATIVE_RESOLUTION[
        "with-audio-dp2+language-dp2"]), ("vision", "audio"))


def test_variable_samples_hold_text_only_and_multi_item_samples() -> None:
    """What the layouts above were fed: samples without any item, with one and with two."""
    _, results = shared_run(NATIVE_RESOLUTION["1+language1"])
    [language] = [r for r in results if r["module"] == "language"]
    images = [items for microbatch in language["item_tokens"] for items in microbatch["vision"]]
    assert {0, 1, 2} <= {len(items) for items in images}
    sizes = {count for items in images for count in items}
    assert len(sizes) >= 3, sizes  # native resolution: token counts follow the image sizes


def test_reference_run_learns_and_encoders_matter() -> None:
    scalars, results = shared_run(ONE_ENCODER["encoder1-language1"])
    losses = scalars["lm loss"]
    assert losses[10] < losses[1] - 0.2, losses
    two_scalars, _ = shared_run(TWO_ENCODERS["1+1+language1"])
    assert two_scalars["lm loss"][1] != losses[1], "a second encoder must change the model"
    encoder = module_params(results, "vision")
    assert any(np.abs(value).sum() > 0 for value in encoder.values())


REDUCTIONS = {  # overlap: the launch whose reductions are counted (overlap off: a reference's)
    False: ONE_ENCODER["encoder-dp2-language-dp2"],
    True: MimoLaunch(4, ("--train-iters", "3", "--eval-iters", "0",
                         *ONE_ENCODER["encoder-dp2-language-dp2"].flags, "--overlap-grad-reduce")),
}


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap-off", "overlap-on"])
def test_one_gradient_reduction_per_module_per_step(overlap: bool) -> None:
    scalars, results = shared_run(REDUCTIONS[overlap])
    # One bucket group per module (the tiny model fits one bucket): a reduction per step.
    assert [r["reductions"] for r in results] == [len(scalars["lm loss"])] * 4


UNTIED = ("--untie-embeddings-and-output-weights",)


@pytest.fixture(scope="module")
def from_saved_weights(tmp_path_factory) -> tuple[tuple[str, ...], tuple]:
    """Megatron seeds each pipeline stage's init stream on its own, so PP changes the random
    init; the pipelined layouts therefore start from one checkpoint's weights (saved by the
    one-rank-per-module layout, resharded by the load). Returns the load flags and the
    one-rank-per-module run from that checkpoint."""
    one = (*VISION, "vision:", "--grid", "language:", *UNTIED)
    checkpoint = str(tmp_path_factory.mktemp("pipeline") / "checkpoints")
    train_mimo(2, one, extra=("--train-iters", "2", "--eval-iters", "0", "--save", checkpoint,
                              "--save-interval", "2"))
    load = ("--load", checkpoint, "--finetune", "--no-load-optim", "--no-load-rng")
    return load, train_mimo(2, one, extra=load, observe_params=True, observe_keys=True)


@pytest.mark.parametrize("nproc, grid", [(3, "language:pp=2"), (5, "language:pp=2,cp=2")],
                         ids=["pp2", "pp2-cp2"])
def test_language_pipeline_parallel_trains_identically_from_the_same_weights(
        from_saved_weights: tuple, nproc: int, grid: str) -> None:
    """From the same weights, pipelined language layouts train as the one-rank-per-module run
    (pp2-cp2: both stages split their rows over CP, the last one's loss too)."""
    load, reference = from_saved_weights
    pipelined = train_mimo(nproc, (*VISION, "vision:", "--grid", grid, *UNTIED),
                           extra=load, observe_params=True, observe_keys=True)
    _assert_same_training(reference, pipelined, ("vision",))


def test_frozen_language_model_keeps_its_weights_while_the_encoder_trains() -> None:
    flags = (*VISION, "vision:", "--grid", "language:")
    short = ("--train-iters", "3", "--eval-iters", "0")
    _, frozen = train_mimo(2, (*flags, "--freeze-language-model"), extra=short,
                           observe_params=True)
    _, initial = train_mimo(2, (*flags, "--freeze-language-model", "--lr", "0", "--min-lr", "0"),
                            extra=short, observe_params=True)  # lr 0: the init (freezing
    # every module is refused)
    for name, value in module_params(initial, "language").items():
        np.testing.assert_array_equal(module_params(frozen, "language")[name], value, name)
    trained, start = module_params(frozen, "vision"), module_params(initial, "vision")
    assert all(not np.array_equal(trained[name], start[name]) for name in start)


COLOCATED = {  # encoders on the language model's ranks, each grid with its own parallelism
    # Encoder DP 4 over language TP 2 x DP 2: each language replica merges rows two encoder
    # replicas computed, one of them on its other TP rank.
    "vision-dp4-on-language-tp2-dp2": MimoLaunch(4, (*VISION, "vision:dp=4@language", "--grid",
                                                     "language:tp=2,dp=2")),
    # Encoder TP 2 over language DP 2: rank 1 computes replica 0's rows but merges replica 1's
    # (the wheel's colocated communicator would hand it replica 0's).
    "vision-tp2-on-language-dp2": MimoLaunch(2, (*VISION, "vision:tp=2@language", "--grid",
                                                 "language:dp=2")),
}


@pytest.mark.parametrize("name", list(COLOCATED))
def test_colocated_layouts_train_identically(name: str) -> None:
    reference = shared_run(ONE_ENCODER["encoder1-language1"])
    _assert_same_training(reference, shared_run(COLOCATED[name]), ("vision",))


def test_a_colocated_and_a_separate_encoder_train_identically() -> None:
    """Vision on the language ranks, audio on a rank of its own."""
    reference = shared_run(TWO_ENCODERS["1+1+language1"])
    mixed = shared_run(MimoLaunch(3, (*TWO, "vision:dp=2@language", "--grid", "audio:",
                                      "--grid", "language:dp=2")))
    _assert_same_training(reference, mixed, ("vision", "audio"))


def test_colocated_native_resolution_trains_identically() -> None:
    """Images of varied sizes, 0..2 per sample: every sample's own row count is routed."""
    reference = shared_run(NATIVE_RESOLUTION["1+language1"])
    colocated = shared_run(MimoLaunch(4, (*NATIVE, "--grid", "vision:dp=4@language", "--grid",
                                          "language:tp=2,dp=2")))
    _assert_same_training(reference, colocated, ("vision",))


@pytest.mark.parametrize("grids", [("vision:tp=2,dp=2@language", "language:pp=2,dp=2"),
                                   ("vision:tp=2,dp=2@language", "language:pp=2,tp=2")],
                         ids=["enc-tp2-dp2-lang-pp2-dp2", "enc-tp2-dp2-lang-pp2-tp2"])
def test_colocated_encoder_under_a_pipelined_language_model_trains_identically(
        from_saved_weights: tuple, grids: tuple[str, str]) -> None:
    """Encoder replicas on both language stages send their rows to the first stage, which
    merges them; the last stage's ranks compute encoder rows too (pp2-dp2: rank 1 is encoder
    replica 0 but language replica 1's first stage)."""
    load, reference = from_saved_weights
    encoder, language = grids
    colocated = train_mimo(4, (*VISION, encoder, "--grid", language, *UNTIED), extra=load,
                           observe_params=True, observe_keys=True)
    _assert_same_training(reference, colocated, ("vision",))


def test_a_colocated_step_routes_once_per_direction_and_reduces_once_per_module() -> None:
    """3 steps of 2 microbatches: one row exchange forward and one backward per step, one DP
    reduction per module per step, and each rank receives exactly the rows it merges but did
    not compute (encoder DP 4: rank r computes position r; language replica r // 2 merges
    positions 2(r // 2) and 2(r // 2) + 1 on both its TP ranks; no gradient has to move)."""
    _, results = train_mimo(4, COLOCATED["vision-dp4-on-language-tp2-dp2"].flags,
                            extra=("--train-iters", "3", "--eval-iters", "0"),
                            count_reductions=True, observe_keys=True)
    vision = [r for r in results if r["module"] == "vision"]
    assert [r["routings"] for r in vision] == [{"forward": 3, "backward": 3}] * 4
    assert [r["reductions"] for r in results] == [6] * 8  # language and vision on every rank
    language = {r["dp_rank"]: r for r in results if r["module"] == "language"}
    row_bytes = 64 * 4  # hidden size x fp32
    for encoder in vision:
        rank = encoder["dp_rank"]
        last_step = language[rank // 2]["item_tokens"][-2:]
        other = sum(sum(microbatch["vision"][(rank ^ 1) % 2]) for microbatch in last_step)
        assert encoder["traffic"] == (other * row_bytes, other * row_bytes), rank


def test_a_colocated_encoder_fed_other_samples_is_caught() -> None:
    with pytest.raises(WorkerFailure, match=r"data misalignment at microbatch 0 of this step: "
                                            r"encoder 'vision' dp rank 0 \(global rank 0\)"):
        train_mimo(2, COLOCATED["vision-tp2-on-language-dp2"].flags, misalign=True, timeout=120)


def test_a_frozen_colocated_encoder_trains_as_on_its_own_ranks() -> None:
    """Tower and projection frozen: no row gradient is routed back, the language model trains
    on the same rows."""
    short = ("--train-iters", "3", "--eval-iters", "0", "--freeze-encoder", "vision",
             "--freeze-projection", "vision")
    _, separate = train_mimo(2, ONE_ENCODER["encoder1-language1"].flags, extra=short,
                             observe_params=True)
    scalars, colocated = train_mimo(2, COLOCATED["vision-tp2-on-language-dp2"].flags,
                                    extra=short, observe_params=True)
    for module in ("vision", "language"):
        expected = module_params(separate, module)
        for name, value in module_params(colocated, module).items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-7,
                                       err_msg=f"{module}: {name}")


PACKED = ("--train-iters", "4", "--eval-iters", "0", *SGD, "--seq-length", "64",
          "--max-position-embeddings", "64", "--encoder", "vision=vit", "--grid")
"""Packed rows for sequence parallelism: a mock sample fills at most half a row, so unpacked the
second TP rank's share of every row is padding, outside the loss, and a norm gradient it failed
to contribute would go unseen; packed, two samples fill both shares. The dense reference is
test_sequence_packing's packed one-rank-per-module launch (shared_run trains it once)."""
MOE = ("--num-experts", "4", "--moe-router-topk", "2")
HYBRID = ("--train-iters", "4", "--eval-iters", "0", *SGD, "--hybrid-layer-pattern", "*-*E", *MOE,
          "--encoder", "vision=vit", "--grid")
"""Megatron's hybrid stack (attention, MLP, MoE layers), unpacked (--pack-sequences packs GPT
only): the second TP rank's share is padding, so :func:`_replicas_agree` holds its norms to the
first rank's."""
SEQUENCE_PARALLEL = {  # name: (one rank per module, the sequence-parallel layout)
    "language-tp2": (
        MimoLaunch(2, (*PACKED, "vision:", "--grid", "language:", "--pack-sequences")),
        MimoLaunch(3, (*PACKED, "vision:", "--grid", "language:tp=2", "--pack-sequences",
                       "--sequence-parallel"))),
    # The experts split over the TP ranks (etp=1: stock's expert biases need it).
    "moe-language-tp2-ep2": (
        MimoLaunch(2, (*PACKED, "vision:", "--grid", "language:", "--pack-sequences", *MOE)),
        MimoLaunch(3, (*PACKED, "vision:", "--grid", "language:tp=2,ep=2,etp=1",
                       "--pack-sequences", "--sequence-parallel", *MOE))),
    "moe-language-tp2-ep2-colocated-encoder": (
        MimoLaunch(2, (*PACKED, "vision:", "--grid", "language:", "--pack-sequences", *MOE)),
        MimoLaunch(2, (*PACKED, "vision:dp=2@language", "--grid", "language:tp=2,ep=2,etp=1",
                       "--pack-sequences", "--sequence-parallel", *MOE))),
    "hybrid-moe-language-tp2-ep2": (
        MimoLaunch(2, (*HYBRID, "vision:", "--grid", "language:")),
        MimoLaunch(3, (*HYBRID, "vision:", "--grid", "language:tp=2,ep=2,etp=1",
                       "--sequence-parallel"))),
}


def _replicas_agree(results: list[dict], module: str) -> None:
    """Every parameter a module keeps whole on each TP rank (norms, biases after a row-parallel
    layer, routers) is identical on all of them: a rank whose norm gradient missed the others'
    tokens would drift."""
    ranks = [r for r in results if r["module"] == module and r["dp_rank"] == 0]
    assert len(ranks) > 1
    for name, value in ranks[0]["params"].items():
        if ranks[0]["partition_dims"][name] is None and not LOCAL_EXPERT.search(name):
            for other in ranks[1:]:
                np.testing.assert_array_equal(other["params"][name], value,
                                              err_msg=f"{module}: {name}")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(SEQUENCE_PARALLEL))
def test_sequence_parallel_language_layouts_train_identically(name: str) -> None:
    """--sequence-parallel on the local path (its torch norms marked as TE's are, compat Gap 37;
    experts' biases and the MiMo gradient norm's expert groups, Gaps 38 and 39; the hybrid
    model's embedding, Gap 40): every loss and gradient norm (1e-5 relative) and every trained
    tensor of both modules, experts by their global index, as one rank per module trains them;
    the parameters each TP rank keeps whole, equal on both."""
    reference, launch = SEQUENCE_PARALLEL[name]
    ref_scalars, ref_results = shared_run(reference)
    scalars, results = shared_run(launch)
    assert sorted(scalars["lm loss"]) == [1, 2, 3, 4]
    assert consumed_keys(results, "language") == consumed_keys(ref_results, "language")
    worst = {}
    for tag, values in ref_scalars.items():
        for iteration, value in values.items():
            assert scalars[tag][iteration] == pytest.approx(value, rel=1e-5), (tag, iteration)
        worst[tag] = max(abs(scalars[tag][i] - v) / abs(v) for i, v in values.items())
    for module, trained in (("language", expert_parallel_params), ("vision", module_params)):
        expected, got = trained(ref_results, module), trained(results, module)
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-7,
                                       err_msg=f"{module}: {key}")
        worst[module] = max(float(np.abs(got[key] - value).max())
                            for key, value in expected.items())
    _replicas_agree(results, "language")
    print(f"{name}: max relative lm loss / grad-norm difference {worst['lm loss']:.1e} / "
          f"{worst['grad-norm']:.1e}; max absolute trained-tensor difference language "
          f"{worst['language']:.1e}, vision {worst['vision']:.1e}")
