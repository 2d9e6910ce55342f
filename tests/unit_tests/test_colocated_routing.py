"""Routing of colocated encoder rows: every language first-stage rank gets exactly its replica's
rows and every encoder rank exactly its rows' gradients, summed over the language CP lanes, on
layouts megatron-core's ColocatedBridgeCommunicator refuses (language PP or CP > 1, variable row
counts), including one where its pairing by each rank's own DP index would give a rank the wrong
samples; each rank receives no byte it did not need.

The pure tests play each plan's messages between all ranks in Python with row labels; one 4-rank
launch checks the same with tensors, against a single-process reference and against the wheel's
communicator where it is right.
"""

from __future__ import annotations

import re

import pytest
import torch

from megatron_plugins.parallel.routing import RoutingPlan, RoutingSummary, summarize
from megatron_plugins.data.addressing import RankSlice
from megatron_plugins.parallel.layout import LayoutError, ModulePlacement, ParallelLayout
from tests.harness.multiprocess import run_in_processes


def _encoder(tp: int = 1, dp: int = 1, pp: int = 1, rank_offset: int = 0) -> ModulePlacement:
    return ModulePlacement(name="vision", provider="vit", tp=tp, pp=pp, cp=1, dp=dp,
                           rank_offset=rank_offset)


def _language(tp: int = 1, cp: int = 1, dp: int = 1, pp: int = 1) -> ModulePlacement:
    return ModulePlacement(name="language", tp=tp, pp=pp, cp=cp, dp=dp, rank_offset=0)


# The acceptance layouts on 4 ranks (micro batch size 2), and language CP with PP.
LAYOUTS = {
    "vision-dp4_language-tp2-dp2": (_encoder(dp=4), _language(tp=2, dp=2)),
    "vision-tp2-dp2_language-tp2-pp2": (_encoder(tp=2, dp=2), _language(tp=2, pp=2)),
    "vision-tp2-dp2_language-dp2-pp2": (_encoder(tp=2, dp=2), _language(dp=2, pp=2)),
    "vision-tp2-dp2_language-cp2-pp2": (_encoder(tp=2, dp=2), _language(cp=2, pp=2)),
}
MICRO_BATCH = 2
# Two microbatches of variable row counts, text-only (zero-row) samples included.
VARIABLE = {2: [[3, 0, 5, 2], [0, 4, 1, 6]], 1: [[3, 0], [5, 1]]}
"""Row counts per microbatch and position, by language dp (global batch = 2 x dp)."""


def _rows(language: ModulePlacement, variable: bool = True) -> list[list[int]]:
    return VARIABLE[language.dp] if variable else [[4] * (MICRO_BATCH * language.dp)] * 2


def _plans(encoder, language, rows) -> dict[int, RoutingPlan]:
    return {rank: RoutingPlan.build(encoder, language, rank, MICRO_BATCH, rows)
            for rank in language.ranks}


def _computed_labels(encoder, language, rank, rows) -> list[tuple[int, int, int]]:
    """(microbatch, position, row) of the rows ``rank`` computes, from the data layer's slice."""
    twin = ParallelLayout((encoder, ModulePlacement(
        name="language", tp=language.tp, pp=language.pp, cp=language.cp, dp=language.dp,
        rank_offset=encoder.size)))
    positions = RankSlice.of(twin, "vision", encoder.coordinates(rank)["dp"], MICRO_BATCH).positions
    return [(k, p, i) for k in range(len(rows)) for p in positions for i in range(rows[k][p])]


def _consumed_labels(language, rank, rows) -> list[tuple[int, int, int]]:
    """The rows the language model merges on ``rank``: its replica's, on pipeline stage 0."""
    coords = language.coordinates(rank)
    if coords["pp"] != 0:
        return []
    first = coords["dp"] * MICRO_BATCH
    return [(k, p, i) for k in range(len(rows)) for p in range(first, first + MICRO_BATCH)
            for i in range(rows[k][p])]


