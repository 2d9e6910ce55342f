"""Stock GPT and MiMo runs whose training loop is a script of stock ``train_step`` calls or split
steps (:class:`megatron_plugins.step.split.SplitTrainStep`), for tests.

Each rank runs stock ``pretrain()`` (the GPT example, or the MiMo entry point's code path) with
``megatron.training.training.train`` replaced by :func:`_drive`, which receives the model,
optimizer, scheduler and data iterator exactly as stock ``train()`` would. A plan is a tuple of
steps, each one of:

- ``("stock",)``: stock ``train_step`` over the step's global batch;
- ``("split", counts)``: the split API over the same global batch; ``counts`` gives how many of
  the global batch's microbatches (taken in replica order) each data-parallel replica feeds, or
  ``None`` for each replica's own microbatches;
- ``("abort", k, raises)``: begin, ``k`` microbatches of the next step's batch, then (with
  ``raises``) one microbatch whose forward raises, then ``abort()`` twice; the state before
  ``begin`` and after ``abort`` is compared bit for bit and the batch stays for the next step.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import numpy as np

from tests.harness.gpt_runs import TINY_GPT, load_gpt_example
from tests.harness.mimo_runs import TINY_MIMO, count_grad_reductions
from tests.harness.multiprocess import run_in_processes

_result: dict[str, Any] = {}


class InjectedFailure(RuntimeError):
    """What the forward of a scripted failing microbatch raises."""


def _torch_optimizers(optimizer: Any) -> list:
    """The torch optimizers inside a Megatron (chained) optimizer; a rank whose parameters are all
    frozen has none."""
    return [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])
            if getattr(opt, "optimizer", None) is not None]


def _state(model: list, optimizer: Any, scheduler: Any) -> list[np.ndarray]:
    """Everything a step may change: parameters, the optimizer's main parameters and state, and
    the scheduler's step counter, as arrays."""
    import torch

    arrays = [p.detach().float().cpu().numpy().copy() for chunk in model
              for p in chunk.parameters()]
    for opt in _torch_optimizers(optimizer):
        for group in opt.param_groups:
            for param in group["params"]:
                arrays.append(param.detach().float().cpu().numpy().copy())
                for value in opt.state.get(param, {}).values():
                    arrays.append(torch.as_tensor(value).detach().float().cpu().numpy().copy())
    arrays.append(np.array([scheduler.num_steps]))
    return arrays


def _bucket_groups(model: list) -> int:
    """Bucket groups of every DDP module of this rank: one reduction each per step."""
    from megatron.core.distributed import DistributedDataParallel

    return sum(len(m.bucket_groups) + len(m.expert_parallel_bucket_groups)
               for chunk in model for m in chunk.modules()
               if isinstance(m, DistributedDataParallel))


def _global_batch(local: list, counts: tuple[int, ...] | None) -> list:
    """This replica's share of the global batch: its own microbatches, or ``counts[dp_rank]`` of
    all replicas' microbatches in replica order."""
    if counts is None:
        return local
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    everything = [batch for replica in gathered for batch in replica]
    rank = dist.get_rank(group)
    start = sum(counts[:rank])
    return everything[start:start + counts[rank]]


def _failable(forward_step_func: Any, failing: dict[str, bool]) -> Any:
    """``forward_step_func``, raising :class:`InjectedFailure` while ``failing["now"]``."""
    def forward_step(data_iterator, model, *args):
        if failing["now"]:
            raise InjectedFailure("scripted microbatch failure")
        return forward_step_func(data_iterator, model, *args)
    return forward_step


