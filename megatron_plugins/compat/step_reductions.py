"""Bridges that take world-wide collectives out of a MiMo training step (Gaps 8 and 11), applied
by :func:`install_step_bridges` in MiMo processes only."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from megatron_plugins.compat import MegatronCompatError, record

__all__ = ["always_succeeds", "install_step_bridges", "rerun_vote", "settle_rerun_vote"]

_SUCCEEDING_STEPS: tuple[str, ...] = (
    "megatron.core.optimizer.optimizer:MixedPrecisionOptimizer.step_with_ready_grads",
    "megatron.core.optimizer.optimizer:FP32Optimizer.step_with_ready_grads",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.step_with_ready_grads",
)
"""``step_with_ready_grads`` implementations of the 0.19.2 wheel that always return True."""


def _resolve(path: str) -> Any:
    module, _, attrs = path.partition(":")
    value: Any = importlib.import_module(module)
    for attr in attrs.split("."):
        value = getattr(value, attr)
    return value


def always_succeeds(optimizer: Any) -> bool:
    """Whether ``optimizer.step_with_ready_grads()`` can only return True (a chain: every link)."""
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    if isinstance(optimizer, ChainedOptimizer):
        return all(always_succeeds(inner) for inner in optimizer.chained_optimizers)
    known = {_resolve(path) for path in _SUCCEEDING_STEPS}
    return type(optimizer).step_with_ready_grads in known


def _folded_mimo_step(self: Any) -> tuple[bool, float | None, int | None]:
    """``MimoOptimizer.step`` with its found-inf, grad-norm and may-fail scalars in one world
    all-reduce (MAX); the success all-reduce only when some rank's optimizer may fail (Gap 8).

    Gap 8 (MiMo optimizer scalars): ``MimoOptimizer.step`` (core/models/mimo/optimizer.py:76-111)
    issues three world-wide all-reduces per step, each a barrier across every GPU of every
    module: found-inf (MAX), the per-module squared grad norms (MAX, in ``get_grad_norm``) and
    update success (MIN). The first two have no data dependency between them; the third only
    matters when some optimizer can report failure, and every ``step_with_ready_grads`` of the
    0.19.2 wheel returns True. Here one MAX all-reduce of ``[found_inf, may_fail, norm_sq...]``
    carries stock's values, so the grad norm is bit-identical; the success MIN runs only when
    some rank's optimizer is not a known always-succeeding one.
    """
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    found_inf = self.prepare_grads()
    infos = sorted(self.module_infos.items())
    # [found_inf, may_fail, squared grad norm of each module in name order]: stock's values.
    scalars = torch.zeros(2 + len(infos), device="cuda", dtype=torch.float32)
    scalars[0] = float(found_inf)
    scalars[1] = float(not all(always_succeeds(opt) for opt in self._active_optimizers))
    for index, (_, info) in enumerate(infos):
        if info.is_active and info.optimizer:
            scalars[2 + index] = (info.optimizer.get_grad_norm() or 0.0) ** 2
    torch.distributed.all_reduce(scalars, op=torch.distributed.ReduceOp.MAX)
    if scalars[0].item() > 0:
        return False, None, None
    grad_norm = torch.sqrt(scalars[2:].sum()).item()
    for opt in self._active_optimizers:
        if getattr(opt, "is_stub_optimizer", False):
            continue
        params = opt.get_parameters()
        if params and opt.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(params, max_norm=opt.config.clip_grad,
                                         total_norm=grad_norm,
                                         use_decoupled_grad=opt.config.use_precision_aware_optimizer)
    num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
    success = self.step_with_ready_grads()
    if scalars[1].item() > 0:
        flag = torch.tensor([1 if success else 0], dtype=torch.int, device="cuda")
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        success = bool(flag.item())
    elif not success:
        raise MegatronCompatError("an optimizer listed as always succeeding reported failure")
    return success, grad_norm, num_zeros


def install_step_bridges() -> None:
    """Apply Gaps 8 (``MimoOptimizer.step``) and 11 (the rerun check). Idempotent; the MiMo
    builder calls it (MiMo processes only: stock optimizers are not touched)."""
    from megatron.core.models.mimo.optimizer import MimoOptimizer
    from megatron.core.rerun_state_machine import RerunStateMachine

    MimoOptimizer.step = _folded_mimo_step
    if RerunStateMachine._reduce_any is not _settled_reduce_any:
        global _stock_reduce_any
        _stock_reduce_any = RerunStateMachine._reduce_any
        RerunStateMachine._reduce_any = _settled_reduce_any
    record("8", "11")


_stock_reduce_any: Any = None
_settled_vote: tuple[int, int, bool] | None = None
"""(rerun machine iteration, this rank's vote, the world's answer) of the step being finished."""


def rerun_vote() -> int:
    """This rank's "rerun the step" flag, read after the step's last result check (Gap 11).

    Gap 11 (the rerun state machine's world check): in its default ``validate_results`` mode the
    stock state machine all-reduces its "rerun this step" flag over the whole world once per step
    (``_reduce_any``, core/rerun_state_machine.py:254-270, called from
    ``should_run_forward_backward`` at :329), one more barrier across every module. The flag is
    final once the step's last result check has run (loss checks in the forward pass, gradient
    checks before the DP reduce, param_and_grad_buffer.py:340-360), which is before the MiMo
    gradient finalization's token count. Bridge (with :func:`settle_rerun_vote`, applied by
    :func:`install_step_bridges`): the token-count all-reduce carries each rank's flag, and the
    machine's next single-flag check of that step returns the summed answer instead of reducing
    again; a flag that changed in between raises rather than diverging.
    """
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    return int(bool(get_rerun_state_machine().rerun_requested))


def settle_rerun_vote(vote: int, world_sum: int) -> None:
    """Record the world-wide sum of the step's votes for the machine's check of this step."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    global _settled_vote
    _settled_vote = (get_rerun_state_machine().current_iteration, vote, world_sum > 0)


def _settled_reduce_any(self: Any, value: Any) -> Any:
    """Stock ``_reduce_any``, except the initial run's single flag once the token count settled it."""
    from megatron.core.rerun_state_machine import RerunState

    global _settled_vote
    settled, _settled_vote = _settled_vote, None
    if (settled is None or isinstance(value, list) or self.state != RerunState.INITIAL_RUN
            or settled[0] != self.current_iteration):
        return _stock_reduce_any(self, value)
    if int(bool(value)) != settled[1]:
        raise MegatronCompatError(
            "the rerun state machine's flag changed after the gradient token count carried it; "
            "a result check now runs after gradient finalization (compat Gap 11)")
    return settled[2]
