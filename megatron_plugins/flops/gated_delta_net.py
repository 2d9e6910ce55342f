"""Gated DeltaNet layers (Qwen3.5's linear attention) over the real token layout.

The count is the model's matrix products as the reference kernels run them
(:mod:`megatron_plugins.ops.gated_delta_rule`, what the CPU simulation and GPUs without
flash-linear-attention execute, and what ``FlopCounterMode`` sees): ``in_proj`` (hidden -> q, k,
v, the output gate z, beta and alpha), the depthwise causal convolution over q, k, v, the chunked
gated delta rule, ``out_proj`` (v -> hidden). flash-linear-attention's Triton kernels compute the
same layer with other products (fused, some recomputed in the backward), so on a GPU with it the
rule's share is this convention, not a measurement of that kernel.

The reference lays a row's documents out as a right-padded batch (one row per document, each as
long as the row's longest, :class:`~megatron_plugins.ops.gated_delta_rule._Documents`): the
convolution runs over that batch, and the rule over it padded to whole chunks of
:data:`CHUNK_SIZE`. Per chunk and value head the rule multiplies ``k_beta k^T`` and ``q k^T``
(``C x K x C`` each), and carries the state through ``w S``, ``q S`` (``C x K x V``), the
intra-chunk ``A v_new`` (``C x C x V``) and the state update ``k^T v_new`` (``K x C x V``). Its
backward, counted exactly: both operands' gradients of each product, except the first chunk's
products with the zero initial state (one gradient) and the last chunk's state update, which
feeds no output (none); plus the two triangular solves' matrix gradients (``C x V x C`` and
``C x K x C``), products the forward does not run. Elementwise work (the convolution's SiLU,
l2norm, the decays, the gated output norm) is not counted, as elsewhere. LoRA adapts
``in_proj`` and ``out_proj`` (targets of those names); a gradient starting at ``out_proj`` skips
the mixing between them (:class:`~.count.FirstLayer`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from megatron_plugins.flops.count import FirstLayer, Work, linear

__all__ = ["CHUNK_SIZE", "GatedDeltaNet", "linear_attention_layers"]

CHUNK_SIZE = 64
"""Tokens per chunk of the reference's chunked delta rule (``ops.gated_delta_rule.CHUNK_SIZE``)."""


def linear_attention_layers(config: Any) -> list[bool]:
    """Which decoder layers are Gated DeltaNet layers, as megatron-core reads
    ``linear_attention_freq`` (an int N: every N-th layer full attention; or a 0/1 list)."""
    if getattr(config, "experimental_attention_variant", None) != "gated_delta_net":
        return [False] * config.num_layers
    freq = config.linear_attention_freq
    if isinstance(freq, int):
        return [(index + 1) % freq != 0 for index in range(config.num_layers)]
    return [bool(flag) for flag in freq]


@dataclass(frozen=True)
class GatedDeltaNet:
    """A Gated DeltaNet mixer: ``key_heads`` q/k heads of ``key_dim``, ``value_heads`` value
    heads of ``value_dim`` (each q/k head serving ``value_heads / key_heads`` of them), a causal
    convolution ``conv_kernel`` wide."""

    hidden: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @classmethod
    def of(cls, config: Any) -> GatedDeltaNet:
        """The mixer a ``TransformerConfig`` (read by field name) describes."""
        return cls(config.hidden_size, config.linear_num_key_heads,
                   config.linear_num_value_heads, config.linear_key_head_dim,
                   config.linear_value_head_dim, config.linear_conv_kernel_dim)

    @property
    def conv_channels(self) -> int:
        """Channels the convolution runs over: q, k and v."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def in_proj_width(self) -> int:
        """``in_proj``'s outputs: q, k, v, the output gate z (v wide), beta and alpha."""
        return self.conv_channels + self.value_heads * self.value_dim + 2 * self.value_heads

    @property
    def params(self) -> int:
        """``in_proj``, the convolution's kernel, ``A_log`` and ``dt_bias`` per value head, the
        output norm's weight (one value head wide), ``out_proj``; no biases."""
        values = self.value_heads * self.value_dim
        return (self.hidden * self.in_proj_width + self.conv_channels * self.conv_kernel
                + 2 * self.value_heads + self.value_dim + values * self.hidden)

    def projections(self, tokens: int) -> Work:
        """``in_proj`` and ``out_proj``: weight x activations, both adaptable."""
        return (Work.linear("in_proj", tokens, self.hidden, self.in_proj_width)
                + Work.linear("out_proj", tokens, self.value_heads * self.value_dim, self.hidden))

    def mixing(self, rows: Iterable[Sequence[int]]) -> Work:
        """The convolution (a weight: ``inner``) and the delta rule (``recurrence``) over each
        row's documents, laid out as the reference lays them."""
        conv = forward = backward = 0
        chunk, k, v = CHUNK_SIZE, self.key_dim, self.value_dim
        for row in rows:
            documents, longest = len(row), max(row, default=0)
            conv += linear(documents * longest, self.conv_kernel, 1) * self.conv_channels
            chunks = -(-longest // chunk)
            if not chunks:
                continue
            per_chunk = 4 * chunk * chunk * k + 2 * chunk * chunk * v + 6 * chunk * k * v
            state = 2 * chunk * k * v
            heads = documents * self.value_heads
            forward += heads * chunks * per_chunk
            backward += heads * (chunks * (10 * chunk * chunk * k + 6 * chunk * chunk * v)
                                 + 2 * state * (2 * chunks - 1) + 2 * state * (chunks - 1))
        return Work(inner=conv, recurrence=forward, recurrence_backward=backward)

    def work(self, rows: Sequence[Sequence[int]]) -> Work:
        """The whole mixer; as a layer's first part under LoRA, the backward between its two
        linears that a gradient starting at ``out_proj`` or later skips
        (:class:`~.count.FirstLayer`)."""
        mixing = self.mixing(rows)
        return replace(self.projections(sum(sum(row) for row in rows)) + mixing,
                       first=FirstLayer(mixing=mixing.inner + mixing.recurrence_backward))
