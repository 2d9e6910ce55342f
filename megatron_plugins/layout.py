"""The heterogeneous layout of one MiMo run: which module owns which ranks, and how each is split.

Every module (each encoder, and the language model under the fixed MiMo key ``"language"``) owns
a disjoint, consecutive rank range with its own TP/CP/DP/PP (and, for the language model, EP and
expert TP). Modules take ranks in the order their ``--grid`` flags are given; the language model
comes last, because stock Megatron reports losses from the last rank.

Everything here is pure Python and runs before any process group exists, so a bad layout fails
identically on every rank with one :class:`LayoutError` naming the flag to fix.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from megatron_plugins.errors import UsageError

LANGUAGE = "language"
"""Megatron's fixed MiMo key for the language module (``MIMO_LANGUAGE_MODULE_KEY``)."""

DENSE_DIMS = ("tp", "cp", "dp", "pp")
"""Dense grid dims, fastest-varying first (Megatron's default order ``tp-cp-ep-dp-pp``)."""

EXPERT_DIMS = ("expt_tp", "ep", "expt_dp", "pp")
"""Expert grid dims over the same ranks, fastest first; ``pp`` matches the dense grid's."""

_GRID_KEYS = ("tp", "pp", "cp", "dp", "ep", "etp")

ALIAS_ENCODER = ("vision", "vit")
"""Name and provider of the encoder that the alias flags describe when no ``--encoder`` is given."""

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_PROVIDER = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*)?")
_POSITIVE = re.compile(r"[0-9]+")

_NAME_RULE = ("a module name starts with an ASCII letter and has only ASCII letters, digits "
              "and '_' (e.g. vision, audio_2)")
_GRID_EXAMPLE = "--grid language:tp=2,pp=1,cp=1,dp=2"
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


class LayoutError(UsageError):
    """A layout that cannot run; the message names the offending flag and how to fix it."""


