"""What one microbatch is worth: its model FLOPs (from :mod:`megatron_plugins.flops`), tokens and
items, counted once per module replica.

Every rank of a replica (its tensor, context-parallel and pipeline ranks) sees the same
microbatch; only the replica's witness (tensor and context-parallel rank 0 of the first stage, the
rank that speaks for it in the data alignment guard too) counts it, so sums over the world are
the module's. The language model counts its real tokens (:data:`~megatron_plugins.data.streams.
REAL_TOKENS`, padding excluded) and its FLOPs over the rows as they run (whole ``--seq-length``
rows, or a packed row's segments); an encoder counts its items, their output tokens and, when its
plugin implements ``item_flops``, their FLOPs (else a notice says it is left out). Each part
(the language model, an encoder's network, its projection) counts as trained, frozen
(``--freeze-*``) or LoRA'd (``--lora``: its weights frozen, its adapters trained).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from megatron_plugins.data.streams import ITEM_SIZES, ITEM_TOKENS, REAL_TOKENS
from megatron_plugins.encoders.counting import flops_notice, microbatch_flops
from megatron_plugins.errors import FlagError
from megatron_plugins.flops.language import FlopsError, language_flops
from megatron_plugins.model.language import language_config_from_args
from megatron_plugins.parallel.layout import LANGUAGE, ParallelLayout
from megatron_plugins.peft.flags import PROJECTION, lora_specs
from megatron_plugins.performance.recorder import Consumed

__all__ = ["BatchCounter", "language_rows"]


def language_rows(batch: Mapping[str, Any]) -> list[list[int]]:
    """The segment lengths attention runs over in each row of a language microbatch: a packed
    row's segments (padded boundaries where context parallelism pads them), else whole rows."""
    packing = batch.get("packing_kwargs")
    if packing:
        bounds = packing.get("cu_seqlens_q_padded")
        bounds = (packing["cu_seqlens_q"] if bounds is None else bounds).tolist()
        return [[end - start for start, end in zip(bounds, bounds[1:])]]
    rows, length = batch["tokens"].shape
    return [[int(length)]] * int(rows)


class BatchCounter:
    """Counts microbatches for the modules of a run (see the module docstring)."""

    def __init__(self, layout: ParallelLayout, encoders: Mapping[str, Callable[[Any], Any]],
                 language: Callable[[tuple[tuple[int, ...], ...]], float],
                 notices: Sequence[str]) -> None:
        self.layout = layout
        self._encoders = dict(encoders)
        self._language = language
        self.notices = list(notices)
        self.counted = {LANGUAGE, *self._encoders}
        """The modules whose FLOPs are counted."""

    @classmethod
    def of_run(cls, run: Any) -> BatchCounter:
        """The counter of a checked run (its args, layout and encoder plugins). A language model
        the formulas do not describe is a :class:`FlagError` for ``--log-throughput``."""
        args = run.args
        language = language_config_from_args(args).transformer
        hidden = language.hidden_size
        frozen = set(args.freeze_encoder)
        frozen_projections = frozen | set(args.freeze_projection)
        adapters = {part: spec.adapters
                    for part, spec in lora_specs(args.lora, run.layout).items()}
        encoders, notices = {}, []
        for name, plugin in run.plugins.items():
            notice = flops_notice(plugin)
            if notice is not None:
                notices.append(notice)
                continue
            config = plugin.transformer_config(language)
            tower, projection = adapters.get(name), adapters.get(name + PROJECTION)
            encoders[name] = _encoder_count(plugin, config, hidden, {
                "encoder_trains": name not in frozen and tower is None,
                "projection_trains": name not in frozen_projections and projection is None,
                "encoder_adapters": tower, "projection_adapters": projection})
        # A gradient reaches the language model's inputs unless --freeze-encoder freezes the
        # encoder and its projection (LoRA on either is then refused).
        input_grad = any(name not in frozen for name in run.plugins)

        def language_count(rows: tuple[tuple[int, ...], ...], vocab_size: int) -> float:
            return float(language_flops(language, vocab_size, rows,
                                        trains=not (args.freeze_language_model
                                                    or LANGUAGE in adapters),
                                        input_grad=input_grad, adapters=adapters.get(LANGUAGE),
                                        pattern=getattr(args, "hybrid_layer_pattern", None)).model)

        @lru_cache(maxsize=64)
        def count_language(rows: tuple[tuple[int, ...], ...]) -> float:
            # Stock pads the vocabulary when it builds the tokenizer, inside pretrain().
            return language_count(rows, args.padded_vocab_size)

        try:
            language_count(((args.seq_length,),), 1)
        except FlopsError as error:
            raise FlagError(f"--log-throughput, --mimo-timeline and --mimo-profile count the "
                            f"model's FLOPs: {error}") from None
        return cls(run.layout, encoders, count_language, notices)

    def for_rank(self, rank: int) -> Callable[[str, Mapping[str, Any]], Consumed]:
        """The count of ``rank``'s microbatches: zero where the rank is not its replica's
        witness."""
        witness = {module.name for module in self.layout.modules_of_rank(rank)
                   if _is_witness(module.coordinates(rank))}

        def count(module: str, batch: Mapping[str, Any]) -> Consumed:
            if module not in witness:
                return Consumed()
            if module == LANGUAGE:
                rows = tuple(tuple(row) for row in language_rows(batch))
                tokens = batch.get(REAL_TOKENS)
                return Consumed(self._language(rows),
                                float(sum(map(sum, rows)) if tokens is None else tokens))
            counts = batch[ITEM_TOKENS][module]
            flops = self._encoders.get(module)
            return Consumed(0.0 if flops is None else flops(batch),
                            float(sum(sum(sample) for sample in counts)),
                            float(sum(len(sample) for sample in counts)))

        return count


def _is_witness(coordinates: Mapping[str, int]) -> bool:
    return coordinates["tp"] == 0 and coordinates["cp"] == 0 and coordinates["pp"] == 0


def _encoder_count(plugin: Any, config: Any, hidden: int, parts: Mapping[str, Any]
                   ) -> Callable[[Mapping[str, Any]], float]:
    """An encoder microbatch's model FLOPs from its items' sizes, its ``parts`` trained, frozen
    or LoRA'd (:meth:`~megatron_plugins.flops.count.EncoderFlops.flops`'s keywords)."""

    def count(batch: Mapping[str, Any]) -> float:
        sizes = [size for sample in batch[ITEM_SIZES][plugin.name] for size in sample]
        work = microbatch_flops(plugin, sizes, config, hidden)
        return float(work.flops(**parts).model)

    return count
