"""The one place that settles a MiMo run's flags, in order, around stock validation.

A MiMo run sets values on the parsed ``args`` that the command line leaves open or that follow
from other flags. Each step below returns its :class:`Adjustment` s (attribute, value, the flag
that gives it, why, whether the user is told) instead of writing ``args``; :func:`settle` applies
them in this order, once, keeps the record and prints the launch's notices from it:

1. the shape flags of ``--language-hf-weights``' config.json, before anything reads them;
2. the freeze lists the pre-import checks resolved (:class:`~megatron_plugins.launch.preflight.Preflight`);
3. the encoders' HF folders and the checkpoint ``--load`` resumes from (a notice when it is not
   stock's choice);
4. defaults: what 0.19.2 leaves unset and, on the CPU simulation, what only a GPU can run;
5. the data source's values and the optimizer flags ``--bf16-precision-aware-optimizer`` implies;
6. the fixed MiMo settings stock validation checks and the language grid written into the stock
   parallel flags, then stock validation;
7. what follows from validated flags (padded vocabulary, checkpoint folders) and the fixed MiMo
   settings stock validation must not see;
8. what a LoRA / per-part-optimizer run records in its checkpoints, and its checks
   (:mod:`megatron_plugins.peft.settling`).
"""

from __future__ import annotations

import argparse
import math
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron.core.transformer.enums import AttnBackend
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer, vocab_size_with_padding
from megatron.training.arguments import validate_args

from megatron_plugins import cpu_simulation
from megatron_plugins.launch import checkpoint_guards
from megatron_plugins.model import deepstack
from megatron_plugins.launch.command_line import given_flag, spellings_of
from megatron_plugins.data.sources import build_source
from megatron_plugins.data.streams import DataSource
from megatron_plugins.data.text import check_tokenizer_folder, special_tokens_flag
from megatron_plugins.encoders import EncoderPlugin, check_hooks, instantiate
from megatron_plugins.model.language import language_config_from_args
from megatron_plugins.parallel.flags import language_grid_flags, language_world_size
from megatron_plugins.peft.settling import check_peft_run, peft_values
from megatron_plugins.launch.optimizer_flags import implied_stock_flags
from megatron_plugins.errors import FlagError
from megatron_plugins.launch.preflight import Preflight
from megatron_plugins.weights.flags import (
    HF_MODEL_FLAG,
    LANGUAGE_FLAG,
    check_hf_model,
    encoder_folders,
    hf_model_encoder,
    implied_language_args,
    language_origin,
)
from megatron_plugins.weights.megatron_init import check_init_flags

__all__ = ["Adjustment", "Settled", "check_image_token", "check_mrope", "settle"]

DEFAULT_EVAL_INTERVAL = 1000
"""--eval-interval when none is given (0.19.2 leaves it unset, then fails); earlier releases' default."""

DEFAULTS_NOTICE = "defaults set (give the flags to silence this): "


@dataclass(frozen=True)
class Adjustment:
    """One value the launch sets on ``args``: the flag that would give it, and why."""

    attr: str
    value: Any
    flag: str
    why: str
    tell: bool = False
    """Whether the user is told (a default they may give themselves)."""


@dataclass
class Settled:
    """What :func:`settle` set, in order, the notices it printed, and the run's parts."""

    adjustments: list[Adjustment] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    plugins: dict[str, EncoderPlugin] = field(default_factory=dict)
    source: DataSource | None = None


class _Record:
    """Applies adjustments to ``args`` once each, in order, and prints notices (rank 0)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.settled = Settled()

    def apply(self, adjustments: Iterable[Adjustment]) -> list[Adjustment]:
        applied = list(adjustments)
        for adjustment in applied:
            setattr(self.args, adjustment.attr, adjustment.value)
        self.settled.adjustments.extend(applied)
        return applied

    def notice(self, text: str | None) -> None:
        if not text:
            return
        self.settled.notices.append(text)
        if self.args.rank == 0:
            print(f"pretrain_mimo.py: notice: {text}", file=sys.stderr, flush=True)


def _spelling(parser: argparse.ArgumentParser, attr: str) -> str:
    """The long flag that stores into ``attr``, for the record."""
    return max(spellings_of(parser, attr), key=len, default=attr)


def language_shape(args: argparse.Namespace, parser: argparse.ArgumentParser,
                   given: Callable[[str], str | None]) -> list[Adjustment]:
    """The stock shape flags and the family of ``--language-hf-weights``' config.json."""
    family, implied = implied_language_args(args, given)
    why = language_origin(args)
    return [Adjustment("language_hf_family", family, LANGUAGE_FLAG, why),
            *(Adjustment(attr, value, _spelling(parser, attr), why)
              for attr, value in implied.items())]


