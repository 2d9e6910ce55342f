"""The one place that settles a MiMo run's flags, in order, around stock validation.

A MiMo run sets values on the parsed ``args`` that the command line leaves open or that follow
from other flags, and checks what stock would fail on only later, without a word. The steps are
data, :data:`STEPS`, which :func:`settle` runs in order: a step returns the :class:`Adjustment` s
it makes (attribute, value, the flag that gives it, why, whether the user is told) instead of
writing ``args``, or checks and returns none; :func:`settle` applies each adjustment once, keeps
the record and prints the launch's notices. Three steps build what the run is made of, once: the
encoder plugins the pre-import checks did not build, the data source and the language model's
config. ``docs/architecture.md`` lists the steps by name; a test holds that list to :data:`STEPS`.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer, vocab_size_with_padding
from megatron.training.arguments import validate_args

from megatron_plugins import cpu_simulation
from megatron_plugins.data.sources import build_source
from megatron_plugins.data.streams import DataSource
from megatron_plugins.data.text import special_tokens_flag
from megatron_plugins.encoders import EncoderPlugin, check_hooks, instantiate
from megatron_plugins.errors import FlagError
from megatron_plugins.launch import checkpoint_guards
from megatron_plugins.launch.command_line import given_flag, spellings_of
from megatron_plugins.launch.flag_checks import (
    check_image_token,
    check_mock_tokenizer,
    check_mrope,
    check_packing,
)
from megatron_plugins.launch.optimizer_flags import implied_stock_flags
from megatron_plugins.launch.preflight import Preflight
from megatron_plugins.launch.scheduler_flags import check_resumed_scheduler, check_scheduler
from megatron_plugins.launch.stock_checks import stock_checked
from megatron_plugins.model import deepstack
from megatron_plugins.model.language import check_gated_delta_net, language_config_from_args
from megatron_plugins.parallel.flags import language_grid_flags, language_world_size
from megatron_plugins.peft.settling import check_peft_run, peft_values
from megatron_plugins.weights.flags import (
    LANGUAGE_FLAG,
    check_hf_model,
    encoder_folders,
    implied_language_args,
    language_origin,
)
from megatron_plugins.weights.megatron_init import check_init_flags

__all__ = ["Adjustment", "STEPS", "Settled", "Settling", "settle"]

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
    language: Any = None
    """The language model's stock ``ModelConfig``, built once from the settled flags."""


class Settling:
    """One run being settled: its parsed flags, what the pre-import checks found, the record."""

    def __init__(self, args: argparse.Namespace, argv: Sequence[str],
                 parser: argparse.ArgumentParser, checked: Preflight,
                 classes: Mapping[str, type[EncoderPlugin]], planning: bool = False) -> None:
        self.args = args
        self.planning = planning  # for mimo-plan, which loads no weights
        self.argv = argv
        self.parser = parser
        self.checked = checked
        self.classes = classes
        self.settled = Settled()

    def given(self, attr: str) -> str | None:
        """The flag that stores into ``attr`` as the command line spells it, or None."""
        return given_flag(self.argv, spellings_of(self.parser, attr))

    def spelling(self, attr: str) -> str:
        """The long flag that stores into ``attr``, for the record."""
        return max(spellings_of(self.parser, attr), key=len, default=attr)

    def apply(self, adjustments: Iterable[Adjustment]) -> None:
        """Set each adjustment on ``args`` and record it."""
        for adjustment in adjustments:
            setattr(self.args, adjustment.attr, adjustment.value)
            self.settled.adjustments.append(adjustment)

    def notice(self, text: str | None) -> None:
        """Record ``text`` and print it on rank 0."""
        if not text:
            return
        self.settled.notices.append(text)
        if self.args.rank == 0:
            print(f"pretrain_mimo.py: notice: {text}", file=sys.stderr, flush=True)


Step = Callable[[Settling], "Iterable[Adjustment] | None"]


def language_shape(run: Settling) -> list[Adjustment]:
    """The stock shape flags and the family of ``--language-hf-weights``' config.json."""
    family, implied = implied_language_args(run.args, run.given, run.planning)
    why = language_origin(run.args)
    return [Adjustment("language_hf_family", family, LANGUAGE_FLAG, why),
            *(Adjustment(attr, value, run.spelling(attr), why)
              for attr, value in implied.items())]


def freeze_lists(run: Settling) -> list[Adjustment]:
    """The projections to freeze by name (a bare --freeze-projection means all)."""
    return [Adjustment("freeze_projection", list(run.checked.freeze_projection),
                       "--freeze-projection", "the pre-import checks resolved the encoder names")]


def encoder_plugins(run: Settling) -> None:
    """Every encoder's plugin, in layout order: those the pre-import checks built (tp > 1) as
    they are, the others built now."""
    built = run.checked.plugins
    run.settled.plugins = {
        module.name: built[module.name] if module.name in built else instantiate(
            module.provider, module.name, run.args, module, run.classes[module.name])
        for module in run.checked.layout.encoders}


