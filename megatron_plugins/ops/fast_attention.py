"""The local path's core attention on torch's fused SDPA kernels, and which core attention a local
layer gets.

Megatron's local ``DotProductAttention`` and the reference attentions here
(:class:`~megatron_plugins.ops.packed_attention.PackedAttention`,
:class:`~megatron_plugins.ops.cp_attention.ContextParallelAttention`) keep each layer's
``heads x s x s`` probabilities for the backward: at real sequence lengths they do not fit on a
GPU. :class:`FastAttention` computes the same attention on
``torch.nn.functional.scaled_dot_product_attention`` (:mod:`megatron_plugins.ops.sdpa`), which
keeps only the inputs, the output and a log-sum-exp per query row: one sequence per batch row or
packed (THD) segments (documents, images, Qwen2.5-VL's windows), causal or bidirectional, GQA, the
softmax scale Megatron applies (query-key layer scaling only guards fp16 range, so the scale is
the same), attention dropout, this rank's heads under TP, and under context parallelism the
all-gather CP attention with the SDPA block product. :func:`local_core_attention` makes it the
core attention of every local-spec layer unless the config asks for the references
(:data:`REFERENCE_ATTENTION`, set by ``--reference-attention``).
"""

from __future__ import annotations

import math
from itertools import groupby

import torch
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.ops import REFERENCE_ATTENTION
from megatron_plugins.ops.cp_attention import ContextParallelAttention
from megatron_plugins.ops.packed_attention import BIDIRECTIONAL, CAUSAL, PackedAttention, segments
from megatron_plugins.ops.sdpa import product

__all__ = ["FastAttention", "bidirectional_layer_spec", "local_core_attention", "packed_layer_spec"]


def local_core_attention(config: TransformerConfig, *, packed: bool) -> type:
    """The core attention of a local-spec layer on ``config`` whose inputs come ``packed`` (THD)
    or not: :class:`FastAttention`, or with :data:`REFERENCE_ATTENTION` the reference the local
    path had before it: the CP one under context parallelism, else PackedAttention for packed
    inputs and Megatron's ``DotProductAttention`` otherwise."""
    if not getattr(config, REFERENCE_ATTENTION, False):
        return FastAttention
    if config.context_parallel_size > 1:
        return ContextParallelAttention
    return PackedAttention if packed else DotProductAttention


def packed_layer_spec(config: TransformerConfig) -> ModuleSpec:
    """The bidirectional (ViT) transformer layer for packed inputs: TE's layer when the config
    uses TE (its attention reads THD itself), else Megatron's local layer on the local path's
    packed core attention."""
    return bidirectional_layer_spec(config, packed=True)


def bidirectional_layer_spec(config: TransformerConfig, *, packed: bool) -> ModuleSpec:
    """Megatron's ViT layer: TE's when the config uses TE, else the local one with
    :func:`local_core_attention` for inputs that come ``packed`` or not."""
    from megatron.core.models.vision import vit_layer_specs

    if config.transformer_impl == "transformer_engine":
        return vit_layer_specs.get_vit_layer_with_transformer_engine_spec()
    spec = vit_layer_specs.get_vit_layer_with_local_spec()
    spec.submodules.self_attention.submodules.core_attention = local_core_attention(
        config, packed=packed)
    return spec