def _play(plans: dict[int, RoutingPlan], direction: str, sources: dict[int, list],
          target_rows: dict[int, int]) -> dict[int, list[list]]:
    """Every rank's target buffer after ``direction``'s messages and local copies, each row the
    list of what landed on it; a send without its matching receive fails."""
    targets = {rank: [[] for _ in range(target_rows[rank])] for rank in plans}
    outbox = {(rank, message.peer): [sources[rank][i] for start, stop in message.spans
                                     for i in range(start, stop)]
              for rank, plan in plans.items() for message in getattr(plan, direction).sends}
    for rank, plan in plans.items():
        exchange = getattr(plan, direction)
        for (start, stop), (target, _) in exchange.local:
            for offset in range(stop - start):
                targets[rank][target + offset].append(sources[rank][start + offset])
        for message in exchange.receives:
            payload = outbox.pop((message.peer, rank))
            assert len(payload) == message.rows, (direction, message.peer, rank)
            rows = [i for start, stop in message.spans for i in range(start, stop)]
            for i, value in zip(rows, payload):
                targets[rank][i].append(value)
    assert not outbox, f"{direction}: sends nobody receives: {sorted(outbox)}"
    return targets


def _check_routing(encoder, language, rows) -> dict[int, RoutingPlan]:
    plans = _plans(encoder, language, rows)
    computed = {r: _computed_labels(encoder, language, r, rows) for r in plans}
    consumed = {r: _consumed_labels(language, r, rows) for r in plans}
    received = _play(plans, "forward", computed, {r: plans[r].consumed_rows for r in plans})
    for rank in plans:
        assert received[rank] == [[label] for label in consumed[rank]], rank
    # Each stage-0 rank backpropagates its CP lane's gradient of every row it consumed.
    lanes = {r: [(*label, language.coordinates(r)["cp"]) for label in consumed[r]]
             for r in plans}
    gradients = _play(plans, "backward", lanes, {r: plans[r].computed_rows for r in plans})
    for rank in plans:
        expected = [[(*label, cp) for cp in range(language.cp)] for label in computed[rank]]
        assert [sorted(row) for row in gradients[rank]] == expected, rank
        assert plans[rank].bytes_moved(8, torch.bfloat16) == plans[rank].bytes_minimum(
            8, torch.bfloat16), rank
    return plans


