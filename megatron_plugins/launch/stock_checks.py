"""Stock Megatron's own flag checks, their failures as one line naming the flags and the fix.

Stock ``validate_args`` and ``TransformerConfig.__post_init__`` (with ``ModelParallelConfig``'s)
check many flag combinations with ``assert`` or ``ValueError``, in terms of attributes
(``recompute_num_layers``), often without a word (``assert not args.bf16``). The launch runs both
before any process group exists (:mod:`megatron_plugins.launch.settle`, steps ``validate`` and
``language_config``), inside :func:`stock_checked`: a failure becomes one
:class:`~megatron_plugins.errors.FlagError` line, the same on every rank. :data:`STOCK_CHECKS`
maps stock's message (or, for a bare ``assert``, its source line) to the flags and the fix; any
other failure still is one line quoting stock's message.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import string
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_plugins.errors import FlagError, UsageError
from megatron_plugins.parallel.layout import ModulePlacement

__all__ = ["STOCK_CHECKS", "StockCheck", "explain", "stock_checked"]


@dataclass(frozen=True)
class StockCheck:
    """One stock check: what its failure says (a regular expression searched in stock's message,
    or a bare assert's source line) and the line the launch says instead.

    ``message`` is a :meth:`str.format` template over ``args`` (the run's flags), ``language``
    (the language grid's placement: ``source``, ``tp``, ``pp``, ...), ``m`` (the match: ``{m[1]}``)
    and ``reason`` (stock's own text); ``{...!f}`` spells an attribute name as its flag."""

    pattern: str
    message: str


STOCK_CHECKS: tuple[StockCheck, ...] = (
    # Precision.
    StockCheck(r"^assert not args\.(bf16|fp16)\b",
               "--fp16 and --bf16 are both given; keep one (the precision the model trains in)"),
    StockCheck(r"^lm cross entropy in fp16 only support",
               "--fp16-lm-cross-entropy needs --fp16; add --fp16 or drop --fp16-lm-cross-entropy"),
    StockCheck(r"^residual connection in fp32 only supported",
               "--fp32-residual-connection needs --fp16 or --bf16; add one or drop "
               "--fp32-residual-connection"),
    StockCheck(r"^fp8_param must be used together with fp8 mode",
               "--fp8-param-gather needs --fp8-format (e4m3 or hybrid); add it or drop "
               "--fp8-param-gather"),
    # The distributed optimizer and overlapped communication.
    StockCheck(r"^(--[\w-]+) only supported with distributed optimizer",
               "{m[1]} needs --use-distributed-optimizer; add it or drop {m[1]}"),
    StockCheck(r"^Must use (--[\w-]+) with (--[\w-]+)",
               "{m[1]} needs {m[2]}; add {m[2]} or drop {m[1]}"),
    StockCheck(r"^Tensor parallel communication/GEMM overlap can happen only when sequence",
               "--tp-comm-overlap needs --sequence-parallel; add it or drop --tp-comm-overlap"),
    StockCheck(r"CUDA_DEVICE_MAX_CONNECTIONS to 1",
               "{language.source}: tp={language.tp}, cp={language.cp} on this GPU needs the "
               "environment variable CUDA_DEVICE_MAX_CONNECTIONS=1 (stock orders tensor- and "
               "context-parallel communication by launch); export CUDA_DEVICE_MAX_CONNECTIONS=1 "
               "before torchrun"),
    # Batch sizes.
    StockCheck(r"^assert args\.micro_batch_size is not None",
               "--micro-batch-size is missing; give the samples per microbatch (e.g. "
               "--micro-batch-size 1)"),
    StockCheck(r"^assert args\.micro_batch_size > 0",
               "--micro-batch-size {args.micro_batch_size} must be at least 1"),
    StockCheck(r"^assert args\.global_batch_size > 0",
               "--global-batch-size {args.global_batch_size} must be at least 1"),
    StockCheck(r"^eval_global_batch_size \((\d+)\) must be divisible by eval_micro_batch_size "
               r"\((\d+)\) \* data_parallel_size \((\d+)\)",
               "--global-batch-size {m[1]} (or --eval-global-batch-size, when given) is not a "
               "multiple of --micro-batch-size {m[2]} (or --eval-micro-batch-size) x "
               "{language.source}: dp={m[3]}; give whole microbatches per data-parallel replica"),
    # The model's shape.
    StockCheck(r"^(\w+) argument is None", "{m[1]!f} is missing; stock's language model needs it"),
    StockCheck(r"^either num-layers or encoder-num-layers should be specified",
               "--num-layers is missing; stock's language model needs it"),
    StockCheck(r"^assert args\.hidden_size % args\.num_attention_heads == 0",
               "--hidden-size {args.hidden_size} is not a multiple of --num-attention-heads "
               "{args.num_attention_heads}; choose one that is, or give each head's width with "
               "--kv-channels"),
    StockCheck(r"^max_position_embeddings \((\d+)\) must be greater than or equal to seq_length "
               r"\((\d+)\)",
               "--seq-length {m[2]} is longer than --max-position-embeddings {m[1]}; raise "
               "--max-position-embeddings to {m[2]} or shorten --seq-length"),
    StockCheck(r"^Group query attention is mutually exclusive with multi latent attention",
               "--group-query-attention and --multi-latent-attention exclude each other; keep "
               "one"),
    StockCheck(r"^--mrope-section should be set",
               "--position-embedding-type mrope needs --mrope-section T H W (each head's rotary "
               "frequency pairs for time, height and width)"),
    StockCheck(r"does not support attention bias-based position embeddings",
               "--position-embedding-type relative needs --transformer-impl transformer_engine"),
    # Pipeline stages.
    StockCheck(r"^(Number of layers should be divisible by the pipeline-model-parallel size|"
               r"number of layers of the model must be divisible pipeline model parallel size)",
               "--num-layers {args.num_layers} does not split evenly over the {language.pp} "
               "pipeline stages of {language.source}: pp={language.pp}; give a multiple of "
               "{language.pp} layers or another pp"),
    StockCheck(r"^number of layers per pipeline stage must be divisible number of layers per "
               r"virtual pipeline stage",
               "--num-layers-per-virtual-pipeline-stage "
               "{args.num_layers_per_virtual_pipeline_stage} does not divide the layers of each "
               "pipeline stage (--num-layers {args.num_layers} over {language.source}: "
               "pp={language.pp}); choose a divisor"),
    StockCheck(r"^When interleaved schedule is used.*should be greater than (\d)",
               "an interleaved pipeline schedule (--num-layers-per-virtual-pipeline-stage or "
               "--num-virtual-stages-per-pipeline-rank) needs {language.source}: pp above "
               "{m[1]}, not pp={language.pp}; drop the flag or give more pipeline stages"),
    StockCheck(r"^Mismatch: (\d+) middle layers remaining but (\d+) middle PP stages",
               "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers leave "
               "{m[1]} of --num-layers {args.num_layers} for {m[2]} middle pipeline stages "
               "({language.source}: pp={language.pp}); give counts that leave no stage without "
               "layers and no layers without a stage"),
    StockCheck(r"^number of layers at middle stage: (\d+) must be divisible by\s*the middle "
               r"pipeline model parallel size (\d+)",
               "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers leave "
               "{m[1]} layers, which do not split evenly over the {m[2]} middle pipeline stages "
               "of {language.source}: pp={language.pp}; change the counts"),
    # Recomputation.
    StockCheck(r"^recompute method is not yet supported for selective",
               "--recompute-method {args.recompute_method} is for --recompute-granularity full; "
               "drop it (selective recomputation takes --recompute-modules)"),
    StockCheck(r'^Using recompute_granularity: full so recompute_method must be',
               "--recompute-granularity full needs --recompute-method uniform or block (and "
               "--recompute-num-layers N)"),
    StockCheck(r"^When using recompute_granularity: full recompute_num_layers must be between 1 "
               r"and num_layers_per_pipeline_rank: (\d+)",
               "--recompute-granularity full needs --recompute-num-layers N, from 1 to the {m[1]} "
               "layers of each pipeline stage"),
    StockCheck(r"^When using recompute_granularity: selective recompute_num_layers must be None",
               "--recompute-num-layers is for --recompute-granularity full; drop it (selective "
               "recomputation takes --recompute-modules)"),
    StockCheck(r"^moe_act in recompute_modules is only supported with moe_grouped_gemm",
               "--recompute-modules moe_act needs --moe-grouped-gemm (a GPU with Transformer "
               "Engine); drop moe_act"),
    StockCheck(r"^mla_up_proj in recompute_modules is only supported with multi_latent",
               "--recompute-modules mla_up_proj needs --multi-latent-attention; drop mla_up_proj"),
    StockCheck(r"^can distribute recomputed activations only across tensor model parallel",
               "--distribute-saved-activations spreads recomputed activations over "
               "tensor-parallel ranks, which {language.source}: tp={language.tp} does not have; "
               "drop it or give the language tp > 1"),
    StockCheck(r"^distributed recompute activations is only application to full",
               "--distribute-saved-activations needs --recompute-granularity full"),
    StockCheck(r"^for distributed recompute activations to work you need to use a recompute "
               r"method",
               "--distribute-saved-activations needs --recompute-method uniform or block"),
    StockCheck(r"^distribute_saved_activations: True must be\s*false when sequence parallel",
               "--distribute-saved-activations and --sequence-parallel exclude each other; keep "
               "one"),
    # Mixture of experts.
    StockCheck(r"^Bias in Moe is only supported when ETP==1",
               "{language.source}: etp={language.etp} splits each expert over tensor-parallel "
               "ranks, which stock's MoE does only without linear biases (on by default); add "
               "--disable-bias-linear or give etp=1"),
    StockCheck(r"^Please use --moe-router-pre-softmax when topk is 1",
               "--moe-router-topk 1 with the softmax router needs --moe-router-pre-softmax (a "
               "softmax over the one chosen expert has no gradient); add it"),
    StockCheck(r"^moe_ffn_hidden_size is set but num_moe_experts is None",
               "--moe-ffn-hidden-size {args.moe_ffn_hidden_size} sizes MoE experts, but the "
               "language model has none; add --num-experts N or drop --moe-ffn-hidden-size"),
    StockCheck(r"^Expert bias for aux-loss-free routing only supports",
               "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid or "
               "sqrtsoftplus, not {args.moe_router_score_function}"),
    StockCheck(r"^moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity",
               "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor X"),
    StockCheck(r"^moe_expert_capacity_factor only works with",
               "--moe-expert-capacity-factor needs --moe-router-load-balancing-type aux_loss, "
               "seq_aux_loss, global_aux_loss or none, not "
               "{args.moe_router_load_balancing_type}"),
    StockCheck(r"^num_moe_experts \((\d+)\) should be divisible by moe_router_num_groups "
               r"\((\d+)\)",
               "--num-experts {m[1]} is not divisible by --moe-router-num-groups {m[2]}; choose "
               "a group count that divides it"),
    StockCheck(r"^moe_router_group_topk \((\d+)\) should be smaller than moe_router_num_groups "
               r"\((\d+)\)",
               "--moe-router-group-topk {m[1]} is more than --moe-router-num-groups {m[2]}; "
               "choose at most {m[2]} groups"),
    StockCheck(r"^When using group limited routing, moe_router_num_groups must be specified",
               "--moe-router-group-topk needs --moe-router-num-groups N"),
    # Transformer Engine.
    StockCheck(r"^apply_rope_fusion is not available",
               "RoPE fusion (stock's default with --position-embedding-type rope) needs "
               "Transformer Engine >= 1.4, which is not installed here; add --no-rope-fusion"),
    StockCheck(r"^fused permutation is not available",
               "--moe-permute-fusion needs Transformer Engine >= 2.1, which is not installed "
               "here; drop --moe-permute-fusion"),
    StockCheck(r"(?:transformer-engine|Transformer Engine|TE)\s*(?:version\s*)?>=\s*"
               r"([\d.]+\w*)",
               "this run needs Transformer Engine >= {m[1]}, which is not installed here "
               "(stock: {reason}); install it or drop the flag that asks for it"),
    # The learning-rate schedule and the run's length.
    StockCheck(r"^assert args\.min_lr <= args\.lr",
               "--min-lr {args.min_lr} is above --lr {args.lr}; the learning rate decays from "
               "--lr down to --min-lr"),
    StockCheck(r"^expected iteration-based training",
               "--train-samples {args.train_samples} and --train-iters {args.train_iters} are "
               "both given; give one"),
    StockCheck(r"^expected iteration-based learnin?g? rate (decay|warmup)",
               "--lr-{m[1]}-samples counts samples, but --train-iters {args.train_iters} counts "
               "iterations; give --lr-{m[1]}-iters instead"),
    StockCheck(r"^expected sample-based learnin?g? rate (decay|warmup)",
               "--lr-{m[1]}-iters counts iterations, but --train-samples {args.train_samples} "
               "counts samples; give --lr-{m[1]}-samples instead"),
    StockCheck(r"^can only specify one of lr-warmup-fraction and lr-warmup-(iters|samples)",
               "--lr-warmup-fraction and --lr-warmup-{m[1]} are both given; keep one"),
    StockCheck(r"^assert args\.(start|end)_weight_decay is not None",
               "--weight-decay-incr-style {args.weight_decay_incr_style} needs "
               "--start-weight-decay and --end-weight-decay"),
    StockCheck(r"^assert args\.(start|end)_weight_decay is None",
               "--start-weight-decay / --end-weight-decay need --weight-decay-incr-style linear "
               "or cosine (constant keeps --weight-decay)"),
    # Checkpoints and logging.
    StockCheck(r"^assert args\.save_interval is not None",
               "--save {args.save} needs --save-interval N (the iterations between checkpoints)"),
    StockCheck(r"^assert args\.save_interval > 0",
               "--save-interval {args.save_interval} must be at least 1"),
    StockCheck(r"^assert args\.save_retain_interval % args\.save_interval == 0",
               "--save-retain-interval {args.save_retain_interval} must be a multiple of "
               "--save-interval {args.save_interval}"),
    StockCheck(r"^assert args\.log_memory_interval % args\.log_interval == 0",
               "--log-memory-interval {args.log_memory_interval} must be a multiple of "
               "--log-interval {args.log_interval}"),
)
"""Stock's checks a MiMo launch reaches from its flags, in the order they are tried; the first
whose pattern matches explains the failure."""


class _Spelling(string.Formatter):
    """``str.format`` where ``!f`` spells an attribute as its flag (``num_layers`` ->
    ``--num-layers``)."""

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if conversion == "f":
            return f"--{value.replace('_', '-')}"
        return super().convert_field(value, conversion)


def _stock_reason(error: BaseException) -> str:
    """Stock's message, or the failing check's source line when stock gives none."""
    reason = str(error).strip()
    if reason:
        return " ".join(reason.split())
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return type(error).__name__
    frame = frames[-1]
    return f"{frame.line or type(error).__name__} ({Path(frame.filename).name}:{frame.lineno})"


def explain(error: BaseException, args: argparse.Namespace, language: ModulePlacement,
            what: str) -> str:
    """The one line for a failed stock check: :data:`STOCK_CHECKS`' explanation, else stock's
    ``what`` check quoted."""
    reason = _stock_reason(error)
    for check in STOCK_CHECKS:
        match = re.search(check.pattern, reason)
        if match:
            return _Spelling().format(check.message, args=args, language=language, m=match,
                                      reason=reason)
    return f"stock Megatron {what} check failed: {reason}"


@contextlib.contextmanager
def stock_checked(args: argparse.Namespace, language: ModulePlacement,
                  what: str) -> Iterator[None]:
    """Run stock's ``what`` checks (``argument``, ``model config``) inside the block; a failure
    is one :class:`FlagError` line naming the flags (:func:`explain`). The launch's own
    :class:`UsageError` s pass as they are."""
    try:
        yield
    except UsageError:
        raise
    except (AssertionError, ValueError) as error:
        raise FlagError(explain(error, args, language, what)) from None
