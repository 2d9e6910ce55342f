"""Live gloo worlds: every group of every module has exactly the members plain arithmetic predicts.

Expected memberships are computed here from hand-written module sizes (ranks count up with tp
fastest, then cp, dp, pp; experts: expt_tp, ep, expt_dp, pp) and pinned by literal rank lists.
"""

from __future__ import annotations

import argparse
import itertools
import re
import shlex

import pytest

from megatron_plugins.launch.plan import main as plan_main
from tests.harness.multiprocess import run_in_processes

pytestmark = pytest.mark.multirank

DENSE = ("tp", "cp", "dp", "pp")
EXPERT = ("expt_tp", "ep", "expt_dp", "pp")

# ProcessGroupCollection field -> (grid, dims the group spans).
EVERY_MODULE = {
    "tp": (DENSE, {"tp"}),
    "cp": (DENSE, {"cp"}),
    "pp": (DENSE, {"pp"}),
    "dp": (DENSE, {"dp"}),
    "dp_cp": (DENSE, {"dp", "cp"}),
    "dp_cp_gtp_remat": (DENSE, {"dp", "cp"}),
    "mp": (DENSE, {"tp", "pp"}),
    "intra_dist_opt": (DENSE, {"tp", "cp", "dp", "pp"}),
    "ep": (EXPERT, {"ep"}),
    "expt_tp": (EXPERT, {"expt_tp"}),
    "expt_dp": (EXPERT, {"expt_dp"}),
    "tp_ep_pp": (EXPERT, {"expt_tp", "ep", "pp"}),
}
LANGUAGE_ONLY = {
    "tp_cp": (DENSE, {"tp", "cp"}),
    "tp_dp_cp": (DENSE, {"tp", "dp", "cp"}),
    "tp_ep": (EXPERT, {"expt_tp", "ep"}),
}
FIELDS = [*EVERY_MODULE, *LANGUAGE_ONLY, "embd", "pos_embd"]
GRID_GROUPS_PER_MODULE = 11  # distinct groups behind EVERY_MODULE (dp_cp_gtp_remat is dp_cp)


