"""The layout flags: ``--encoder``, ``--grid`` and upstream examples/mimo's ``--encoder-tp`` /
``--llm-*`` spellings, parsed into a checked :class:`~megatron_plugins.parallel.layout.ParallelLayout`.

``--encoder`` values become a ``NAME -> PROVIDER`` dict as argparse reads them
(:class:`~megatron_plugins.parallel.module_values.ModuleValues`); the other values are kept as
strings by argparse and checked here, so every mistake raises one
:class:`~megatron_plugins.parallel.layout.LayoutError` naming the flag, before any process group
exists.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NamedTuple

from megatron_plugins.parallel.layout import (
    GRID_EXAMPLE,
    GRID_KEYS,
    LANGUAGE,
    MODULE_NAME,
    LayoutError,
    ModulePlacement,
    ParallelLayout,
    check_module_name,
)
from megatron_plugins.parallel.checks import check_layout
from megatron_plugins.parallel.module_values import ModuleValues, module_values

__all__ = [
    "ALIAS_ENCODER", "add_layout_args", "encoder_providers", "language_grid_flags",
    "language_world_size", "layout_from_args", "required_world_size"
]

ALIAS_ENCODER = ("vision", "vit")
"""Name and provider of the encoder that the alias flags describe when no ``--encoder`` is given."""

_PROVIDER = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*)?")
_POSITIVE = re.compile(r"[0-9]+")

_ENCODER_EXAMPLE = "--encoder vision=vit or --encoder vision=my_pkg.encoders:VisionEncoder"

# Upstream Megatron-LM examples/mimo spellings of a one-encoder layout: flag -> (module, grid key).
_ALIAS_FLAGS = {
    "--encoder-tp": ("encoder", "tp"),
    "--encoder-dp": ("encoder", "dp"),
    "--llm-tp": (LANGUAGE, "tp"),
    "--llm-pp": (LANGUAGE, "pp"),
    "--llm-cp": (LANGUAGE, "cp"),
    "--llm-dp": (LANGUAGE, "dp"),
    "--llm-ep": (LANGUAGE, "ep"),
    "--llm-expt-tp": (LANGUAGE, "etp"),
}

# Stock flags that describe the language grid: (args attribute, flag, stock default, grid key).
_STOCK_PARALLEL_FLAGS = (
    ("tensor_model_parallel_size", "--tensor-model-parallel-size", 1, "tp"),
    ("pipeline_model_parallel_size", "--pipeline-model-parallel-size", 1, "pp"),
    ("context_parallel_size", "--context-parallel-size", 1, "cp"),
    ("expert_model_parallel_size", "--expert-model-parallel-size", 1, "ep"),
    ("expert_tensor_parallel_size", "--expert-tensor-parallel-size", None, "etp"),
)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


class _AppendWords(argparse.Action):
    """Append every whitespace-separated word of the value: ``--grid "a:dp=1 language:dp=2"`` is
    two ``--grid`` flags (the form a YAML case file with one value per flag can express)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        setattr(namespace, self.dest, items + str(values).split())


def add_layout_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the layout flags; usable as (part of) Megatron's ``extra_args_provider``.

    ``--encoder`` becomes a dict as it is read; the other values are kept as strings and
    checked by :func:`layout_from_args`. Every mistake raises a :class:`LayoutError`, not an
    argparse exit.
    """
    group = parser.add_argument_group("megatron-plugins heterogeneous layout")
    group.add_argument(
        "--encoder", action=ModuleValues, dest="mimo_encoders", metavar="NAME=PROVIDER",
        words=True, error=LayoutError, example=_ENCODER_EXAMPLE,
        help="An encoder module and its provider: a built-in name (vit, audio) or "
             "package.module:attr. Repeat once per encoder, or give several in one "
             "space-separated value.",
    )
    group.add_argument(
        "--grid", action=_AppendWords, dest="mimo_grids",
        metavar="NAME:tp=T,pp=P,cp=C,dp=D[,ep=E,etp=X][@HOST]",
        help=f"One module's parallel split; one per encoder plus one for '{LANGUAGE}'. Omitted "
             "keys are 1. Modules take consecutive ranks in the order of their --grid flags "
             "(several grids may share one space-separated value). An encoder with "
             f"@{LANGUAGE} is colocated: it takes no ranks of its own and splits the language "
             "model's ranks by its tp x dp.",
    )
    for flag, (module, key) in _ALIAS_FLAGS.items():
        group.add_argument(
            flag, dest=_dest(flag), metavar="N",
            help=f"Upstream examples/mimo alias: {key} of the "
                 f"{'single encoder' if module == 'encoder' else 'language model'} "
                 "(default 1; do not combine with --grid).",
        )
    group.add_argument(
        "--llm-offset", metavar="N",
        help="Upstream examples/mimo flag: the language grid's first rank. Modules take "
             "consecutive ranks here, so it must equal the encoders' rank count.",
    )
    return parser


def _parse_size(text: str, label: str) -> int:
    """``label`` spells the flag and value as given, e.g. ``--grid vit:tp=0: tp=0``."""
    if not _POSITIVE.fullmatch(text) or int(text) < 1:
        raise LayoutError(f"{label} must be a positive integer (e.g. 2)")
    return int(text)


def _check_encoder(name: str, provider: str) -> None:
    text = f"{name}={provider}"
    check_module_name(name, f"--encoder {text}")
    if not _PROVIDER.fullmatch(provider):
        raise LayoutError(f"--encoder {text}: expected NAME=PROVIDER (e.g. {_ENCODER_EXAMPLE})")
    if name == LANGUAGE:
        raise LayoutError(
            f"--encoder {text}: '{LANGUAGE}' is reserved for the language model; "
            "give the encoder another name"
        )


def _encoders(args: Any) -> dict[str, str]:
    """``--encoder``'s ``NAME -> PROVIDER`` (``args`` built by hand may hold the strings)."""
    return module_values(getattr(args, "mimo_encoders", None), "--encoder", LayoutError)