@pytest.mark.parametrize("variable", [True, False], ids=["variable-rows", "uniform-rows"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_every_rank_gets_its_replicas_rows_and_back_their_summed_gradients(name, variable):
    encoder, language = LAYOUTS[name]
    _check_routing(encoder, language, _rows(language, variable))


def test_a_rank_whose_encoder_replica_is_not_its_language_replica_receives_the_right_rows():
    """Rank 1 embeds positions 0-1 (encoder replica 0) but consumes 2-3 (language replica 1):
    rank 2 sends them, rank 1's own rows go only back to rank 0's gradient."""
    encoder, language = LAYOUTS["vision-tp2-dp2_language-dp2-pp2"]
    plans = _check_routing(encoder, language, [[3, 0, 5, 2]])
    assert [(m.peer, m.rows) for m in plans[1].forward.receives] == [(2, 7)]
    assert plans[1].forward.local == () and plans[1].forward.sends == ()
    assert [(m.peer, m.rows) for m in plans[1].backward.receives] == [(0, 3)]
    assert [(m.peer, m.rows) for m in plans[1].backward.sends] == [(2, 7), (3, 7)]
    assert plans[0].forward.local == (((0, 3), (0, 3)),)


def test_later_stage_ranks_send_their_rows_to_stage_0_and_consume_none():
    encoder, language = LAYOUTS["vision-tp2-dp2_language-tp2-pp2"]
    plans = _check_routing(encoder, language, [[3, 2], [5, 1]])
    # Encoder replica 1 (ranks 2-3, language stage 1) embeds position 1: 2 + 1 rows.
    for rank in (2, 3):
        assert plans[rank].consumed_rows == 0 and plans[rank].forward.receives == ()
        assert [(m.peer, m.rows) for m in plans[rank].forward.sends] == [(rank - 2, 3)]
    # Both TP lanes of stage 0 receive every row of replica 1, each from its own sender.
    assert [(m.peer, m.rows) for m in plans[0].forward.receives] == [(2, 3)]
    assert [(m.peer, m.rows) for m in plans[1].forward.receives] == [(3, 3)]


def test_language_cp_lanes_each_send_their_gradient_and_the_encoder_sums_them():
    encoder, language = LAYOUTS["vision-tp2-dp2_language-cp2-pp2"]
    plans = _check_routing(encoder, language, [[3, 2], [5, 1]])
    # Rank 0 (CP lane 0) embeds position 0 (3 + 5 rows): it holds its lane's gradient and
    # receives lane 1's from rank 1; rank 2 (position 1, off stage 0) receives both lanes'.
    assert [(m.peer, m.rows) for m in plans[0].backward.receives] == [(1, 8)]
    assert [(m.peer, m.rows) for m in plans[2].backward.receives] == [(0, 3), (1, 3)]
    assert plans[2].minimum_received_rows == 6


def test_moved_bytes_count_only_remote_rows():
    encoder, language = LAYOUTS["vision-dp4_language-tp2-dp2"]
    plans = _check_routing(encoder, language, [[3, 0, 5, 2]])
    # Rank 0 consumes positions 0-1 and computed 0: it receives position 1's 0 rows (nothing);
    # rank 1 computed 1 and receives position 0's 3 rows, and sends its 0 rows' gradient nowhere.
    assert plans[0].bytes_moved(4, torch.float32) == 0
    assert plans[1].bytes_moved(4, torch.float32) == 3 * 4 * 4
    assert sum(p.bytes_moved(1, torch.bfloat16) for p in plans.values()) == 2 * (3 + 5 + 2)


def test_all_samples_without_rows_exchange_nothing():
    encoder, language = LAYOUTS["vision-tp2-dp2_language-dp2-pp2"]
    for plan in _plans(encoder, language, [[0, 0, 0, 0]]).values():
        for exchange in (plan.forward, plan.backward):
            assert exchange.sends == exchange.receives == exchange.local == ()


def test_microbatch_spans_index_each_buffer():
    encoder, language = LAYOUTS["vision-dp4_language-tp2-dp2"]
    plan = RoutingPlan.build(encoder, language, 3, MICRO_BATCH, VARIABLE[2])
    # Rank 3: encoder replica 3 computes position 3 (2 then 6 rows); language replica 1, 2-3.
    assert plan.computed_microbatches == ((0, 2), (2, 8))
    assert plan.consumed_microbatches == ((0, 7), (7, 14))


@pytest.mark.parametrize("encoder, message", [
    (_encoder(dp=2), "--grid vision: colocated with --grid language (ranks 0-3) but covers "
                     "ranks 0-1; choose tp x dp = 4 for vision"),
    (_encoder(dp=4, rank_offset=4), "covers ranks 4-7"),
    (_encoder(dp=2, pp=2), "--grid vision: pp=2: a colocated encoder must have pp=1"),
])
def test_encoders_not_on_the_language_ranks_are_refused(encoder, message):
    with pytest.raises(LayoutError, match=re.escape(message)):
        RoutingPlan.build(encoder, _language(tp=2, dp=2), 0, MICRO_BATCH, [[1, 1, 1, 1]])


def test_a_micro_batch_the_encoder_replicas_cannot_split_is_refused():
    with pytest.raises(LayoutError, match="--micro-batch-size 1 x --grid language: dp=2 = 2 "
                                          "samples per microbatch cannot be split"):
        RoutingPlan.build(_encoder(dp=4), _language(tp=2, dp=2), 0, 1, [[1, 1]])


def test_a_missing_or_negative_row_count_names_the_position():
    encoder, language = LAYOUTS["vision-dp4_language-tp2-dp2"]
    with pytest.raises(ValueError, match="microbatch 0, position 1"):
        RoutingPlan.build(encoder, language, 0, MICRO_BATCH, [{0: 3}])
    with pytest.raises(ValueError, match="row count -1 of microbatch 0, position 0"):
        RoutingPlan.build(encoder, language, 0, MICRO_BATCH, [[-1, 0, 0, 0]])


def test_a_rank_reads_only_the_counts_of_its_own_slices():
    """Rank 0 of the dp4/tp2xdp2 layout computes position 0 and consumes 0-1: counts for them
    are enough, and give the plan the full table gives."""
    encoder, language = LAYOUTS["vision-dp4_language-tp2-dp2"]
    full = RoutingPlan.build(encoder, language, 0, MICRO_BATCH, VARIABLE[2])
    known = [{p: counts[p] for p in (0, 1)} for counts in VARIABLE[2]]
    assert RoutingPlan.build(encoder, language, 0, MICRO_BATCH, known) == full


@pytest.mark.parametrize("name, summary", [
    # Every rank embeds one of the two samples its replica consumes, and holds its gradient.
    ("vision-dp4_language-tp2-dp2", RoutingSummary(0.5, 1.0, 0.0)),
    # Stage 0 (ranks 0-1) computes sample 0 and receives sample 1 from stage 1 (ranks 2-3),
    # which takes back its gradient.
    ("vision-tp2-dp2_language-tp2-pp2", RoutingSummary(0.5, 1.0, 1.0)),
    # Rank 0 holds its replica's samples, rank 1 receives both of its own; backward rank 1
    # takes samples 0-1 from rank 0, ranks 2-3 samples 2-3 from rank 1.
    ("vision-tp2-dp2_language-dp2-pp2", RoutingSummary(0.5, 0.5, 1.5)),
])
def test_the_summary_counts_routed_rows_per_sample(name, summary):
    assert summarize(*LAYOUTS[name], MICRO_BATCH) == summary


# --- One 4-rank launch: tensors through gloo, against a reference and the wheel ---------------

WIDTH = 3
ORACLE_LAYOUTS = {
    # Fan-in and fan-out where every rank's encoder replica feeds its own language replica.
    "vision-dp4_language-tp2-dp2": (_encoder(dp=4), _language(tp=2, dp=2)),
    "vision-tp2-dp2_language-dp4": (_encoder(tp=2, dp=2), _language(dp=4)),
}


def _row_values(k: int, p: int, count: int) -> torch.Tensor:
    """Distinct rows of (microbatch, position)."""
    base = torch.arange(count * WIDTH, dtype=torch.float32).view(count, WIDTH)
    return base + 1000 * k + 100 * p


def _gradient_values(k: int, p: int, count: int, cp: int) -> torch.Tensor:
    """CP lane ``cp``'s gradient of (microbatch, position)'s rows (the same on every TP rank)."""
    return -(_row_values(k, p, count) + 0.5) * (cp + 1) ** 2


def _stack(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, WIDTH)


def _encoder_positions(encoder: ModulePlacement, rank: int, rows: list[list[int]]) -> range:
    batch = len(rows[0]) // encoder.dp
    replica = encoder.coordinates(rank)["dp"]
    return range(replica * batch, (replica + 1) * batch)


def _computed(encoder, rank, rows, microbatches=None, values=_row_values) -> torch.Tensor:
    """What ``rank`` computes (``values``: rows, or a gradient of them), microbatch by microbatch."""
    microbatches = range(len(rows)) if microbatches is None else microbatches
    return _stack([values(k, p, rows[k][p]) for k in microbatches
                   for p in _encoder_positions(encoder, rank, rows)])


def _consumed(language, rank, rows, values, microbatches=None) -> torch.Tensor:
    """``values(k, p, count, cp)`` of the rows ``rank`` consumes (none off stage 0)."""
    coords = language.coordinates(rank)
    if coords["pp"] != 0:
        return torch.zeros(0, WIDTH)
    first = coords["dp"] * MICRO_BATCH
    microbatches = range(len(rows)) if microbatches is None else microbatches
    return _stack([values(k, p, rows[k][p], coords["cp"]) for k in microbatches
                   for p in range(first, first + MICRO_BATCH)])


def _routing_rank(cases: list[tuple[ModulePlacement, ModulePlacement, list[list[int]]]],
                  oracles: list[tuple[ModulePlacement, ModulePlacement, list[list[int]]]]) -> dict:
    """On each rank: route_forward / route_backward of every case (counting batch_isend_irecv
    calls), and for every oracle case our routing and the wheel's communicator, microbatch by
    microbatch."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    import torch.distributed as dist
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.models.mimo.comm.colocated_communicator import ColocatedBridgeCommunicator

    from megatron_plugins.step.colocated import route_backward, route_forward

    rank = dist.get_rank()
    calls = []
    stock = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: calls.append(len(ops)) or stock(ops)
    report = {"cases": [], "oracles": []}
    for encoder, language, rows in cases:
        plan = RoutingPlan.build(encoder, language, rank, MICRO_BATCH, rows)
        before = len(calls)
        leaf = route_forward(_computed(encoder, rank, rows), plan)
        grads = _consumed(language, rank, rows, _gradient_values)
        report["cases"].append({"leaf": leaf.tolist(), "grad": route_backward(grads, plan).tolist(),
                                "calls": len(calls) - before})
    for encoder, language, rows in oracles:
        grids = [HyperCommGrid([m.tp, 1, m.dp, 1], ["tp", "cp", "dp", "pp"], rank_offset=0)
                 for m in (encoder, language)]
        wheel = ColocatedBridgeCommunicator(grids[0], grids[1], "vision", "language",
                                            dim_mapping={"b": 0, "h": 1})
        plan = RoutingPlan.build(encoder, language, rank, MICRO_BATCH, rows)
        ours = {"leaf": route_forward(_computed(encoder, rank, rows), plan),
                "grad": route_backward(_consumed(language, rank, rows, _gradient_values), plan)}
        theirs = {"leaf": [], "grad": []}
        for k in range(len(rows)):
            rows_in = _computed(encoder, rank, rows, [k]).requires_grad_()
            out = wheel.communicate(rows_in)
            out.backward(_consumed(language, rank, rows, _gradient_values, [k]))
            theirs["leaf"].append(out.detach())
            theirs["grad"].append(rows_in.grad)
        wheel.destroy()
        report["oracles"].append({
            "ours": {key: value.tolist() for key, value in ours.items()},
            "theirs": {key: torch.cat(value).tolist() for key, value in theirs.items()}})
    dist.batch_isend_irecv = stock
    return report


CASES = [(name, variable) for name in LAYOUTS for variable in (True, False)]


@pytest.fixture(scope="module")
def routed() -> list[dict]:
    """Every case and oracle on 4 gloo ranks, in one launch (CI time)."""
    cases = [(*LAYOUTS[name], _rows(LAYOUTS[name][1], variable)) for name, variable in CASES]
    oracles = [(*ORACLE_LAYOUTS[name], _rows(ORACLE_LAYOUTS[name][1], False))
               for name in ORACLE_LAYOUTS]
    return run_in_processes(_routing_rank, 4, args=(cases, oracles), timeout=120,
                            simulated=True)


@pytest.mark.parametrize("case", range(len(CASES)),
                         ids=[f"{name}-{'variable' if v else 'uniform'}" for name, v in CASES])
@pytest.mark.multirank
def test_routed_tensors_equal_the_single_process_reference(routed, case):
    name, variable = CASES[case]
    encoder, language = LAYOUTS[name]
    rows = _rows(language, variable)
    for rank, report in enumerate(routed):
        result = report["cases"][case]
        expected_leaf = _consumed(language, rank, rows, lambda k, p, n, cp: _row_values(k, p, n))
        # The reference gradient: every CP lane's gradient of the rank's rows, summed.
        expected_grad = sum(
            _computed(encoder, rank, rows,
                      values=lambda k, p, n, cp=cp: _gradient_values(k, p, n, cp))
            for cp in range(language.cp))
        assert torch.equal(torch.tensor(result["leaf"]).view(-1, WIDTH), expected_leaf), rank
        assert torch.equal(torch.tensor(result["grad"]).view(-1, WIDTH), expected_grad), rank
        # One batch_isend_irecv per direction in which the rank has peers, none otherwise.
        plan = RoutingPlan.build(encoder, language, rank, MICRO_BATCH, rows)
        directions = [plan.forward, plan.backward]
        assert result["calls"] == sum(bool(e.sends or e.receives) for e in directions), rank


@pytest.mark.parametrize("name", ORACLE_LAYOUTS)
@pytest.mark.multirank
def test_routing_equals_the_wheels_colocated_communicator_where_it_is_right(routed, name):
    index = list(ORACLE_LAYOUTS).index(name)
    for rank, report in enumerate(routed):
        oracle = report["oracles"][index]
        assert oracle["ours"] == oracle["theirs"], rank
