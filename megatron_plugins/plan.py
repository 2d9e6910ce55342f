"""Print a heterogeneous layout's rank map without launching anything (``mimo-plan``).

Takes the launch's layout flags plus the few stock flags validation reads, and prints each
module's rank range and group sizes and every rank's coordinates, or the validation error on one
line with exit code 2. Coordinates are computed by :meth:`ModuleGrid.coordinates`, which follows
``HyperCommGrid``'s rank order, so they match the live topology.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megatron_plugins.layout import (
    DENSE_DIMS,
    EXPERT_DIMS,
    LayoutError,
    ModuleGrid,
    ParallelLayout,
    add_layout_args,
    layout_from_args,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mimo-plan", allow_abbrev=False,
        description="Show which rank runs which module, and where, for a MiMo layout.",
    )
    add_layout_args(parser)
    launch = parser.add_argument_group("launch and model (as given to torchrun and Megatron)")
    launch.add_argument("--nproc-per-node", type=int, required=True)
    launch.add_argument("--nnodes", type=int, default=1)
    launch.add_argument("--num-attention-heads", type=int)
    launch.add_argument("--num-query-groups", type=int)
    launch.add_argument("--num-experts", type=int)
    launch.add_argument("--tensor-parallel-num-weight-shards", type=int)
    launch.add_argument("--expert-tensor-parallel-num-weight-shards", type=int)
    # There is no --group-query-attention here: a given --num-query-groups is always checked.
    parser.set_defaults(group_query_attention=True)
    return parser


def _dims(values: dict[str, int], dims: Sequence[str]) -> str:
    return " ".join(f"{dim}={values[dim]}" for dim in dims)


def _sizes(module: ModuleGrid) -> dict[str, int]:
    return {dim: module.dim_size(dim) for dim in DENSE_DIMS + EXPERT_DIMS}


def format_plan(layout: ParallelLayout) -> str:
    """Module lines (ranks, group sizes) then one line per rank (module, coordinates)."""
    names = ", ".join(m.name for m in layout.modules)
    lines = [f"world: {layout.world_size} ranks; modules in rank order: {names}"]
    for module in layout.modules:
        provider = f" provider={module.provider}" if module.provider else ""
        sizes = _sizes(module)
        lines.append(
            f"module {module.name}{provider} ranks={module.ranks.start}-{module.ranks.stop - 1} "
            f"group sizes: {_dims(sizes, DENSE_DIMS)} | {_dims(sizes, EXPERT_DIMS)}"
        )
    for rank in range(layout.world_size):
        module = layout.module_of_rank(rank)
        coords = module.coordinates(rank)
        lines.append(
            f"rank {rank} {module.name}: {_dims(coords, DENSE_DIMS)} | {_dims(coords, EXPERT_DIMS)}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mimo-plan`` and ``python -m megatron_plugins.plan``; returns exit code."""
    args = _parser().parse_args(argv)
    try:
        layout = layout_from_args(args, args.nproc_per_node * args.nnodes)
    except LayoutError as error:
        print(f"mimo-plan: error: {error}", file=sys.stderr)
        return 2
    print(format_plan(layout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
