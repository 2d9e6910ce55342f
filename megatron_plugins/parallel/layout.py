"""The heterogeneous layout of one MiMo run: which module owns which ranks, and how each is split.

Every module (each encoder, and the language model under the fixed MiMo key ``"language"``) owns
a disjoint, consecutive rank range with its own TP/CP/DP/PP (and, for the language model, EP and
expert TP). Modules take ranks in the order their ``--grid`` flags are given; the language model
comes last, because stock Megatron reports losses from the last rank. An encoder may instead be
*hosted* (``--grid vision:dp=4@language``, issue 28): its grid covers exactly the language model's
ranks, with its own split, and it takes no ranks of its own.

Everything here is pure Python and runs before any process group exists, so a bad layout fails
identically on every rank with one :class:`LayoutError` naming the flag to fix. The flags that
describe a layout are parsed in :mod:`megatron_plugins.parallel.flags`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_plugins.errors import UsageError

__all__ = [
    "DENSE_DIMS", "EXPERT_DIMS", "GRID_EXAMPLE", "GRID_KEYS", "LANGUAGE", "LayoutError",
    "MODULE_NAME", "ModulePlacement", "ParallelLayout", "check_module_name", "check_supported", "choices",
    "divisors", "encoder_micro_batch_size", "layout_record"
]

LANGUAGE = "language"
"""Megatron's fixed MiMo key for the language module (``MIMO_LANGUAGE_MODULE_KEY``)."""

DENSE_DIMS = ("tp", "cp", "dp", "pp")
"""Dense grid dims, fastest-varying first (Megatron's default order ``tp-cp-ep-dp-pp``)."""

EXPERT_DIMS = ("expt_tp", "ep", "expt_dp", "pp")
"""Expert grid dims over the same ranks, fastest first; ``pp`` matches the dense grid's."""

GRID_KEYS = ("tp", "pp", "cp", "dp", "ep", "etp")
"""The sizes one module's grid has, as ``--grid`` spells them."""

MODULE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
"""What a module name may be: it becomes part of flag values and checkpoint keys."""

GRID_EXAMPLE = "--grid language:tp=2,pp=1,cp=1,dp=2"
"""A valid ``--grid`` flag, for error messages to show."""

_NAME_RULE = ("a module name starts with an ASCII letter and has only ASCII letters, digits "
              "and '_' (e.g. vision, audio_2)")


class LayoutError(UsageError):
    """A layout that cannot run; the message names the offending flag and how to fix it."""


def check_module_name(name: object, where: str) -> None:
    """Raise a :class:`LayoutError` naming ``where`` unless ``name`` is a valid module name."""
    if not isinstance(name, str) or not MODULE_NAME.fullmatch(name):
        raise LayoutError(f"{where}: module name {name!r} is not valid: {_NAME_RULE}")


def choices(values: Sequence[int]) -> str:
    return "{" + ", ".join(str(v) for v in sorted(set(values))) + "}"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True, kw_only=True)
