"""The PEFT flags: LoRA per part of the model and optimizer settings per part, checked before torch.

A *part* is what a flag names: ``language`` (the language model), an encoder's name (its network,
the tower) or ``NAME.projection`` (that encoder's projection to the language model), the pieces the
freeze flags already treat apart. ``--lora PART:rank=R,alpha=A[,dropout=P][,targets=T+T]`` adds
low-rank adapters to the part's Megatron linear layers named in ``targets`` (all of the part's by
default) and freezes the part's own weights; ``--module-lr PART=LR``, ``--module-min-lr PART=LR``
and ``--module-weight-decay PART=WD`` give a part its own learning rate, minimum learning rate and
weight decay on the run's one scheduler. Everything here is pure Python: :func:`check_peft` runs
in the pre-import checks, so a bad value is one line before any process group.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megatron_plugins.errors import FlagError
from megatron_plugins.flops.count import Adapters
from megatron_plugins.parallel.layout import LANGUAGE, ParallelLayout
from megatron_plugins.parallel.module_values import ModuleValues, module_values

__all__ = [
    "ATTENTION", "GATED_DELTA_NET", "LORA_EXAMPLE", "LORA_FLAG", "MLP", "OPTIM_FLAGS",
    "PROJECTION", "LoraSpec",
    "PartOptim", "add_peft_args", "check_peft", "describe", "encoder_of", "lora_specs",
    "part_optims", "parts_of"
]

LORA_FLAG = "--lora"
LORA_EXAMPLE = "--lora language:rank=8,alpha=16,targets=linear_qkv+linear_proj"
PROJECTION = ".projection"
"""Suffix of an encoder's projection part: ``vision.projection``."""
ATTENTION = ("linear_qkv", "linear_proj")
"""Megatron's attention linears: fused QKV (column parallel) and the output (row parallel)."""
MLP = ("linear_fc1", "linear_fc2")
"""Megatron's MLP linears (gated or plain ``linear_fc1``, column parallel; ``linear_fc2``, row),
in an MoE layer each routed expert's and the shared experts'."""
GATED_DELTA_NET = ("in_proj", "out_proj")
"""Megatron's Gated DeltaNet linears (Qwen3.5's linear attention, language model only): ``in_proj``
(q, k, v, the output gate z, beta, alpha; column parallel) and ``out_proj`` (row parallel)."""
OPTIM_FLAGS = {"lr": "--module-lr", "min_lr": "--module-min-lr",
               "weight_decay": "--module-weight-decay"}
"""PartOptim field -> its flag."""


@dataclass(frozen=True)
class LoraSpec:
    """LoRA on one part: ``W x + alpha / rank * B A x`` on each target linear."""

    part: str
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        """The factor on the adapter's output (PEFT's ``lora_alpha / r``)."""
        return self.alpha / self.rank

    @property
    def adapters(self) -> Adapters:
        """What the FLOPs count needs of it (rank and targets)."""
        return Adapters(self.rank, self.targets)


@dataclass(frozen=True)
class PartOptim:
    """A part's own optimizer settings; None keeps the run's."""

    lr: float | None = None
    min_lr: float | None = None
    weight_decay: float | None = None


def add_peft_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register ``--lora`` and the per-part optimizer flags (one group)."""
    group = parser.add_argument_group("megatron-plugins parameter-efficient fine-tuning")
    group.add_argument(LORA_FLAG, action="append", default=[], metavar="PART:rank=R,alpha=A",
                       help="LoRA on PART (language, an encoder NAME, or NAME.projection): "
                            "adapters of rank R scaled by A/R on its Megatron linear layers "
                            "(targets=linear_qkv+linear_proj+linear_fc1+linear_fc2, on the "
                            "language model also Gated DeltaNet's in_proj+out_proj; default all "
                            "the part has; dropout=P on the adapters' input); the part's own "
                            "weights are frozen. Repeatable, once per part.")
    values = dict(action=ModuleValues, each="part")
    group.add_argument(OPTIM_FLAGS["lr"], metavar="PART=LR", example="--module-lr vision=2e-5",
                       **values,
                       help="PART's learning rate on the run's scheduler (its minimum follows "
                            "--min-lr in proportion unless --module-min-lr gives it). Repeatable.")
    group.add_argument(OPTIM_FLAGS["min_lr"], metavar="PART=LR",
                       example="--module-min-lr vision=2e-6", **values,
                       help="PART's minimum learning rate. Repeatable.")
    group.add_argument(OPTIM_FLAGS["weight_decay"], metavar="PART=WD",
                       example="--module-weight-decay vision=0.1", **values,
                       help="PART's weight decay. Repeatable.")
    return parser


def parts_of(layout: ParallelLayout) -> list[str]:
    """Every part of the layout's model: the language model, each encoder and its projection."""
    return [LANGUAGE, *(name for module in layout.encoders
                        for name in (module.name, module.name + PROJECTION))]


