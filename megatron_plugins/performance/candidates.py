"""The layouts a run could use on the GPUs given, each checked as the launch checks it.

Three ways to place an encoder (:data:`HOMOGENEOUS`, :data:`COLOCATED`, :data:`SEPARATE`): inside
the language model's first pipeline stage with its TP and DP (what a standard VLM does, the
baseline: this project launches it only as a colocated layout, so with a language PP or CP above 1
it is a reference, not a launch), on the language ranks with a TP/DP of its own
(``--grid NAME:...@language``), or on ranks of its own. The language grid varies TP (powers of two
dividing the heads, within a node), PP (dividing the layers), CP, EP (dividing the experts) and DP;
then the micro-batch size and full recomputation. Every layout but the homogeneous reference goes
through :func:`megatron_plugins.parallel.flags.layout_from_args`, the launch's own checks.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from megatron_plugins.parallel.flags import layout_from_args
from megatron_plugins.parallel.layout import (
    LANGUAGE,
    LayoutError,
    ModulePlacement,
    ParallelLayout,
    divisors,
    encoder_micro_batch_size,
)

__all__ = ["COLOCATED", "CHECKED_FLAGS", "Candidate", "EncoderPlacement", "HOMOGENEOUS",
           "MICRO_BATCHES", "SEPARATE", "Space", "enumerate_candidates", "layout_candidate"]

HOMOGENEOUS = "homogeneous"
"""An encoder inside the language model's first pipeline stage, with its TP and DP."""
COLOCATED = "colocated"
"""An encoder on the language model's ranks with a TP/DP of its own."""
SEPARATE = "separate"
"""An encoder on ranks of its own."""

CHECKED_FLAGS = ("num_attention_heads", "num_query_groups", "group_query_attention",
                 "num_experts", "tensor_parallel_num_weight_shards",
                 "expert_tensor_parallel_num_weight_shards", "seq_length", "pack_sequences",
                 "cp_comm_type", "hybrid_context_parallel", "balance_encoder_work")
"""The run's flags the layout checks read (``sequence_parallel`` follows each candidate's TP)."""

MICRO_BATCHES = (1, 2, 4, 8)
"""Micro-batch sizes tried (with the command line's own)."""


@dataclass(frozen=True)
class EncoderPlacement:
    """Where one encoder runs: ``mode`` and its TP x DP (homogeneous: the language's)."""

    name: str
    provider: str
    mode: str
    tp: int
    dp: int


@dataclass(frozen=True)
class Candidate:
    """One layout with its micro-batch size and recomputation."""

    language: ModulePlacement
    encoders: tuple[EncoderPlacement, ...]
    micro: int
    recompute: bool
    colocated_recompute: bool = False
    layout: ParallelLayout | None = None
    """The checked layout (None for a homogeneous reference the launch cannot run)."""

    @property
    def ranks(self) -> int:
        return self.language.rank_offset + self.language.size

    @property
    def kind(self) -> str:
        modes = {placement.mode for placement in self.encoders}
        return modes.pop() if len(modes) == 1 else "mixed"

    def encoder_grid(self, name: str) -> ModulePlacement:
        """An encoder's placement (a homogeneous one: the language's TP and DP on its ranks)."""
        if self.layout is not None:
            return self.layout.module(name)
        placement = next(p for p in self.encoders if p.name == name)
        return ModulePlacement(name=name, provider=placement.provider, tp=placement.tp, pp=1,
                               cp=1, dp=placement.dp, rank_offset=self.language.rank_offset,
                               host=LANGUAGE)

    def grids(self) -> list[str]:
        """The ``--grid`` values, encoders first (a homogeneous one as the colocated layout the
        launch runs when the language has PP 1 and CP 1)."""
        values = []
        for placement in self.encoders:
            tp, dp, at = placement.tp, placement.dp, ""
            if placement.mode in (HOMOGENEOUS, COLOCATED):
                at = f"@{LANGUAGE}"
            values.append(f"{placement.name}:tp={tp},dp={dp}{at}")
        language = self.language
        keys = [f"tp={language.tp}", f"pp={language.pp}", f"cp={language.cp}",
                f"dp={language.dp}"] + ([f"ep={language.ep}"] if language.ep > 1 else [])
        return values + [f"{LANGUAGE}:{','.join(keys)}"]

    def flags(self) -> list[str]:
        """The launch flags to copy: encoders, grids, micro-batch size, recomputation."""
        flags = [token for placement in self.encoders
                 for token in ("--encoder", f"{placement.name}={placement.provider}")]
        flags += [token for grid in self.grids() for token in ("--grid", grid)]
        flags += ["--micro-batch-size", str(self.micro)]
        if self.language.tp > 1:
            flags.append("--sequence-parallel")
        if self.recompute:
            flags += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                      "--recompute-num-layers", "1"]
        if self.colocated_recompute:
            flags.append("--colocated-encoder-recompute")
        return flags

    @property
    def launchable(self) -> bool:
        return self.layout is not None


@dataclass(frozen=True)
class Space:
    """What to enumerate: the model's limits and the GPUs' ranks."""

    heads: int
    layers: int
    encoder_heads: Mapping[str, int]
    providers: Mapping[str, str]
    experts: int
    global_batch: int
    gpus_per_node: int
    fewest: int
    most: int
    checks: Mapping[str, Any]
    """The run's :data:`CHECKED_FLAGS` values."""
    linear_heads: tuple[int, int] | None = None
    """Gated DeltaNet's key and value heads (Qwen3.5): TP divides both, and no layout splits
    the sequence over CP (the launch refuses it: the layers' state runs along it)."""


def _powers(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]


