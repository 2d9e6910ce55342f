"""Per-module seeding: draws are equal across ranks exactly where stock's stream rules say so.

Under the CPU simulation the "CUDA" generator is the CPU default generator and Megatron's RNG
tracker forks it, so tracker streams can be drawn and compared on CPU. Megatron is imported only
inside the ranks, after the simulation is active.
"""

from __future__ import annotations

import argparse
import itertools
import shlex
from types import SimpleNamespace

import pytest

from tests.multiprocess import run_in_processes

SEED = 1234
STREAMS = ("python", "numpy", "torch", "cuda", "model-parallel", "expert-parallel")

# One layout covers every rule: TP ranks (vision), DP replicas, PP stages and EP ranks (language).
FLAGS = "--encoder vision=vit --grid vision:tp=2 --grid language:pp=2,dp=2,ep=2 --num-experts 4"
COORDS = {  # rank: (module, tp, dp, pp, ep, etp), written out by hand
    0: ("vision", 0, 0, 0, 0, 0), 1: ("vision", 1, 0, 0, 0, 0),
    2: ("language", 0, 0, 0, 0, 0), 3: ("language", 0, 1, 0, 1, 0),
    4: ("language", 0, 0, 1, 0, 0), 5: ("language", 0, 1, 1, 1, 0),
}


def stream_seed(stream: str, coords: tuple, dp_random_init: bool) -> int:
    """The seed stock Megatron gives a stream (training/initialize.py, tensor_parallel/random.py),
    with our per-module offset (language 0, first encoder 10,000,000)."""
    module, tp, dp, pp, ep, etp = coords
    seed = SEED + {"language": 0, "vision": 10_000_000}[module]
    seed += 100 * pp + (10 * dp if dp_random_init else 0)
    if stream == "model-parallel":
        return seed + 2718 + tp
    if stream == "expert-parallel":
        # Stock's own formula: (pp=0, ep=1) and (pp=1, ep=0) share a seed (ranks 3 and 4 here).
        return seed + 1024 + 100 * ep + etp
    return seed


def _parse(command: str) -> argparse.Namespace:
    from megatron_plugins.layout_flags import add_layout_args

    parser = add_layout_args(argparse.ArgumentParser(allow_abbrev=False))
    parser.add_argument("--num-experts", type=int)
    return parser.parse_args(shlex.split(command))


def _options(dp_random_init=False, te=False, inference=False, cuda_graph_impl="none"):
    return SimpleNamespace(data_parallel_random_init=dp_random_init, te_rng_tracker=te,
                           inference_rng_tracker=inference, cuda_graph_impl=cuda_graph_impl)


def _seed_and_draw(command: str) -> dict:
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    import random

    import numpy as np
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import random as tensor_parallel_random

    import megatron_plugins.rng as rng
    from megatron_plugins.layout_flags import layout_from_args
    from megatron_plugins.topology import build_topology

    layout = layout_from_args(_parse(command), dist.get_world_size())
    topology = build_topology(layout)
    [module] = topology.active_modules
    pgc = topology.module_pgs[module]

    def draw() -> dict:
        tracker = tensor_parallel_random.get_cuda_rng_tracker()
        values = {"python": random.random(), "numpy": float(np.random.random()),
                  "torch": torch.rand(4).tolist(), "cuda": torch.rand(4, device="cuda").tolist()}
        for stream in ("model-parallel", "expert-parallel"):
            with tracker.fork(f"{stream}-rng"):
                values[stream] = torch.rand(4, device="cuda").tolist()
        return values

    draws = {}
    for dp_random_init in (False, True):
        rng.seed_module(topology, module, SEED, _options(dp_random_init=dp_random_init))
        draws[dp_random_init] = draw()

    calls = []
    stock = rng._set_random_seed

    def recording(*args, **kwargs):
        groups = {name: kwargs.pop(name) for name in
                  ("pp_group", "dp_group", "tp_group", "ep_group", "etp_group")}
        calls.append((args, kwargs, [groups["pp_group"] is pgc.pp, groups["dp_group"] is pgc.dp,
                                     groups["tp_group"] is pgc.tp, groups["ep_group"] is pgc.ep,
                                     groups["etp_group"] is pgc.expt_tp]))
        return stock(*args, **kwargs, **groups)

    rng._set_random_seed = recording
    rng.seed_module(topology, module, SEED,
                    _options(te=True, inference=True, cuda_graph_impl="local"))
    other = next(m.name for m in layout.modules if m.name != module)
    try:
        rng.seed_module(topology, other, SEED, _options())
        wrong_module = None
    except ValueError as error:
        wrong_module = str(error)
    topology.destroy()
    return {"module": module, "draws": draws, "call": calls[0], "wrong_module": wrong_module,
            "expected_seed": rng.module_seed(layout, module, SEED)}


