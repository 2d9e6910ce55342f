"""Megatron's stock pretrain() of a tiny GPT on the CPU simulation, across parallel layouts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.harness.gpt_runs import cached_gpt_run, train_gpt
from tests.harness.multiprocess import WorkerFailure

pytestmark = pytest.mark.multirank

# name: (processes, extra stock flags, whether all ranks are data-parallel replicas)
LAYOUTS = {
    "dp2": (2, (), True),
    "dp2-distributed-optimizer": (2, ("--use-distributed-optimizer",), True),
    "tp2": (2, ("--tensor-model-parallel-size", "2"), False),
    "pp2": (2, ("--pipeline-model-parallel-size", "2"), False),
    "bf16-dp2": (2, ("--bf16",), True),
    "tp2-pp2": (4, ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"),
                False),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_stock_gpt_trains(name: str) -> None:
    nproc, extra, replicas = LAYOUTS[name]
    losses, params = cached_gpt_run(nproc, extra, 0)
    assert sorted(losses) == list(range(1, 21)), "20 iterations must each log an lm loss"
    assert all(math.isfinite(value) for value in losses.values())
    assert losses[20] < losses[1] - 0.3, f"loss did not fall: {losses[1]} -> {losses[20]}"
    if replicas:
        for name_, value in params[0].items():
            for rank in range(1, nproc):
                np.testing.assert_array_equal(params[rank][name_], value, err_msg=name_)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_rerun_with_same_seed_is_bit_identical(name: str) -> None:
    nproc, extra, _ = LAYOUTS[name]
    first, _ = cached_gpt_run(nproc, extra, 0)
    second, _ = cached_gpt_run(nproc, extra, 1)
    assert first == second


def test_tensor_parallel_matches_single_tensor_rank() -> None:
    tp1, _ = cached_gpt_run(2, (), 0)
    tp2, _ = cached_gpt_run(2, ("--tensor-model-parallel-size", "2"), 0)
    for iteration, value in tp1.items():
        assert tp2[iteration] == pytest.approx(value, rel=1e-5), iteration


def test_stock_pretrain_needs_the_wheel_bridge() -> None:
    with pytest.raises(WorkerFailure, match="exit code 1|SystemExit: 1"):
        train_gpt(1, ("--train-iters", "2"), tag="no-bridge", install_bridge=False, timeout=80)


def test_importing_the_plugin_set_leaves_stock_gpt_training_bit_identical() -> None:
    plain, plain_params = cached_gpt_run(2, (), 0)
    imported, imported_params = train_gpt(2, tag="with-plugins", import_plugins=True)
    assert imported == plain
    for name, value in plain_params[0].items():
        np.testing.assert_array_equal(imported_params[0][name], value, err_msg=name)