def _check_name(name: object, where: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise LayoutError(f"{where}: module name {name!r} is not valid: {_NAME_RULE}")


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _choices(values: Sequence[int]) -> str:
    return "{" + ", ".join(str(v) for v in sorted(set(values))) + "}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True, kw_only=True)
class ModulePlacement:
    """One module's rank range and its split; ``provider`` is None only for the language model."""

    name: str
    tp: int
    pp: int
    cp: int
    dp: int
    ep: int = 1
    etp: int = 1
    rank_offset: int
    provider: str | None = None
    source: str = field(default="", compare=False, repr=False)
    """The flag(s) that declared this module, as error messages should name them."""

    def __post_init__(self) -> None:
        if not self.source:
            object.__setattr__(self, "source", f"--grid {self.name}")
        _check_name(self.name, self.source)
        for key in _GRID_KEYS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(
                    f"{self.source}: {key}={value!r} must be a positive integer "
                    f"(e.g. {_GRID_EXAMPLE})"
                )
        if isinstance(self.rank_offset, bool) or not isinstance(self.rank_offset, int) or (
            self.rank_offset < 0
        ):
            raise LayoutError(f"{self.source}: rank_offset={self.rank_offset!r} must be >= 0")
        stage = self.tp * self.cp * self.dp
        if stage % (self.ep * self.etp) != 0:
            raise LayoutError(
                f"{self.source}: ep={self.ep} x etp={self.etp} = {self.ep * self.etp} does not "
                f"divide tp*cp*dp = {stage} (the expert grid must tile each pipeline stage: "
                f"Megatron needs ep*etp*pp to divide the module size); choose ep*etp in "
                f"{_choices(_divisors(stage))}"
            )

    @property
    def size(self) -> int:
        """Number of ranks the module owns."""
        return self.tp * self.pp * self.cp * self.dp

    @property
    def ranks(self) -> range:
        """Global ranks the module owns."""
        return range(self.rank_offset, self.rank_offset + self.size)

    @property
    def expt_dp(self) -> int:
        """Expert data-parallel size: the ranks of one pipeline stage not used by ep x etp."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    def dim_size(self, dim: str) -> int:
        """Size of one dim of :data:`DENSE_DIMS` or :data:`EXPERT_DIMS`."""
        sizes = {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp,
                 "expt_tp": self.etp, "ep": self.ep, "expt_dp": self.expt_dp}
        return sizes[dim]

    def coordinates(self, rank: int) -> dict[str, int]:
        """A rank's index along every dense and expert dim.

        Matches ``HyperCommGrid``: the first dim varies fastest across consecutive ranks, so
        ``local = tp + TP*(cp + CP*(dp + DP*pp))`` and likewise for the expert dims.
        """
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not in module {self.name} (ranks {self.ranks})")
        coords: dict[str, int] = {}
        for dims in (DENSE_DIMS, EXPERT_DIMS):
            local = rank - self.rank_offset
            for dim in dims:
                coords[dim] = local % self.dim_size(dim)
                local //= self.dim_size(dim)
        return coords


@dataclass(frozen=True)
class ParallelLayout:
    """All modules of a run, tiling ranks ``0..world_size-1`` in order."""

    modules: tuple[ModulePlacement, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", tuple(self.modules))
        names = [m.name for m in self.modules]
        for name in names:
            if names.count(name) > 1:
                raise LayoutError(f"--grid {name} given twice; give each module one --grid")
        if LANGUAGE not in names:
            raise LayoutError(
                f"--grid {LANGUAGE} is missing; add one for the language model "
                f"(e.g. {_GRID_EXAMPLE})"
            )
        expected_offset = 0
        for module in self.modules:
            if module.rank_offset != expected_offset:
                raise LayoutError(
                    f"{module.source}: starts at rank {module.rank_offset}, expected "
                    f"{expected_offset}; modules must tile the ranks consecutively in --grid order"
                )
            expected_offset += module.size
            if module.name == LANGUAGE and module is not self.modules[-1]:
                raise LayoutError(
                    f"{module.source} must come last: Megatron logs losses and TensorBoard "
                    "from the last rank, which must be a language rank; give --grid "
                    f"{LANGUAGE} after the encoders' --grid flags"
                )
            if (module.name == LANGUAGE) != (module.provider is None):
                raise LayoutError(
                    f"{module.source}: every encoder needs a provider (--encoder "
                    f"{module.name}=PROVIDER) and the language model takes none"
                )

    @property
    def world_size(self) -> int:
        """Ranks the layout needs: the sum of all module sizes."""
        return sum(m.size for m in self.modules)

    @property
    def language(self) -> ModulePlacement:
        """The language module."""
        return self.module(LANGUAGE)

    @property
    def encoders(self) -> tuple[ModulePlacement, ...]:
        """The encoder modules, in layout order."""
        return tuple(m for m in self.modules if m.name != LANGUAGE)

    def module(self, name: str) -> ModulePlacement:
        """The module called ``name``."""
        for module in self.modules:
            if module.name == name:
                return module
        names = [m.name for m in self.modules]
        raise KeyError(f"no module {name!r} in the layout (modules: {names})")

    def module_of_rank(self, rank: int) -> ModulePlacement:
        """The module that owns global ``rank``."""
        for module in self.modules:
            if rank in module.ranks:
                return module
        raise ValueError(f"rank {rank} is outside the layout's {self.world_size} ranks")

    def check_world_size(self, world_size: int) -> None:
        """Raise unless the launch has exactly the ranks the modules need."""
        if world_size != self.world_size:
            parts = " + ".join(f"{m.name} {m.size}" for m in self.modules)
            raise LayoutError(
                f"WORLD_SIZE / --nproc-per-node is {world_size} but the --grid sizes sum to "
                f"{self.world_size} ({parts}); launch {self.world_size} ranks or change the grids"
            )


class _AppendWords(argparse.Action):
    """Append every whitespace-separated word of the value: ``--grid "a:dp=1 language:dp=2"`` is
    two ``--grid`` flags (the form a YAML case file with one value per flag can express)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        setattr(namespace, self.dest, items + str(values).split())


def add_layout_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the layout flags; usable as (part of) Megatron's ``extra_args_provider``.

    Values are kept as strings and checked by :func:`layout_from_args`, so every mistake raises
    the same :class:`LayoutError` instead of an argparse exit.
    """
    group = parser.add_argument_group("megatron-plugins heterogeneous layout")
    group.add_argument(
        "--encoder", action=_AppendWords, dest="mimo_encoders", metavar="NAME=PROVIDER",
        help="An encoder module and its provider: a built-in name (vit, audio) or "
             "package.module:attr. Repeat once per encoder, or give several in one "
             "space-separated value.",
    )
    group.add_argument(
        "--grid", action=_AppendWords, dest="mimo_grids",
        metavar="NAME:tp=T,pp=P,cp=C,dp=D[,ep=E,etp=X]",
        help=f"One module's parallel split; one per encoder plus one for '{LANGUAGE}'. Omitted "
             "keys are 1. Modules take consecutive ranks in the order of their --grid flags "
             "(several grids may share one space-separated value).",
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


def _parse_encoder(text: str) -> tuple[str, str]:
    name, sep, provider = text.partition("=")
    if sep and name:
        _check_name(name, f"--encoder {text}")
    if not sep or not _NAME.fullmatch(name) or not _PROVIDER.fullmatch(provider):
        raise LayoutError(f"--encoder {text}: expected NAME=PROVIDER (e.g. {_ENCODER_EXAMPLE})")
    if name == LANGUAGE:
        raise LayoutError(
            f"--encoder {text}: '{LANGUAGE}' is reserved for the language model; "
            "give the encoder another name"
        )
    return name, provider


def _parse_grid(text: str) -> tuple[str, dict[str, int]]:
    name, sep, body = text.partition(":")
    where = f"--grid {text}"
    if sep and name:
        _check_name(name, where)
    if not sep or not _NAME.fullmatch(name):
        raise LayoutError(f"{where}: expected NAME:key=value,... (e.g. {_GRID_EXAMPLE})")
    values: dict[str, int] = {}
    for item in body.split(",") if body else []:
        key, eq, value = item.partition("=")
        if not eq:
            raise LayoutError(f"{where}: expected key=value, got {item!r} (e.g. {_GRID_EXAMPLE})")
        if key not in _GRID_KEYS:
            raise LayoutError(f"{where}: unknown key {key!r}; use keys {', '.join(_GRID_KEYS)}")
        if key in values:
            raise LayoutError(f"{where}: {key} given twice; give each key once")
        values[key] = _parse_size(value, f"{where}: {key}={value}")
    return name, values


def _grid_specs(args: Any) -> list[tuple[str, dict[str, int], str | None, str]]:
    """(name, sizes, provider, source) per module, in rank order, from --grid or alias flags."""
    encoders: dict[str, str] = {}
    for text in getattr(args, "mimo_encoders", None) or []:
        name, provider = _parse_encoder(text)
        if name in encoders:
            raise LayoutError(f"--encoder {name} given twice; give each encoder once")
        encoders[name] = provider
    grids = getattr(args, "mimo_grids", None) or []
    aliases = {flag: getattr(args, _dest(flag), None) for flag in _ALIAS_FLAGS}
    used_aliases = [flag for flag, value in aliases.items() if value is not None]

    if used_aliases:
        if grids:
            raise LayoutError(
                f"{used_aliases[0]} cannot be combined with --grid; describe every module "
                f"with --grid (e.g. {_GRID_EXAMPLE}) or use only the alias flags"
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
            sizes[module][key] = _parse_size(aliases[flag], f"{flag} {aliases[flag]}")
        encoder_flags = "/".join(f for f, (m, _) in _ALIAS_FLAGS.items() if m == "encoder")
        language_flags = "/".join(f for f, (m, _) in _ALIAS_FLAGS.items() if m == LANGUAGE)
        return [
            (encoder, sizes["encoder"], provider, f"--grid {encoder} (from {encoder_flags})"),
            (LANGUAGE, sizes[LANGUAGE], None, f"--grid {LANGUAGE} (from {language_flags})"),
        ]

    specs = []
    for text in grids:
        name, values = _parse_grid(text)
        if name != LANGUAGE and name not in encoders:
            raise LayoutError(
                f"--grid {name} has no --encoder {name}=PROVIDER; add one "
                f"(e.g. --encoder {name}=vit) or drop the grid"
            )
        specs.append((name, values, encoders.get(name), f"--grid {name}"))
    gridded = {spec[0] for spec in specs}
    for name in encoders:
        if name not in gridded:
            raise LayoutError(
                f"--encoder {name} has no --grid; add one (e.g. --grid {name}:tp=1,dp=1)"
            )
    return specs


def _check_supported(module: ModulePlacement) -> None:
    """Reject splits that build but cannot train correctly on disjoint grids yet."""
    if module.name == LANGUAGE:
        if module.cp > 1:
            raise LayoutError(
                f"{module.source}: cp={module.cp}: context parallelism for the language model is "
                "not supported yet (the encoder bridge cannot shard its activations over CP); "
                "use cp=1"
            )
        return
    unsupported = (("pp", "pipeline"), ("cp", "context"))
    for key, what in unsupported:
        if getattr(module, key) > 1:
            raise LayoutError(
                f"{module.source}: {key}={getattr(module, key)}: encoder {what} parallelism is "
                f"not supported yet; use {key}=1 and scale the encoder with tp or dp"
            )
    for key in ("ep", "etp"):
        if getattr(module, key) > 1:
            raise LayoutError(
                f"{module.source}: {key}={getattr(module, key)}: expert parallelism is only "
                f"supported for the language model; use {key}=1"
            )


def _check_heads(module: ModulePlacement, heads: int, what: str) -> None:
    if heads % module.tp != 0:
        raise LayoutError(
            f"{module.source}: tp={module.tp} does not divide {what} {heads}; "
            f"choose tp in {_choices(_divisors(heads))}"
        )


def _check_language_model(layout: ParallelLayout, args: Any) -> None:
    language = layout.language
    heads = getattr(args, "num_attention_heads", None)
    if heads is not None:
        _check_heads(language, heads, "--num-attention-heads")
    # Stock uses --num-query-groups only with --group-query-attention.
    groups = getattr(args, "num_query_groups", None)
    if groups is not None and getattr(args, "group_query_attention", False):
        if groups % language.tp != 0 and language.tp % groups != 0:
            valid = [t for t in _divisors(heads or groups) if groups % t == 0 or t % groups == 0]
            raise LayoutError(
                f"{language.source}: tp={language.tp} is neither a multiple nor a divisor of "
                f"--num-query-groups {groups}; choose tp in {_choices(valid)}"
            )
    experts = getattr(args, "num_experts", None)
    if experts is None and language.ep > 1:
        raise LayoutError(
            f"{language.source}: ep={language.ep} needs an MoE language model; add "
            f"--num-experts N (N divisible by {language.ep}) or use ep=1"
        )
    if experts is not None and experts % language.ep != 0:
        stage = language.tp * language.cp * language.dp
        valid = [e for e in _divisors(experts) if stage % (e * language.etp) == 0]
        raise LayoutError(
            f"--num-experts {experts} is not divisible by {language.source}: ep={language.ep}; "
            f"choose ep in {_choices(valid)}"
        )
    for flag, size, grid_key in (
        ("--tensor-parallel-num-weight-shards", language.tp, "tp"),
        ("--expert-tensor-parallel-num-weight-shards", language.etp, "etp"),
    ):
        shards = getattr(args, _dest(flag), None)
        if shards is not None and shards > size:
            raise LayoutError(
                f"{flag} {shards} enables GTP weight sharding ({shards} shards > "
                f"{language.source}: {grid_key}={size}), which megatron-core 0.19.2 silently "
                f"ignores on disjoint grids; remove {flag}"
            )


def _check_encoder(encoder: ModulePlacement, language: ModulePlacement, heads: int | None) -> None:
    if heads is not None:
        _check_heads(encoder, heads, f"the {encoder.name} encoder's attention heads")
    if encoder.dp % language.dp != 0 and language.dp % encoder.dp != 0:
        raise LayoutError(
            f"{encoder.source}: dp={encoder.dp} and {language.source}: dp={language.dp} must be "
            "multiples of one another (the encoder-to-language bridge fans DP replicas in or "
            f"out); choose an encoder dp that divides {language.dp} or is a multiple of it"
        )


def _check_llm_offset(layout: ParallelLayout, offset: str | None) -> None:
    """Upstream's ``--llm-offset``: accepted when it names where the language grid starts here."""
    start = layout.language.rank_offset
    if offset is not None and offset != str(start):
        raise LayoutError(
            f"--llm-offset {offset}: the language grid starts at rank {start}, right after "
            f"the encoders' ranks; drop --llm-offset or give {start}"
        )


def encoder_micro_batch_size(layout: ParallelLayout, encoder: str, micro_batch_size: int) -> int:
    """Samples per encoder DP replica per microbatch: language microbatch x llm_dp / enc_dp."""
    language, module = layout.language, layout.module(encoder)
    total = micro_batch_size * language.dp
    if total % module.dp != 0:
        raise LayoutError(
            f"--micro-batch-size {micro_batch_size} x {language.source}: dp={language.dp} = "
            f"{total} samples per microbatch cannot be split over {module.source}: "
            f"dp={module.dp}; choose a micro batch size that makes it divisible"
        )
    return total // module.dp


def required_world_size(args: Any) -> int:
    """Ranks the layout flags describe (their grids' sizes summed), before any other check."""
    total = 0
    for _, sizes, _, _ in _grid_specs(args):
        total += math.prod(sizes.get(key, 1) for key in ("tp", "pp", "cp", "dp"))
    return total


def layout_from_args(
    args: Any, world_size: int, encoder_heads: Mapping[str, int] | None = None
) -> ParallelLayout:
    """Build the layout from parsed flags and check that it can run on ``world_size`` ranks.

    ``args`` holds the layout flags plus the stock model flags the checks read when present
    (``num_attention_heads``, ``num_query_groups`` with ``group_query_attention``,
    ``num_experts``, ``tensor_parallel_num_weight_shards``,
    ``expert_tensor_parallel_num_weight_shards``). ``encoder_heads`` maps encoder names to
    attention-head counts known from the encoder plugins; call again once they are known.
    """
    modules = []
    offset = 0
    for name, sizes, provider, source in _grid_specs(args):
        module = ModulePlacement(name=name, rank_offset=offset, provider=provider, source=source,
                            **{key: sizes.get(key, 1) for key in _GRID_KEYS})
        modules.append(module)
        offset += module.size
    layout = ParallelLayout(tuple(modules))
    _check_llm_offset(layout, getattr(args, "llm_offset", None))
    for module in layout.modules:
        _check_supported(module)
    layout.check_world_size(world_size)
    _check_language_model(layout, args)
    heads = encoder_heads or {}
    for encoder in layout.encoders:
        _check_encoder(encoder, layout.language, heads.get(encoder.name))
    return layout


@contextmanager
def apply_language_grid(args: Any, layout: ParallelLayout) -> Iterator[None]:
    """Write the language grid into Megatron's stock parallel args so stock validation checks it.

    Tensor/pipeline/context/expert(-tensor) parallel sizes are set for good. Inside the block,
    ``args.world_size`` is the language module's size: stock ``validate_args`` derives (and checks)
    ``data_parallel_size`` from it. On exit the real world size is back, which stock
    ``initialize_megatron`` passes to ``init_process_group``. Use as
    ``with apply_language_grid(args, layout): validate_args(args)``. A stock parallel flag given
    with another value than the grid's is an error naming both.
    """
    language = layout.language
    for attr, flag, default, key in _STOCK_PARALLEL_FLAGS:
        wanted = getattr(language, key)
        given = getattr(args, attr, default)
        if given != default and given != wanted:
            raise LayoutError(
                f"{flag} {given} disagrees with {language.source}: {key}={wanted}; drop "
                f"{flag} (the language grid sets it) or change the grid"
            )
    for attr, _, _, key in _STOCK_PARALLEL_FLAGS:
        setattr(args, attr, getattr(language, key))
    world_size = args.world_size
    args.world_size = language.size
    try:
        yield
    finally:
        args.world_size = world_size
