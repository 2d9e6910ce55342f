"""Reference context-parallel (CP) attention, for the CPU simulation and GPUs without TE.

Megatron's local ``DotProductAttention`` refuses ``context_parallel_size > 1`` (only Transformer
Engine's attention splits a sequence over CP ranks), so without TE no CP path could run.
:class:`ContextParallelAttention` is a drop-in ``core_attention`` with TE's "all_gather"
semantics: each rank all-gathers keys and values over the CP group, attends from its own query
positions (stock's load-balanced split, :mod:`megatron_plugins.ops.cp_positions`) with the causal
mask in global positions, per document for packed (THD) rows. Only local tensors are saved; the
backward re-gathers, recomputes and all-reduces the key and value gradients (gloo has no
reduce-scatter), then keeps this rank's slice. The product of local queries and gathered keys is
PackedAttention's materializing one (``fast=False``: the reference) or SDPA's
(:func:`megatron_plugins.ops.sdpa.positioned`, ``fast=True``: what
:class:`megatron_plugins.ops.fast_attention.FastAttention` runs under CP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.ops.cp_positions import local_positions
from megatron_plugins.ops.packed_attention import attend
from megatron_plugins.ops.sdpa import positioned

__all__ = ["ContextParallelAttention"]

CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)
BIDIRECTIONAL = (AttnMaskType.no_mask, AttnMaskType.padding)


@dataclass(frozen=True)
class _Numerics:
    """What the block product needs besides the tensors; ``fast``: SDPA's product, else
    :func:`attend`'s."""

    softmax_scale: float
    coeff: int | None
    softmax_in_fp32: bool
    causal: bool
    fast: bool


@dataclass(frozen=True)
class _Layout:
    """Where this rank's tokens sit in the whole sequence: ``query_positions`` are this rank's
    global positions in local order, ``gathered_positions`` those of every rank, rank-major
    (the order ``all_gather`` yields); ``documents`` the (padded start, real length) of each
    document of a packed row, None for one sequence per batch row."""

    query_positions: torch.Tensor
    gathered_positions: torch.Tensor
    documents: tuple[tuple[int, int], ...] | None


def _gather(tensor: torch.Tensor, group: dist.ProcessGroup, layout: _Layout) -> torch.Tensor:
    """Every rank's ``tensor`` (sequence on dim 0) in global sequence order."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    ordered = torch.empty((layout.gathered_positions.numel(), *tensor.shape[1:]),
                          dtype=tensor.dtype, device=tensor.device)
    ordered[layout.gathered_positions] = torch.cat(parts)
    return ordered


def _block(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           positions: torch.Tensor, numerics: _Numerics) -> torch.Tensor:
    """Queries ``[sq, b, heads, dim]`` at ``positions`` (indices into the keys) against keys /
    values ``[sk, b, groups, dim]`` -> ``[sq, b, heads, dim]``, causal in those positions."""
    if numerics.fast:
        return positioned(query, key, value, positions, scale=numerics.softmax_scale,
                          causal=numerics.causal)
    allowed = None
    if numerics.causal:
        allowed = torch.arange(key.shape[0], device=positions.device)[None, :] <= positions[:, None]
    return torch.stack([attend(query[:, b], key[:, b], value[:, b], allowed,
                               softmax_scale=numerics.softmax_scale, coeff=numerics.coeff,
                               softmax_in_fp32=numerics.softmax_in_fp32)
                        for b in range(query.shape[1])], dim=1)


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: _Layout,
               numerics: _Numerics) -> torch.Tensor:
    """Local queries against the whole sequence's keys / values (global order); returns
    ``[s_l, b, heads, dim]`` or THD ``[t_l, heads, dim]``."""
    q_pos = layout.query_positions
    if layout.documents is None:
        return _block(query, key, value, q_pos, numerics)
    context = query.new_zeros(query.shape)
    for start, length in layout.documents:
        # Padding tokens of a document (and between documents) attend to nothing: zero out.
        rows = ((q_pos >= start) & (q_pos < start + length)).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        span = slice(start, start + length)
        context[rows] = _block(query[rows, None], key[span, None], value[span, None],
                               q_pos[rows] - start, numerics)[:, 0]
    return context


class _GatheredAttention(torch.autograd.Function):
    """Attention over all-gathered keys / values that saves only this rank's tensors."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                group: dist.ProcessGroup, layout: _Layout, numerics: _Numerics) -> torch.Tensor:
        ctx.save_for_backward(query, key, value)
        ctx.group, ctx.layout, ctx.numerics = group, layout, numerics
        return _attention(query, _gather(key, group, layout), _gather(value, group, layout),
                          layout, numerics)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        query, key, value = ctx.saved_tensors
        group, layout = ctx.group, ctx.layout
        with torch.enable_grad():
            query = query.detach().requires_grad_()
            key_all = _gather(key, group, layout).requires_grad_()
            value_all = _gather(value, group, layout).requires_grad_()
            output = _attention(query, key_all, value_all, layout, ctx.numerics)
        # A rank may hold only padding (a short document's late chunks): its output depends on
        # nothing and its gradients are zero, but it still joins the all-reduce below.
        leaves = (query, key_all, value_all)
        if output.requires_grad:
            grad_query, grad_key, grad_value = torch.autograd.grad(
                output, leaves, grad_output, allow_unused=True, materialize_grads=True)
        else:
            grad_query, grad_key, grad_value = (torch.zeros_like(t) for t in leaves)
        # Every rank's queries reach every rank's keys: sum the gradients over the group, then
        # keep the rows this rank holds (rank-major, as gathered).
        rank, local = dist.get_rank(group), key.shape[0]
        own = layout.gathered_positions[rank * local:(rank + 1) * local]
        grads = torch.cat([grad_key.flatten(), grad_value.flatten()])
        dist.all_reduce(grads, op=dist.ReduceOp.SUM, group=group)
        grad_key, grad_value = grads.split([grad_key.numel(), grad_value.numel()])
        return (grad_query, grad_key.view(key_all.shape)[own],
                grad_value.view(value_all.shape)[own], None, None, None)


