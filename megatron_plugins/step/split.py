"""A train step split into begin / microbatch / finish / abort, for trainers that stream samples.

Reinforcement-learning and streaming trainers do not hold a whole global batch: rollouts arrive one
microbatch at a time, the number of valid tokens is known only at the end, and a step must be
abandonable. :class:`SplitTrainStep` drives a model and optimizer built by stock Megatron (stock
GPT, or the MiMo model of :mod:`megatron_plugins.model.builder`) through that state machine:

- ``begin(loss_kind)`` zeroes the grad buffers and holds back every DP reduction;
- ``microbatch(batch)`` runs one forward-backward through the stock schedule (the pipeline
  schedule with one microbatch when PP > 1, on every rank of the model's grids) under no-sync;
  the loss is a sum (``calculate_per_token_loss`` semantics), so gradients accumulate unscaled;
- ``finish()`` sums the step's count world-wide in one all-reduce, does the one stock reduction
  per module, divides by the count, steps optimizer and scheduler, and returns the metrics;
- ``abort()`` drops the step: gradients zeroed, hooks and RNG restored, nothing stepped.

The order inside ``finish`` is stock ``finalize_model_grads``'s (reduce, then divide), so a step fed
the same microbatches is bit-identical to stock ``train_step``. Replicas may feed different numbers
of microbatches (zero included): the divisor is the global count, whatever the layout.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.distributed.finalize_model_grads import reset_model_temporary_tensors
from megatron.core.models.mimo import MimoModel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.utils import get_attr_wrapped_model, get_model_config, unwrap_model
from megatron.training.utils.common_utils import (
    logical_and_across_model_parallel_group,
    reduce_max_stat_across_model_parallel_group,
)

from megatron_plugins.step.colocated import ColocatedSchedule, colocated_encoders
from megatron_plugins.step.grad_sync import CrossGridGradSync, counts_tokens, scale_module_gradients

__all__ = ["SplitStepError", "SplitTrainStep", "StepMetrics", "StepState", "sequence_loss_func"]

LOSS_KINDS = ("tokens", "sequences")
"""What the loss function's second return value counts, and so what divides the gradients."""


class SplitStepError(RuntimeError):
    """A split-step call made in the wrong state (an API misuse, no bad flag); the message names
    the call and the state."""


class StepState(enum.Enum):
    """Where a :class:`SplitTrainStep` is: no step, a step taking microbatches, a failed step."""

    IDLE = "idle"
    OPEN = "open"
    FAILED = "failed"


@dataclass(frozen=True)
class StepMetrics:
    """One finished step, globally normalized (identical on every rank)."""

    loss: float
    """Summed loss of every microbatch on every replica, divided by ``count``."""
    count: int
    """Valid tokens (``loss_kind="tokens"``) or sequences of the whole step."""
    loss_kind: str
    microbatches: int
    """Microbatches of the whole step, summed over data-parallel replicas."""
    samples: int
    """``microbatches x micro_batch_size``: what the learning-rate scheduler advanced by."""
    grad_norm: float | None
    skipped: bool
    """The optimizer skipped the update (fp16 overflow); the scheduler did not advance."""
    moe_losses: dict[str, float] = field(default_factory=dict)
    """MoE auxiliary losses, averaged over the step's true number of microbatches."""


class _StockGradSync:
    """Reduce / count / scale for stock DDP chunks, in ``finalize_model_grads``'s order."""

    def __init__(self, model: list[torch.nn.Module], counts: bool) -> None:
        self._model = model
        self._counts = counts

    def reduce_gradients(self) -> None:
        finalize_model_grads(self._model, None)

    def global_token_count(self, local: torch.Tensor) -> torch.Tensor:
        total = local.detach().clone() if self._counts else torch.zeros_like(local)
        dist.all_reduce(total)
        return total

    def scale_gradients(self, total: torch.Tensor) -> None:
        scale_module_gradients(self._model, total)


def sequence_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The ``loss_kind="sequences"`` counterpart of stock GPT's per-token ``loss_func``: each
    sequence's mean token loss, summed, and the number of sequences with a valid token."""
    mask = loss_mask.float()
    losses = output_tensor.float().view(mask.shape)
    tokens = mask.sum(dim=-1)
    valid = tokens > 0
    per_sequence = (losses * mask).sum(dim=-1)[valid] / tokens[valid]
    loss = per_sequence.sum()
    count = valid.sum().to(torch.int)
    return loss, count, {"sequence loss": torch.cat([loss.detach().view(1), count.view(1).float()])}


