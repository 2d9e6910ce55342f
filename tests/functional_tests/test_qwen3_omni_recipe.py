"""The Qwen3-Omni recipe's CPU-simulation twin in CI: ``cpu_simulation.sh`` trains a tiny whole
Qwen3-Omni-MoE folder saved by transformers at ``train_8gpu.sh``'s layout shrunk to 2 processes
(both towers colocated on the language ranks, experts over EP 2) for 8 steps: its losses are
finite and fall, it writes its checkpoint, and the same launch shows both encoders in the
throughput figures of every log line and in the step timeline."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess

import pytest

from tests.harness.multiprocess import REPO_ROOT
from tests.harness.tensorboard_scalars import read_scalars

pytestmark = pytest.mark.multirank

RECIPE = REPO_ROOT / "examples" / "mimo" / "recipes" / "qwen3_omni" / "cpu_simulation.sh"
STEPS = list(range(1, 9))
NUMBER = r"[\d.e+-]+"
PERCENT = r"\d+\.\d%"


@pytest.mark.timeout(900)
def test_cpu_simulation_twin_trains_and_measures_both_towers(tmp_path):
    from tests.models.qwen3_omni_whole import save_tiny_qwen3_omni

    folder = save_tiny_qwen3_omni(tmp_path / "hf")
    run = tmp_path / "run"
    result = subprocess.run(["bash", str(RECIPE), str(folder), "--mimo-timeline",
                             str(run / "timeline")], cwd=REPO_ROOT, text=True,
                            env={**os.environ, "MIMO_RUN_DIR": str(run)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=800)
    assert result.returncode == 0, result.stdout[-4000:]
    losses = read_scalars(run / "tensorboard", "lm loss")
    assert sorted(losses) == STEPS, losses
    assert all(math.isfinite(loss) for loss in losses.values()), losses
    assert losses[8] < losses[1], losses
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "8"

    # Every log line carries each tower's FLOP rate, busy share and replica imbalance (DP 2).
    lines = [line for line in result.stdout.splitlines() if re.search(r" iteration +\d+/", line)]
    assert len(lines) == len(STEPS), result.stdout[-4000:]
    for line in lines:
        assert re.search(rf"\| TFLOP/s/GPU: image {NUMBER}, audio {NUMBER}, language {NUMBER}, "
                         rf"total {NUMBER} \|", line), line
        assert re.search(rf"\| busy: image {PERCENT}, audio {PERCENT}, language {PERCENT} \|",
                         line), line
        for tower in ("image", "audio"):
            assert re.search(rf"\| {tower} replica imbalance: compute {NUMBER}, tokens {NUMBER} \|",
                             line), (tower, line)
    for tower in ("image", "audio"):
        flops = read_scalars(run / "tensorboard", f"mimo/model-flops/{tower}")
        assert sorted(flops) == STEPS and all(value > 0 for value in flops.values()), tower

    # The timeline: one process per module, each tower's forward and backward on both ranks.
    events = json.loads((run / "timeline" / "timeline.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(names.values()) == ["audio", "image", "language"]
    phases = {(names[e["pid"]], e["tid"], e["name"]) for e in events if e["ph"] == "X"}
    for tower in ("image", "audio"):
        for rank in (0, 1):
            assert {(tower, rank, "encoder-forward"), (tower, rank, "encoder-backward")} <= phases
    assert (run / "timeline" / "timeline.png").stat().st_size > 0
