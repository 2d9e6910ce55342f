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

from tests.harness.multiprocess import run_in_processes

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
    from megatron_plugins.parallel.flags import add_layout_args

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

    import megatron_plugins.parallel.rng as rng
    from megatron_plugins.parallel.flags import layout_from_args
    from megatron_plugins.parallel.topology import build_topology

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


@pytest.mark.multirank
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
    from megatron_plugins.parallel.layout import ModulePlacement, ParallelLayout
    from megatron_plugins.parallel.rng import MODULE_SEED_STRIDE, module_seed

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
    from megatron_plugins.parallel.rng import rng_state_key_prefix

    names = ["language", "vision", "audio", "vision2", "v"]
    keys = [f"{rng_state_key_prefix(name)}rng_state" for name in names]
    assert len(set(keys)) == len(names)
    assert all(key.startswith(f"{name}.") for key, name in zip(keys, names))



# ------------------------------------------------------------------------------------------------
# ModuleRng: two modules on one process draw exactly what each draws on a process of its own.

# The reference: each module on ranks of its own (vision on 0-1, language on 2-3), both TP 2, so
# the tensor-parallel stream differs per rank.
DISJOINT_FLAGS = "--encoder vision=vit --grid vision:tp=2 --grid language:tp=2"
HOSTED = ("vision", "language")


class _OneRankGroup:
    """A group of size 1 for in-process tests (``torch.distributed`` may be uninitialized)."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


def _hosting_topology(layout, groups) -> SimpleNamespace:
    """What a colocated rank's topology gives ModuleRng: both modules' groups on one process."""
    return SimpleNamespace(layout=layout, active_modules=list(HOSTED),
                           module_pgs={name: groups for name in HOSTED})


def _dropout() -> list:
    """Dropout on whatever "CUDA" stream is live (the default one outside a tracker fork)."""
    import torch

    return torch.nn.functional.dropout(torch.ones(4, 8, device="cuda"), 0.5).tolist()


def _fork_dropout() -> list:
    """Dropout on the tensor-parallel stream, as Megatron's attention dropout draws it."""
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        return _dropout()


def _draw(cuda: bool = True) -> dict:
    """One step's draws: Python, NumPy, torch and (with a device) default-stream dropout."""
    import random

    import numpy as np
    import torch

    values = {"python": random.random(), "numpy": float(np.random.random()),
              "torch": torch.rand(3).tolist()}
    if cuda:
        values["dropout"] = _dropout()
    return values


def _build(tp_group) -> list:
    """A tiny TP-sharded layer; Megatron draws its weight under the model-parallel fork."""
    import torch
    from megatron.core import ModelParallelConfig, tensor_parallel

    layer = tensor_parallel.ColumnParallelLinear(
        8, 6, config=ModelParallelConfig(tensor_model_parallel_size=2), bias=False,
        init_method=lambda weight: torch.nn.init.normal_(weight, std=0.5), tp_group=tp_group)
    return layer.weight.tolist()


def _draws_in_contexts(module_rng) -> dict:
    draws = {}
    for name in HOSTED:
        with module_rng.enter(name):
            draws[name] = {**_draw(), "fork": _fork_dropout()}
    return draws