class ModulePlacement:
    """One module's rank range and its split; ``provider`` is None only for the language model,
    ``host`` names the module whose ranks a hosted (colocated) module shares (None: its own)."""

    name: str
    tp: int
    pp: int
    cp: int
    dp: int
    ep: int = 1
    etp: int = 1
    rank_offset: int
    provider: str | None = None
    host: str | None = None
    source: str = field(default="", compare=False, repr=False)
    """The flag(s) that declared this module, as error messages should name them."""

    def __post_init__(self) -> None:
        if not self.source:
            at = f"@{self.host}" if self.host is not None else ""
            object.__setattr__(self, "source", f"--grid {self.name}{at}")
        check_module_name(self.name, self.source)
        if self.host is not None:
            check_module_name(self.host, self.source)
        for key in GRID_KEYS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(
                    f"{self.source}: {key}={value!r} must be a positive integer "
                    f"(e.g. {GRID_EXAMPLE})"
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
                f"{choices(divisors(stage))}"
            )

    @property
    def size(self) -> int:
        """Number of ranks the module owns."""
        return self.tp * self.pp * self.cp * self.dp

    @property
    def cp_chunks(self) -> int:
        """Equal pieces CP cuts each row (or packed sample) into: 2 x cp, so every CP rank gets
        an early and a late piece of a causal sequence; 1 without CP."""
        return 2 * self.cp if self.cp > 1 else 1

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
    """All modules of a run: those on their own ranks tile ``0..world_size-1`` in order, hosted
    modules lie on their host's ranks."""

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
                f"(e.g. {GRID_EXAMPLE})"
            )
        own = [m for m in self.modules if m.host is None]
        expected_offset = 0
        for module in self.modules:
            if module.host is not None:
                _check_hosted(module, self.module(LANGUAGE))
            elif module.rank_offset != expected_offset:
                raise LayoutError(
                    f"{module.source}: starts at rank {module.rank_offset}, expected "
                    f"{expected_offset}; modules must tile the ranks consecutively in --grid order"
                )
            else:
                expected_offset += module.size
            if module.name == LANGUAGE and module is not own[-1]:
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
        """Ranks the layout needs: the sum of the sizes of the modules on their own ranks."""
        return sum(m.size for m in self.modules if m.host is None)

    @property
    def hosted(self) -> tuple[ModulePlacement, ...]:
        """The modules on another module's ranks (colocated encoders), in layout order."""
        return tuple(m for m in self.modules if m.host is not None)

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
        """The module whose own ranks hold global ``rank`` (a hosted module shares them)."""
        for module in self.modules:
            if module.host is None and rank in module.ranks:
                return module
        raise ValueError(f"rank {rank} is outside the layout's {self.world_size} ranks")

    def modules_of_rank(self, rank: int) -> tuple[ModulePlacement, ...]:
        """Every module global ``rank`` runs: its own module first, then the modules hosted on
        it in layout order (two modules on a colocated rank)."""
        owner = self.module_of_rank(rank)
        return (owner, *(m for m in self.hosted if m.host == owner.name))

    @property
    def most_modules_per_rank(self) -> int:
        """The most modules any rank runs (2 where an encoder is colocated): every rank's
        optimizer build must take part in that many world gathers (``compat`` Gap 25)."""
        return max(len(self.modules_of_rank(rank)) for rank in range(self.world_size))

    def check_world_size(self, world_size: int) -> None:
        """Raise unless the launch has exactly the ranks the modules need."""
        if world_size != self.world_size:
            parts = " + ".join(f"{m.name} {m.size}" for m in self.modules if m.host is None)
            if self.hosted:
                parts += "; " + ", ".join(f"{m.name} on {m.host}" for m in self.hosted)
            raise LayoutError(
                f"WORLD_SIZE / --nproc-per-node is {world_size} but the --grid sizes sum to "
                f"{self.world_size} ({parts}); launch {self.world_size} ranks or change the grids"
            )


def check_supported(module: ModulePlacement) -> None:
    """Reject encoder splits that build but cannot train correctly on disjoint grids yet (the
    language model takes every split; its limits are :mod:`.checks`)."""
    if module.name == LANGUAGE:
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


def _check_hosted(module: ModulePlacement, language: ModulePlacement) -> None:
    """A hosted module must be an encoder on exactly the language model's ranks, split over them
    by tp x dp alone (the routing between the two grids moves whole rows per DP replica)."""
    if module.name == LANGUAGE:
        raise LayoutError(
            f"{module.source}: the language model hosts colocated encoders; it cannot be placed "
            f"on another module; drop @{module.host}"
        )
    if module.host != LANGUAGE:
        raise LayoutError(
            f"{module.source}: an encoder can share only the language model's ranks; use "
            f"@{LANGUAGE} or drop @{module.host}"
        )
    check_supported(module)
    if module.rank_offset != language.rank_offset:
        raise LayoutError(
            f"{module.source}: starts at rank {module.rank_offset}, expected "
            f"{language.rank_offset}: a colocated module takes its host's ranks"
        )
    if module.size != language.size:
        ranks = language.size
        examples = [f"{module.name}:dp={ranks}@{LANGUAGE}"]
        if ranks % 2 == 0:
            examples.append(f"{module.name}:tp=2,dp={ranks // 2}@{LANGUAGE}")
        raise LayoutError(
            f"{module.source}: colocated on {LANGUAGE}'s {ranks} ranks, tp x dp must be {ranks} "
            f"(is {module.size}); e.g. {' or '.join(examples)}"
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


def layout_record(layout: ParallelLayout) -> list[dict[str, Any]]:
    """What identifies a layout for resuming: every module's name, provider and split, and for a
    hosted (colocated) module the module it sits on; records of other modules do not mention it,
    so a layout written before colocation existed still compares equal."""
    return [{"name": m.name, "provider": m.provider, "tp": m.tp, "pp": m.pp, "cp": m.cp,
             "dp": m.dp, "ep": m.ep, "etp": m.etp, **({"on": m.host} if m.host else {})}
            for m in layout.modules]