class ContextParallelAttention(MegatronModule):
    """``core_attention`` for cp > 1 without Transformer Engine: this rank's queries attend to
    the keys / values of the whole sequence (all-gathered over ``pg_collection.cp``).

    Takes and returns what :class:`~megatron_plugins.ops.packed_attention.PackedAttention`
    does: ``[s_l, b, heads, dim]`` -> ``[s_l, b, heads * dim]``, or THD ``[t_l, heads, dim]``
    -> ``[t_l, heads * dim]`` with ``packed_seq_params`` (padded boundaries a multiple of
    ``2 x cp``); the local rows are stock's split of the sequence (per document for THD).
    Causal or bidirectional, GQA; no dropout, dense mask, bias, windows or softmax variants.
    ``cp_comm_type`` is accepted and ignored: this is always TE's "all_gather" scheme. ``fast``
    (keyword only, not a spec parameter): SDPA's block product instead of the materializing one.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection: ProcessGroupCollection | None = None, *,
                 fast: bool = False) -> None:
        super().__init__(config=config)
        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise ValueError("the local context parallel attention computes vanilla full "
                             f"attention: softmax_type {config.softmax_type!r} and window_size "
                             f"{config.window_size} need --transformer-impl transformer_engine")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout > 0:
            raise ValueError(f"the local context parallel attention has no dropout; set "
                             f"--attention-dropout 0 (got {dropout}) or use "
                             "--transformer-impl transformer_engine")
        if pg_collection is None or getattr(pg_collection, "cp", None) is None:
            raise ValueError("ContextParallelAttention needs pg_collection.cp, the context "
                             "parallel group to gather keys and values over")
        if attn_mask_type not in CAUSAL + BIDIRECTIONAL:
            raise ValueError(f"the local context parallel attention supports causal or "
                             f"bidirectional attention, not {attn_mask_type.name}")
        self.attn_mask_type = attn_mask_type
        self.fast = fast
        self.cp_group = pg_collection.cp
        self.tp_group = pg_collection.tp
        self.softmax_scale = (1.0 / math.sqrt(config.kv_channels) if softmax_scale is None
                              else softmax_scale)
        # Query-key layer scaling as DotProductAttention (see PackedAttention).
        self.coeff = max(1, layer_number) if config.apply_query_key_layer_scaling else None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        """Attention of this rank's tokens over the whole sequence; shapes in the class
        docstring."""
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("the local context parallel attention masks by position: it "
                             "takes no attention mask or bias (MimoModel refuses a dense mask "
                             "under CP too)")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type not in CAUSAL + BIDIRECTIONAL:
            raise ValueError(f"the local context parallel attention supports causal or "
                             f"bidirectional attention, not {mask_type.name}")
        numerics = _Numerics(self.softmax_scale, self.coeff,
                             self.config.attention_softmax_in_fp32, mask_type in CAUSAL, self.fast)
        layout = self._layout(query, packed_seq_params)
        context = _GatheredAttention.apply(query, key, value, self.cp_group, layout, numerics)
        return context.reshape(*context.shape[:-2], -1)

    def _layout(self, query: torch.Tensor, params: PackedSeqParams | None) -> _Layout:
        cp, rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        packed = params is not None and params.qkv_format == "thd"
        seq_length = query.shape[0] * cp
        if packed:
            padded = params.cu_seqlens_q_padded
            if padded is None:
                padded = params.cu_seqlens_q
            if not torch.equal(params.cu_seqlens_q.cpu(), params.cu_seqlens_kv.cpu()):
                raise ValueError("the local context parallel attention is self-attention: "
                                 "cu_seqlens_q and cu_seqlens_kv must match")
            starts = padded[:-1].tolist()
            documents = tuple(zip(starts, torch.diff(params.cu_seqlens_q).tolist()))
        else:
            params, documents = None, None
        gathered = torch.cat([local_positions(seq_length, cp, r, params, query.device)
                              for r in range(cp)])
        return _Layout(gathered[rank * query.shape[0]:(rank + 1) * query.shape[0]], gathered,
                       documents)
