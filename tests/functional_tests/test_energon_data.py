"""Real data (Energon, a real tokenizer) trains the same on every layout, resumes exactly, and a
misaligned encoder is caught.

The dataset is the README's generated image + audio + caption set, made once per test process.
Layout invariance here is the acceptance of the real-data path: the same samples, in the same
order, reach the same positions whatever the encoder and language DP (and language CP) sizes,
because every rank reads one global stream (one Energon batch per step) and keeps its positions of
it; the context-parallel ranks of a language replica hold the same samples and split the rows.
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.harness.energon_data import energon_flags, stock_prepared_dataset, synthetic_dataset
from tests.harness.mimo_runs import TINY_MIMO, MimoLaunch, module_params, shared_run, train_mimo
from tests.harness.multiprocess import REPO_ROOT, WorkerFailure, run_preforked
from tests.harness.tensorboard_scalars import read_scalars

pytestmark = pytest.mark.multirank

SCRIPT = REPO_ROOT / "examples" / "mimo" / "pretrain_mimo.py"

SGD = ("--optimizer", "sgd", "--lr", "0.05", "--min-lr", "0.005")
VISION = ("--encoder", "vision=vit", "--grid")
TWO = ("--encoder", "vision=vit", "--encoder", "audio=audio", "--grid")
LAYOUTS = {  # name: (processes, layout flags)
    "vision1-language1": (2, (*VISION, "vision:", "--grid", "language:")),
    "vision-dp2-language1": (3, (*VISION, "vision:dp=2", "--grid", "language:")),
    "vision1-language-dp2": (3, (*VISION, "vision:", "--grid", "language:dp=2")),
    "1+1+language1": (3, (*TWO, "vision:", "--grid", "audio:", "--grid", "language:")),
    "1+1+language-dp2": (4, (*TWO, "vision:", "--grid", "audio:", "--grid", "language:dp=2")),
    "vision1-language-cp2": (3, (*VISION, "vision:", "--grid", "language:cp=2")),
    "vision-dp2-language-cp2": (4, (*VISION, "vision:dp=2", "--grid", "language:cp=2")),
}
REFERENCE = {"vision-dp2-language1": "vision1-language1",
             "vision1-language-dp2": "vision1-language1",
             "vision1-language-cp2": "vision1-language1",
             "vision-dp2-language-cp2": "vision1-language1",
             "1+1+language-dp2": "1+1+language1"}

def _run(name: str) -> tuple:
    nproc, layout = LAYOUTS[name]
    return shared_run(MimoLaunch(nproc, (*energon_flags(synthetic_dataset()), *SGD, *layout),
                                 timeout=240))


def _global_microbatch_keys(results: list[dict]) -> list[list[str]]:
    """Keys of each global microbatch, as the language replicas held them, in DP order (one rank
    per replica: its tensor and context-parallel ranks hold the same samples)."""
    replicas = {r["dp_rank"]: r["keys"] for r in results
                if r["module"] == "language" and r.get("keys")}
    return [sum(batch, []) for batch in zip(*(replicas[dp] for dp in sorted(replicas)))]


@pytest.mark.parametrize("name", list(REFERENCE))
def test_real_data_trains_identically_on_every_layout(name: str) -> None:
    reference_scalars, reference = _run(REFERENCE[name])
    scalars, results = _run(name)
    assert sorted(scalars["lm loss"]) == list(range(1, 11))
    losses = scalars["lm loss"]
    worst = max(abs(losses[i] - value) / abs(value)
                for i, value in reference_scalars["lm loss"].items())
    print(f"{name}: max relative lm loss difference {worst:.2e}")
    for iteration, value in reference_scalars["lm loss"].items():
        assert losses[iteration] == pytest.approx(value, rel=1e-5), iteration
    trained, expected = module_params(results, "vision"), module_params(reference, "vision")
    assert trained.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_allclose(trained[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
    # The same samples, in the same order: 10 steps x 4 microbatches of the global batch of 8.
    ref_keys, keys = _global_microbatch_keys(reference), _global_microbatch_keys(results)
    assert sum(ref_keys, []) == sum(keys, []) and len(sum(keys, [])) == 80
    assert len(set(sum(keys, []))) > 40  # real, shuffled samples, not one repeated


def test_real_data_loss_falls() -> None:
    scalars, _ = _run("1+1+language1")
    losses = scalars["lm loss"]
    assert losses[10] < 0.8 * losses[1], losses


@pytest.mark.parametrize("nproc,language", [(2, "language:"), (3, "language:cp=2")],
                         ids=["language-cp1", "language-cp2"])
def test_a_misaligned_encoder_is_stopped_at_the_first_step_naming_both_ranks(
        nproc: int, language: str) -> None:
    """At cp=2 only the replica's first context-parallel rank witnesses its samples, once."""
    with pytest.raises(WorkerFailure, match=r"data misalignment at microbatch 0 of this step: "
                       r"encoder 'vision' dp rank 0 \(global rank 0\) embedded sample "
                       r"'train/1' at position 0, but language global rank 1 holds 'train/0'"):
        train_mimo(nproc, (*VISION, "vision:", "--grid", language), misalign=True, timeout=120)


def test_a_folder_prepared_by_stock_energon_prepare_trains(tmp_path: Path) -> None:
    """The README's `energon prepare --field-map` caption folder: its text parts reach the
    language rank as bytes and train."""
    root = stock_prepared_dataset("caption")
    run = run_preforked(SCRIPT, [*TINY_MIMO, *SGD, *VISION, "vision:", "--grid", "language:",
                                 *energon_flags(root), "--train-iters", "4", "--eval-interval",
                                 "2", "--tensorboard-dir", str(tmp_path)], nproc=2, timeout=240)
    assert run.returncode == 0, run.output[-4000:]
    losses = read_scalars(tmp_path, "lm loss")
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values())
    assert "Traceback" not in run.output


def test_a_field_map_missing_a_field_exits_2_in_one_line_before_any_process_group(
        tmp_path: Path) -> None:
    shutil.copytree(stock_prepared_dataset("caption"), tmp_path / "copy")
    spec_file = tmp_path / "copy" / "energon" / ".nv-meta" / "dataset.yaml"
    spec = yaml.safe_load(spec_file.read_text())
    spec["field_map"] = {"image": "png"}
    spec_file.write_text(yaml.safe_dump(spec))
    # Rank 0 of 2 launched alone: it could not even form a process group.
    run = run_preforked(SCRIPT, [*TINY_MIMO, *VISION, "vision:", "--grid", "language:",
                                 *energon_flags(tmp_path / "copy")], nproc=1, world_size=2,
                        timeout=90)
    assert run.returncode == 2, run.output[-3000:]
    errors = re.findall(r"^pretrain_mimo\.py: error: (.*)$", run.output, flags=re.M)
    assert errors == [f"--data-path {tmp_path / 'copy' / 'energon'}: its .nv-meta/dataset.yaml "
                      "maps no tar part to the 'caption' field of CaptioningSample; add "
                      '"caption": "<part extension>" to its field_map (or re-run `energon '
                      'prepare --force-overwrite` with that entry in --field-map)'], run.output
    assert "Traceback" not in run.output