def sizes(tp=1, cp=1, dp=1, pp=1, ep=1, etp=1):
    return {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "ep": ep, "expt_tp": etp,
            "expt_dp": tp * cp * dp // (ep * etp)}


# world size -> layouts run one after another in the same processes:
# (flags, [(module, first rank, sizes)], literal {field: {rank: members}} checks).
LAYOUTS = {
    2: [(
        "--encoder vision=vit --grid vision: --grid language:",
        [("vision", 0, sizes()), ("language", 1, sizes())],
        {"tp": {0: [0], 1: [1]}, "embd": {1: [1], 0: None}, "pos_embd": {1: [1]}},
    )],
    4: [(
        "--encoder vision=vit --grid vision:dp=2 --grid language:tp=2",
        [("vision", 0, sizes(dp=2)), ("language", 2, sizes(tp=2))],
        {"dp": {0: [0, 1], 2: [2]}, "tp": {0: [0], 2: [2, 3]}, "mp": {3: [2, 3]},
         "expt_dp": {0: [0, 1], 2: [2, 3]}, "embd": {2: [2], 3: [3]}},
    ), (
        "--encoder vit=vit --encoder audio=audio --grid vit: --grid audio: --grid language:dp=2",
        [("vit", 0, sizes()), ("audio", 1, sizes()), ("language", 2, sizes(dp=2))],
        {"dp": {0: [0], 1: [1], 2: [2, 3]}, "intra_dist_opt": {3: [2, 3]}, "tp_dp_cp": {2: [2, 3]}},
    )],
    5: [(
        "--encoder vision=vit --grid vision: --grid language:tp=2,dp=2,ep=2 --num-experts 4",
        [("vision", 0, sizes()), ("language", 1, sizes(tp=2, dp=2, ep=2))],
        {"tp": {1: [1, 2], 4: [3, 4]}, "dp": {1: [1, 3], 2: [2, 4]}, "ep": {1: [1, 2], 4: [3, 4]},
         "expt_dp": {1: [1, 3], 4: [2, 4]}, "tp_ep": {2: [1, 2]}, "tp_ep_pp": {3: [3, 4]},
         "intra_dist_opt": {1: [1, 2, 3, 4]}},
    )],
    6: [(
        "--encoder vision=vit --grid vision:tp=2 --grid language:pp=2,dp=2",
        [("vision", 0, sizes(tp=2)), ("language", 2, sizes(pp=2, dp=2))],
        {"tp": {0: [0, 1], 2: [2]}, "pp": {2: [2, 4], 3: [3, 5], 4: [2, 4]},
         "dp": {2: [2, 3], 5: [4, 5]}, "mp": {5: [3, 5]}, "expt_dp": {0: [0, 1], 4: [4, 5]},
         "embd": {2: [2, 4], 3: [3, 5], 4: [2, 4], 5: [3, 5]},
         "pos_embd": {2: [2], 3: [3], 4: None, 5: None}},
    )],
}


def _parse(command: str) -> argparse.Namespace:
    from megatron_plugins.parallel.flags import add_layout_args

    parser = add_layout_args(argparse.ArgumentParser(allow_abbrev=False))
    parser.add_argument("--num-experts", type=int)
    return parser.parse_args(shlex.split(command))


def _build_and_inspect(commands: list[str]) -> dict:
    """On every rank: build each layout's topology, record what Megatron's readers see, destroy."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()  # as every CPU run is; the groups are the same on GPUs
    import torch.distributed as dist
    from megatron.core.models.mimo.config.role import ModuleLayout, RankRole
    from megatron.core.models.mimo.optimizer import _get_pg_collection_for_optimizer

    from megatron_plugins.parallel.layout import LayoutError, ModulePlacement, ParallelLayout
    from megatron_plugins.parallel.flags import layout_from_args
    from megatron_plugins.parallel.topology import build_topology

    registry = dist.distributed_c10d._world.pg_map
    too_big = ModulePlacement(name="language", tp=1, pp=1, cp=1, dp=dist.get_world_size() + 1,
                         rank_offset=0)
    try:
        build_topology(ParallelLayout((too_big,)))
        wrong_world = None
    except LayoutError as error:
        wrong_world = (str(error), len(registry))
    reports = []
    for command in commands:
        layout = layout_from_args(_parse(command), dist.get_world_size())
        before = len(registry)
        topology = build_topology(layout)
        built = len(registry)
        [(name, pgc)] = topology.module_pgs.items()
        carrier = topology.pg_collection
        optimizer_pgc = _get_pg_collection_for_optimizer(topology.grids[name])
        role = RankRole.build([m.name for m in layout.encoders], topology.grids)
        report = {
            "module": name,
            "active": topology.active_modules,
            "carrier": (sorted(carrier.keys()), carrier.language_model_module_name),
            "groups": {
                field: None if getattr(pgc, field) is None
                else dist.get_process_group_ranks(getattr(pgc, field))
                for field in FIELDS
            },
            "coords": {dim: getattr(pgc, dim).rank() for dim in ("tp", "cp", "dp", "pp", "ep",
                                                                  "expt_tp", "expt_dp")},
            "optimizer_uses_same_groups": all(
                getattr(optimizer_pgc, field) is getattr(pgc, field)
                for field in ("dp", "dp_cp", "tp", "pp", "mp", "tp_ep_pp", "expt_dp",
                              "intra_dist_opt")
            ),
            "role": (role.mode is ModuleLayout.NON_COLOCATED, sorted(role.modules)),
            "grids": {n: (g.shape, g.dim_names, g.rank_offset) for n, g in topology.grids.items()},
            "groups_created": built - before,
        }
        topology.destroy()
        report["groups_left"] = len(registry) - before
        topology.destroy()
        report["groups_left_after_second_destroy"] = len(registry) - before
        reports.append(report)
    return {"wrong_world": wrong_world, "reports": reports}


def expected_members(module_sizes: dict[str, int], first: int, order: tuple[str, ...],
                     spans: set[str], rank: int) -> list[int]:
    """Ranks of the module that share ``rank``'s coordinate on every dim outside ``spans``."""
    coords = {}
    ranks = itertools.count(first)
    for outer_to_inner in itertools.product(*(range(module_sizes[d]) for d in reversed(order))):
        coords[next(ranks)] = dict(zip(reversed(order), outer_to_inner))
    mine = coords[rank]
    return [r for r, c in coords.items() if all(c[d] == mine[d] for d in order if d not in spans)]


def expected_report_groups(modules: list, rank: int) -> dict[str, list[int] | None]:
    """Every field's members on ``rank`` (None where the rank has no such group)."""
    for name, first, module_sizes in modules:
        size = module_sizes["tp"] * module_sizes["cp"] * module_sizes["dp"] * module_sizes["pp"]
        if first <= rank < first + size:
            break
    fields = dict(EVERY_MODULE, **(LANGUAGE_ONLY if name == "language" else {}))
    groups: dict[str, list[int] | None] = {
        field: expected_members(module_sizes, first, order, spans, rank)
        for field, (order, spans) in fields.items()
    }
    groups.update({field: None for field in LANGUAGE_ONLY if field not in fields})
    chain = expected_members(module_sizes, first, DENSE, {"pp"}, rank)
    is_language = name == "language"
    embedding = [chain[0], chain[-1]] if len(chain) > 1 else [chain[0]]
    groups["embd"] = embedding if is_language and rank in embedding else None
    groups["pos_embd"] = [chain[0]] if is_language and rank == chain[0] else None
    return groups


def _plan(command: str, world_size: int, capsys) -> tuple[dict[int, dict], dict[str, dict]]:
    """Rank coordinates and module group sizes as ``mimo-plan`` prints them."""
    assert plan_main(shlex.split(command) + ["--nproc-per-node", str(world_size)]) == 0
    output = capsys.readouterr().out
    ranks, modules = {}, {}
    for line in output.splitlines():
        pairs = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line.split(":", 1)[-1])}
        if match := re.match(r"rank (\d+) node \d+ (\w+):", line):
            ranks[int(match[1])] = dict(pairs, module=match[2])
        elif match := re.match(r"module (\w+) ", line):
            modules[match[1]] = pairs
    return ranks, modules


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_groups_match_independent_arithmetic(world_size, capsys):
    layouts = LAYOUTS[world_size]
    per_rank = run_in_processes(_build_and_inspect, world_size,
                                args=([flags for flags, _, _ in layouts],), timeout=150,
                                simulated=True)
    for rank, result in enumerate(per_rank):
        message, groups = result["wrong_world"]
        assert f"WORLD_SIZE / --nproc-per-node is {world_size} but" in message
        assert groups == 1  # only the default group: nothing built for a mismatched layout
    for index, (flags, modules, literal) in enumerate(layouts):
        plan_ranks, plan_modules = _plan(flags, world_size, capsys)
        language_first = dict((name, first) for name, first, _ in modules)["language"]
        for rank, result in enumerate(per_rank):
            report = result["reports"][index]
            name = report["module"]
            assert report["groups"] == expected_report_groups(modules, rank), (flags, rank)
            for field, members in literal.items():
                if rank in members:
                    assert report["groups"][field] == members[rank], (flags, field, rank)
            in_language = rank >= language_first
            assert report["active"] == (name,)
            assert report["carrier"] == ([name], "language" if in_language else None)
            assert report["role"] == (True, [name])
            assert report["optimizer_uses_same_groups"]
            assert sorted(report["grids"]) == sorted(n for n, _, _ in modules)
            for module, first, module_sizes in modules:
                shape, dims, offset = report["grids"][module]
                assert (dims, offset) == (list(DENSE), first)
                assert shape == [module_sizes[d] for d in DENSE]
            embedding = sum(report["groups"][f] is not None for f in ("embd", "pos_embd"))
            extra = len(LANGUAGE_ONLY) + embedding if in_language else 0
            assert report["groups_created"] == GRID_GROUPS_PER_MODULE + extra
            assert report["groups_left"] == 0
            assert report["groups_left_after_second_destroy"] == 0
            # mimo-plan's arithmetic agrees with the live groups.
            assert plan_ranks[rank] == dict(report["coords"], module=name)
            plan_sizes = plan_modules[name]
            assert plan_sizes == {d: len(report["groups"][d]) for d in plan_sizes}