def test_streams_equal_exactly_where_stock_makes_them_equal():
    world_size = len(COORDS)
    results = run_in_processes(_seed_and_draw, world_size, args=(FLAGS,), timeout=150,
                               simulated=True)
    assert [r["module"] for r in results] == [COORDS[rank][0] for rank in range(world_size)]
    for dp_random_init, stream in itertools.product((False, True), STREAMS):
        for a, b in itertools.combinations(range(world_size), 2):
            same_draw = (results[a]["draws"][dp_random_init][stream]
                         == results[b]["draws"][dp_random_init][stream])
            same_seed = (stream_seed(stream, COORDS[a], dp_random_init)
                         == stream_seed(stream, COORDS[b], dp_random_init))
            assert same_draw == same_seed, (stream, dp_random_init, a, b)
    draws = [result["draws"] for result in results]
    plain, dp_init = False, True
    assert draws[2][plain]["torch"] == draws[3][plain]["torch"]  # DP replicas identical
    assert draws[2][plain]["cuda"] == draws[3][plain]["cuda"]
    assert draws[2][dp_init]["torch"] != draws[3][dp_init]["torch"]  # unless DP random init
    assert draws[2][plain]["torch"] != draws[4][plain]["torch"]  # PP stages distinct
    assert draws[0][plain]["cuda"] == draws[1][plain]["cuda"]  # TP ranks share the default...
    assert draws[0][plain]["model-parallel"] != draws[1][plain]["model-parallel"]  # ...not TP
    assert draws[2][plain]["expert-parallel"] != draws[3][plain]["expert-parallel"]  # EP ranks
    for stream in STREAMS:  # no stream of one module repeats in another
        vision = {str(draws[r][init][stream]) for r in (0, 1) for init in (plain, dp_init)}
        language = {str(draws[r][init][stream]) for r in (2, 3, 4, 5) for init in (plain, dp_init)}
        assert not vision & language, stream
    for result in results:
        args, kwargs, own_groups = result["call"]
        # Forwarded like stock initialize_megatron: seed, dp random init, TE and inference trackers,
        # use_cudagraphable_rng = cuda_graph_impl != "none", and the module's own groups.
        assert args == (result["expected_seed"], False, True, True)
        assert kwargs == {"use_cudagraphable_rng": True}
        assert own_groups == [True] * 5
        assert "seed the module this rank runs" in result["wrong_module"]


def test_module_seeds_are_offset_per_module():
    from megatron_plugins.layout import ModulePlacement, ParallelLayout
    from megatron_plugins.rng import MODULE_SEED_STRIDE, module_seed

    layout = ParallelLayout((
        ModulePlacement(name="vision", tp=1, pp=1, cp=1, dp=2, rank_offset=0, provider="vit"),
        ModulePlacement(name="audio", tp=1, pp=1, cp=1, dp=1, rank_offset=2, provider="audio"),
        ModulePlacement(name="language", tp=2, pp=2, cp=1, dp=1, rank_offset=3),
    ))
    assert module_seed(layout, "language", SEED) == SEED
    assert module_seed(layout, "vision", SEED) == SEED + MODULE_SEED_STRIDE
    assert module_seed(layout, "audio", SEED) == SEED + 2 * MODULE_SEED_STRIDE
    huge = ParallelLayout((ModulePlacement(name="language", tp=1, pp=1, cp=1, dp=10**6,
                                      rank_offset=0),))
    with pytest.raises(ValueError, match="too large for distinct per-module RNG streams"):
        module_seed(huge, "language", SEED)


def test_rng_checkpoint_keys_are_distinct_per_module():
    from megatron_plugins.rng import rng_state_key_prefix

    names = ["language", "vision", "audio", "vision2", "v"]
    keys = [f"{rng_state_key_prefix(name)}rng_state" for name in names]
    assert len(set(keys)) == len(names)
    assert all(key.startswith(f"{name}.") for key, name in zip(keys, names))
