"""The layout's checks against the run's other flags: attention heads and query groups each
module's TP must divide, experts for EP, what the language grid's context parallelism and
colocated encoders need, encoder and language DP fan-in or fan-out.

Pure Python, run before any process group exists (the launch's pre-import checks and
``mimo-plan``), so a layout the model cannot run fails on every rank with one line naming the
flag. The layout value's own invariants (tiling, names, hosted placement) are in :mod:`.layout`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_plugins.errors import FlagError
from megatron_plugins.parallel.layout import (
    LayoutError,
    ModulePlacement,
    ParallelLayout,
    check_supported,
    choices,
    divisors,
)

__all__ = ["check_context_parallel", "check_layout"]


def _check_heads(module: ModulePlacement, heads: int, what: str) -> None:
    if heads % module.tp != 0:
        raise LayoutError(
            f"{module.source}: tp={module.tp} does not divide {what} {heads}; "
            f"choose tp in {choices(divisors(heads))}"
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
            valid = [t for t in divisors(heads or groups) if groups % t == 0 or t % groups == 0]
            raise LayoutError(
                f"{language.source}: tp={language.tp} is neither a multiple nor a divisor of "
                f"--num-query-groups {groups}; choose tp in {choices(valid)}"
            )
    experts = getattr(args, "num_experts", None)
    if experts is None and language.ep > 1:
        raise LayoutError(
            f"{language.source}: ep={language.ep} needs an MoE language model; add "
            f"--num-experts N (N divisible by {language.ep}) or use ep=1"
        )
    if experts is not None and experts % language.ep != 0:
        stage = language.tp * language.cp * language.dp
        valid = [e for e in divisors(experts) if stage % (e * language.etp) == 0]
        raise LayoutError(
            f"--num-experts {experts} is not divisible by {language.source}: ep={language.ep}; "
            f"choose ep in {choices(valid)}"
        )
    for flag, attr, size, grid_key in (
        ("--tensor-parallel-num-weight-shards", "tensor_parallel_num_weight_shards",
         language.tp, "tp"),
        ("--expert-tensor-parallel-num-weight-shards", "expert_tensor_parallel_num_weight_shards",
         language.etp, "etp"),
    ):
        shards = getattr(args, attr, None)
        if shards is not None and shards > size:
            raise LayoutError(
                f"{flag} {shards} enables GTP weight sharding ({shards} shards > "
                f"{language.source}: {grid_key}={size}), which megatron-core 0.19.2 silently "
                f"ignores on disjoint grids; remove {flag}"
            )


def check_context_parallel(language: ModulePlacement, seq_length: int | None, *,
                           sequence_parallel: bool = False, packed: bool = False) -> None:
    """Refuse a ``--seq-length`` the language grid's context and sequence parallelism cannot cut
    evenly.

    CP cuts every row (with ``packed``: every packed sample, padded to fit) into ``2 x cp``
    chunks, and ``--sequence-parallel`` then scatters each CP rank's share (at cp=1 the whole
    row, a packed one too) over ``tp``; stock asserts the first deep in argument validation,
    MimoModel the second in the first forward.
    """
    split_over_tp = sequence_parallel and language.tp > 1
    if seq_length is None or (language.cp == 1 and not split_over_tp):
        return
    chunks = language.cp_chunks if language.cp > 1 else 1
    divisor = chunks * (language.tp if split_over_tp else 1)
    if seq_length % divisor == 0:
        return
    if language.cp > 1:
        why = (f"{language.source}: cp={language.cp} cuts every row into 2 x cp = {chunks} equal "
               "context-parallel chunks")
        if packed:
            why += f" (--pack-sequences pads each packed sample to a multiple of {chunks} too)"
        if split_over_tp:
            why += f" and --sequence-parallel splits each CP rank's share over tp={language.tp}"
    else:
        why = (f"--sequence-parallel splits every row over the {language.tp} tensor-parallel "
               f"ranks of {language.source}: tp={language.tp}")
    lower = seq_length // divisor * divisor
    nearest = f"{lower} or {lower + divisor}" if lower else str(divisor)
    raise LayoutError(f"--seq-length {seq_length} is not a multiple of {divisor}: {why}; choose "
                      f"--seq-length {nearest}")


def _check_context_parallel_flags(language: ModulePlacement, args: Any) -> None:
    """Stock CP flags that need process groups only Megatron's global ``parallel_state``
    creates, and the row length CP and sequence parallelism cut
    (:func:`check_context_parallel`)."""
    if "a2a+p2p" in (getattr(args, "cp_comm_type", None) or []) and language.cp > 1:
        raise LayoutError(
            f"--cp-comm-type a2a+p2p with {language.source}: cp={language.cp} needs Megatron's "
            "global hierarchical CP groups, which disjoint grids do not create; use p2p, "
            "all_gather or a2a"
        )
    if getattr(args, "hybrid_context_parallel", False) and language.cp > 1:
        raise LayoutError(
            f"--hybrid-context-parallel with {language.source}: cp={language.cp} needs "
            "Megatron's global hybrid DP x CP groups and schedule, which disjoint grids do not "
            "create; drop it (the language grid's cp splits every row over its CP ranks)"
        )
    check_context_parallel(language, getattr(args, "seq_length", None),
                           sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
                           packed=bool(getattr(args, "pack_sequences", False)))


def _check_encoder(encoder: ModulePlacement, language: ModulePlacement, heads: int | None) -> None:
    if heads is not None:
        _check_heads(encoder, heads, f"the {encoder.name} encoder's attention heads")
    if encoder.dp % language.dp != 0 and language.dp % encoder.dp != 0:
        raise LayoutError(
            f"{encoder.source}: dp={encoder.dp} and {language.source}: dp={language.dp} must be "
            "multiples of one another (the encoder-to-language bridge fans DP replicas in or "
            f"out); choose an encoder dp that divides {language.dp} or is a multiple of it"
        )


def _check_colocation_flags(layout: ParallelLayout, args: Any) -> None:
    """What colocated encoders cannot run with yet: the language model's CP (the row gradients
    of the CP lanes are not summed on the way back) and fan-in work balancing; and
    ``--colocated-encoder-recompute`` without any of them."""
    if getattr(args, "colocated_encoder_recompute", False) and not layout.hosted:
        raise FlagError(
            "--colocated-encoder-recompute: no encoder is on the language model's ranks, so no "
            "encoder forward is kept until the backward; drop the flag or colocate an encoder "
            "with --grid NAME:...@language"
        )
    for module in layout.hosted:
        if layout.language.cp > 1:
            raise LayoutError(
                f"{module.source} with {layout.language.source}: cp={layout.language.cp}: "
                "colocated encoders with language cp>1 are not supported yet; use cp=1 or place "
                f"{module.name} on its own ranks"
            )
        if getattr(args, "balance_encoder_work", False):
            raise LayoutError(
                f"--balance-encoder-work with {module.source}: colocated encoders cannot balance "
                f"work yet; drop --balance-encoder-work or place {module.name} on its own ranks"
            )


def check_layout(
    layout: ParallelLayout, args: Any, world_size: int,
    encoder_heads: Mapping[str, int] | None = None,
) -> None:
    """Check that a built layout can run on ``world_size`` ranks with the model ``args`` describe.

    ``args`` holds the stock model flags the checks read when present (``num_attention_heads``,
    ``num_query_groups`` with ``group_query_attention``, ``num_experts``,
    ``tensor_parallel_num_weight_shards``, ``expert_tensor_parallel_num_weight_shards``; with a
    language ``cp > 1`` also ``seq_length``, ``sequence_parallel``, ``pack_sequences``,
    ``cp_comm_type`` and ``hybrid_context_parallel``; at language ``tp > 1`` with
    ``sequence_parallel`` also ``seq_length``; with a hosted encoder
    ``balance_encoder_work``; ``colocated_encoder_recompute``).
    ``encoder_heads`` maps encoder names to attention-head counts known from the encoder plugins.
    """
    for module in layout.modules:
        check_supported(module)
    layout.check_world_size(world_size)
    _check_language_model(layout, args)
    _check_context_parallel_flags(layout.language, args)
    _check_colocation_flags(layout, args)
    heads = encoder_heads or {}
    for encoder in layout.encoders:
        _check_encoder(encoder, layout.language, heads.get(encoder.name))