def encoder_providers(args: Any) -> dict[str, str]:
    """``--encoder``'s ``NAME -> PROVIDER``, or the alias flags' one encoder when none is given."""
    return _encoders(args) or dict([ALIAS_ENCODER])


def _parse_grid(text: str) -> tuple[str, dict[str, int], str | None]:
    """``NAME:key=value,...[@HOST]`` -> name, sizes, host (None: the module's own ranks)."""
    name, sep, body = text.partition(":")
    where = f"--grid {text}"
    body, at, host = body.partition("@")
    if "@" in name or (at and not MODULE_NAME.fullmatch(host)):
        raise LayoutError(f"{where}: expected NAME:key=value,...@HOST, HOST a module name (e.g. "
                          f"--grid {name.partition('@')[0]}:dp=2@{LANGUAGE})")
    if sep and name:
        check_module_name(name, where)
    if not sep or not MODULE_NAME.fullmatch(name):
        raise LayoutError(f"{where}: expected NAME:key=value,... (e.g. {GRID_EXAMPLE})")
    values: dict[str, int] = {}
    for item in body.split(",") if body else []:
        key, eq, value = item.partition("=")
        if not eq:
            raise LayoutError(f"{where}: expected key=value, got {item!r} (e.g. {GRID_EXAMPLE})")
        if key not in GRID_KEYS:
            raise LayoutError(f"{where}: unknown key {key!r}; use keys {', '.join(GRID_KEYS)}")
        if key in values:
            raise LayoutError(f"{where}: {key} given twice; give each key once")
        values[key] = _parse_size(value, f"{where}: {key}={value}")
    return name, values, host if at else None


class _Spec(NamedTuple):
    """One module as the flags describe it, before ranks are assigned."""

    name: str
    sizes: dict[str, int]
    provider: str | None
    source: str
    host: str | None = None

    @property
    def size(self) -> int:
        """Ranks the grid spans."""
        return math.prod(self.sizes.get(key, 1) for key in ("tp", "pp", "cp", "dp"))


