"""Bridges for the language model under context parallelism on disjoint grids (Gaps 19, 20, 21).

Shared context: MimoModel hands every CP rank of the language model the whole sequence and keeps
this rank's share itself (stock's load-balanced split: chunks ``r`` and ``2cp-1-r``, per document
for packed THD rows), and the language model finds its positions from ``pg_collection.cp``. On
disjoint grids ``parallel_state`` is never initialized, so stock code that needs Transformer
Engine's index kernel or falls back to ``parallel_state``'s CP group does not split, or splits a
packed row as one sequence.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from megatron_plugins.compat import record
from megatron_plugins.ops.cp_positions import thd_partitioned_indices

__all__ = ["bind_mrope_cp_group", "split_packed_rows_without_te", "whole_packed_mrope_rows"]


@functools.cache
def _partition_adapter_class() -> type:
    """``PartitionAdapter`` whose THD split needs no Transformer Engine."""
    from megatron.core.models.mimo.partition.utils import PartitionAdapter

    class TorchThdPartitionAdapter(PartitionAdapter):
        """MiMo's partition adapter splitting packed (THD) rows with
        :func:`~megatron_plugins.ops.cp_positions.thd_partitioned_indices` (Gap 19); one sequence
        per row goes through stock's split."""

        def _apply_context_parallel(self, embeddings, labels, loss_mask, packed_seq_params):
            if (not self.cfg.use_cp or packed_seq_params is None
                    or getattr(packed_seq_params, "qkv_format", "sbhd") == "sbhd"):
                return super()._apply_context_parallel(embeddings, labels, loss_mask,
                                                       packed_seq_params)
            group = self.cfg.cp_group
            shard = []
            for data in (embeddings, labels, loss_mask):
                if data is not None:
                    index = thd_partitioned_indices(
                        packed_seq_params.cu_seqlens_q_padded, data.size(1), group.size(),
                        group.rank()).to(data.device)
                    data = data.index_select(1, index)
                shard.append(data)
            return (*shard, packed_seq_params)

    return TorchThdPartitionAdapter


def split_packed_rows_without_te(model: Any) -> None:
    """Give a language rank's MimoModel a THD context-parallel split that needs no Transformer
    Engine, when TE's is unavailable (Gap 19).

    Gap 19 (MiMo's THD CP split needs TE): ``PartitionAdapter._apply_context_parallel``
    (models/mimo/partition/utils.py:214-226) asserts ``_HAVE_TEX`` and TE >= 1.10 for packed
    rows and index-selects with ``tex.thd_get_partitioned_indices``; without TE (the CPU
    simulation, GPUs without TE) a packed row under CP asserts on the first step. The adapter is
    replaced by one computing the same indices in torch; other adapters and TE installs keep
    stock's.
    """
    from megatron.core.models.mimo.partition import utils

    adapter = getattr(model, "partition_adapter", None)
    if adapter is None or utils._HAVE_TEX or not adapter.cfg.use_cp:
        return
    model.partition_adapter = _partition_adapter_class()(adapter.cfg)
    record("19")


def _multimodal_rope(model: torch.nn.Module) -> Any:
    """The GPT model's multimodal RoPE, or None for other position embeddings."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        MultimodalRotaryEmbedding,
    )

    rotary = getattr(model, "rotary_pos_emb", None)
    return rotary if isinstance(rotary, MultimodalRotaryEmbedding) else None


def bind_mrope_cp_group(model: torch.nn.Module, cp_group: torch.distributed.ProcessGroup) -> None:
    """Give a GPT model's multimodal RoPE the model's own CP group (Gap 20).

    Gap 20 (GPT mrope without the CP group): ``GPTModel`` builds ``MultimodalRotaryEmbedding``
    without ``cp_group`` (models/gpt/gpt_model.py:210-217, unlike the ``RotaryEmbedding`` above
    it), which then falls back to ``parallel_state.get_context_parallel_group(
    check_initialized=False)`` (models/common/embeddings/rotary_pos_embedding.py:308-313): None
    on disjoint grids, so under CP the frequencies stay whole ``[S, ...]`` against ``[S/cp, ...]``
    queries. Both the stock and the interleaved (Gap 17) forward read ``self.cp_group``.
    """
    rotary = _multimodal_rope(model)
    if rotary is not None:
        rotary.cp_group = cp_group
        record("20")


def _thd_row(forward: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a ``GPTModel.forward`` call is for a packed (THD) row."""
    params = forward.bind_partial(*args, **kwargs).arguments.get("packed_seq_params")
    return params is not None and params.qkv_format == "thd"


def _note_packed_row(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of the GPT model: tell its multimodal RoPE whether the row is packed."""
    model.rotary_pos_emb.whole_packed_row = _thd_row(inspect.signature(model.forward), args,
                                                     kwargs)


@functools.cache
def _whole_packed_row_class(base: type) -> type:
    """``base`` (a ``MultimodalRotaryEmbedding`` class) returning a packed row's frequencies
    whole."""

    class WholePackedRowRotaryEmbedding(base):
        """Multimodal RoPE that leaves a packed row's frequencies unsplit (Gap 21): rope_utils
        picks each document's CP chunks from the whole row."""

        whole_packed_row = False

        def forward(self, position_ids: torch.Tensor, mrope_section: list[int],
                    cp_group: Any = None) -> torch.Tensor:
            if not self.whole_packed_row:
                return super().forward(position_ids, mrope_section, cp_group)
            group, self.cp_group = self.cp_group, None
            try:
                return super().forward(position_ids, mrope_section)
            finally:
                self.cp_group = group

    WholePackedRowRotaryEmbedding.__name__ = f"WholePackedRow{base.__name__}"
    WholePackedRowRotaryEmbedding.__qualname__ = WholePackedRowRotaryEmbedding.__name__
    return WholePackedRowRotaryEmbedding


def whole_packed_mrope_rows(model: torch.nn.Module) -> None:
    """Make a GPT model's multimodal RoPE return a packed row's frequencies for the whole row,
    so that each document's CP chunks are picked at its offset (Gap 21).

    Gap 21 (mrope splits a packed row as one sequence): ``MultimodalRotaryEmbedding.forward``
    zigzag-splits its ``[S, B, 1, d]`` frequencies whenever it has a CP group
    (models/common/embeddings/rotary_pos_embedding.py:361-366), while a packed row is split per
    document (MiMo's THD split). ``_apply_rotary_pos_emb_thd`` (models/common/embeddings/
    rope_utils.py:189-268) picks each document's two chunks itself when the frequencies are as
    long as the row (case 1, at the document's padded offset); the pre-split ``S/cp`` rows fall
    into its case 2 instead, which restarts every document at the split's first rows: wrong
    angles. A forward pre-hook on the GPT model notes whether the row is THD; the RoPE (class
    swapped, keeping its state and a Gap 17 layout) then computes packed rows unsplit.
    """
    rotary = _multimodal_rope(model)
    if rotary is None:
        return
    rotary.__class__ = _whole_packed_row_class(type(rotary))
    model.register_forward_pre_hook(_note_packed_row, with_kwargs=True)
    record("21")