def _colocated_streams(command: str) -> dict:
    """Each rank: its own module alone (seed_module), then both modules on it (ModuleRng)."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    import pickle

    import torch.distributed as dist
    from megatron.core import tensor_parallel

    import megatron_plugins.parallel.rng as rng
    from megatron_plugins.parallel.flags import layout_from_args
    from megatron_plugins.parallel.topology import build_topology

    rank = dist.get_rank()
    topology = build_topology(layout_from_args(_parse(command), dist.get_world_size()))
    [module] = topology.active_modules
    rng.seed_module(topology, module, SEED, _options())
    own = {"weight": _build(topology.module_pgs[module].tp), "d1": _draw(), "d2": _draw()}
    with tensor_parallel.get_cuda_rng_tracker().fork():
        own["fork"] = [_dropout(), _dropout(), _dropout()]
    own["d3"] = _draw()

    # Both modules on this rank, each with a TP group over the same two ranks as its own module.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    groups = SimpleNamespace(tp=pairs[rank // 2], pp=singles[rank], dp=singles[rank],
                             ep=singles[rank], expt_tp=singles[rank])
    hosting = _hosting_topology(topology.layout, groups)
    module_rng = rng.ModuleRng.seed(hosting, SEED, _options())
    live_after_seeding = module_rng.live
    both = {name: {} for name in HOSTED}
    vision, language = both["vision"], both["language"]
    with module_rng.enter("vision"):
        vision["weight"] = _build(groups.tp)
    with module_rng.enter("language"):  # the live module: a no-op context
        language["weight"] = _build(groups.tp)
    with module_rng.enter("vision"):
        vision["d1"] = _draw()
    language["d1"] = _draw()
    with module_rng.enter("vision"):
        vision["d2"] = _draw()
    language["d2"] = _draw()
    with tensor_parallel.get_cuda_rng_tracker().fork():  # language's TP stream around vision's
        language["fork"] = [_dropout()]
        with module_rng.enter("vision"):
            vision["fork"] = [_fork_dropout(), _fork_dropout(), _fork_dropout()]
            with module_rng.enter("language"):  # back into the fork it left
                language["fork"].append(_dropout())
        language["fork"].append(_dropout())
    with module_rng.enter("vision"):
        vision["d3"] = _draw()
    language["d3"] = _draw()

    saved = pickle.dumps(module_rng.state_dict())
    next_draws = _draws_in_contexts(module_rng)
    module_rng.load_state_dict(pickle.loads(saved))
    replayed = _draws_in_contexts(module_rng)
    resumed_rng = rng.ModuleRng.seed(hosting, SEED, _options())
    resumed_rng.load_state_dict(pickle.loads(saved))
    topology.destroy()
    return {"module": module, "own": own, "both": both, "live_after_seeding": live_after_seeding,
            "next": next_draws, "replayed": replayed, "resumed": _draws_in_contexts(resumed_rng)}


@pytest.fixture(scope="module")
def colocated_results() -> list:
    return run_in_processes(_colocated_streams, 4, args=(DISJOINT_FLAGS,), timeout=150,
                            simulated=True)


@pytest.mark.multirank
def test_two_modules_on_one_process_draw_their_own_streams(colocated_results):
    # Rank r hosts both modules at TP rank r % 2; ranks 0-1 ran vision alone, ranks 2-3 language.
    for rank, result in enumerate(colocated_results):
        assert result["live_after_seeding"] == "language"
        for name, alone_rank in (("vision", rank % 2), ("language", 2 + rank % 2)):
            alone = colocated_results[alone_rank]
            assert alone["module"] == name
            # Weights (tracker fork at construction), default and TP-stream dropout masks, Python,
            # NumPy and torch draws: interleaved and nested contexts continue each stream exactly.
            assert result["both"][name] == alone["own"], (rank, name)
    own = [result["own"] for result in colocated_results]
    assert own[0]["weight"] != own[2]["weight"]  # the property is not vacuous: modules differ,
    assert own[0]["weight"] != own[1]["weight"]  # and so do TP ranks
    assert own[0]["d1"]["dropout"] == own[1]["d1"]["dropout"]  # TP ranks share the default


@pytest.mark.multirank
def test_module_rng_state_dict_round_trips(colocated_results):
    for result in colocated_results:
        assert result["replayed"] == result["next"]  # loaded into the same object
        assert result["resumed"] == result["next"]  # loaded into a freshly seeded one (resume)
        assert result["next"]["vision"] != result["next"]["language"]


def _in_process_topology() -> SimpleNamespace:
    from megatron_plugins.parallel.layout import ModulePlacement, ParallelLayout

    layout = ParallelLayout((
        ModulePlacement(name="vision", tp=1, pp=1, cp=1, dp=1, rank_offset=0, provider="vit"),
        ModulePlacement(name="language", tp=1, pp=1, cp=1, dp=1, rank_offset=1),
    ))
    group = _OneRankGroup()
    return _hosting_topology(layout, SimpleNamespace(tp=group, pp=group, dp=group, ep=group,
                                                     expt_tp=group))


def _cuda_present() -> bool:
    import torch

    return torch.cuda.device_count() > 0


def test_one_module_rng_seeds_exactly_like_seed_module():
    from megatron_plugins.parallel.rng import ModuleRng, seed_module

    topology, cuda = _in_process_topology(), _cuda_present()
    for name in HOSTED:
        seed_module(topology, name, SEED, _options())
        alone = [_draw(cuda), _draw(cuda)]
        module_rng = ModuleRng.seed(topology, SEED, _options(), modules=[name])
        with module_rng.enter(name):
            first = _draw(cuda)
        assert [first, _draw(cuda)] == alone


def test_contexts_continue_each_stream_across_entries_in_process():
    from megatron_plugins.parallel.rng import ModuleRng, seed_module

    topology, cuda = _in_process_topology(), _cuda_present()
    alone = {}
    for name in HOSTED:
        seed_module(topology, name, SEED, _options())
        alone[name] = [_draw(cuda) for _ in range(3)]
    assert alone["vision"] != alone["language"]
    module_rng = ModuleRng.seed(topology, SEED, _options())
    assert module_rng.modules == HOSTED and module_rng.live == "language"
    both = {name: [] for name in HOSTED}
    with module_rng.enter("vision"):  # A, B, A, with B nested inside A and A inside B
        both["vision"].append(_draw(cuda))
        with module_rng.enter("language"):
            both["language"].append(_draw(cuda))
            with module_rng.enter("vision"):
                both["vision"].append(_draw(cuda))
            both["language"].append(_draw(cuda))
        assert module_rng.live == "vision"
    assert module_rng.live == "language"
    both["language"].append(_draw(cuda))
    with module_rng.enter("vision"):
        both["vision"].append(_draw(cuda))
    assert both == alone


def test_module_rng_state_dict_pickles_and_loads_per_module():
    import pickle

    from megatron_plugins.parallel.rng import ModuleRng

    topology, cuda = _in_process_topology(), _cuda_present()
    module_rng = ModuleRng.seed(topology, SEED, _options())
    with module_rng.enter("vision"):
        _draw(cuda)
    saved = pickle.loads(pickle.dumps(module_rng.state_dict()))
    assert set(saved) == set(HOSTED)
    expected = {}
    for name in HOSTED:
        with module_rng.enter(name):
            expected[name] = _draw(cuda)
    # A resumed rank: stock restores the live (language) streams itself, the rest from the dict.
    resumed = ModuleRng.seed(topology, SEED, _options())
    resumed.load_state_dict({"vision": saved["vision"]})
    with resumed.enter("vision"):
        assert _draw(cuda) == expected["vision"]
    resumed.load_state_dict({"language": saved["language"]})
    assert _draw(cuda) == expected["language"]


def test_module_rng_replays_a_module_from_the_state_it_saved_inside_its_context():
    """--colocated-encoder-recompute: phase 3 restores an encoder's streams of a microbatch's
    start and draws what phase 1 drew; the resident module's streams go on untouched."""
    from megatron_plugins.parallel.rng import ModuleRng

    topology, cuda = _in_process_topology(), _cuda_present()
    module_rng = ModuleRng.seed(topology, SEED, _options())
    with module_rng.enter("vision"):
        start = module_rng.state_dict(["vision"])
        first = [_draw(cuda) for _ in range(2)]
    with module_rng.enter("vision"):
        module_rng.load_state_dict(start)
        assert [_draw(cuda) for _ in range(2)] == first
    assert set(start) == {"vision"}
    language = _draw(cuda)
    ModuleRng.seed(topology, SEED, _options())
    assert _draw(cuda) == language


def test_module_rng_refuses_modules_the_rank_does_not_host():
    from megatron_plugins.parallel.rng import ModuleRng

    topology = _in_process_topology()
    with pytest.raises(ValueError, match="distinct module names"):
        ModuleRng.seed(topology, SEED, _options(), modules=["vision", "vision"])
    module_rng = ModuleRng.seed(topology, SEED, _options())
    message = "no RNG streams for module audio: this rank hosts vision, language"
    with pytest.raises(ValueError, match=message), module_rng.enter("audio"):
        pass
    with pytest.raises(ValueError, match=message):
        module_rng.load_state_dict({"audio": module_rng.state_dict()["vision"]})
    assert module_rng.live == "language"