class FastAttention(MegatronModule):
    """``core_attention`` on SDPA computing what the references compute (their numerics up to
    rounding), with the signature Megatron's ``Attention`` builds it with.

    Takes ``[s, b, heads, dim]`` query and ``[s, b, groups, dim]`` key / value (groups dividing
    heads: GQA) and returns ``[s, b, heads * dim]``, masked by ``attention_mask`` when one is
    given (True: masked out, as ``DotProductAttention``; the standard causal one runs as SDPA's
    causal case, no mask) else by the mask type; with THD ``packed_seq_params`` ``[T, heads,
    dim]`` -> ``[T, heads * dim]``, attending within each segment, padding tokens zero, as
    :class:`PackedAttention`. Under context parallelism the CP attention's all-gather exchange
    with SDPA's block product (:class:`ContextParallelAttention` ``fast=True``), which refuses
    dropout and masks as the reference does. Vanilla softmax without windows only.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection: ProcessGroupCollection | None = None) -> None:
        super().__init__(config=config)
        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise ValueError(f"the fast attention computes vanilla full attention: softmax_type "
                             f"{config.softmax_type!r} and window_size {config.window_size} need "
                             "--reference-attention (Megatron's local attention) or "
                             "--transformer-impl transformer_engine")
        if attn_mask_type not in CAUSAL + BIDIRECTIONAL:
            raise ValueError(f"the fast attention supports causal or bidirectional attention, "
                             f"not {attn_mask_type.name}")
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = (1.0 / math.sqrt(config.kv_channels) if softmax_scale is None
                              else softmax_scale)
        self.dropout_p = config.attention_dropout if attention_dropout is None \
            else attention_dropout
        self.context_parallel = None
        if config.context_parallel_size > 1:
            self.context_parallel = ContextParallelAttention(
                config, layer_number, attn_mask_type, attention_type, attention_dropout,
                softmax_scale, cp_comm_type, pg_collection, fast=True)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        """Attention of the given tokens; shapes in the class docstring."""
        if self.context_parallel is not None:
            return self.context_parallel(query, key, value, attention_mask, attn_mask_type,
                                         attention_bias, packed_seq_params)
        if attention_bias is not None:
            raise ValueError("the fast attention takes no attention bias; pass "
                             "--reference-attention or --transformer-impl transformer_engine")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type not in CAUSAL + BIDIRECTIONAL:
            raise ValueError(f"the fast attention supports causal or bidirectional attention, "
                             f"not {mask_type.name}")
        causal = mask_type in CAUSAL
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            if attention_mask is not None:
                raise ValueError("the fast attention takes packed segments or a mask, not both")
            return self._packed(query, key, value, causal, packed_seq_params)
        masked = None if attention_mask is None or _is_causal(attention_mask, query, key) \
            else attention_mask
        causal = causal if attention_mask is None else masked is None
        context = self._product(query.transpose(0, 1), key.transpose(0, 1),
                                _alone(value, query, key).transpose(0, 1), causal, masked)
        return context.transpose(0, 1).reshape(query.shape[0], query.shape[1], -1)

    def _packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool,
                params: PackedSeqParams) -> torch.Tensor:
        """Per-segment attention of THD tokens: segments of one length in one product (their
        tokens gathered, no ``T x T`` mask); with dropout one segment at a time in order, so
        the masks are drawn as PackedAttention draws them."""
        pairs = list(zip(segments(params, "q"), segments(params, "kv")))
        if self._dropout() > 0:
            batches = [[pair] for pair in pairs]
        else:
            by_length = sorted(pairs, key=lambda pair: (pair[0][1], pair[1][1]))
            batches = [list(group) for _, group in
                       groupby(by_length, key=lambda pair: (pair[0][1], pair[1][1]))]
        context = query.new_zeros(query.shape)
        for batch in batches:
            (_, q_len), (_, k_len) = batch[0]
            if q_len == 0:
                continue
            rows = _rows([q_start for (q_start, _), _ in batch], q_len, query.device)
            keys = _rows([k_start for _, (k_start, _) in batch], k_len, query.device)
            out = self._product(query[rows].view(len(batch), q_len, *query.shape[1:]),
                                key[keys].view(len(batch), k_len, *key.shape[1:]),
                                value[keys].view(len(batch), k_len, *value.shape[1:]),
                                causal, None)
            context[rows] = out.reshape(-1, *query.shape[1:])
        return context.reshape(context.shape[0], -1)

    def _dropout(self) -> float:
        return self.dropout_p if self.training else 0.0

    def _product(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool,
                 masked: torch.Tensor | None) -> torch.Tensor:
        """``[n, s, heads, dim]`` products; dropout drawn as ``DotProductAttention`` draws it:
        in the TP rank's tracker stream, forked here unless sequence parallel (the GPT block
        then runs all its layers in that stream)."""
        dropout_p = self._dropout()
        options = dict(scale=self.softmax_scale, causal=causal, dropout_p=dropout_p,
                       masked=masked)
        if dropout_p == 0 or self.config.sequence_parallel:
            return product(query, key, value, **options)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return product(query, key, value, **options)


def _alone(value: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``value`` copied out of the fused QKV output when the query and key no longer view it
    (the rotary embedding made them new tensors): SDPA keeping the slice would keep the whole
    QKV output alive for the backward, the copy only the value's bytes."""
    storage = value.untyped_storage().data_ptr()
    if value.is_contiguous() or storage in (query.untyped_storage().data_ptr(),
                                            key.untyped_storage().data_ptr()):
        return value
    return value.contiguous()


def _rows(starts: list[int], length: int, device: torch.device) -> torch.Tensor:
    """Token indices of segments of one ``length`` at ``starts``, segment-major."""
    return (torch.tensor(starts, device=device)[:, None]
            + torch.arange(length, device=device)[None, :]).reshape(-1)


def _is_causal(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether a Megatron mask (True: masked) is the causal one every batch row and head shares
    (the data's): then SDPA's causal case runs without it. A transient comparison, not kept."""
    sq, sk = query.shape[0], key.shape[0]
    if sq != sk or mask.shape[-2:] != (sq, sk) or mask.dtype != torch.bool:
        return False
    future = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu_(1)
    return bool(torch.equal(mask, future.expand_as(mask)))