def _grid_specs(args: Any) -> list[_Spec]:
    """Every module, in flag order, from --grid or the alias flags."""
    encoders = _encoders(args)
    for name, provider in encoders.items():
        _check_encoder(name, provider)
    grids = getattr(args, "mimo_grids", None) or []
    aliases = {flag: getattr(args, _dest(flag), None) for flag in _ALIAS_FLAGS}
    used_aliases = [flag for flag, value in aliases.items() if value is not None]

    if used_aliases:
        if grids:
            raise LayoutError(
                f"{used_aliases[0]} cannot be combined with --grid; describe every module "
                f"with --grid (e.g. {GRID_EXAMPLE}) or use only the alias flags"
            )
        if len(encoders) > 1:
            raise LayoutError(
                f"{used_aliases[0]} describes a single encoder but --encoder gives "
                f"{', '.join(encoders)}; use one --grid per encoder instead"
            )
        encoder, provider = next(iter(encoders.items()), ALIAS_ENCODER)
        sizes: dict[str, dict[str, int]] = {"encoder": {}, LANGUAGE: {}}
        for flag in used_aliases:
            module, key = _ALIAS_FLAGS[flag]
            if "@" in aliases[flag]:
                raise LayoutError(
                    f"{flag} {aliases[flag]}: the alias flags describe an encoder on its own "
                    f"ranks; for a colocated encoder give every module a --grid (e.g. --grid "
                    f"{encoder}:dp=2@{LANGUAGE} --grid {LANGUAGE}:dp=2)"
                )
            sizes[module][key] = _parse_size(aliases[flag], f"{flag} {aliases[flag]}")
        encoder_flags = "/".join(f for f, (m, _) in _ALIAS_FLAGS.items() if m == "encoder")
        language_flags = "/".join(f for f, (m, _) in _ALIAS_FLAGS.items() if m == LANGUAGE)
        return [
            _Spec(encoder, sizes["encoder"], provider, f"--grid {encoder} (from {encoder_flags})"),
            _Spec(LANGUAGE, sizes[LANGUAGE], None, f"--grid {LANGUAGE} (from {language_flags})"),
        ]

    specs = []
    for text in grids:
        name, values, host = _parse_grid(text)
        if name != LANGUAGE and name not in encoders:
            raise LayoutError(
                f"--grid {name} has no --encoder {name}=PROVIDER; add one "
                f"(e.g. --encoder {name}=vit) or drop the grid"
            )
        source = f"--grid {name}" if host is None else f"--grid {text}"
        specs.append(_Spec(name, values, encoders.get(name), source, host))
    gridded = {spec.name for spec in specs}
    for name in encoders:
        if name not in gridded:
            raise LayoutError(
                f"--encoder {name} has no --grid; add one (e.g. --grid {name}:tp=1,dp=1)"
            )
    return specs


def _check_llm_offset(layout: ParallelLayout, offset: str | None) -> None:
    """Upstream's ``--llm-offset``: accepted when it names where the language grid starts here."""
    start = layout.language.rank_offset
    if offset is not None and offset != str(start):
        raise LayoutError(
            f"--llm-offset {offset}: the language grid starts at rank {start}, right after "
            f"the encoders' ranks; drop --llm-offset or give {start}"
        )


def required_world_size(args: Any) -> int:
    """Ranks the layout flags describe (the sizes of the grids on their own ranks summed; a
    colocated grid adds none), before any other check."""
    total = 0
    for spec in _grid_specs(args):
        if spec.host is None:
            total += spec.size
    return total


def layout_from_args(
    args: Any, world_size: int, encoder_heads: Mapping[str, int] | None = None
) -> ParallelLayout:
    """Build the layout from parsed flags and check that it can run on ``world_size`` ranks.

    ``args`` holds the layout flags plus the stock model flags that
    :func:`~megatron_plugins.parallel.checks.check_layout` reads. ``encoder_heads`` maps encoder names to
    attention-head counts known from the encoder plugins; call again once they are known.
    """
    specs = _grid_specs(args)
    offsets: dict[str, int] = {}
    offset = 0
    for spec in specs:
        if spec.host is None:
            offsets[spec.name] = offset
            offset += spec.size
    # A hosted module starts where its host does; ParallelLayout refuses an unknown host.
    modules = tuple(
        ModulePlacement(name=spec.name, provider=spec.provider, source=spec.source, host=spec.host,
                        rank_offset=offsets[spec.name] if spec.host is None
                        else offsets.get(spec.host, 0),
                        **{key: spec.sizes.get(key, 1) for key in GRID_KEYS})
        for spec in specs
    )
    layout = ParallelLayout(modules)
    _check_llm_offset(layout, getattr(args, "llm_offset", None))
    check_layout(layout, args, world_size, encoder_heads)
    return layout


def language_grid_flags(args: Any, layout: ParallelLayout) -> list[tuple[str, str, int | None]]:
    """``(args attribute, stock flag, value)`` for each stock parallel flag the language grid
    sets, so stock validation checks the grid. A stock parallel flag given with another value
    than the grid's is an error naming both."""
    language = layout.language
    for attr, flag, default, key in _STOCK_PARALLEL_FLAGS:
        wanted = getattr(language, key)
        given = getattr(args, attr, default)
        if given != default and given != wanted:
            raise LayoutError(
                f"{flag} {given} disagrees with {language.source}: {key}={wanted}; drop "
                f"{flag} (the language grid sets it) or change the grid"
            )
    return [(attr, flag, getattr(language, key)) for attr, flag, _, key in _STOCK_PARALLEL_FLAGS]


@contextmanager
def language_world_size(args: Any, layout: ParallelLayout) -> Iterator[None]:
    """Inside the block ``args.world_size`` is the language module's size: stock
    ``validate_args`` derives (and checks) ``data_parallel_size`` from it. On exit the real world
    size is back, which stock ``initialize_megatron`` passes to ``init_process_group``."""
    world_size = args.world_size
    args.world_size = layout.language.size
    try:
        yield
    finally:
        args.world_size = world_size
