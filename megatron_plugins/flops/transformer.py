"""Transformer formulas over the real token layout: attention per segment (a packed document, an
image, an attention window, a whole row), GQA, plain and gated MLPs, MoE with top-k routed and
shared experts.

A layout is the list of segment lengths attention runs over; every other product is linear in
their sum. Shapes come from a Megatron ``TransformerConfig`` (or anything with its field names:
no torch needed) through :meth:`Layer.of`.

Attention counts what the kernel computes (:class:`AttentionKernel`): Megatron's local
``DotProductAttention`` and our reference attentions (``ops.packed_attention``,
``--reference-attention``) multiply the whole ``L x L`` score matrix of a segment and mask it
afterwards, causal or not, which is also what ``FlopCounterMode`` counts on them; Transformer
Engine's fused / flash attention and the local path's default, SDPA's fused kernels
(``ops.fast_attention``), skip the blocks a causal mask removes (``L (L + 1) / 2`` score pairs)
and recompute the scores in their backward.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from megatron_plugins.flops.count import FirstLayer, Work, linear
from megatron_plugins.ops import REFERENCE_ATTENTION

__all__ = ["Attention", "AttentionKernel", "Layer", "MLP", "MoE", "attention_kernel", "linear"]


class AttentionKernel(enum.Enum):
    """How an attention computes its scores."""

    MATMUL = "matmul"
    """Two batched products over the whole ``L x L`` scores of each segment, masked afterwards
    (``--reference-attention``: local ``DotProductAttention``, ``PackedAttention``): backward 2x
    forward."""
    FLASH = "flash"
    """A fused kernel (Transformer Engine, flash attention, SDPA's fused kernels of the local
    path's ``FastAttention``): a causal mask's upper triangle is skipped, ``L (L + 1) / 2``
    pairs; backward 2x forward plus the scores recomputed (half the forward), counted as
    recomputation."""


def attention_kernel(config: Any) -> AttentionKernel:
    """The kernel the layers of ``config`` (a ``TransformerConfig``, read by name) run: the
    matmul one for the local path's references (``--reference-attention``), else a fused one
    (Transformer Engine's, or SDPA's on the local path)."""
    if config.transformer_impl == "local" and getattr(config, REFERENCE_ATTENTION, False):
        return AttentionKernel.MATMUL
    return AttentionKernel.FLASH


@dataclass(frozen=True)
class Attention:
    """Self-attention: fused QKV (GQA: ``groups`` key/value heads; an output gate adds a
    query-sized gate), scores per segment, output projection."""

    hidden: int
    heads: int
    groups: int
    head_dim: int
    output_gate: bool = False
    causal: bool = False
    kernel: AttentionKernel = AttentionKernel.MATMUL

    def projections(self, tokens: int) -> Work:
        query, key_value = self.heads * self.head_dim, self.groups * self.head_dim
        qkv = query * (2 if self.output_gate else 1) + 2 * key_value
        return (Work.linear("linear_qkv", tokens, self.hidden, qkv)
                + Work.linear("linear_proj", tokens, query, self.hidden))

    def scores(self, segments: Iterable[int]) -> Work:
        """QK^T and PV over each segment, with every query head (GQA repeats key/value heads)."""
        skip = self.causal and self.kernel is AttentionKernel.FLASH
        pairs = sum(length * (length + 1) // 2 if skip else length * length
                    for length in segments)
        forward = 2 * 2 * pairs * self.heads * self.head_dim
        recompute = forward // 2 if self.kernel is AttentionKernel.FLASH else 0
        return Work(scores=forward, kernel_recompute=recompute)

    def work(self, segments: Iterable[int]) -> Work:
        segments = list(segments)
        return self.projections(sum(segments)) + self.scores(segments)


@dataclass(frozen=True)
class MLP:
    """``hidden -> ffn`` (twice as wide when gated: SwiGLU's gate and up), ``ffn -> hidden``."""

    hidden: int
    ffn: int
    gated: bool = False

    def work(self, tokens: int) -> Work:
        return (Work.linear("linear_fc1", tokens, self.hidden, self.ffn * (2 if self.gated else 1))
                + Work.linear("linear_fc2", tokens, self.ffn, self.hidden))


@dataclass(frozen=True)
class MoE:
    """Router (``hidden -> experts``), each token through its ``topk`` routed experts (no token
    dropped: no capacity factor), the shared experts and their optional sigmoid gate; LoRA on
    ``linear_fc1`` / ``linear_fc2`` adapts the routed experts' (over ``topk`` rows a token) and
    the shared experts'."""

    hidden: int
    experts: int
    topk: int
    expert: MLP
    shared: MLP | None = None
    shared_gate: bool = False

    def routed(self, tokens: int) -> Work:
        gating = linear(tokens, self.hidden, self.experts)
        return (Work(gating=gating, first=FirstLayer(routing=2 * gating))
                + self.expert.work(tokens * self.topk))

    def shared_work(self, tokens: int) -> Work:
        if self.shared is None:
            return Work()
        gate = linear(tokens, self.hidden, 1) if self.shared_gate else 0
        return self.shared.work(tokens) + Work(inner=gate, first=FirstLayer(routing=gate))

    def work(self, tokens: int) -> Work:
        return self.routed(tokens) + self.shared_work(tokens)


@dataclass(frozen=True)
class Layer:
    """One transformer layer: attention, then an MLP or an MoE."""

    attention: Attention
    mlp: MLP | MoE

    @classmethod
    def of(cls, config: Any, *, causal: bool = False,
           kernel: AttentionKernel = AttentionKernel.MATMUL, moe: bool = False) -> Layer:
        """The layer a ``TransformerConfig`` describes (read by field name); ``moe``: its MoE
        layer (``num_moe_experts`` experts) rather than its dense one."""
        heads = config.num_attention_heads
        head_dim = config.kv_channels or config.hidden_size // heads
        attention = Attention(config.hidden_size, heads, config.num_query_groups or heads,
                              head_dim, bool(getattr(config, "attention_output_gate", False)),
                              causal, kernel)
        gated = bool(config.gated_linear_unit)
        ffn = config.ffn_hidden_size or 4 * config.hidden_size
        if not moe:
            return cls(attention, MLP(config.hidden_size, ffn, gated))
        shared = config.moe_shared_expert_intermediate_size
        return cls(attention, MoE(
            config.hidden_size, config.num_moe_experts, config.moe_router_topk,
            MLP(config.hidden_size, config.moe_ffn_hidden_size or ffn, gated),
            MLP(config.hidden_size, shared, gated) if shared else None,
            bool(config.moe_shared_expert_gate)))

    def work(self, segments: Iterable[int]) -> Work:
        segments = list(segments)
        return self.attention.work(segments) + self.mlp.work(sum(segments))
