"""Gradient finalization across disjoint grids: per-module reductions, one global token count.

The stock schedule calls ``config.finalize_model_grads_func([mimo_model], num_tokens, ...)`` once
per step on every rank. Here each active module finalizes on its own groups with stock
``finalize_model_grads`` (DP reduce, TP-replicated and embedding reductions), then every rank
divides its gradients by the same global token count. That count has one source, the language
model's last pipeline stage (tensor rank 0 of each DP x CP replica), and is summed world-wide, so
encoder gradients are normalized exactly like language gradients whatever the encoder DP, the
language DP, TP or PP are. A per-module normalizer is the silent encoder_dp / llm_dp bug.

The same all-reduce carries the data alignment guard's per-step sums
(:class:`~megatron_plugins.data.addressing.AlignmentGuard`), so checking that encoders embedded
the language model's samples costs no extra collective, and the stock rerun state machine's
"rerun this step" flag, so its world-wide check costs none either (compat Gap 11).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
from megatron.core.distributed import finalize_model_grads
from megatron.core.models.mimo import MimoModel
from megatron.core.pipeline_parallel.utils import is_pp_last_stage
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import unwrap_model

from megatron_plugins.compat import step_reductions
from megatron_plugins.data.addressing import GuardSet
from megatron_plugins.parallel.layout import LANGUAGE
from megatron_plugins.step.phases import GRAD_REDUCE, phase

__all__ = ["CrossGridGradSync", "counts_tokens", "install_grad_sync", "scale_module_gradients"]


def _active_modules(model: MimoModel, names: Mapping[str, object]) -> Iterator[tuple[str, torch.nn.Module]]:
    for name in names:
        yield name, model.language_model if name == LANGUAGE else model.modality_submodules[name]


def counts_tokens(language: ProcessGroupCollection | None) -> bool:
    """Whether this rank is the one source of its replica's token count (see module docstring);
    ``language`` is the rank's language-model groups, None on a rank without the loss."""
    return language is not None and is_pp_last_stage(language.pp) and language.tp.rank() == 0


def scale_module_gradients(modules: Iterable[torch.nn.Module], total: torch.Tensor) -> None:
    """Divide every module's gradients by the global count ``total`` (at least 1)."""
    scaling = 1.0 / torch.clamp(total, min=1)
    for module in modules:
        module.scale_gradients(scaling)


class CrossGridGradSync:
    """The ``finalize_model_grads_func`` and ``no_sync_func`` a MiMo model's config carries.

    ``no_sync`` is re-entrant safe: if a step raised inside the schedule's no-sync window (the
    stock schedule does not exit it on error), the next step's entry, or finalization, closes the
    stale window first, so DDP hooks are never left disabled.
    """

    def __init__(self, model: MimoModel, module_pgs: Mapping[str, ProcessGroupCollection],
                 guard: GuardSet | None = None) -> None:
        self._model = model
        self._module_pgs = dict(module_pgs)
        self._guard = guard
        self._counts_tokens = counts_tokens(module_pgs.get(LANGUAGE))
        self._open: contextlib.ExitStack | None = None

    def _close(self) -> None:
        if self._open is not None:
            stack, self._open = self._open, None
            stack.close()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Hold back DDP's overlapped grad reduction of every active module (all but the last
        microbatch)."""
        self._close()
        stack = contextlib.ExitStack()
        stack.enter_context(self._model.no_sync())
        self._open = stack
        try:
            yield
        finally:
            self._close()

    def global_token_count(self, num_tokens: torch.Tensor | None,
                           carry_rerun_vote: bool = False) -> torch.Tensor:
        """Tokens of the whole global batch, identical on every rank, in one world all-reduce
        that also checks the step's data alignment and, with ``carry_rerun_vote`` (only after the
        step's last result check), settles the rerun state machine's check (compat
        Gap 11)."""
        if num_tokens is None:
            raise RuntimeError(
                "MiMo gradient finalization needs per-token loss: the language config must have "
                "calculate_per_token_loss=True (the MiMo entry point sets it)"
            )
        local = num_tokens if self._counts_tokens else torch.zeros_like(num_tokens)
        parts = [local.detach().reshape(1).to(torch.int64)]
        if carry_rerun_vote:
            vote = step_reductions.rerun_vote()
            parts.append(torch.tensor([vote], dtype=torch.int64, device=local.device))
        if self._guard is not None:
            parts.append(self._guard.contribution().to(local.device))
        packed = torch.cat(parts)
        dist.all_reduce(packed)
        if carry_rerun_vote:
            step_reductions.settle_rerun_vote(vote, int(packed[1]))
        if self._guard is not None:
            self._guard.check(packed[1 + carry_rerun_vote:].cpu())
        return packed[0].to(num_tokens.dtype).reshape(num_tokens.shape)

    def reduce_gradients(self, force_all_reduce: bool = False) -> None:
        """Stock per-module finalization (DP reduce, TP-replicated and embedding reductions),
        without normalization; the split train step calls it apart from the token count."""
        self._close()
        for name, module in _active_modules(self._model, self._module_pgs):
            finalize_model_grads([module], None, pg_collection=self._module_pgs[name],
                                 force_all_reduce=force_all_reduce)

    def scale_gradients(self, total: torch.Tensor) -> None:
        """Divide every active module's gradients by the global count ``total``."""
        modules = (module for _, module in _active_modules(self._model, self._module_pgs))
        scale_module_gradients(modules, total)

    def finalize(self, model: list[torch.nn.Module], num_tokens: torch.Tensor | None,
                 pg_collection: object = None, force_all_reduce: bool = False) -> None:
        """Stock per-module finalization, then division by the global token count."""
        assert unwrap_model(model[0]) is self._model, "grad sync installed on another model"
        with phase(GRAD_REDUCE):
            self.reduce_gradients(force_all_reduce)
            self.scale_gradients(self.global_token_count(num_tokens, carry_rerun_vote=True))


def install_grad_sync(model: MimoModel, module_pgs: Mapping[str, ProcessGroupCollection],
                      guard: GuardSet | None = None) -> CrossGridGradSync:
    """Point the model config's finalize/no-sync hooks at a :class:`CrossGridGradSync`.

    Stock ``train()`` keeps a finalize function already set on the config; its own no-sync
    function is only installed for DDP-wrapped chunks, which a MimoModel is not.
    """
    sync = CrossGridGradSync(model, module_pgs, guard)
    model.config.finalize_model_grads_func = sync.finalize
    model.config.no_sync_func = sync.no_sync
    return sync
