"""Which of a module's process groups span nodes, with ranks laid out ``nproc_per_node`` to a node
in global rank order (as torchrun places them).

A group across nodes talks over the network instead of NVLink: ``mimo-plan`` warns about the TP,
CP and EP groups (:data:`FAST_DIMS`, which talk every layer) and the advisor prices every group
by the link it crosses. Pure Python, from :meth:`ModulePlacement.coordinates`.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_plugins.parallel.layout import DENSE_DIMS, EXPERT_DIMS, ModulePlacement

__all__ = ["FAST_DIMS", "cross_node_groups"]

FAST_DIMS = ("tp", "cp", "ep", "expt_tp")
"""Dims whose groups talk every layer: a group of them across nodes is the costly mistake."""


def cross_node_groups(module: ModulePlacement, nproc_per_node: int,
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
            nodes.setdefault(key, set()).add(rank // nproc_per_node)
        spanning = sum(len(members) > 1 for members in nodes.values())
        if spanning:
            found[dim] = (spanning, len(nodes))
    return found