def freeze_lists(checked: Preflight) -> list[Adjustment]:
    """The projections to freeze by name (a bare --freeze-projection means all)."""
    return [Adjustment("freeze_projection", list(checked.freeze_projection), "--freeze-projection",
                       "the pre-import checks resolved the encoder names")]


def encoder_weights(args: argparse.Namespace,
                    plugins: dict[str, EncoderPlugin]) -> list[Adjustment]:
    """``--encoder-hf-weights NAME=DIR`` values checked, as a NAME -> DIR dict (``--hf-model``'s
    parts checked to meet)."""
    folders = encoder_folders(args.encoder_hf_weights, plugins, args.hf_model)
    check_hf_model(args, plugins)
    return [Adjustment("encoder_hf_weights", folders, "--encoder-hf-weights",
                       "checked against the run's encoders")]


def check_image_token(args: argparse.Namespace, source: DataSource) -> None:
    """The data's placeholder for ``--hf-model``'s encoder must be the checkpoint's image token:
    the language model reads image features where HF put them."""
    from megatron_plugins.weights.vlm_families import read_vlm

    name = hf_model_encoder(args)
    if name is None:
        return
    vlm, config = read_vlm(args.hf_model)
    want, have = vlm.image_token_id(config), source.special_token_ids.get(name)
    if have != want:
        raise FlagError(f"{HF_MODEL_FLAG} {args.hf_model}: its image token is id {want}, but the "
                        f"data marks encoder {name}'s positions with id {have}; give a tokenizer "
                        f"whose <{name}> token is id {want} (the checkpoint's own tokenizer)")


def resume(args: argparse.Namespace, checked: Preflight) -> list[Adjustment]:
    """The iteration ``--load`` resumes from; told when it is not stock's choice."""
    point = checkpoint_guards.check_checkpoint_flags(args, checked.layout)
    if point is None:
        return []
    return [Adjustment("ckpt_step", point.step, "--ckpt-step", point.notice or "",
                       tell=point.notice is not None)]


def defaults(args: argparse.Namespace, given: Callable[[str], str | None],
             language_cp: int = 1) -> list[Adjustment]:
    """What 0.19.2 leaves unset and, on the CPU simulation, what only a GPU can run. A
    GPU-only value the user gave explicitly is a :class:`FlagError` naming the flag. At language
    cp > 1 the reference CP attention of ``--transformer-impl local`` has no dropout, so stock's
    default attention dropout gives way (an explicit one is refused by the language config)."""
    chosen = []
    if args.tokenizer_type is None:
        if args.vocab_size is None:
            raise FlagError("--tokenizer-type is missing: the mock data needs only a vocabulary "
                            "size; add --vocab-size N (the NullTokenizer is then used) or give "
                            "--tokenizer-type")
        chosen.append(Adjustment("tokenizer_type", "NullTokenizer",
                                 "--tokenizer-type NullTokenizer", "no tokenizer was given",
                                 tell=True))
    if args.eval_interval is None:
        chosen.append(Adjustment("eval_interval", DEFAULT_EVAL_INTERVAL,
                                 f"--eval-interval {DEFAULT_EVAL_INTERVAL}",
                                 "megatron-core 0.19.2 leaves it unset", tell=True))
    if cpu_simulation.is_active():
        for attr, value, flag, reason in cpu_simulation.CPU_SIMULATION_VALUES:
            if getattr(args, attr) == value:
                continue
            spelled = given(attr)
            if spelled is not None:
                raise FlagError(f"{spelled} cannot run on the CPU simulation ({reason}); "
                                f"{'use ' + flag if flag.startswith('--') else flag}")
            chosen.append(Adjustment(attr, value, flag, reason, tell=True))
    impl = next((a.value for a in chosen if a.attr == "transformer_impl"), args.transformer_impl)
    if (language_cp > 1 and impl == "local" and args.attention_dropout > 0
            and given("attention_dropout") is None):
        chosen.append(Adjustment("attention_dropout", 0.0, "--attention-dropout 0",
                                 "the reference context-parallel attention has no dropout",
                                 tell=True))
    return chosen


def check_mock_tokenizer(args: argparse.Namespace) -> None:
    """The mock data (no ``--data-path``) draws ids below ``--vocab-size``; a HuggingFace
    tokenizer it is given must still be a readable folder (stock builds it)."""
    if args.data_path or args.tokenizer_type != "HuggingFaceTokenizer":
        return
    if args.tokenizer_model:
        check_tokenizer_folder(args.tokenizer_model)
    if args.vocab_size is None:
        raise FlagError("--vocab-size is missing: the mock data (no --data-path) draws token ids "
                        "below it; add --vocab-size N, or train on a dataset with --data-path")