def encoder_of(part: str) -> str:
    """The module a part belongs to: ``vision.projection`` -> ``vision``."""
    return part.removesuffix(PROJECTION)


def _known_part(part: str, layout: ParallelLayout | None, flag: str, text: str) -> None:
    if layout is None:
        return
    parts = parts_of(layout)
    if part not in parts:
        raise FlagError(f"{flag} {text}: {part!r} is not a part of this model; parts are "
                        f"{', '.join(parts)}")


def _valid_targets(part: str, linear_attention: bool | None) -> tuple[str, ...]:
    """The part's targets; the language model's Gated DeltaNet ones unless ``linear_attention``
    says it has none (None: not known yet, before its config is built)."""
    if part.endswith(PROJECTION):
        return MLP
    if part != LANGUAGE:
        return ATTENTION + MLP
    return ATTENTION + (GATED_DELTA_NET if linear_attention is not False else ()) + MLP


def _number(text: str, flag: str, value: str, kind: type) -> float:
    try:
        number = kind(value)
    except ValueError:
        raise FlagError(f"{flag} {text}: {value!r} is not a{'n integer' if kind is int else ' number'}"
                        ) from None
    if not math.isfinite(number):
        raise FlagError(f"{flag} {text}: {value!r} is not a finite number")
    return number


def _lora(text: str, layout: ParallelLayout | None, linear_attention: bool | None) -> LoraSpec:
    part, sep, options = text.partition(":")
    usage = f"expected PART:rank=R,alpha=A[,dropout=P][,targets=T+T] (e.g. {LORA_EXAMPLE})"
    if not sep or not part:
        raise FlagError(f"{LORA_FLAG} {text}: {usage}")
    _known_part(part, layout, LORA_FLAG, text)
    values: dict[str, str] = {}
    for item in options.split(",") if options else []:
        key, eq, value = item.partition("=")
        if not eq or key not in ("rank", "alpha", "dropout", "targets"):
            raise FlagError(f"{LORA_FLAG} {text}: {item!r} is not rank=, alpha=, dropout= or "
                            f"targets=; {usage}")
        if key in values:
            raise FlagError(f"{LORA_FLAG} {text}: {key}= is given twice; give each once")
        values[key] = value
    for key in ("rank", "alpha"):
        if key not in values:
            raise FlagError(f"{LORA_FLAG} {text}: {key}= is missing; {usage}")
    rank = int(_number(text, LORA_FLAG, values["rank"], int))
    if rank <= 0:
        raise FlagError(f"{LORA_FLAG} {text}: rank {rank} must be a positive integer (the "
                        "adapters' inner size, e.g. rank=8)")
    alpha = _number(text, LORA_FLAG, values["alpha"], float)
    if alpha <= 0:
        raise FlagError(f"{LORA_FLAG} {text}: alpha {values['alpha']} must be positive (the "
                        "adapters' output is scaled by alpha / rank, e.g. alpha=16)")
    dropout = _number(text, LORA_FLAG, values.get("dropout", "0"), float)
    if not 0 <= dropout < 1:
        raise FlagError(f"{LORA_FLAG} {text}: dropout {values['dropout']} must be in [0, 1)")
    valid = _valid_targets(part, linear_attention)
    targets = tuple(values["targets"].split("+")) if "targets" in values else valid
    for target in targets:
        if target in GATED_DELTA_NET and target not in valid:
            raise FlagError(f"{LORA_FLAG} {text}: {target} is a Gated DeltaNet linear (Qwen3.5's "
                            "linear attention), and this language model has no Gated DeltaNet "
                            f"layers; its targets are {', '.join(valid)}")
        if target not in valid:
            raise FlagError(f"{LORA_FLAG} {text}: unknown target {target!r}; {part}'s targets "
                            f"are {', '.join(valid)}")
    if len(set(targets)) != len(targets):
        raise FlagError(f"{LORA_FLAG} {text}: a target is named twice")
    return LoraSpec(part, rank, alpha, dropout, targets)


