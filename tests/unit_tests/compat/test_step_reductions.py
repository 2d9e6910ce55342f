"""Training-step bridges (Gaps 8 and 11): canaries that the stock wheel still has each gap, and
the bridges' tests."""

from __future__ import annotations

import inspect

import pytest

from megatron_plugins.compat import MegatronCompatError, step_reductions
from tests.unit_tests.compat.wheel_source import source_digest


def test_gap8_canary_mimo_optimizer_issues_separate_world_reductions() -> None:
    """Gap 8: the wheel's MimoOptimizer.step is what the folded step replicates, and the
    step_with_ready_grads it trusts to succeed are the 0.19.2 ones (a new release fails here)."""
    from megatron.core.models.mimo.optimizer import MimoOptimizer

    step = inspect.getsource(MimoOptimizer.step)
    assert step.count("torch.distributed.all_reduce(") == 2, "found-inf and success reductions"
    assert "torch.distributed.all_reduce(norm_sq" in inspect.getsource(MimoOptimizer.get_grad_norm)
    assert source_digest(MimoOptimizer.step) == "b94c7151c14f89f1"
    assert source_digest(MimoOptimizer.get_grad_norm) == "e9d577bfcae5757f"
    digests = {"MixedPrecisionOptimizer": "34fc101b433f1515", "FP32Optimizer": "90ac3825f5932ab0",
               "DistributedOptimizer": "2350cce9dd8822dd"}
    for path in step_reductions._SUCCEEDING_STEPS:
        cls = path.partition(":")[2].split(".")[0]
        assert source_digest(step_reductions._resolve(path)) == digests[cls], path


def test_gap8_always_succeeds_follows_chains() -> None:
    from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer

    fp32 = FP32Optimizer.__new__(FP32Optimizer)
    chain = ChainedOptimizer.__new__(ChainedOptimizer)
    chain.chained_optimizers = [fp32, fp32]
    assert step_reductions.always_succeeds(chain)

    class MayFail(FP32Optimizer):
        def step_with_ready_grads(self) -> bool:
            return False

    chain.chained_optimizers = [fp32, MayFail.__new__(MayFail)]
    assert not step_reductions.always_succeeds(chain)


def test_gap11_canary_stock_rerun_check_is_a_world_all_reduce_after_the_result_checks():
    """Gap 11: the initial run's check all-reduces one flag over the world (no group), and the
    gradient result checks run before the DP reduce, so before the MiMo token count."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
    from megatron.core.rerun_state_machine import RerunStateMachine

    stock = step_reductions._stock_reduce_any or RerunStateMachine._reduce_any
    assert "torch.distributed.all_reduce(val_tensor)\n" in inspect.getsource(stock)
    assert source_digest(stock) == "9fc4efee07ae520d"
    assert "will_rerun = self._reduce_any(self.rerun_requested)" in inspect.getsource(
        RerunStateMachine.should_run_forward_backward)
    start = inspect.getsource(_ParamAndGradBucketGroup.start_grad_sync)
    assert start.index("self.check_grads(") < start.index("reduce_op = ")


@pytest.fixture
def validating_machine(monkeypatch):
    """A rerun state machine in stock's default mode, in its initial run, with the bridge on and
    stock's reduction recorded instead of issued."""
    from megatron.core.rerun_state_machine import RerunMode, RerunState, RerunStateMachine

    step_reductions.install_step_bridges()
    stock_calls = []
    monkeypatch.setattr(step_reductions, "_stock_reduce_any",
                        lambda machine, value: stock_calls.append(value) or False)
    machine = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    machine.state = RerunState.INITIAL_RUN
    monkeypatch.setattr("megatron.core.rerun_state_machine.get_rerun_state_machine",
                        lambda: machine)
    return machine, stock_calls


def test_gap11_settled_vote_answers_the_check_without_a_reduction(validating_machine):
    from megatron.core.rerun_state_machine import RerunState

    machine, stock_calls = validating_machine
    step_reductions.settle_rerun_vote(step_reductions.rerun_vote(), world_sum=1)
    assert machine._reduce_any(machine.rerun_requested) is True  # another rank asked
    assert stock_calls == []
    step_reductions.settle_rerun_vote(step_reductions.rerun_vote(), world_sum=0)
    assert not machine.should_run_forward_backward(None) and stock_calls == []
    assert machine.state == RerunState.NOT_RUNNING_YET
    # Nothing settled for this step (a split step, or no finalization): stock's reduction.
    machine.state = RerunState.INITIAL_RUN
    assert not machine.should_run_forward_backward(None) and stock_calls == [False]


def test_gap11_a_flag_raised_after_the_count_is_refused(validating_machine):
    machine, _ = validating_machine
    step_reductions.settle_rerun_vote(step_reductions.rerun_vote(), world_sum=0)
    machine.rerun_requested = True
    with pytest.raises(MegatronCompatError, match="Gap 11"):
        machine.should_run_forward_backward(None)