def data_source_values(args: argparse.Namespace,
                       plugins: dict[str, EncoderPlugin]) -> list[Adjustment]:
    """An Energon run's placeholders as tokenizer special tokens and its loader states
    saved with each checkpoint (compat Gap 10)."""
    if not args.data_path:
        return []
    return [Adjustment("special_tokens", special_tokens_flag(args.special_tokens, list(plugins)),
                       "--tokenizer-special-tokens",
                       "stock's tokenizer must hold the encoders' placeholders"),
            Adjustment("dataloader_save", args.save, "--dataloader-save",
                       "Energon loader states go into each checkpoint")]


def optimizer_flags(args: argparse.Namespace, parser: argparse.ArgumentParser,
                    argv: Sequence[str]) -> list[Adjustment]:
    """The stock flags ``--bf16-precision-aware-optimizer`` implies."""
    return [Adjustment(attr, value, _spelling(parser, attr),
                       "--bf16-precision-aware-optimizer implies it")
            for attr, value in implied_stock_flags(args, argv).items()]


def mimo_before_validation() -> list[Adjustment]:
    """Fixed MiMo settings stock validation checks (the loss is summed per token; data
    comes from MiMo's provider)."""
    return [Adjustment("calculate_per_token_loss", True, "--calculate-per-token-loss",
                       "MiMo's loss is a per-token sum"),
            Adjustment("dataloader_type", "external", "--dataloader-type external",
                       "MiMo's data provider builds the iterators")]


def _check_learning_rates(args: argparse.Namespace,
                          given: Callable[[str], str | None]) -> None:
    """Stock compares --min-lr <= --lr with a bare assert, which a nan fails without a word."""
    for attr in ("lr", "min_lr"):
        value = getattr(args, attr)
        if value is not None and not math.isfinite(value):
            flag = given(attr) or f"--{attr.replace('_', '-')}"
            raise FlagError(f"{flag} {value} is not a finite number; give a learning rate such as "
                            f"{flag} 1e-4")


def _stock_reason(error: BaseException) -> str:
    """Stock's message, or the failing check's source line when stock gives none."""
    reason = str(error).strip()
    if reason:
        return reason
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return type(error).__name__
    frame = frames[-1]
    return f"{frame.line or type(error).__name__} ({Path(frame.filename).name}:{frame.lineno})"


def language_grid(args: argparse.Namespace, checked: Preflight) -> list[Adjustment]:
    """The language grid written into stock's parallel flags, so stock validation checks it."""
    return [Adjustment(attr, value, flag, f"{checked.layout.language.source} sets it")
            for attr, flag, value in language_grid_flags(args, checked.layout)]


def validate(args: argparse.Namespace, checked: Preflight,
             given: Callable[[str], str | None]) -> None:
    """Stock ``validate_args`` over the language grid's world size, its failures as one
    :class:`FlagError` line."""
    with language_world_size(args, checked.layout):
        _check_learning_rates(args, given)
        try:
            validate_args(args)
        except (AssertionError, ValueError) as error:
            raise FlagError(f"stock Megatron argument check failed: {_stock_reason(error)}") \
                from None


def padded_vocabulary(args: argparse.Namespace, source: DataSource) -> list[Adjustment]:
    """Stock pads the tokenizer's vocabulary only when it builds it, after the language
    config is first needed; the same function gives the same size now."""
    if not args.data_path or args.padded_vocab_size is not None:
        return []
    return [Adjustment("padded_vocab_size",
                       vocab_size_with_padding(source.tokenizer.vocab_size, args,
                                               logging_enabled=False),
                       "--padded-vocab-size", "stock's padding of the tokenizer's vocabulary")]


def init_checkpoints(args: argparse.Namespace, plugins: dict[str, EncoderPlugin],
                     checked: Preflight) -> list[Adjustment]:
    """The Megatron checkpoints that initialize modules, as iteration folders."""
    if args.language_megatron_checkpoint and args.padded_vocab_size is None:
        # The checkpoint's padded vocabulary is compared below; stock's tokenizer sets ours.
        build_tokenizer(args)
    resolved = check_init_flags(args, plugins, checked.layout.language.pp)
    return [Adjustment(attr, value, f"--{attr.replace('_', '-')}", "the iteration folder to load")
            for attr, value in resolved.items()]


