"""The Qwen3.5-VL recipe's CPU-simulation twin in CI: ``cpu_simulation.sh`` trains a tiny whole
Qwen3.5-VL folder saved by transformers (dense and MoE) for 8 steps; its losses are finite and
fall, and it writes its checkpoint."""

from __future__ import annotations

import math
import os
import subprocess

import pytest

from tests.harness.multiprocess import REPO_ROOT
from tests.harness.tensorboard_scalars import read_scalars

pytestmark = pytest.mark.multirank

RECIPE = REPO_ROOT / "examples" / "mimo" / "recipes" / "qwen3_5_vl" / "cpu_simulation.sh"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_cpu_simulation_twin_trains_a_tiny_whole_folder(moe, tmp_path):
    from tests.models.qwen3_5_whole import save_whole

    folder = save_whole(tmp_path / "hf", seed=0, moe=moe)
    run = tmp_path / "run"
    result = subprocess.run(["bash", str(RECIPE), str(folder)], cwd=REPO_ROOT, text=True,
                            env={**os.environ, "MIMO_RUN_DIR": str(run)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=800)
    assert result.returncode == 0, result.stdout[-4000:]
    losses = read_scalars(run / "tensorboard", "lm loss")
    assert sorted(losses) == list(range(1, 9)), losses
    assert all(math.isfinite(loss) for loss in losses.values()), losses
    assert losses[8] < losses[1], losses
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
