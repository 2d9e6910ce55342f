"""The language model's FLOPs over a microbatch's real token layout.

Megatron's GPT from the stock flags (its ``TransformerConfig``, read by field name): dense or MoE
layers by ``moe_layer_freq``, GQA, gated MLP, top-k routed and shared experts, the output layer
(logits over the padded vocabulary), and ``mtp_num_layers`` multi-token-prediction layers (each
its ``eh_proj``, a layer like the last decoder layer, and logits again). A hybrid model
(``--hybrid-layer-pattern``) of attention (``*``), MLP (``-``) and MoE (``E``) layers counts
the same parts layer by layer. A Gated DeltaNet GPT (Qwen3.5: ``experimental_attention_variant=
"gated_delta_net"``) has a Gated DeltaNet mixer (:mod:`.gated_delta_net`, the reference kernels'
products) in the layers ``linear_attention_freq`` marks and gated attention (its query projection
also yields a per-head output gate; partial rotary changes no product) in the others.

The layout is one list of segment lengths per row: a whole unpacked row (``[seq_length]``,
padding included: every position runs), or a packed row's documents (``--pack-sequences``: one
segment per sample and the trailing padding as one more, as the batch's ``cu_seqlens`` say);
attention is causal within a segment.

Recomputation follows Megatron's ``--recompute-granularity``: ``full`` reruns whole layers
(``--recompute-method uniform``: every layer and every MTP layer; ``block``: the first
``--recompute-num-layers`` layers of every model chunk and no MTP layer, as 0.19.2 does),
``selective`` reruns the ``--recompute-modules`` that hold matmuls: ``core_attn`` (the scores),
``mlp`` (dense MLPs), ``moe`` (router, routed and shared experts), ``shared_experts``; the others
(``layernorm``, ``moe_act``, ``gdn_norm_out``) rerun elementwise work only. DeepStack's additions
after the first layers are elementwise and not counted (its mergers are the encoder's). Under
LoRA (``--lora language``, :class:`~.count.Adapters`) the weights get no gradient, the adapters
do, and without a trained encoder before it the gradient starts at the first adapted linear
(Gated DeltaNet's ``in_proj`` / ``out_proj`` and the MoE experts' ``linear_fc1`` / ``linear_fc2``
among them). Not supported (a :class:`FlopsError` naming the flag):
multi-latent attention, attention variants other than Gated DeltaNet (DSA), MoE latent
projections, Mamba / GDN / MLA / DSA hybrid layers, MTP in a hybrid pattern.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from megatron_plugins.errors import UsageError
from megatron_plugins.flops.count import Adapters, Flops, Work
from megatron_plugins.flops.gated_delta_net import GatedDeltaNet, linear_attention_layers
from megatron_plugins.flops.transformer import (
    AttentionKernel,
    Layer,
    MoE,
    attention_kernel,
    linear,
)

__all__ = ["FlopsError", "chunk_layers", "language_flops"]


class FlopsError(UsageError):
    """A model the FLOPs formulas do not describe; the message names the flag."""


UNSUPPORTED = (("multi_latent_attention", "--multi-latent-attention"),
               ("moe_latent_size", "--moe-latent-size"))
"""Config fields (truthy: unsupported) and their flags."""
VARIANTS = (None, "gated_delta_net")
"""``--experimental-attention-variant`` values counted."""

ATTENTION, LINEAR, MLP, MOE = "*", "G", "-", "E"
"""Layer symbols (Megatron's hybrid ``Symbols``): a GPT layer is ``*-`` or ``*E``, a Gated
DeltaNet GPT's linear-attention layer ``G-`` or ``GE``."""


def _gpt_layer(config: Any, index: int, linear: bool) -> str:
    mixer = LINEAR if linear else ATTENTION
    if not config.num_moe_experts:
        return mixer + MLP
    pattern = config.moe_layer_freq
    moe = bool(pattern[index]) if isinstance(pattern, list) else index % pattern == 0
    return mixer + (MOE if moe else MLP)


def _layers(config: Any, pattern: str | None) -> list[str]:
    """Each decoder layer's parts as layer symbols."""
    if pattern is None:
        return [_gpt_layer(config, index, linear)
                for index, linear in enumerate(linear_attention_layers(config))]
    if "/" in pattern or config.mtp_num_layers:
        raise FlopsError(f"--hybrid-layer-pattern {pattern} with MTP layers: the FLOPs count "
                         "does not describe them; drop the MTP part")
    layers = list(pattern.replace("|", ""))
    unknown = sorted(set(layers) - {ATTENTION, MLP, MOE})
    if unknown:
        raise FlopsError(f"--hybrid-layer-pattern {pattern}: the FLOPs count has no formula for "
                         f"its {', '.join(unknown)} layers (only {ATTENTION} {MLP} {MOE})")
    return layers


def chunk_layers(config: Any) -> list[int]:
    """Decoder layers of each model chunk (pipeline stage, then virtual stage), as Megatron's
    ``get_num_layers_to_build`` splits them: evenly, or with
    ``--decoder-first/last-pipeline-num-layers``."""
    if (config.pipeline_model_parallel_layout is not None
            or config.account_for_embedding_in_pipeline_split
            or config.account_for_loss_in_pipeline_split):
        raise FlopsError("--recompute-method block with --pipeline-model-parallel-layout or "
                         "--account-for-embedding/loss-in-pipeline-split: the FLOPs count does "
                         "not split layers that way; pass the layers of each model chunk")
    pp = config.pipeline_model_parallel_size
    vp = (config.virtual_pipeline_model_parallel_size or 1) if pp > 1 else 1
    first = config.num_layers_in_first_pipeline_stage
    last = config.num_layers_in_last_pipeline_stage
    given = [count for count in (first, last) if count is not None]
    middle = pp - len(given)
    stages = [(config.num_layers - sum(given)) // middle if middle else 0] * pp
    if first is not None:
        stages[0] = first
    if last is not None:
        stages[-1] = last
    return [count // vp for count in stages for _ in range(vp)]


def _recomputed(config: Any, layers: int, chunks: Sequence[int] | None,
                hybrid: bool) -> list[bool]:
    """Which decoder layers full recomputation reruns."""
    if config.recompute_granularity != "full":
        return [False] * layers
    if config.recompute_method != "block":
        return [True] * layers
    if chunks is None and hybrid:
        raise FlopsError("--recompute-method block with --hybrid-layer-pattern: pass the layers "
                         "of each model chunk")
    chosen = []
    for count in chunks if chunks is not None else chunk_layers(config):
        chosen += [index < config.recompute_num_layers for index in range(count)]
    return chosen


def _layer_works(config: Any, parts: str, rows: list[Sequence[int]], *, kernel: AttentionKernel,
                 modules: set[str]) -> list[tuple[Work, bool]]:
    """One layer of these ``parts`` over these rows: its works, each with whether the selective
    ``modules`` rerun it."""
    segments = [length for row in rows for length in row]
    tokens = sum(segments)
    shape = Layer.of(config, causal=True, kernel=kernel, moe=MOE in parts)
    works = []
    if LINEAR in parts:
        works.append((GatedDeltaNet.of(config).work(rows), False))
    if ATTENTION in parts:
        works += [(shape.attention.projections(tokens), False),
                  (shape.attention.scores(segments), "core_attn" in modules)]
    if isinstance(shape.mlp, MoE):
        whole = "moe" in modules
        works += [(shape.mlp.routed(tokens), whole),
                  (shape.mlp.shared_work(tokens), whole or "shared_experts" in modules)]
    elif MLP in parts:
        works.append((shape.mlp.work(tokens), "mlp" in modules))
    return works


def _layer_flops(works: list[tuple[Work, bool]], *, full: bool, trains: bool, input_grad: bool,
                 adapters: Adapters | None) -> Flops:
    """A layer's works (:func:`_layer_works`), the whole layer recomputed with ``full``. LoRA'd
    (``adapters``), ``input_grad`` says whether a gradient reaches the layer's input; without
    one it starts at the layer's first adapter (none: forward only)."""
    if adapters is None:
        return sum((work.flops(trains=trains, input_grad=input_grad, recomputed=full or again)
                    for work, again in works), Flops())
    layer = sum((work for work, _ in works), Work())
    if not (input_grad or adapters.adapt(layer.linears)):
        return Flops(layer.forward)
    flops = (layer if input_grad else layer.leading()).flops(
        trains=False, input_grad=input_grad, adapters=adapters)
    return flops + Flops(recompute=sum(work.forward + adapters.forward(work.linears)
                                       for work, again in works if full or again))


def language_flops(config: Any, vocab_size: int, rows: Iterable[Sequence[int]], *,
                   trains: bool = True, input_grad: bool = False,
                   kernel: AttentionKernel | None = None, pattern: str | None = None,
                   chunks: Sequence[int] | None = None, adapters: Adapters | None = None
                   ) -> Flops:
    """FLOPs of one microbatch through the language model.

    ``config``: its TransformerConfig; ``vocab_size``: the padded vocabulary the output layer
    has; ``rows``: segment lengths per row (see the module docstring); ``trains``: its weights
    get gradients (not ``--freeze-language-model``); ``input_grad``: a trained encoder or
    projection needs the gradient of its inputs (a frozen model then still runs a backward);
    ``kernel``: the attention kernel (default: the one ``config``'s layers run);
    ``pattern``: the ``--hybrid-layer-pattern`` of a hybrid model; ``chunks``: layers per model
    chunk, for ``--recompute-method block`` where :func:`chunk_layers` cannot tell;
    ``adapters``: LoRA on it (``trains`` then False).
    """
    variant = getattr(config, "experimental_attention_variant", None)
    unsupported = [flag for field, flag in UNSUPPORTED if getattr(config, field, None)]
    if variant not in VARIANTS:
        unsupported.append(f"--experimental-attention-variant {variant}")
    if unsupported:
        raise FlopsError(f"{unsupported[0]}: the FLOPs count does not describe this language "
                         "model; drop the flag or count its FLOPs elsewhere")
    rows = [list(row) for row in rows]
    tokens = sum(sum(row) for row in rows)
    layers = _layers(config, pattern)
    modules = (set(config.recompute_modules or ["core_attn"])
               if config.recompute_granularity == "selective" else set())
    shape = {"kernel": attention_kernel(config) if kernel is None else kernel,
             "modules": modules}
    grads = {"trains": trains, "adapters": adapters}
    total, flowing = Flops(), input_grad
    for parts, full in zip(layers, _recomputed(config, len(layers), chunks, pattern is not None)):
        works = _layer_works(config, parts, rows, **shape)
        total += _layer_flops(works, full=full, input_grad=flowing, **grads)
        if adapters is not None:
            flowing = flowing or adapters.adapt(sum((work for work, _ in works), Work()).linears)
    mtp_full = config.recompute_granularity == "full" and config.recompute_method != "block"
    eh_proj = Work(inner=linear(tokens, 2 * config.hidden_size, config.hidden_size))
    for _ in range(config.mtp_num_layers or 0):
        total += (eh_proj.flops(trains=trains, input_grad=flowing, recomputed=mtp_full)
                  + _layer_flops(_layer_works(config, layers[-1], rows, **shape),
                                 full=mtp_full, input_grad=flowing, **grads))
    logits = Work(inner=linear(tokens, config.hidden_size, vocab_size))
    return total + (logits * (1 + (config.mtp_num_layers or 0))).flops(trains=trains,
                                                                       input_grad=flowing)
