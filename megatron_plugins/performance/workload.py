"""What one training step asks of each module, independent of the layout: FLOPs, parameters,
tokens through the layers, activation bytes.

The language model is counted by :func:`megatron_plugins.flops.language.language_flops` over the
rows a microbatch holds (unpacked: ``micro`` rows of ``--seq-length``, every position computed;
packed: one row with ``micro`` documents of the data's mean length and the padding); an encoder by
its plugin's ``item_flops`` over the data's items (the launch computes those, here they arrive as
numbers). Shapes come from a ``TransformerConfig`` or anything with its field names, so nothing
here needs torch.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from megatron_plugins.flops.count import Adapters, Flops, Work
from megatron_plugins.flops.gated_delta_net import (
    CHUNK_SIZE,
    GatedDeltaNet,
    linear_attention_layers,
)
from megatron_plugins.flops.language import language_flops
from megatron_plugins.flops.transformer import linear

__all__ = ["EncoderWork", "LanguageWork", "TransformerShape", "Workload"]


@dataclass(frozen=True)
class TransformerShape:
    """A transformer stack's shape: what parameters, activations and TP/CP/EP traffic follow.
    ``linear_layers`` of the ``layers`` are Gated DeltaNet layers (Qwen3.5: ``linear``'s
    shape), the others attention layers."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    gated: bool = False
    output_gate: bool = False
    experts: int = 0
    topk: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    shared_gate: bool = False
    moe_layers: int = 0
    linear: GatedDeltaNet | None = None
    linear_layers: int = 0

    @classmethod
    def of(cls, config: Any) -> TransformerShape:
        """The shape a ``TransformerConfig`` (read by field name) describes."""
        heads = config.num_attention_heads
        hidden = config.hidden_size
        ffn = config.ffn_hidden_size or 4 * hidden
        experts = getattr(config, "num_moe_experts", None) or 0
        freq = getattr(config, "moe_layer_freq", 1)
        if not experts:
            moe_layers = 0
        elif isinstance(freq, list):
            moe_layers = sum(bool(flag) for flag in freq)
        else:
            moe_layers = len(range(0, config.num_layers, freq))
        linear_layers = sum(linear_attention_layers(config))
        return cls(
            layers=config.num_layers, hidden=hidden, ffn=ffn, heads=heads,
            groups=getattr(config, "num_query_groups", None) or heads,
            head_dim=getattr(config, "kv_channels", None) or hidden // heads,
            gated=bool(getattr(config, "gated_linear_unit", False)),
            output_gate=bool(getattr(config, "attention_output_gate", False)), experts=experts,
            topk=getattr(config, "moe_router_topk", 0) if experts else 0,
            expert_ffn=(getattr(config, "moe_ffn_hidden_size", None) or ffn) if experts else 0,
            shared_ffn=getattr(config, "moe_shared_expert_intermediate_size", None) or 0,
            shared_gate=bool(getattr(config, "moe_shared_expert_gate", False)),
            moe_layers=moe_layers,
            linear=GatedDeltaNet.of(config) if linear_layers else None,
            linear_layers=linear_layers)

    @property
    def attention_params(self) -> int:
        query, key_value = self.heads * self.head_dim, self.groups * self.head_dim
        gates = query if self.output_gate else 0
        return self.hidden * (query + gates + 2 * key_value) + query * self.hidden

    def mlp_params(self, ffn: int) -> int:
        return self.hidden * ffn * (3 if self.gated else 2)

    @property
    def expert_params(self) -> int:
        """Parameters of the routed experts, all MoE layers: what EP splits."""
        return self.moe_layers * self.experts * self.mlp_params(self.expert_ffn)

    @property
    def params(self) -> int:
        """Parameters of the layers (layer norms and biases left out; a Gated DeltaNet mixer's
        per-head parameters and output norm counted, :attr:`GatedDeltaNet.params`)."""
        dense = self.layers - self.moe_layers
        router = self.hidden * (self.experts + int(self.shared_gate))
        moe = self.moe_layers * (router + self.mlp_params(self.shared_ffn))
        mixers = (self.layers - self.linear_layers) * self.attention_params
        if self.linear is not None:
            mixers += self.linear_layers * self.linear.params
        return mixers + dense * self.mlp_params(self.ffn) + moe + self.expert_params

    def adapter_params(self, adapters: Adapters) -> tuple[int, int]:
        """LoRA's parameters on these layers' ``adapters.targets`` (``rank x (in + out)`` per
        adapted linear): (outside the routed experts, the routed experts' of all MoE layers,
        what EP splits)."""
        query, key_value = self.heads * self.head_dim, self.groups * self.head_dim
        width = 2 if self.gated else 1
        linears = {"linear_qkv": (self.layers - self.linear_layers)
                   * (self.hidden + query * (2 if self.output_gate else 1) + 2 * key_value),
                   "linear_proj": (self.layers - self.linear_layers) * (query + self.hidden),
                   "linear_fc1": ((self.layers - self.moe_layers) * (width * self.ffn + self.hidden)
                                  + self.moe_layers * (width * self.shared_ffn + self.hidden)
                                  * bool(self.shared_ffn)),
                   "linear_fc2": ((self.layers - self.moe_layers) * (self.ffn + self.hidden)
                                  + self.moe_layers * (self.shared_ffn + self.hidden)
                                  * bool(self.shared_ffn))}
        if self.linear is not None:
            values = self.linear.value_heads * self.linear.value_dim
            linears["in_proj"] = self.linear_layers * (self.hidden + self.linear.in_proj_width)
            linears["out_proj"] = self.linear_layers * (values + self.hidden)
        experts = {"linear_fc1": width * self.expert_ffn + self.hidden,
                   "linear_fc2": self.expert_ffn + self.hidden}
        rank, targets = adapters.rank, adapters.targets
        return (rank * sum(linears.get(name, 0) for name in targets),
                rank * self.moe_layers * self.experts * sum(experts.get(name, 0)
                                                            for name in targets))

    def _linear_elements(self) -> int:
        """Per token, what a Gated DeltaNet mixer keeps for its backward on the GPU kernel
        (flash-linear-attention, as attention is modelled on flash attention): its norm's input
        and output, ``in_proj``'s output, the convolution's output, the rule's inputs (q and k
        l2-normed and repeated to the value heads, v, g, beta) and its intra-chunk matrix
        (:data:`CHUNK_SIZE` per value head), the rule's output and the gated norm's."""
        mixer = self.linear
        values = mixer.value_heads * mixer.value_dim
        rule = mixer.value_heads * (2 * mixer.key_dim + mixer.value_dim + 2 + CHUNK_SIZE)
        return (2 * self.hidden + mixer.in_proj_width + mixer.conv_channels + rule
                + 2 * values)

    def activation_elements(self, tokens: float) -> float:
        """Elements one layer keeps for its backward over ``tokens`` (flash attention: no score
        matrix): both norms' inputs and outputs, Q/K/V (and an output gate) and the attention
        output (a Gated DeltaNet layer: :meth:`_linear_elements`), the MLP's first layer's
        outputs and its activation's; routed tokens count ``topk`` times; layers of each kind
        averaged."""
        query, key_value = self.heads * self.head_dim, self.groups * self.head_dim
        attention = (2 * self.hidden + (3 if self.output_gate else 2) * query
                     + 2 * key_value)
        if self.linear is not None:
            linear = self.linear_layers / self.layers
            attention = linear * self._linear_elements() + (1 - linear) * attention
        width = 3 if self.gated else 2
        dense_mlp = 2 * self.hidden + width * self.ffn
        if not self.moe_layers:
            return tokens * (attention + dense_mlp)
        moe_mlp = (2 * self.hidden + self.topk * width * self.expert_ffn
                   + width * self.shared_ffn)
        share = self.moe_layers / self.layers
        return tokens * (attention + share * moe_mlp + (1 - share) * dense_mlp)


