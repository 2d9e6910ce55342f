"""What moving bytes costs: the link a process group talks over and the time of its collectives.

A group whose ranks sit on one node talks over the GPUs' intra-node link, a group across nodes
over the network (:func:`megatron_plugins.parallel.nodes.cross_node_groups`). Ring algorithms:
an all-reduce moves ``2 (n - 1) / n`` of the buffer through each rank's link in ``2 (n - 1)``
steps, an all-gather, a reduce-scatter and an all-to-all ``(n - 1) / n`` in ``n - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from megatron_plugins.parallel.layout import ModulePlacement
from megatron_plugins.parallel.nodes import cross_node_groups
from megatron_plugins.performance.assumptions import Assumptions
from megatron_plugins.performance.gpus import Hardware

__all__ = ["Link", "group_link", "link_between"]


@dataclass(frozen=True)
class Link:
    """Achievable bandwidth (bytes/s) and latency per step (s) of one rank's link."""

    bandwidth: float
    latency: float

    def all_reduce(self, size: float, ranks: int) -> float:
        """Seconds to all-reduce a ``size``-byte buffer over ``ranks`` ranks."""
        return 2 * self._ring(size, ranks)

    def all_gather(self, size: float, ranks: int) -> float:
        """Seconds to all-gather (or reduce-scatter, or all-to-all) a ``size``-byte buffer,
        ``size`` being the whole (gathered) buffer."""
        return self._ring(size, ranks)

    def send(self, size: float) -> float:
        """Seconds to send ``size`` bytes to one rank."""
        return size / self.bandwidth + self.latency if size else 0.0

    def _ring(self, size: float, ranks: int) -> float:
        if ranks <= 1:
            return 0.0
        return (ranks - 1) / ranks * size / self.bandwidth + (ranks - 1) * self.latency


def _link(hardware: Hardware, assumptions: Assumptions, inter_node: bool) -> Link:
    gbps = hardware.gpu.inter_node_gbps if inter_node else hardware.gpu.intra_node_gbps
    return Link(gbps * 1e9 * assumptions.link_efficiency, assumptions.latency_us * 1e-6)


def group_link(module: ModulePlacement, dim: str, hardware: Hardware,
               assumptions: Assumptions) -> Link:
    """The link ``module``'s ``dim`` groups (``tp``, ``cp``, ``dp``, ``pp``, ``ep``, ...) talk
    over: the network when any of them spans nodes."""
    return _link(hardware, assumptions, _spans(module, hardware.gpus_per_node, dim))


@lru_cache(maxsize=65536)
def _spans(module: ModulePlacement, gpus_per_node: int, dim: str) -> bool:
    return dim in cross_node_groups(module, gpus_per_node, (dim,))


def link_between(first: range, second: range, hardware: Hardware,
                 assumptions: Assumptions) -> Link:
    """The link between two rank ranges (an encoder's and the language model's first stage): the
    network unless they share one node."""
    nodes = {rank // hardware.gpus_per_node for rank in (*first, *second)}
    return _link(hardware, assumptions, len(nodes) > 1)
