"""Print a heterogeneous layout's rank map without launching anything (``mimo-plan``), with
``--gpu NAME`` also each rank's memory by the advisor's model, or with ``--advise`` the layouts
to launch on the GPUs given (:mod:`megatron_plugins.launch.advise`).

Takes the whole training command line (flags it does not need are ignored) plus torchrun's
``--nproc-per-node`` / ``--nnodes`` (or ``--nproc-per-node 1,8,8`` for nodes running different
numbers of ranks, each node's torchrun given its own count), runs the launch's own checks (:func:`preflight.check_run`),
and prints each module's ranks, nodes and group sizes, a warning for every TP/CP/EP group that
spans nodes, and (on request or for small layouts) every rank's node and coordinates (on a
colocated rank, both modules'), and with ``--micro-batch-size`` how much of each colocated
encoder's output crosses ranks; or the error on one line with exit code 2. Coordinates come from
:meth:`ModulePlacement.coordinates`, which follows ``HyperCommGrid``'s rank order, so they match the
live topology.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megatron_plugins.parallel.routing import summarize
from megatron_plugins.errors import FlagError, UsageError, report
from megatron_plugins.launch.command_line import raise_flag_errors
from megatron_plugins.parallel.layout import (
    DENSE_DIMS,
    EXPERT_DIMS,
    ModulePlacement,
    ParallelLayout,
)
from megatron_plugins.launch.preflight import check_parser, check_run
from megatron_plugins.parallel.nodes import NodeSizes, cross_node_groups, node_of

__all__ = ["main"]

ADVISE = "--advise"
"""With this flag ``mimo-plan`` advises a layout instead (:mod:`megatron_plugins.launch.advise`)."""

SMALL = 64
"""Layouts up to this many ranks get the per-rank table without ``--ranks``."""

def _node_sizes(text: str) -> NodeSizes:
    """``--nproc-per-node``: ranks on every node, or on each node in node-rank order."""
    parts = text.split(",")
    if not all(part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a rank count (8) or one per node in node-rank order (1,8,8)")
    sizes = tuple(int(part) for part in parts)
    return sizes[0] if len(sizes) == 1 else sizes


def _nodes_text(nproc_per_node: NodeSizes) -> str:
    if isinstance(nproc_per_node, int):
        return str(nproc_per_node)
    return ",".join(map(str, nproc_per_node))


def _world_size(nproc_per_node: NodeSizes, nnodes: int | None) -> int:
    """The ranks the launch starts; per-node sizes fix the node count, which ``--nnodes`` must
    then repeat."""
    if isinstance(nproc_per_node, int):
        return nproc_per_node * (nnodes or 1)
    if nnodes is not None and nnodes != len(nproc_per_node):
        raise FlagError(f"--nnodes {nnodes} but --nproc-per-node {_nodes_text(nproc_per_node)} "
                        f"names {len(nproc_per_node)} nodes; give one count per node")
    return sum(nproc_per_node)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mimo-plan", allow_abbrev=False, parents=[check_parser()],
        description="Show which rank runs which module, and where, for a MiMo layout. Paste the "
                    "whole training command line: flags the plan does not need are ignored.",
    )
    launch = parser.add_argument_group("launch (as given to torchrun)")
    launch.add_argument("--nproc-per-node", "--nproc_per_node", type=_node_sizes, required=True,
                        help="Ranks per node, or one count per node in node-rank order (1,8,8).")
    launch.add_argument("--nnodes", type=int, default=None)
    launch.add_argument("--ranks", action="store_true",
                        help=f"Print the per-rank table (default: only up to {SMALL} ranks).")
    launch.add_argument("--gpu", default=None, metavar="NAME",
                        help="Also print each rank's memory by the advisor's model on this GPU "
                             "(e.g. h100-sxm; reads the model as the launch does: seconds; "
                             "the data as mimo-plan --advise's data flags describe it).")
    return raise_flag_errors(parser)


def _dims(values: dict[str, int], dims: Sequence[str]) -> str:
    return " ".join(f"{dim}={values[dim]}" for dim in dims)


def _sizes(module: ModulePlacement) -> dict[str, int]:
    return {dim: module.dim_size(dim) for dim in DENSE_DIMS + EXPERT_DIMS}


def _coordinates(module: ModulePlacement, rank: int) -> str:
    coords = module.coordinates(rank)
    return f"{_dims(coords, DENSE_DIMS)} | {_dims(coords, EXPERT_DIMS)}"


def _span(values: range | list[int]) -> str:
    return f"{min(values)}-{max(values)}"


def _routing(layout: ParallelLayout, module: ModulePlacement, micro_batch_size: int) -> str:
    summary = summarize(module, layout.language, micro_batch_size)
    return (f"routing {module.name} -> {layout.language.name} (--micro-batch-size "
            f"{micro_batch_size}): {summary.local_share:.0%} of the rows the first language "
            f"stage merges are computed on the merging rank; per {module.name} row, "
            f"{summary.rows_per_sample:g} copies cross ranks forward and "
            f"{summary.gradients_per_sample:g} gradients back")


def format_plan(layout: ParallelLayout, nproc_per_node: NodeSizes, ranks: bool,
                micro_batch_size: int | None = None) -> str:
    """A summary per module (ranks, nodes, group sizes), the colocated encoders' routing (given
    ``micro_batch_size``), warnings, then the per-rank table."""
    nodes = node_of(layout.world_size - 1, nproc_per_node) + 1
    per_node = _nodes_text(nproc_per_node)
    names = ", ".join(m.name for m in layout.modules if m.host is None)
    if layout.hosted:
        names += "; " + ", ".join(f"{m.name} on {m.host}" for m in layout.hosted)
    lines = [f"world: {layout.world_size} ranks on {nodes} node(s) of {per_node}; "
             f"modules in rank order: {names}"]
    warnings = []
    # Rank order: each module on its own ranks, then the modules hosted on them.
    in_rank_order = [module for owner in layout.modules if owner.host is None
                     for module in layout.modules_of_rank(owner.rank_offset)]
    for module in in_rank_order:
        provider = f" provider={module.provider}" if module.provider else ""
        host = f" (on {module.host})" if module.host else ""
        sizes = _sizes(module)
        module_nodes = [node_of(rank, nproc_per_node) for rank in module.ranks]
        lines.append(
            f"module {module.name}{provider} ranks={_span(module.ranks)}{host} "
            f"nodes={_span(module_nodes)} group sizes: {_dims(sizes, DENSE_DIMS)} | "
            f"{_dims(sizes, EXPERT_DIMS)}"
        )
        for dim, (spanning, total) in cross_node_groups(module, nproc_per_node).items():
            warnings.append(
                f"WARNING: module {module.name}: {spanning} of {total} {dim} groups "
                f"({module.dim_size(dim)} ranks each) span nodes ({per_node} ranks per "
                f"node); {dim} traffic then crosses the network every layer: keep {dim} groups "
                f"inside a node (a {dim} dividing {per_node}, module sizes ending on node "
                f"boundaries)"
            )
    for module in layout.hosted:
        lines.append(_routing(layout, module, micro_batch_size) if micro_batch_size else
                     f"routing {module.name} -> {layout.language.name}: add --micro-batch-size "
                     "to see how many of its rows cross ranks")
    lines.extend(warnings)
    if ranks:
        for rank in range(layout.world_size):
            modules = "; ".join(f"{module.name}: {_coordinates(module, rank)}"
                                for module in layout.modules_of_rank(rank))
            lines.append(f"rank {rank} node {node_of(rank, nproc_per_node)} {modules}")
    else:
        lines.append(f"(per-rank table: add --ranks; shown by default up to {SMALL} ranks)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mimo-plan`` and ``python -m megatron_plugins.launch.plan``; returns exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if ADVISE in argv:
        from megatron_plugins.launch.advise import main as advise

        return advise(argv)
    try:
        own, _ = _parser().parse_known_args(argv)
        world_size = _world_size(own.nproc_per_node, own.nnodes)
        layout = check_run(argv, world_size, quiet=True).layout
    except UsageError as error:
        return report("mimo-plan", error)
    print(format_plan(layout, own.nproc_per_node, own.ranks or layout.world_size <= SMALL,
                      own.micro_batch_size))
    if own.gpu is None:
        return 0
    from megatron_plugins.launch.advise import layout_memory

    sizes = own.nproc_per_node
    per_node = sizes if isinstance(sizes, int) else max(sizes)
    nodes = node_of(layout.world_size - 1, sizes) + 1
    try:
        print(layout_memory(argv, layout, nodes, per_node), flush=True)
    except UsageError as error:
        return report("mimo-plan", error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