def encoder_weights(run: Settling) -> list[Adjustment]:
    """``--encoder-hf-weights`` checked against the run's encoders (``--hf-model``'s parts
    checked to meet)."""
    args, plugins = run.args, run.settled.plugins
    folders = encoder_folders(args.encoder_hf_weights, plugins, args.hf_model)
    check_hf_model(args, plugins, run.planning)
    return [Adjustment("encoder_hf_weights", folders, "--encoder-hf-weights",
                       "checked against the run's encoders")]


def resume(run: Settling) -> list[Adjustment]:
    """The iteration ``--load`` resumes from; told when it is not stock's choice."""
    point = checkpoint_guards.check_checkpoint_flags(run.args, run.checked.layout)
    if point is None:
        return []
    run.notice(point.notice)
    return [Adjustment("ckpt_step", point.step, "--ckpt-step", point.notice or "",
                       tell=point.notice is not None)]


def defaults(run: Settling) -> list[Adjustment]:
    """What 0.19.2 leaves unset and, on the CPU simulation, what only a GPU can run. A
    GPU-only value the user gave explicitly is a :class:`FlagError` naming the flag. At language
    cp > 1 the reference CP attention of ``--transformer-impl local`` has no dropout, so stock's
    default attention dropout gives way (an explicit one is refused by the language config)."""
    args, given = run.args, run.given
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
    if (run.checked.layout.language.cp > 1 and impl == "local" and args.attention_dropout > 0
            and given("attention_dropout") is None):
        chosen.append(Adjustment("attention_dropout", 0.0, "--attention-dropout 0",
                                 "the local path's context-parallel attention has no dropout",
                                 tell=True))
    told = [adjustment.flag for adjustment in chosen if adjustment.tell]
    run.notice(DEFAULTS_NOTICE + ", ".join(told) if told else None)
    return chosen


def mock_tokenizer(run: Settling) -> None:
    """A HuggingFace tokenizer the mock data is given must be readable (stock builds it)."""
    check_mock_tokenizer(run.args)


def data_source(run: Settling) -> None:
    """The run's data source, built once; it checks what it can before any process group."""
    run.settled.source = build_source(run.args, run.settled.plugins)


def image_token(run: Settling) -> None:
    """``--hf-model``'s image token is where the data puts that encoder's features."""
    check_image_token(run.args, run.settled.source)


def data_source_values(run: Settling) -> list[Adjustment]:
    """An Energon run's placeholders as tokenizer special tokens and its loader states
    saved with each checkpoint (compat Gap 10)."""
    args = run.args
    if not args.data_path:
        return []
    return [Adjustment("special_tokens",
                       special_tokens_flag(args.special_tokens, list(run.settled.plugins)),
                       "--tokenizer-special-tokens",
                       "stock's tokenizer must hold the encoders' placeholders"),
            Adjustment("dataloader_save", args.save, "--dataloader-save",
                       "Energon loader states go into each checkpoint")]


def optimizer_flags(run: Settling) -> list[Adjustment]:
    """The stock flags ``--bf16-precision-aware-optimizer`` implies."""
    return [Adjustment(attr, value, run.spelling(attr),
                       "--bf16-precision-aware-optimizer implies it")
            for attr, value in implied_stock_flags(run.args, run.argv, run.planning).items()]


def mimo_before_validation(run: Settling) -> list[Adjustment]:
    """Fixed MiMo settings stock validation checks (the loss is summed per token; data
    comes from MiMo's provider)."""
    return [Adjustment("calculate_per_token_loss", True, "--calculate-per-token-loss",
                       "MiMo's loss is a per-token sum"),
            Adjustment("dataloader_type", "external", "--dataloader-type external",
                       "MiMo's data provider builds the iterators")]


def language_grid(run: Settling) -> list[Adjustment]:
    """The language grid written into stock's parallel flags, so stock validation checks it."""
    layout = run.checked.layout
    return [Adjustment(attr, value, flag, f"{layout.language.source} sets it")
            for attr, flag, value in language_grid_flags(run.args, layout)]


def linear_attention(run: Settling) -> None:
    """Gated DeltaNet layers (Qwen3.5) on the grid just written: refused at language CP > 1 and
    off the local implementation, before stock's checks reach them."""
    check_gated_delta_net(run.args)


def validate(run: Settling) -> None:
    """Stock ``validate_args`` over the language grid's world size, its failures as one
    :class:`FlagError` line naming the flags (:mod:`.stock_checks`). Stock compares --min-lr <=
    --lr with a bare assert, which a nan fails without a word: a learning rate must be finite
    first."""
    args = run.args
    for attr in ("lr", "min_lr"):
        value = getattr(args, attr)
        if value is not None and not math.isfinite(value):
            flag = run.given(attr) or f"--{attr.replace('_', '-')}"
            raise FlagError(f"{flag} {value} is not a finite number; give a learning rate such as "
                            f"{flag} 1e-4")
    layout = run.checked.layout
    with language_world_size(args, layout), stock_checked(args, layout.language, "argument"):
        validate_args(args)