def _moe_track_names(config: Any) -> list[str]:
    """The auxiliary losses stock ``training_log`` reports for this router configuration."""
    balancing = str(config.moe_router_load_balancing_type)
    names = [name for key, name in (("aux_loss", "load_balancing_loss"),
                                    ("seq_aux_loss", "seq_load_balancing_loss"),
                                    ("global_aux_loss", "global_load_balancing_loss"))
             if key in balancing]
    if config.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names


class SplitTrainStep:
    """begin / microbatch / finish / abort over ``model`` (the stock list of chunks), ``optimizer``
    and ``scheduler`` as stock ``setup_model_and_optimizer`` returns them.

    ``forward_step_func`` is stock-shaped (``(data_iterator, model) -> (output, loss_func)``) and
    its ``loss_func`` returns ``(summed loss, count, report)``, the count being valid tokens or
    sequences as the step's ``loss_kind`` says (stock GPT's and MiMo's per-token loss functions
    qualify; :func:`sequence_loss_func` is the per-sequence one). ``p2p_communicator`` and
    ``pg_collection`` are what stock ``pretrain()`` gives the schedule (MiMo's communicator and
    multi-module collection); ``micro_batch_size`` and ``seq_length`` default to the stock flags.
    """

    def __init__(self, model: list[torch.nn.Module], optimizer: Any, scheduler: Any,
                 forward_step_func: Callable, *, micro_batch_size: int | None = None,
                 seq_length: int | None = None, p2p_communicator: Any = None,
                 pg_collection: Any = None) -> None:
        self._model = list(model)
        self._optimizer = optimizer
        self._scheduler = scheduler
        self._forward_step_func = forward_step_func
        self._config = get_model_config(self._model[0])
        if not self._config.calculate_per_token_loss:
            raise SplitStepError(
                "SplitTrainStep needs summed losses: build the model with "
                "--calculate-per-token-loss (calculate_per_token_loss=True in its config)")
        if micro_batch_size is None or seq_length is None:
            from megatron.training import get_args

            args = get_args()
            micro_batch_size = micro_batch_size or args.micro_batch_size
            seq_length = seq_length or args.seq_length
        self._micro_batch_size = micro_batch_size
        self._seq_length = seq_length
        self._schedule_kwargs = {"p2p_communicator": p2p_communicator,
                                 "pg_collection": pg_collection}
        # On a rank hosting encoders each microbatch runs their forward, the language schedule
        # and their backward (megatron_plugins.step.colocated); elsewhere the stock schedule.
        self._forward_backward = ColocatedSchedule(
            get_forward_backward_func(schedule_pg_collection=pg_collection))
        self._hosted = colocated_encoders(self._model[0])
        self._pgc = (get_attr_wrapped_model(self._model[0], "pg_collection")
                     or ProcessGroupCollection.use_mpu_process_groups())
        inner = unwrap_model(self._model[0])
        has_loss = not isinstance(inner, MimoModel) or inner.language_model is not None
        self._has_loss = has_loss
        self._counts = counts_tokens(self._pgc if has_loss else None)
        finalizer = self._config.finalize_model_grads_func
        cross_grid = getattr(finalizer, "__self__", None)
        self._sync = (cross_grid if isinstance(cross_grid, CrossGridGradSync)
                      else _StockGradSync(self._model, self._counts))
        self.state = StepState.IDLE
        self._saved_hooks: dict[str, Any] = {}
        self._saved_rng: tuple | None = None
        self._saved_module_rng: dict[str, Any] = {}
        self._saved_iteration = 0
        self._loss_kind = LOSS_KINDS[0]
        self._microbatches = 0
        self._count: torch.Tensor | None = None
        self._loss_sum: torch.Tensor | None = None

    # ------------------------------------------------------------------ state machine

    def _require(self, call: str, *states: StepState) -> None:
        if self.state in states:
            return
        hint = {StepState.IDLE: "call begin() first",
                StepState.OPEN: "finish() or abort() the open step first",
                StepState.FAILED: "a microbatch or finish() raised; call abort()"}[self.state]
        raise SplitStepError(f"SplitTrainStep.{call}() in state {self.state.value!r}: {hint}")

    def begin(self, loss_kind: str = "tokens") -> None:
        """Open a step normalized by the global count of valid ``"tokens"`` or ``"sequences"``."""
        self._require("begin", StepState.IDLE)
        if loss_kind not in LOSS_KINDS:
            raise SplitStepError(f"SplitTrainStep.begin(loss_kind={loss_kind!r}): use one of "
                                 f"{', '.join(LOSS_KINDS)}")
        for chunk in self._model:
            chunk.zero_grad_buffer()
        self._optimizer.zero_grad()
        get_moe_metrics_tracker().clear()
        config = self._config
        self._saved_hooks = {name: getattr(config, name) for name in
                             ("no_sync_func", "grad_sync_func", "finalize_model_grads_func",
                              "grad_scale_func")}
        # The schedule must neither re-enable DDP's overlapped reduction on its last microbatch
        # (no_sync_func, grad_sync_func) nor finalize: finish() does that once for the step.
        config.no_sync_func = contextlib.nullcontext
        config.grad_sync_func = None
        config.finalize_model_grads_func = None
        if config.grad_scale_func is None:
            config.grad_scale_func = self._optimizer.scale_loss
        self._saved_rng = (torch.get_rng_state(), torch.cuda.get_rng_state(),
                           {name: state.clone() for name, state in
                            get_cuda_rng_tracker().get_states().items()})
        if self._hosted is not None:  # the language model's streams are the process's, above
            self._saved_module_rng = self._hosted.rng.state_dict(tuple(self._hosted.encoders))
        # Stock result checks (NaN / Inf in loss and gradients) run inside the rerun state
        # machine's forward-backward pass; the split step is that pass, from begin to finish.
        rerun = get_rerun_state_machine()
        self._saved_iteration = rerun.current_iteration
        rerun.should_run_forward_backward(None)
        self._loss_kind = loss_kind
        self._microbatches = 0
        self._count = torch.zeros([], dtype=torch.int, device=_device())
        self._loss_sum = torch.zeros([], dtype=torch.float64, device=_device())
        self.state = StepState.OPEN

    def _loss(self, loss_func: Callable, output_tensor: torch.Tensor) -> Any:
        loss, count, report = loss_func(output_tensor)
        self._count += count.detach().to(torch.int).view([])
        self._loss_sum += loss.detach().double().view([])
        return loss, count, report

    def _forward_step(self, data_iterator: Iterator, model: torch.nn.Module, *args: Any) -> Any:
        output, loss_func = self._forward_step_func(data_iterator, model, *args)
        return output, partial(self._loss, loss_func)

    def microbatch(self, batch: Any) -> None:
        """Forward-backward of one microbatch (what ``forward_step_func`` reads with ``next``),
        gradients accumulated locally; every rank of the model's grids calls it together."""
        self._require("microbatch", StepState.OPEN)
        try:
            with contextlib.ExitStack() as no_sync:
                for chunk in self._model:
                    no_sync.enter_context(chunk.no_sync())
                self._forward_backward(
                    forward_step_func=self._forward_step, data_iterator=iter([batch]),
                    model=self._model, num_microbatches=1, seq_length=self._seq_length,
                    micro_batch_size=self._micro_batch_size, forward_only=False,
                    **self._schedule_kwargs)
        except BaseException:
            self.state = StepState.FAILED
            raise
        self._microbatches += 1

    def finish(self) -> StepMetrics:
        """Normalize by the global count, reduce once per module, step; returns the metrics."""
        self._require("finish", StepState.OPEN)
        try:
            total = self._sync.global_token_count(self._count.clone())
        except BaseException:
            self.state = StepState.FAILED
            raise
        if int(total) == 0:
            raise SplitStepError(
                f"SplitTrainStep.finish() in state 'open' after {self._microbatches} local "
                f"microbatches: the step has 0 valid {self._loss_kind} on every replica; feed a "
                f"microbatch with valid {self._loss_kind} or call abort()")
        try:
            return self._finish(total)
        except BaseException:
            self.state = StepState.FAILED
            raise

    def _finish(self, total: torch.Tensor) -> StepMetrics:
        for chunk in self._model:
            if _overlaps_grad_reduce(chunk):
                chunk.start_grad_sync()
        self._sync.reduce_gradients()
        self._sync.scale_gradients(total)
        if get_rerun_state_machine().should_run_forward_backward(None):
            raise SplitStepError(
                "SplitTrainStep.finish(): a result check (NaN / Inf or unexpected loss or "
                "gradient) asked to rerun the step, which a split step cannot replay; call abort()")
        self._restore_hooks()
        update_successful, grad_norm, _ = self._optimizer.step()
        update_successful = logical_and_across_model_parallel_group(update_successful,
                                                                    group=self._pgc.mp)
        grad_norm = reduce_max_stat_across_model_parallel_group(grad_norm, group=self._pgc.mp)
        reports_microbatches = self._counts and self._pgc.cp.rank() == 0
        sums = torch.stack([self._loss_sum if self._counts else torch.zeros_like(self._loss_sum),
                            torch.tensor(float(self._microbatches if reports_microbatches else 0),
                                         dtype=torch.float64, device=_device())])
        dist.all_reduce(sums)
        microbatches = int(sums[1])
        samples = microbatches * self._micro_batch_size
        if update_successful:
            self._scheduler.step(increment=samples)
        moe_losses = self._moe_losses(microbatches)
        self.state = StepState.IDLE
        return StepMetrics(loss=float(sums[0]) / int(total), count=int(total),
                           loss_kind=self._loss_kind, microbatches=microbatches, samples=samples,
                           grad_norm=grad_norm, skipped=not update_successful,
                           moe_losses=moe_losses)

    def _moe_losses(self, microbatches: int) -> dict[str, float]:
        """Stock's MoE report, scaled by the step's true microbatch count (its DP average over
        replicas becomes a mean over every microbatch of the step)."""
        config = self._config
        if getattr(config, "num_moe_experts", None) is None or not self._has_loss:
            return {}
        dp_group = getattr(self._pgc, "dp", None)
        dp = dp_group.size() if dp_group is not None else \
            parallel_state.get_data_parallel_world_size()
        losses: dict[str, torch.Tensor] = {}
        get_moe_metrics_tracker().report(
            loss_scale=dp / max(microbatches, 1), iteration=0, force_initialize=True,
            track_names=_moe_track_names(config), num_layers=config.num_layers,
            moe_layer_freq=config.moe_layer_freq, mtp_num_layers=config.mtp_num_layers,
            pg_collection=self._pgc, total_loss_dict=losses)
        return {name: float(value) for name, value in losses.items()}

    def abort(self) -> None:
        """Drop the step: gradients and MoE counters zeroed, schedule hooks and RNG restored,
        parameters, optimizer state and step counter untouched. Idempotent; no collective."""
        if self.state is StepState.IDLE:
            return
        for chunk in self._model:
            chunk.zero_grad_buffer()
        self._optimizer.zero_grad()
        reset_model_temporary_tensors(self._config, self._model)
        get_moe_metrics_tracker().clear()
        self._restore_hooks()
        rerun = get_rerun_state_machine()
        rerun.state = RerunState.NOT_RUNNING_YET
        rerun.current_iteration = self._saved_iteration
        cpu, device, tracker = self._saved_rng
        torch.set_rng_state(cpu)
        torch.cuda.set_rng_state(device)
        get_cuda_rng_tracker().set_states(tracker)
        if self._hosted is not None:
            self._hosted.rng.load_state_dict(self._saved_module_rng)
        self.state = StepState.IDLE

    def _restore_hooks(self) -> None:
        for name, value in self._saved_hooks.items():
            setattr(self._config, name, value)
        self._saved_hooks = {}


def _device() -> torch.device:
    """Where counts live: the collectives' device (the CPU under the CPU simulation)."""
    return torch.device("cuda", torch.cuda.current_device())


def _overlaps_grad_reduce(chunk: torch.nn.Module) -> bool:
    """Whether ``chunk``'s reductions are started by hooks (which the step held back), so
    ``finish`` must start them; a MimoModel starts only its overlapped modules itself."""
    if isinstance(chunk, MimoModel):
        return True
    ddp_config = getattr(chunk, "ddp_config", None)
    return bool(ddp_config is not None and ddp_config.overlap_grad_reduce)
