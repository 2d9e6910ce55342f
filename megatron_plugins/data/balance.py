"""Encoder load balancing within fan-in groups (``--balance-encoder-work``).

When an encoder has more DP replicas than the language model, ``g = encoder dp / language dp``
of its replicas fill one language replica (a fan-in group). Their fixed slices of the group's
samples carry unequal work when samples hold different numbers and sizes of items, and the
step waits for the slowest. Balancing assigns the group's samples to its replicas by work, as a
pure function of the samples' item token counts, so every rank (encoder and language alike)
computes the same assignment without a collective; the language's first stage then puts the
rows it received (replica by replica) back into its own sample order (:func:`received_order`).
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_plugins.parallel.layout import ParallelLayout

__all__ = ["assign_samples", "balanced_encoders", "received_order", "sample_work"]


def sample_work(item_tokens: Sequence[int]) -> int:
    """A sample's encoder cost: per item ``tokens^2`` (self-attention over the item's tokens)
    plus ``tokens`` (the per-token linear layers), summed over its items."""
    return sum(tokens * tokens + tokens for tokens in item_tokens)


def assign_samples(item_tokens: Sequence[Sequence[int]], replicas: int) -> list[list[int]]:
    """Each replica's samples (indices into ``item_tokens``, one entry per sample of the group in
    position order), in increasing order.

    Greedy largest-first: samples by decreasing work (ties: lowest index first), each onto the
    replica with the least work so far (ties: lowest replica). Deterministic, so identical on
    every rank; a replica may get no sample.
    """
    if replicas < 1:
        raise ValueError(f"cannot assign samples to {replicas} replicas")
    work = [sample_work(counts) for counts in item_tokens]
    loads = [0] * replicas
    assigned: list[list[int]] = [[] for _ in range(replicas)]
    for index in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        replica = min(range(replicas), key=lambda r: (loads[r], r))
        loads[replica] += work[index]
        assigned[replica].append(index)
    return [sorted(samples) for samples in assigned]


def received_order(item_tokens: Sequence[Sequence[int]], replicas: int) -> list[int]:
    """For each row of the group's encoder output in sample order, the row it arrives at: the
    bridge concatenates the replicas' outputs in replica order, each replica's samples in the
    order :func:`assign_samples` gives them. ``received.index_select(0, order)`` is the output
    in sample order."""
    rows = [sum(counts) for counts in item_tokens]
    start = [0] * len(rows)
    offset = 0
    for samples in assign_samples(item_tokens, replicas):
        for index in samples:
            start[index] = offset
            offset += rows[index]
    return [start[index] + row for index in range(len(rows)) for row in range(rows[index])]


def balanced_encoders(layout: ParallelLayout) -> dict[str, int]:
    """The encoders ``--balance-encoder-work`` balances, each with its fan-in group's replica
    count: those with more DP replicas than the language (the others have one replica per
    language replica or fewer, so nothing to balance)."""
    language = layout.language.dp
    return {module.name: module.dp // language for module in layout.encoders
            if module.dp > language}