class _Snapshot:
    """A copy of everything a step changes (parameters, the optimizer's main parameters, state
    and hyperparameters, the scheduler's counter, RNG), to run several plans from one start."""

    def __init__(self, model: list, optimizer: Any, scheduler: Any) -> None:
        import torch
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        self._model, self._optimizer, self._scheduler = model, optimizer, scheduler
        self._params = [p.detach().clone() for chunk in model for p in chunk.parameters()]
        self._optimizers = []
        for inner in _torch_optimizers(optimizer):
            self._optimizers.append((
                inner,
                [[p.detach().clone() for p in group["params"]] for group in inner.param_groups],
                [{k: v for k, v in group.items() if k != "params"} for group in inner.param_groups],
                {p: {k: torch.as_tensor(v).clone() for k, v in state.items()}
                 for p, state in inner.state.items()},
            ))
        self._num_steps = scheduler.num_steps
        self._rng = (torch.get_rng_state(), torch.cuda.get_rng_state(),
                     {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()})

    def restore(self) -> None:
        import torch
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        with torch.no_grad():
            for param, saved in zip((p for chunk in self._model for p in chunk.parameters()),
                                    self._params):
                param.copy_(saved)
            for inner, params, hyper, state in self._optimizers:
                for group, saved_params, saved_hyper in zip(inner.param_groups, params, hyper):
                    for param, saved in zip(group["params"], saved_params):
                        param.copy_(saved)
                    group.update(saved_hyper)
                inner.state.clear()
                for param, entries in state.items():
                    inner.state[param] = {k: v.clone() for k, v in entries.items()}
        self._scheduler.num_steps = self._num_steps
        cpu, device, tracker = self._rng
        torch.set_rng_state(cpu)
        torch.cuda.set_rng_state(device)
        get_cuda_rng_tracker().set_states({k: v.clone() for k, v in tracker.items()})


def _sequence_level(forward_step_func: Any) -> Any:
    """``forward_step_func`` with its per-token loss swapped for the per-sequence one (both the
    GPT example's and MiMo's loss functions are ``partial(loss_func, loss_mask)``)."""
    from functools import partial

    from megatron_plugins.step.split import sequence_loss_func

    def forward_step(data_iterator, model, *args):
        output, loss_func = forward_step_func(data_iterator, model, *args)
        return output, partial(sequence_loss_func, loss_func.args[0])
    return forward_step


def _misuse(api: Any, batches: list, failing: dict[str, bool]) -> list[str]:
    """The errors of every misuse, in order: microbatch and finish before begin, begin twice, a
    step with no valid token, microbatch after a failed one. Leaves no step open."""
    from megatron_plugins.step.split import SplitStepError

    errors = []

    def expect(call: Any, *args: Any) -> None:
        try:
            call(*args)
        except SplitStepError as error:
            errors.append(str(error))
        else:
            errors.append("no error")

    expect(api.microbatch, batches[0])
    expect(api.finish)
    api.begin("tokens")
    expect(api.begin, "tokens")
    expect(api.finish)
    failing["now"] = True
    try:
        api.microbatch(batches[0])
    except InjectedFailure:
        pass
    failing["now"] = False
    expect(api.microbatch, batches[0])
    expect(api.finish)
    api.abort()
    expect(api.begin, "bytes")
    return errors


def _run_plan(plan: tuple, batches: list, model, optimizer, scheduler, forward_step_func,
              config, schedule: dict[str, Any], reductions: dict[str, int]) -> dict[str, Any]:
    """One plan's steps from the current state; its records and final parameters."""
    import megatron.training.training as training
    import torch
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.training.training import train_step

    from megatron_plugins.step.split import SplitTrainStep

    # The name stock train() calls: MiMo's colocated layouts wrap it (compat Gap 24).
    forward_backward = training.get_forward_backward_func(
        schedule_pg_collection=schedule["pg_collection"])
    failing = {"now": False}
    api = SplitTrainStep(model, optimizer, scheduler, _failable(forward_step_func, failing),
                         **schedule)
    sequences = SplitTrainStep(model, optimizer, scheduler, _sequence_level(forward_step_func),
                               **schedule)
    steps, index = [], 0
    for item in plan:
        # A forward may edit its batch in place (tensors "moved" to the simulated device are the
        # same tensors): every plan and every replay gets its own copy.
        pending = copy.deepcopy(batches[index])
        record: dict[str, Any] = {"kind": item[0]}
        if item[0] == "stock":
            loss, skipped, *_, grad_norm, _, _ = train_step(
                forward_step_func, RerunDataIterator(iter(pending)), model, optimizer, scheduler,
                config, forward_backward, iteration=index, **schedule)
            record.update(loss={k: float(v) for k, v in loss.items()}, grad_norm=grad_norm)
            index += 1
        elif item[0] in ("split", "sequences"):
            step = api if item[0] == "split" else sequences
            before = reductions["calls"]
            step.begin("tokens" if item[0] == "split" else "sequences")
            for batch in _global_batch(pending, item[1]):
                step.microbatch(batch)
            record["microbatch_reductions"] = reductions["calls"] - before
            before = reductions["calls"]
            record["metrics"] = step.finish()
            record["finish_reductions"] = reductions["calls"] - before
            index += 1
        elif item[0] == "misuse":
            record["errors"] = _misuse(api, pending, failing)
        else:
            _, k, raises = item
            state = _state(model, optimizer, scheduler)
            rng = torch.get_rng_state()
            api.begin("tokens")
            for batch in copy.deepcopy(pending[:k]):
                api.microbatch(batch)
            if raises:
                failing["now"] = True
                try:
                    api.microbatch(pending[k])
                except InjectedFailure:
                    record["raised"] = True
                failing["now"] = False
            record["state_before_abort"] = api.state.value
            api.abort()
            api.abort()
            after = _state(model, optimizer, scheduler)
            record["restored"] = (len(state) == len(after) and all(
                np.array_equal(a, b) for a, b in zip(state, after))
                and torch.equal(rng, torch.get_rng_state()))
        steps.append(record)
    return {"steps": steps, "params": {name: p.detach().float().cpu().numpy().copy()
                                       for chunk in model for name, p in chunk.named_parameters()}}