def _language_grids(space: Space, size: int) -> Iterator[tuple[int, int, int, int, int]]:
    """``(tp, pp, cp, ep, dp)`` of ``size`` ranks the model's shape allows."""
    seq = space.checks.get("seq_length") or 0
    linear = space.linear_heads or ()
    for tp in _powers(min(space.gpus_per_node, size)):
        if space.heads % tp or any(heads % tp for heads in linear):
            continue
        for pp in divisors(space.layers):
            if size % (tp * pp) or pp > 32:
                continue
            widest = 1 if linear else min(space.gpus_per_node, size // (tp * pp))
            for cp in _powers(widest):
                if size % (tp * pp * cp) or (cp > 1 and seq % (2 * cp * tp)):
                    continue
                dp = size // (tp * pp * cp)
                stage = tp * cp * dp
                for ep in (divisors(space.experts) if space.experts else [1]):
                    if stage % ep == 0:
                        yield tp, pp, cp, ep, dp


def _encoder_options(space: Space, name: str, language: ModulePlacement, spare: int,
                     micro: int) -> list[EncoderPlacement]:
    """Where one encoder may run beside ``language`` with at most ``spare`` ranks of its own."""
    provider, heads = space.providers[name], space.encoder_heads[name]
    options = []
    shapes = [(language.size, COLOCATED)] if language.cp == 1 else []
    shapes += [(ranks, SEPARATE) for ranks in range(1, spare + 1)]
    samples = micro * language.dp
    for ranks, mode in shapes:
        for tp in _powers(min(space.gpus_per_node, ranks)):
            dp = ranks // tp
            if ranks % tp or heads % tp or samples % dp:
                continue
            if dp % language.dp and language.dp % dp:
                continue
            options.append(EncoderPlacement(name, provider, mode, tp, dp))
    return options


def _checked(space: Space, language: tuple[int, int, int, int, int],
             encoders: Sequence[EncoderPlacement], micro: int, recompute: bool
             ) -> Candidate | None:
    """The candidate if the launch's checks accept its layout, else None."""
    tp, pp, cp, ep, dp = language
    grids = Candidate(ModulePlacement(name=LANGUAGE, tp=tp, pp=pp, cp=cp, dp=dp, ep=ep,
                                      rank_offset=0), tuple(encoders), micro, recompute).grids()
    args = argparse.Namespace(**space.checks, sequence_parallel=tp > 1, llm_offset=None,
                              mimo_encoders=[f"{p.name}={p.provider}" for p in encoders],
                              mimo_grids=grids, colocated_encoder_recompute=False)
    ranks = sum(p.tp * p.dp for p in encoders if p.mode == SEPARATE) + tp * pp * cp * dp
    try:
        layout = layout_from_args(args, ranks, dict(space.encoder_heads))
        for placement in encoders:
            encoder_micro_batch_size(layout, placement.name, micro)
    except LayoutError:
        return None
    return Candidate(layout.language, tuple(encoders), micro, recompute, layout=layout)


def layout_candidate(layout: ParallelLayout, micro: int, recompute: bool,
                     colocated_recompute: bool) -> Candidate:
    """A checked layout given by the command line (or a profile) as a candidate."""
    encoders = tuple(EncoderPlacement(m.name, m.provider or "", COLOCATED if m.host else SEPARATE,
                                      m.tp, m.dp) for m in layout.encoders)
    return Candidate(layout.language, encoders, micro, recompute, colocated_recompute, layout)


def enumerate_candidates(space: Space, micro_batches: Sequence[int] = MICRO_BATCHES,
                         homogeneous_fewest: int | None = None) -> Iterator[Candidate]:
    """Every layout of ``space.fewest`` to ``space.most`` ranks (homogeneous references from
    ``homogeneous_fewest`` ranks), each micro-batch size, with and without recomputation."""
    names = list(space.providers)
    low = min(space.fewest, homogeneous_fewest or space.fewest)
    for size in range(1, space.most + 1):
        for grid in _language_grids(space, size):
            tp, pp, cp, ep, dp = grid
            language = ModulePlacement(name=LANGUAGE, tp=tp, pp=pp, cp=cp, dp=dp, ep=ep,
                                       rank_offset=0)
            for micro, recompute in itertools.product(micro_batches, (False, True)):
                if space.global_batch % (micro * dp):
                    continue
                if size >= low:
                    homogeneous = tuple(EncoderPlacement(name, space.providers[name],
                                                         HOMOGENEOUS, tp, dp) for name in names)
                    if all(space.encoder_heads[name] % tp == 0 for name in names):
                        yield Candidate(language, homogeneous, micro, recompute,
                                        layout=_homogeneous_layout(space, grid, homogeneous,
                                                                   micro))
                spare = space.most - size
                per_encoder = [_encoder_options(space, name, language, spare, micro)
                               for name in names]
                for choice in itertools.product(*per_encoder):
                    own = sum(p.tp * p.dp for p in choice if p.mode == SEPARATE)
                    if not space.fewest <= size + own <= space.most:
                        continue
                    candidate = _checked(space, grid, choice, micro, recompute)
                    if candidate is None:
                        continue
                    yield candidate
                    if any(p.mode == COLOCATED for p in choice):
                        yield replace(candidate, colocated_recompute=True)


def _homogeneous_layout(space: Space, grid: tuple[int, int, int, int, int],
                        encoders: tuple[EncoderPlacement, ...], micro: int
                        ) -> ParallelLayout | None:
    """The colocated layout that runs a homogeneous reference here (language PP 1, CP 1)."""
    tp, pp, cp, _, dp = grid
    if pp > 1 or cp > 1:
        return None
    candidate = _checked(space, grid, [EncoderPlacement(p.name, p.provider, COLOCATED, tp, dp)
                                       for p in encoders], micro, False)
    return candidate.layout if candidate is not None else None