def packing(run: Settling) -> None:
    """``--pack-sequences`` needs an attention that reads packed segments."""
    check_packing(run.args)


def mrope(run: Settling) -> None:
    """``--mrope-section`` and ``--mrope-interleaved`` fit the heads' rotary dims."""
    check_mrope(run.args)


def scheduler(run: Settling) -> None:
    """The learning-rate and weight-decay schedule's flags, and on resume the checkpoint's."""
    check_scheduler(run.args)
    check_resumed_scheduler(run.args)


def padded_vocabulary(run: Settling) -> list[Adjustment]:
    """Stock pads the tokenizer's vocabulary when it builds the tokenizer at start-up, writing
    ``args.padded_vocab_size`` itself; the same functions give the same size now, into the
    record, before the language config and an init checkpoint's vocabulary need it."""
    args = run.args
    if args.padded_vocab_size is not None:
        return []
    if args.data_path:
        vocab = run.settled.source.tokenizer.vocab_size
    elif args.pad_vocab_size:
        # Stock's own tokenizer, built on a copy: stock's build writes the padded size itself.
        vocab = build_tokenizer(argparse.Namespace(**vars(args))).vocab_size
    else:
        return []
    return [Adjustment("padded_vocab_size",
                       vocab_size_with_padding(vocab, args, logging_enabled=False),
                       "--padded-vocab-size", "stock's padding of the tokenizer's vocabulary")]


def init_checkpoints(run: Settling) -> list[Adjustment]:
    """The Megatron checkpoints that initialize modules, as iteration folders."""
    resolved = check_init_flags(run.args, run.settled.plugins, run.checked.layout.language.pp)
    return [Adjustment(attr, value, f"--{attr.replace('_', '-')}", "the iteration folder to load")
            for attr, value in resolved.items()]


def mimo_after_validation(run: Settling) -> list[Adjustment]:
    """The cross-grid schedule requires variable sequence lengths, which Megatron's
    allgather MoE dispatcher (the stock default) does not support."""
    fixed = [Adjustment("variable_seq_lengths", True, "--variable-seq-lengths",
                        "the cross-grid schedule needs it")]
    if run.args.moe_token_dispatcher_type == "allgather":
        fixed.append(Adjustment("moe_token_dispatcher_type", "alltoall",
                                "--moe-token-dispatcher-type alltoall",
                                "allgather does not support variable sequence lengths"))
    return fixed


def peft(run: Settling) -> list[Adjustment]:
    """What a LoRA / per-part-optimizer run records in its checkpoints: the frozen parts'
    references and every part's scheduler values."""
    values = peft_values(run.args, run.checked.layout, run.settled.plugins)
    return [Adjustment(attr, value, "--lora / --module-lr", "recorded in every checkpoint")
            for attr, value in values.items()]


def language_config(run: Settling) -> None:
    """The language model's config, built once from the settled flags (stock's config checks
    failing as one line naming the flags, :mod:`.stock_checks`); the encoders' DeepStack levels
    and build-time hooks checked against it."""
    with stock_checked(run.args, run.checked.layout.language, "model config"):
        run.settled.language = language_config_from_args(run.args)
    transformer = run.settled.language.transformer
    plugins = run.settled.plugins
    deepstack.check_layers({name: plugin.deepstack_levels for name, plugin in plugins.items()},
                           transformer)
    for plugin in plugins.values():
        run.notice(check_hooks(plugin, transformer))


def peft_targets(run: Settling) -> None:
    """LoRA's targets and the parts it names checked against the built models' layers."""
    check_peft_run(run.args, run.checked.layout, run.settled.plugins,
                   run.settled.language.transformer)


STEPS: tuple[Step, ...] = (
    language_shape, freeze_lists, encoder_plugins, encoder_weights, resume, defaults,
    mock_tokenizer, data_source, image_token, data_source_values, optimizer_flags,
    mimo_before_validation, language_grid, linear_attention, validate, packing, mrope, scheduler,
    padded_vocabulary, init_checkpoints, mimo_after_validation, peft, language_config,
    peft_targets,
)
"""The steps of :func:`settle`, in order; each is named by its function."""


def settle(args: argparse.Namespace, argv: Sequence[str], parser: argparse.ArgumentParser,
           checked: Preflight, classes: Mapping[str, type[EncoderPlugin]],
           planning: bool = False) -> Settled:
    """Run :data:`STEPS` on parsed ``args`` in order (``classes``: every encoder's plugin class;
    ``planning``: for ``mimo-plan``, which loads no weights); returns the record and the run's
    encoder plugins, data source and language config. Raises a
    :class:`~megatron_plugins.errors.UsageError` naming the flag to fix."""
    run = Settling(args, argv, parser, checked, classes, planning)
    for step in STEPS:
        run.apply(step(run) or ())
    return run.settled
