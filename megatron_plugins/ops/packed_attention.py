"""Reference attention over packed (THD) variable-length sequences, without Transformer Engine.

Megatron's local ``DotProductAttention`` rejects ``packed_seq_params`` (only TE's attention reads
``cu_seqlens``), so a ViT on native-resolution images (one segment per image, all images in one
``[T, 1, H]`` row) has no local path. :class:`PackedAttention` is a drop-in ``core_attention``
that attends within each segment only, on CPU and CUDA, with ``DotProductAttention``'s numerics
(softmax scale, query-key layer scaling, fp32 softmax). It is the reference for the fast
attention (:mod:`megatron_plugins.ops.fast_attention`) and, with ``--reference-attention``, the
local packed layers' core attention.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["BIDIRECTIONAL", "CAUSAL", "PackedAttention", "attend", "packed_seq_params", "segments"]

CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)
"""Mask types a query sees its own and earlier positions under (self-attention: sq == sk)."""
BIDIRECTIONAL = (AttnMaskType.no_mask, AttnMaskType.padding)
"""Mask types a query sees every key of its sequence or segment under."""


def packed_seq_params(lengths: torch.Tensor) -> PackedSeqParams:
    """THD parameters for segments of these ``lengths`` laid end to end (self-attention): the
    fields both :class:`PackedAttention` and TE's attention read."""
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    longest = int(lengths.max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def segments(params: PackedSeqParams, kind: str) -> list[tuple[int, int]]:
    """(start, length) of each segment of ``kind`` ("q" or "kv"): starts from the padded
    cumulative lengths when given (padding between segments), lengths from the unpadded ones."""
    cu_seqlens = getattr(params, f"cu_seqlens_{kind}")
    padded = getattr(params, f"cu_seqlens_{kind}_padded")
    starts = (cu_seqlens if padded is None else padded)[:-1].tolist()
    return list(zip(starts, torch.diff(cu_seqlens).tolist()))


class PackedAttention(MegatronModule):
    """``core_attention`` for ``packed_seq_params.qkv_format == "thd"``: softmax(QK^T)V on each
    segment separately, bidirectional or causal within the segment, on this rank's heads.

    Takes what ``Attention.forward`` passes in the THD case, query ``[T, heads, dim]`` and key /
    value ``[T, groups, dim]`` (groups dividing heads: GQA), and returns ``[T, heads * dim]``.
    Without ``packed_seq_params`` it takes ``[s, b, heads, dim]`` as ``b`` whole sequences and
    returns ``[s, b, heads * dim]``. Tokens outside every segment (padding) come out zero.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection: ProcessGroupCollection | None = None) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("PackedAttention does not split sequences over context parallel "
                             "ranks; use --transformer-impl transformer_engine for cp > 1")
        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise ValueError("PackedAttention computes vanilla full attention: softmax_type "
                             f"{config.softmax_type!r} and window_size {config.window_size} need "
                             "--transformer-impl transformer_engine")
        self.attn_mask_type = attn_mask_type
        if pg_collection is not None:
            self.tp_group = pg_collection.tp
        head_dim = config.kv_channels
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        # Query-key layer scaling divides the scores by the layer number before the matmul (fp16
        # range) and multiplies it back inside the fp32 softmax, as DotProductAttention does.
        self.coeff = max(1, layer_number) if config.apply_query_key_layer_scaling else None
        self.attention_dropout = torch.nn.Dropout(
            config.attention_dropout if attention_dropout is None else attention_dropout)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        """Attention within each segment; see the class docstring for shapes."""
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("PackedAttention takes segments, not an attention mask or bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type not in CAUSAL + BIDIRECTIONAL:
            raise ValueError(f"PackedAttention supports causal or bidirectional attention, not "
                             f"{mask_type.name}")
        causal = mask_type in CAUSAL
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return self._unpacked(query, key, value, causal)
        queries = segments(packed_seq_params, "q")
        keys = segments(packed_seq_params, "kv")
        context = query.new_zeros(query.shape)
        for (q_start, q_len), (k_start, k_len) in zip(queries, keys):
            context[q_start:q_start + q_len] = self._attend(
                query[q_start:q_start + q_len], key[k_start:k_start + k_len],
                value[k_start:k_start + k_len], causal)
        return context.reshape(context.shape[0], -1)

    def _unpacked(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  causal: bool) -> torch.Tensor:
        """``[s, b, heads, dim]``: each batch row is one sequence."""
        rows = [self._attend(query[:, b], key[:, b], value[:, b], causal)
                for b in range(query.shape[1])]
        return torch.stack(rows, dim=1).reshape(query.shape[0], query.shape[1], -1)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                causal: bool) -> torch.Tensor:
        """One segment: query ``[sq, heads, dim]``, key / value ``[sk, groups, dim]`` ->
        ``[sq, heads, dim]``."""
        allowed = None
        if causal:
            allowed = torch.ones(query.shape[0], key.shape[0], dtype=torch.bool,
                                 device=query.device).tril()
        return attend(query, key, value, allowed, softmax_scale=self.softmax_scale,
                      coeff=self.coeff, softmax_in_fp32=self.config.attention_softmax_in_fp32,
                      dropout=self._dropout if self.training and self.attention_dropout.p > 0
                      else None)

    def _dropout(self, probs: torch.Tensor) -> torch.Tensor:
        if self.config.sequence_parallel:
            return self.attention_dropout(probs)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return self.attention_dropout(probs)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           allowed: torch.Tensor | None, *, softmax_scale: float, coeff: int | None,
           softmax_in_fp32: bool,
           dropout: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """softmax(QK^T)V with ``DotProductAttention``'s numerics, shared by the reference
    attentions: query ``[sq, heads, dim]``, key / value ``[sk, groups, dim]`` (GQA), ``allowed``
    ``[sq, sk]`` (None: every key) -> ``[sq, heads, dim]``; every query needs an allowed key."""
    repeats = query.shape[1] // key.shape[1]
    if repeats > 1:
        key = key.repeat_interleave(repeats, dim=1)
        value = value.repeat_interleave(repeats, dim=1)
    scores = torch.matmul(query.transpose(0, 1), key.permute(1, 2, 0)) * (softmax_scale
                                                                         / (coeff or 1))
    if softmax_in_fp32:
        scores = scores.float()
    if coeff is not None:
        scores = scores * coeff
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    if dropout is not None:
        probs = dropout(probs)
    return torch.matmul(probs, value.transpose(0, 1)).transpose(0, 1)