def _drive(plans: dict[str, tuple], forward_step_func, model, optimizer, opt_param_scheduler,
           train_data_iterator, valid_data_iterator, process_non_loss_data_func, config,
           checkpointing_context, non_loss_data_func, inference_model=None,
           p2p_communicator=None, pg_collection=None):
    """Stock ``train()``'s place: the config it sets, then every plan from the same start on the
    same batches."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    for chunk in model:
        chunk.train()
    config.grad_scale_func = optimizer.scale_loss
    if config.finalize_model_grads_func is None:
        config.finalize_model_grads_func = finalize_model_grads
    steps = max(sum(item[0] != "abort" for item in plan) for plan in plans.values())
    batches = [[next(train_data_iterator) if train_data_iterator is not None else None
                for _ in range(get_num_microbatches())] for _ in range(steps)]
    schedule = {"p2p_communicator": p2p_communicator, "pg_collection": pg_collection}
    start = _Snapshot(model, optimizer, opt_param_scheduler)
    reductions = count_grad_reductions()
    for name, plan in plans.items():
        start.restore()
        _result[name] = _run_plan(plan, batches, model, optimizer, opt_param_scheduler,
                                  forward_step_func, config, schedule, reductions)
    _result["bucket_groups"] = _bucket_groups(model)
    return steps, 0.0


def _install_driver(plans: dict[str, tuple]) -> None:
    from functools import partial

    import megatron.training.training as training

    training.train = partial(_drive, plans)


def gpt_rank(argv: list[str], plans: dict[str, tuple]) -> dict[str, Any]:
    """One rank of a stock GPT run (examples/gpt/pretrain_gpt.py) trained by each plan."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    from megatron_plugins.compat import startup

    sys.argv = ["pretrain_gpt.py", *argv]
    gpt = load_gpt_example()
    startup.install()
    _install_driver(plans)
    pretrain(gpt.build_config(), gpt.datasets_provider, ModelType.encoder_or_decoder,
             gpt.forward_step)
    return dict(_result)


def mimo_rank(argv: list[str], plans: dict[str, tuple]) -> dict[str, Any]:
    """One rank of a MiMo run (the entry point's code path) trained by each plan."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    from megatron_plugins.launch.pretrain import parse_mimo_args, train

    _install_driver(plans)
    train(parse_mimo_args(argv))
    return dict(_result)


def run_plans(kind: str, nproc: int, flags: tuple[str, ...], plans: dict[str, tuple],
              timeout: float = 200.0) -> list[dict[str, Any]]:
    """Run every plan from the same initial state on ``nproc`` ranks of the tiny GPT
    (``kind="gpt"``, per-token loss) or MiMo model; per rank, each plan's records."""
    base = [*TINY_GPT, "--calculate-per-token-loss"] if kind == "gpt" else TINY_MIMO
    steps = max(sum(item[0] != "abort" for item in plan) for plan in plans.values())
    argv = [*base, "--train-iters", str(steps), "--eval-iters", "0", *flags]
    rank = gpt_rank if kind == "gpt" else mimo_rank
    return run_in_processes(rank, nproc, timeout=timeout, args=(argv, plans),
                            simulated=True)
