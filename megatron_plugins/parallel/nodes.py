"""Which of a module's process groups span nodes, with ranks laid out ``nproc_per_node`` to a node
(or per node, in node-rank order, for nodes of unequal sizes) in global rank order (as torchrun
places them).

A group across nodes talks over the network instead of NVLink: ``mimo-plan`` warns about the TP,
CP and EP groups (:data:`FAST_DIMS`, which talk every layer) and the advisor prices every group
by the link it crosses. Pure Python, from :meth:`ModulePlacement.coordinates`.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate

from megatron_plugins.parallel.layout import DENSE_DIMS, EXPERT_DIMS, ModulePlacement

__all__ = ["FAST_DIMS", "NodeSizes", "cross_node_groups", "node_of"]

FAST_DIMS = ("tp", "cp", "ep", "expt_tp")
"""Dims whose groups talk every layer: a group of them across nodes is the costly mistake."""

NodeSizes = int | tuple[int, ...]
"""Ranks per node: one count for every node, or each node's in node-rank order (torch's agents
give node k the global ranks after those of nodes 0..k-1)."""


def node_of(rank: int, nproc_per_node: NodeSizes) -> int:
    """The node that runs global ``rank``."""
    if isinstance(nproc_per_node, int):
        return rank // nproc_per_node
    return bisect_right(list(accumulate(nproc_per_node)), rank)


def cross_node_groups(module: ModulePlacement, nproc_per_node: NodeSizes,
                      dims: Sequence[str] = FAST_DIMS) -> dict[str, tuple[int, int]]:
    """Per dim of ``dims`` (default :data:`FAST_DIMS`) with groups of more than one rank:
    (groups spanning nodes, groups) of ``module``, for the dims where some group spans nodes."""
    found = {}
    for dim in dims:
        if module.dim_size(dim) == 1:
            continue
        others = [d for d in (DENSE_DIMS if dim in DENSE_DIMS else EXPERT_DIMS) if d != dim]
        nodes: dict[tuple[int, ...], set[int]] = {}
        for rank in module.ranks:
            coords = module.coordinates(rank)
            key = tuple(coords[d] for d in others)
            nodes.setdefault(key, set()).add(node_of(rank, nproc_per_node))
        spanning = sum(len(members) > 1 for members in nodes.values())
        if spanning:
            found[dim] = (spanning, len(nodes))
    return found
