"""A plain ``torch.nn.Module`` encoder at encoder tp=2 trains replicated on its two tp ranks,
saves, and resumes bit-identically (the save used to fail with ``Invalid sharding pattern``)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness.mimo_runs import train_mimo

pytestmark = pytest.mark.multirank

LAYOUT = ("--encoder", "sensors=tests.fixtures.plain_encoder:PlainEncoder",
          "--grid", "sensors:tp=2", "--grid", "language:dp=1",
          "--train-iters", "4", "--eval-iters", "0", "--lr", "3e-3")


def test_plain_encoder_at_tp2_trains_saves_and_resumes_bit_identically(tmp_path):
    save = str(tmp_path / "checkpoints")
    full, full_ranks = train_mimo(3, LAYOUT, extra=("--save", save, "--save-interval", "2"),
                                  observe_params=True)
    resumed, resumed_ranks = train_mimo(3, LAYOUT, extra=("--load", save, "--ckpt-step", "2"),
                                        observe_params=True)
    assert sorted(full["lm loss"]) == [1, 2, 3, 4] and sorted(resumed["lm loss"]) == [3, 4]
    assert full["lm loss"][4] < full["lm loss"][1]
    assert {step: full["lm loss"][step] for step in (3, 4)} == resumed["lm loss"]
    encoder = [r for r in full_ranks if r["module"] == "sensors"]
    assert sorted(r["tp_rank"] for r in encoder) == [0, 1]
    replicated = [name for name, dim in encoder[0]["partition_dims"].items() if dim is None]
    assert sum(".encoders.sensors." in name for name in replicated) == 4  # the whole PlainMLP
    for name in replicated:  # the tp ranks' copies stayed equal
        np.testing.assert_array_equal(encoder[0]["params"][name], encoder[1]["params"][name],
                                      err_msg=name)
    for before, after in zip(full_ranks, resumed_ranks):
        assert before["module"] == after["module"]
        for name, value in before["params"].items():
            np.testing.assert_array_equal(value, after["params"][name], err_msg=name)
