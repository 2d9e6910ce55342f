"""Per-module RNG seeding and checkpoint RNG keys for heterogeneous MiMo runs.

Stock ``pretrain()`` skips its own seeding when given a ``MultiModuleProcessGroupCollection``;
each rank then seeds its module here, through stock ``_set_random_seed`` with the module's own
groups, so stock's stream rules hold inside every module:

* ``seed + 100 * pp_rank`` (``+ 10 * dp_rank`` with ``--data-parallel-random-init``) for the
  Python, NumPy, torch and CUDA default generators: identical across DP and CP replicas, distinct
  across PP stages;
* tracker streams on top of that: tensor-parallel ``+ 2718 + tp_rank``, expert-parallel
  ``+ 1024 + 100 * ep_rank + etp_rank`` (stock's formula, kept as is: expert streams of
  ``(pp, ep) = (0, 1)`` and ``(1, 0)`` coincide).

Seed-offset scheme: module ``i`` seeds with ``seed + MODULE_SEED_STRIDE * i``, where the language
model is ``i = 0`` (its streams equal a stock run's with the same ``--seed``) and encoders are
``i = 1, 2, ...`` in layout order. The stride (10,000,000) is larger than the largest offset stock
adds inside a module (:func:`module_seed` checks it), so no stream of one module can coincide with
a stream of another.
"""

from __future__ import annotations

from typing import Protocol

from megatron.training.initialize import _set_random_seed

from megatron_plugins.layout import LANGUAGE, ModulePlacement, ParallelLayout
from megatron_plugins.topology import HeteroTopology

__all__ = ["MODULE_SEED_STRIDE", "module_seed", "rng_state_key_prefix", "seed_module"]

MODULE_SEED_STRIDE = 10_000_000


class SeedArgs(Protocol):
    """The stock arguments ``initialize_megatron`` forwards to ``_set_random_seed``."""

    data_parallel_random_init: bool
    te_rng_tracker: bool
    inference_rng_tracker: bool
    cuda_graph_impl: str


def _largest_stock_offset(module: ModulePlacement) -> int:
    """Largest offset stock seeding adds to a module's seed, over all its ranks and streams."""
    default = 100 * (module.pp - 1) + 10 * (module.dp - 1)
    tracker = max(2718 + module.tp - 1, 1024 + 100 * (module.ep - 1) + module.etp - 1)
    return default + tracker


def module_seed(layout: ParallelLayout, module_name: str, seed: int) -> int:
    """The base seed of ``module_name``: the language model keeps ``seed``, encoders are offset."""
    order = [LANGUAGE] + [m.name for m in layout.encoders]
    module = layout.module(module_name)
    if _largest_stock_offset(module) >= MODULE_SEED_STRIDE:
        raise ValueError(
            f"module {module_name} is too large for distinct per-module RNG streams: stock adds "
            f"offsets up to {_largest_stock_offset(module)} >= {MODULE_SEED_STRIDE}"
        )
    return seed + MODULE_SEED_STRIDE * order.index(module_name)


def seed_module(topology: HeteroTopology, module_name: str, seed: int, args: SeedArgs) -> None:
    """Seed this rank's generators for ``module_name`` exactly as stock initialize_megatron does.

    Forwards ``data_parallel_random_init``, ``te_rng_tracker``, ``inference_rng_tracker`` and
    ``use_cudagraphable_rng = cuda_graph_impl != "none"`` like ``initialize.py``, with the
    module's pp/dp/tp/ep/expert-tp groups in place of the uninitialized global ones.
    """
    pgc = topology.module_pgs.get(module_name)
    if pgc is None:
        raise ValueError(
            f"this rank is in {', '.join(topology.active_modules)}, not in {module_name}; "
            "seed the module this rank runs"
        )
    _set_random_seed(
        module_seed(topology.layout, module_name, seed),
        args.data_parallel_random_init,
        args.te_rng_tracker,
        args.inference_rng_tracker,
        use_cudagraphable_rng=args.cuda_graph_impl != "none",
        pp_group=pgc.pp,
        dp_group=pgc.dp,
        tp_group=pgc.tp,
        ep_group=pgc.ep,
        etp_group=pgc.expt_tp,
    )


def rng_state_key_prefix(module_name: str) -> str:
    """Checkpoint RNG key prefix of a module (``model.rng_state_key_prefix``).

    Stock saves RNG state as ``f"{prefix}rng_state"`` sharded over the module's (pp, tp); modules
    on disjoint grids need distinct keys. Module names cannot contain ``.``, so prefixes never
    collide.
    """
    return f"{module_name}."