def lora_specs(values: Sequence[str], layout: ParallelLayout | None,
               linear_attention: bool | None = None) -> dict[str, LoraSpec]:
    """Each ``--lora`` value checked against the layout (its parts are not checked without
    one: a saved run's values), by part. ``linear_attention``: whether the language model has
    Gated DeltaNet layers (None: not known, their targets accepted)."""
    specs: dict[str, LoraSpec] = {}
    for text in values:
        spec = _lora(text, layout, linear_attention)
        if spec.part in specs:
            raise FlagError(f"{LORA_FLAG} {spec.part} is given twice; give each part once")
        specs[spec.part] = spec
    return specs


def part_optims(args: argparse.Namespace, layout: ParallelLayout) -> dict[str, PartOptim]:
    """The per-part optimizer flags of ``args`` checked against the layout, by part."""
    found: dict[str, dict[str, float]] = {}
    for field, flag in OPTIM_FLAGS.items():
        given = module_values(getattr(args, flag[2:].replace("-", "_"), None), flag)
        for part, value in given.items():
            text = f"{part}={value}"
            _known_part(part, layout, flag, text)
            number = _number(text, flag, value, float)
            if number < 0 or (field == "lr" and number == 0):
                raise FlagError(f"{flag} {text}: {value} must be "
                                f"{'positive' if field == 'lr' else 'zero or positive'}")
            found.setdefault(part, {})[field] = number
    return {part: PartOptim(**fields) for part, fields in found.items()}


def _frozen_parts(args: argparse.Namespace, layout: ParallelLayout,
                  freeze_projection: Sequence[str]) -> dict[str, str]:
    """Part -> the flag that freezes it."""
    frozen = {}
    if args.freeze_language_model:
        frozen[LANGUAGE] = "--freeze-language-model"
    for module in layout.encoders:
        if module.name in args.freeze_encoder:
            frozen[module.name] = frozen[module.name + PROJECTION] = (
                f"--freeze-encoder {module.name}")
        elif module.name in freeze_projection:
            frozen[module.name + PROJECTION] = f"--freeze-projection {module.name}"
    return frozen


def _check_expert_adapters(spec: LoraSpec | None, num_experts: int | None,
                           layout: ParallelLayout) -> None:
    """Experts' adapters are sharded as the expert linears only at expert TP 1: refuse others."""
    etp = layout.language.etp
    if spec is None or not num_experts or etp == 1 or not set(spec.targets) & set(MLP):
        return
    raise FlagError(f"{LORA_FLAG} {LANGUAGE}: LoRA on MoE experts "
                    f"(targets {'+'.join(t for t in spec.targets if t in MLP)}) needs expert "
                    f"TP 1, and --grid {LANGUAGE} has etp={etp}; drop etp (the experts then "
                    f"split over ep alone) or give targets={'+'.join(ATTENTION)}")


def check_peft(args: argparse.Namespace, layout: ParallelLayout,
               freeze_projection: Sequence[str]) -> None:
    """Every PEFT flag against the layout and the freeze flags; one :class:`FlagError` line."""
    specs = lora_specs(args.lora, layout)
    _check_expert_adapters(specs.get(LANGUAGE), args.num_experts, layout)
    optims = part_optims(args, layout)
    frozen = _frozen_parts(args, layout, freeze_projection)
    for part in specs:
        if part in frozen:
            raise FlagError(f"{LORA_FLAG} {part}: {part} is frozen by {frozen[part]}; LoRA "
                            f"trains adapters on a part, so drop {frozen[part]} or the {LORA_FLAG}")
    for part, optim in optims.items():
        if part in frozen:
            flag = OPTIM_FLAGS[next(f for f in OPTIM_FLAGS if getattr(optim, f) is not None)]
            raise FlagError(f"{flag} {part}: {part} is frozen by {frozen[part]} and trains "
                            "nothing; drop one of the two")
        if optim.lr is not None and optim.min_lr is not None and optim.min_lr > optim.lr:
            raise FlagError(f"--module-min-lr {part}={optim.min_lr:g} is above --module-lr "
                            f"{part}={optim.lr:g}")


def describe(specs: Mapping[str, LoraSpec]) -> list[str]:
    """The specs as ``--lora`` would spell them, every field given (for records and messages)."""
    return [f"{s.part}:rank={s.rank},alpha={s.alpha:g},dropout={s.dropout:g},"
            f"targets={'+'.join(s.targets)}" for s in specs.values()]
