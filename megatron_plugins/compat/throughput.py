"""Stock's FLOPs count for throughput, replaced by the MiMo model's (Gap 28).

Gap 28 (GPT-only throughput): stock ``train()`` counts every iteration's FLOPs with
``num_floating_point_operations(args, batch_size, ...)`` (training/training.py:390; called at
:3963 for the FLOPs so far, which checkpoints and ``--log-progress`` keep) and ``training_log``
prints ``--log-throughput``'s ``throughput per GPU (TFLOP/s/GPU)`` as the same count over
``args.world_size`` (:2827): a GPT built from the language model's flags alone. On a MiMo run
that leaves out every encoder's FLOPs while dividing by every rank, encoder ranks included, and
counts the configured ``--seq-length`` rows whatever the batch held. Bridge
(:func:`count_flops_with`): the name ``train()`` and ``training_log`` call answers what the
caller's counter says (the performance room's count of the batches the run consumed), until the
returned undo runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_plugins.compat import record

__all__ = ["count_flops_with"]


def count_flops_with(counter: Callable[[Any, int], float]) -> Callable[[], None]:
    """Gap 28: stock's ``num_floating_point_operations(args, batch_size, **packing_stats)``
    returns ``counter(args, batch_size)``; returns the undo."""
    import megatron.training.training as training

    stock = training.num_floating_point_operations

    def mimo_flops(args: Any, batch_size: int, **_packing_stats: Any) -> float:
        return counter(args, batch_size)

    training.num_floating_point_operations = mimo_flops
    record("28")

    def undo() -> None:
        training.num_floating_point_operations = stock

    return undo
