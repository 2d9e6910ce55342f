"""--pack-sequences trains the same samples to the same loss as unpacked rows, on every layout.

fp32 on the CPU simulation, plain SGD (see test_mimo_layout_invariance). Mock samples fill at
most half a 64-position row, so a microbatch of two always fits in one packed row and nothing is
cut: packed and unpacked runs see the same tokens, positions and loss mask, and each sample
attends only to itself in both.

Language context parallelism (cp=2) pads each packed sample to a multiple of 2 x cp with
loss-masked positions and splits every sample into its own zigzag chunks: the loss and the
trained encoder must still equal the cp=1 runs'.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness.mimo_runs import MimoLaunch, module_params, shared_run

pytestmark = pytest.mark.multirank

SGD = ("--optimizer", "sgd", "--lr", "0.05", "--min-lr", "0.005")
ROW = ("--seq-length", "64", "--max-position-embeddings", "64")
BASE = (*SGD, *ROW, "--encoder", "vision=vit", "--grid")
PACK = ("--pack-sequences",)
LAYOUTS = {  # name: (processes, layout flags)
    "encoder-dp2-language-dp1": (3, (*BASE, "vision:dp=2", "--grid", "language:")),
    "encoder-dp1-language-dp2": (3, (*BASE, "vision:", "--grid", "language:dp=2")),
}
PP2 = (*BASE, "vision:", "--grid", "language:pp=2")
"""Its stages initialize from their own seeds, so it is compared with itself unpacked."""
ITERATIONS = ("--train-iters", "4", "--eval-iters", "0")
MROPE = (*SGD, *ROW, "--encoder", "vision=vit", "--vit-native-resolution",
         "--vit-max-pixels", "1024", "--position-embedding-type", "mrope",
         "--mrope-section", "2", "3", "3", "--grid", "vision:", "--grid")
"""Native-resolution images at their grids' 3D positions; the language grid comes last."""


def _trained(nproc: int, flags: tuple[str, ...]) -> tuple[dict[int, float],
                                                        dict[str, np.ndarray]]:
    """lm loss per iteration and the trained vision encoder of the layout's launch."""
    scalars, results = shared_run(MimoLaunch(nproc, (*ITERATIONS, *flags)))
    assert sorted(scalars["lm loss"]) == [1, 2, 3, 4]
    return scalars["lm loss"], module_params(results, "vision")


def _losses(nproc: int, flags: tuple[str, ...]) -> dict[int, float]:
    return _trained(nproc, flags)[0]


def _assert_same_training(reference: tuple[int, tuple[str, ...]],
                          other: tuple[int, tuple[str, ...]]) -> None:
    """Per-iteration loss within 1e-5 relative and the same trained encoder."""
    ref_losses, ref_encoder = _trained(*reference)
    losses, encoder = _trained(*other)
    worst = max(abs(losses[i] - value) / abs(value) for i, value in ref_losses.items())
    print(f"max relative lm loss difference {worst:.2e} over {len(ref_losses)} iterations")
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert encoder.keys() == ref_encoder.keys()
    for name, value in ref_encoder.items():
        np.testing.assert_allclose(encoder[name], value, rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.fixture(scope="module")
def packed_reference() -> dict[int, float]:
    return _losses(2, (*BASE, "vision:", "--grid", "language:", *PACK))


def test_packing_on_and_off_train_to_the_same_loss(packed_reference: dict[int, float]) -> None:
    unpacked = _losses(2, (*BASE, "vision:", "--grid", "language:"))
    assert packed_reference == pytest.approx(unpacked, rel=1e-5)


def test_packing_with_rotary_positions_matches_unpacked() -> None:
    rope = (*BASE, "vision:", "--grid", "language:", "--position-embedding-type", "rope")
    assert _losses(2, (*rope, *PACK)) == pytest.approx(_losses(2, rope), rel=1e-5)


def test_packing_with_mrope_grid_positions_matches_unpacked() -> None:
    """Native-resolution images at their grids' 3D positions, restarting per packed sample."""
    mrope = (*MROPE, "language:")
    assert _losses(2, (*mrope, *PACK)) == pytest.approx(_losses(2, mrope), rel=1e-5)


def test_packed_segments_reach_every_pipeline_stage() -> None:
    assert _losses(3, (*PP2, *PACK)) == pytest.approx(_losses(3, PP2), rel=1e-5)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_packed_layouts_train_identically(name: str,
                                          packed_reference: dict[int, float]) -> None:
    nproc, flags = LAYOUTS[name]
    assert _losses(nproc, (*flags, *PACK)) == pytest.approx(packed_reference, rel=1e-5)


def test_packed_rows_at_language_cp2_train_as_at_cp1() -> None:
    """Each sample padded to a multiple of 4 (loss mask 0) and split into its zigzag chunks."""
    _assert_same_training((2, (*BASE, "vision:", "--grid", "language:", *PACK)),
                          (3, (*BASE, "vision:", "--grid", "language:cp=2", *PACK)))


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "unpacked"])
def test_mrope_grid_positions_at_language_cp2_train_as_at_cp1(pack: bool) -> None:
    """Packed: the [3, S] positions of whole packed rows, cut per sample like the tokens;
    unpacked: the row's zigzag chunks."""
    packing = PACK if pack else ()
    _assert_same_training((2, (*MROPE, "language:", *packing)),
                          (3, (*MROPE, "language:cp=2", *packing)))


def test_a_microbatch_whose_runs_overflow_the_packed_row_ends_the_run_in_one_line() -> None:
    """Four samples of two images each cannot share one 64-position packed row: the language
    rank that packs them ends the run with one line naming the samples and what to change
    (exit code 2), not a traceback from inside Megatron's training loop."""
    from tests.harness.mimo_runs import TINY_MIMO
    from tests.harness.multiprocess import REPO_ROOT, run_preforked

    run = run_preforked(REPO_ROOT / "examples" / "mimo" / "pretrain_mimo.py", [
        *TINY_MIMO, *ROW, "--encoder", "vision=vit", "--grid", "vision:", "--grid", "language:",
        *PACK, "--micro-batch-size", "4", "--mock-items-per-sample", "2"], nproc=2, timeout=150)
    assert run.returncode == 2, run.output[-3000:]
    lines = [line for line in run.output.splitlines() if "pretrain_mimo.py: error:" in line]
    assert lines == [
        "pretrain_mimo.py: error: samples 'train/0', 'train/1', 'train/2', 'train/3': their "
        "encoder placeholder runs need 67 positions, more than one packed row of --seq-length 64 "
        "holds (--pack-sequences); raise --seq-length or lower --micro-batch-size"]
    # (the vision rank, cut off mid-step by its peer's exit, may say so before it is killed)
    assert "in pack_row" not in run.output and "PackingError" not in run.output
