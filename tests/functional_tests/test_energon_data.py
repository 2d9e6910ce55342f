"""Real data (Energon, a real tokenizer) trains the same on every layout, resumes exactly, and a
misaligned encoder is caught.

The dataset is the README's generated image + audio + caption set, made once per test process.
Layout invariance here is the acceptance of the real-data path: the same samples, in the same
order, reach the same positions whatever the encoder and language DP sizes, because every rank
reads one global stream (one Energon batch per step) and keeps its positions of it.
"""

from __future__ import annotations

import pytest

from tests.energon_data import energon_flags, synthetic_dataset
from tests.mimo_runs import train_mimo
from tests.multiprocess import WorkerFailure

SGD = ("--optimizer", "sgd", "--lr", "0.05", "--min-lr", "0.005")
VISION = ("--encoder", "vision=vit", "--grid")
TWO = ("--encoder", "vision=vit", "--encoder", "audio=audio", "--grid")
LAYOUTS = {  # name: (processes, layout flags)
    "vision1-language1": (2, (*VISION, "vision:", "--grid", "language:")),
    "vision-dp2-language1": (3, (*VISION, "vision:dp=2", "--grid", "language:")),
    "vision1-language-dp2": (3, (*VISION, "vision:", "--grid", "language:dp=2")),
    "1+1+language1": (3, (*TWO, "vision:", "--grid", "audio:", "--grid", "language:")),
    "1+1+language-dp2": (4, (*TWO, "vision:", "--grid", "audio:", "--grid", "language:dp=2")),
}
REFERENCE = {"vision-dp2-language1": "vision1-language1",
             "vision1-language-dp2": "vision1-language1",
             "1+1+language-dp2": "1+1+language1"}

_runs: dict[str, tuple] = {}


def _run(name: str) -> tuple:
    if name not in _runs:
        nproc, layout = LAYOUTS[name]
        _runs[name] = train_mimo(nproc, (*SGD, *layout),
                                 extra=energon_flags(synthetic_dataset()), observe_keys=True,
                                 timeout=240)
    return _runs[name]


def _global_microbatch_keys(results: list[dict]) -> list[list[str]]:
    """Keys of each global microbatch, as the language replicas held them, in DP order."""
    language = sorted((r for r in results if r["module"] == "language" and r.get("keys")),
                      key=lambda r: r["dp_rank"])
    return [sum(batch, []) for batch in zip(*(r["keys"] for r in language))]


@pytest.mark.parametrize("name", list(REFERENCE))
def test_real_data_trains_identically_on_every_layout(name: str) -> None:
    reference_scalars, reference = _run(REFERENCE[name])
    scalars, results = _run(name)
    assert sorted(scalars["lm loss"]) == list(range(1, 11))
    for iteration, value in reference_scalars["lm loss"].items():
        assert scalars["lm loss"][iteration] == pytest.approx(value, rel=1e-5), iteration
    # The same samples, in the same order: 10 steps x 4 microbatches of the global batch of 8.
    ref_keys, keys = _global_microbatch_keys(reference), _global_microbatch_keys(results)
    assert sum(ref_keys, []) == sum(keys, []) and len(sum(keys, [])) == 80
    assert len(set(sum(keys, []))) > 40  # real, shuffled samples, not one repeated


def test_real_data_loss_falls() -> None:
    scalars, _ = _run("1+1+language1")
    losses = scalars["lm loss"]
    assert losses[10] < 0.8 * losses[1], losses


def test_a_misaligned_encoder_is_stopped_at_the_first_step_naming_both_ranks() -> None:
    with pytest.raises(WorkerFailure, match=r"data misalignment at microbatch 0 of this step: "
                       r"encoder 'vision' dp rank 0 \(global rank 0\) embedded sample "
                       r"'train/1' at position 0, but language global rank 1 holds 'train/0'"):
        train_mimo(2, (*VISION, "vision:", "--grid", "language:"), misalign=True, timeout=120)
