"""--pack-sequences trains the same samples to the same loss as unpacked rows, on every layout.

fp32 on the CPU simulation, plain SGD (see test_mimo_layout_invariance). Mock samples fill at
most half a 64-position row, so a microbatch of two always fits in one packed row and nothing is
cut: packed and unpacked runs see the same tokens, positions and loss mask, and each sample
attends only to itself in both.
"""

from __future__ import annotations

import pytest

from tests.mimo_runs import train_mimo

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


def _losses(nproc: int, flags: tuple[str, ...]) -> dict[int, float]:
    scalars, _ = train_mimo(nproc, flags, extra=ITERATIONS)
    assert sorted(scalars["lm loss"]) == [1, 2, 3, 4]
    return scalars["lm loss"]


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
    mrope = (*SGD, *ROW, "--encoder", "vision=vit", "--vit-native-resolution",
             "--vit-max-pixels", "1024", "--position-embedding-type", "mrope",
             "--mrope-section", "2", "3", "3", "--grid", "vision:", "--grid", "language:")
    assert _losses(2, (*mrope, *PACK)) == pytest.approx(_losses(2, mrope), rel=1e-5)


def test_packed_segments_reach_every_pipeline_stage() -> None:
    assert _losses(3, (*PP2, *PACK)) == pytest.approx(_losses(3, PP2), rel=1e-5)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_packed_layouts_train_identically(name: str,
                                          packed_reference: dict[int, float]) -> None:
    nproc, flags = LAYOUTS[name]
    assert _losses(nproc, (*flags, *PACK)) == pytest.approx(packed_reference, rel=1e-5)