def mimo_after_validation(args: argparse.Namespace) -> list[Adjustment]:
    """The cross-grid schedule requires variable sequence lengths, which Megatron's
    allgather MoE dispatcher (the stock default) does not support."""
    fixed = [Adjustment("variable_seq_lengths", True, "--variable-seq-lengths",
                        "the cross-grid schedule needs it")]
    if args.moe_token_dispatcher_type == "allgather":
        fixed.append(Adjustment("moe_token_dispatcher_type", "alltoall",
                                "--moe-token-dispatcher-type alltoall",
                                "allgather does not support variable sequence lengths"))
    return fixed


def check_packing(args: argparse.Namespace) -> None:
    """``--pack-sequences`` needs an attention that reads THD segments."""
    if not args.pack_sequences:
        return
    if args.attention_backend == AttnBackend.local:
        raise FlagError("--pack-sequences needs an attention that reads packed (THD) segments, "
                        "which --attention-backend local's DotProductAttention does not; drop "
                        "--attention-backend local (with --transformer-impl local the reference "
                        "packed attention is used)")


def check_mrope(args: argparse.Namespace) -> None:
    """``--mrope-section`` splits a head's rotary frequency pairs over (t, h, w): three counts
    summing to half the rotary dims, else Megatron fails deep in the first forward.
    ``--mrope-interleaved`` lays those pairs out, so it needs mrope."""
    if args.position_embedding_type != "mrope":
        if getattr(args, "mrope_interleaved", False):
            raise FlagError(f"--mrope-interleaved lays out multimodal RoPE's frequency pairs; it "
                            f"needs --position-embedding-type mrope (got "
                            f"{args.position_embedding_type})")
        return
    pairs = int(args.kv_channels * args.rotary_percent) // 2
    section = list(args.mrope_section or [])
    if len(section) != 3 or sum(section) != pairs:
        raise FlagError(f"--mrope-section {' '.join(map(str, section))} must be three counts "
                        f"(temporal, height, width) summing to the {pairs} rotary frequency pairs "
                        f"of a head (--kv-channels {args.kv_channels} x --rotary-percent "
                        f"{args.rotary_percent} / 2)")


def peft(args: argparse.Namespace, checked: Preflight,
         plugins: dict[str, EncoderPlugin]) -> list[Adjustment]:
    """What a LoRA / per-part-optimizer run records in its checkpoints: the frozen parts'
    references and every part's scheduler values."""
    return [Adjustment(attr, value, "--lora / --module-lr", "recorded in every checkpoint")
            for attr, value in peft_values(args, checked.layout, plugins).items()]


def settle(args: argparse.Namespace, argv: Sequence[str], parser: argparse.ArgumentParser,
           checked: Preflight) -> Settled:
    """Apply every step to parsed ``args`` in order; returns the record and the run's encoder
    plugins and data source. Raises a :class:`~megatron_plugins.errors.UsageError` naming the
    flag to fix."""
    record = _Record(args)

    def given(attr: str) -> str | None:
        return given_flag(argv, spellings_of(parser, attr))

    record.apply(language_shape(args, parser, given))
    record.apply(freeze_lists(checked))
    plugins = {module.name: instantiate(module.provider, module.name, args, module)
               for module in checked.layout.encoders}
    record.apply(encoder_weights(args, plugins))
    for adjustment in record.apply(resume(args, checked)):
        record.notice(adjustment.why if adjustment.tell else None)
    chosen = defaults(args, given, checked.layout.language.cp)
    told = [adjustment.flag for adjustment in record.apply(chosen) if adjustment.tell]
    record.notice(DEFAULTS_NOTICE + ", ".join(told) if told else None)
    check_mock_tokenizer(args)
    source = build_source(args, plugins)
    check_image_token(args, source)
    record.apply(data_source_values(args, plugins))
    record.apply(optimizer_flags(args, parser, argv))
    record.apply(mimo_before_validation())
    record.apply(language_grid(args, checked))
    validate(args, checked, given)
    check_packing(args)
    check_mrope(args)
    record.apply(padded_vocabulary(args, source))
    record.apply(init_checkpoints(args, plugins, checked))
    record.apply(mimo_after_validation(args))
    record.apply(peft(args, checked, plugins))
    language = language_config_from_args(args).transformer
    check_peft_run(args, checked.layout, plugins, language)
    deepstack.check_layers({name: plugin.deepstack_levels for name, plugin in plugins.items()},
                           language)
    for plugin in plugins.values():
        record.notice(check_hooks(plugin, language))
    record.settled.plugins = plugins
    record.settled.source = source
    return record.settled