@dataclass(frozen=True)
class EncoderWork:
    """One encoder's work per sample, averaged over the data: its items' FLOPs (encoder and
    projection, trained or frozen as the run says), tokens through its layers, language positions
    its output fills (``output_tokens``, the rows it sends), parameters."""

    name: str
    shape: TransformerShape
    params: int
    flops: Flops
    tokens: float
    output_tokens: float
    output_width: int
    """Elements per output row (language hidden x (1 + DeepStack levels))."""
    trained_params: int
    """Parameters with gradients and optimizer state: all of them when the encoder and its
    projection train, none when frozen; under LoRA its adapters (counted in ``params`` too) and
    a projection that trains."""


@dataclass(frozen=True)
class LanguageWork:
    """The language model: its config (TransformerConfig field names), padded vocabulary,
    parameters outside the layers (embedding, output layer, MTP) and the data's rows."""

    config: Any
    vocab: int
    seq_length: int
    sample_tokens: float
    """Mean positions a sample fills before padding (text and items)."""
    packed: bool = False
    trains: bool = True
    input_grad: bool = True
    """A trained encoder or projection needs the gradient of the language model's input."""
    embedding_params: int = 0
    output_params: int = 0
    mtp_params: int = 0
    adapters: Adapters | None = None
    """``--lora language``: these adapters train, the model's own weights (``trains`` False)
    do not."""
    _counted: dict[tuple[int, bool], Flops] = field(default_factory=dict, compare=False,
                                                   repr=False)
    """Counts already made, by (micro-batch size, recompute): candidates share them."""
    _logits: dict[int, Flops] = field(default_factory=dict, compare=False, repr=False)
    """:meth:`logits_flops` already counted, by micro-batch size."""

    @functools.cached_property
    def shape(self) -> TransformerShape:
        """The layers' shape, read once: every candidate priced asks for it."""
        return TransformerShape.of(self.config)

    def rows(self, micro: int) -> list[list[int]]:
        """Segment lengths of one microbatch's rows: ``micro`` whole rows, or one packed row of
        ``micro`` documents and its padding."""
        if not self.packed:
            return [[self.seq_length]] * micro
        document = max(1, round(self.sample_tokens))
        used = min(micro * document, self.seq_length)
        pieces = [document] * (used // document) + ([used % document] if used % document else [])
        return [pieces + ([self.seq_length - used] if used < self.seq_length else [])]

    def microbatch_flops(self, micro: int, recompute: bool) -> Flops:
        """FLOPs of one microbatch (``recompute``: every layer recomputed in full)."""
        if (micro, recompute) not in self._counted:
            config = self.config
            if recompute:
                config = _with(config, recompute_granularity="full", recompute_method="uniform",
                               recompute_num_layers=1)
            self._counted[micro, recompute] = language_flops(
                config, self.vocab, self.rows(micro), trains=self.trains,
                input_grad=self.input_grad, adapters=self.adapters)
        return self._counted[micro, recompute]

    def logits_flops(self, micro: int) -> Flops:
        """The output layer's share of :meth:`microbatch_flops` (on the last pipeline stage)."""
        if micro not in self._logits:
            tokens = sum(sum(row) for row in self.rows(micro))
            heads = 1 + (getattr(self.config, "mtp_num_layers", None) or 0)
            logits = Work(inner=linear(tokens, self.shape.hidden, self.vocab)) * heads
            self._logits[micro] = logits.flops(  # adapters before it need its input gradient
                trains=self.trains, input_grad=self.input_grad or self.adapters is not None)
        return self._logits[micro]

    @property
    def params(self) -> int:
        return self.shape.params + self.embedding_params + self.output_params + self.mtp_params

    @functools.cached_property
    def adapter_params(self) -> tuple[int, int]:
        """LoRA's parameters (:meth:`TransformerShape.adapter_params`; none without it)."""
        return (0, 0) if self.adapters is None else self.shape.adapter_params(self.adapters)


def _with(config: Any, **fields: Any) -> Any:
    """A copy of ``config`` (a dataclass or a namespace) with ``fields`` changed."""
    if dataclasses.is_dataclass(config):
        return dataclasses.replace(config, **fields)
    copy = type(config)(**vars(config))
    for name, value in fields.items():
        setattr(copy, name, value)
    return copy


@dataclass(frozen=True)
class Workload:
    """A run's modules and batch: what every layout of it must compute."""

    language: LanguageWork
    encoders: tuple[EncoderWork, ...]
    global_batch: int
    bytes_per_param: float = 2.0
    """Parameters' and activations' element size (bf16/fp16: 2, fp32: 4)."""
    grad_bytes: float = 4.0
    """Main gradient bytes per parameter (the DDP buffer)."""
    optimizer_bytes: float = 12.0
    """Optimizer state bytes per parameter on the GPU (fp32 master copy and Adam's moments)."""
    optimizer_offloaded: float = 0.0
    """The share of the optimizer state held on the CPU (``--optimizer-cpu-offload``)."""
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False

    @property
    def real_tokens(self) -> float:
        """Language positions a step fills before padding: what tokens/s counts."""
        return self.global_batch * self.language.sample_tokens

    def encoder(self, name: str) -> EncoderWork:
        return next(work for work in self.encoders if work.name == name)
