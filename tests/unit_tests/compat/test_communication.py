"""Communication bridges (Gaps 9, 12, 13, 15, 18): canaries that the stock wheel still has each
gap, and the bridges' tests."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from megatron_plugins.compat import MegatronCompatError, communication
from tests.harness.multiprocess import run_in_processes
from tests.unit_tests.compat.wheel_source import source_digest


def test_gap9_canary_bridge_exchanges_shapes_on_every_transfer() -> None:
    """Gap 9: every bridge transfer asks for a shape handshake, and the multi-module schedule
    insists on variable_seq_lengths (so no static tensor_shape reaches the bridge)."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator

    for name in ("send_forward", "recv_forward", "send_backward", "recv_backward",
                 "send_forward_recv_backward", "send_backward_recv_forward"):
        assert "self._communicate_shapes(" in inspect.getsource(getattr(BridgeCommunicator, name))
    assert source_digest(BridgeCommunicator._communicate_shapes) == "522553b2bc0c597e"
    assert "config.variable_seq_lengths=True required for multi-module pipelines" in (
        inspect.getsource(schedules.forward_backward_pipelining_without_interleaving))


def _stand_in_bridge(role: str, exchanged: list) -> SimpleNamespace:
    """A cross-grid bridge between a 1-rank encoder grid (rank 0) and a 2-rank language grid
    (ranks 1, 2) as seen from this rank (0 sends, 1 receives), with stock's per-peer split and a
    shape exchange that records what it was asked to send or receive."""
    from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator

    peers = {"SENDER": ([1, 2], []), "RECEIVER": ([], [0]), "MEMBER": ([], [])}[role]
    rank = {"SENDER": 0, "RECEIVER": 1, "MEMBER": 2}[role]

    def stock(tensor_to_send_next=None, recv_next=False, recv_prev=False,
              tensor_to_send_prev=None):
        exchanged.append((tensor_to_send_next is not None, recv_next, recv_prev,
                          tensor_to_send_prev is not None))
        return ([(6, 8)] if recv_prev else []), ([(6, 8), (6, 8)] if recv_next else [])

    info = SimpleNamespace(role=SimpleNamespace(name=role), send_to_ranks=peers[0],
                           recv_from_ranks=peers[1])
    return SimpleNamespace(_communicate_shapes=stock, src_module_name="vision",
                           dest_module_name="language", current_rank=rank, comm_map={rank: info},
                           _as_per_peer_tensors=BridgeCommunicator._as_per_peer_tensors)


def test_gap9_a_bridge_exchanges_each_direction_once_and_refuses_new_shapes() -> None:
    activation = torch.zeros(6, 8)
    exchanged = []
    sender = _stand_in_bridge("SENDER", exchanged)
    communicator = SimpleNamespace(bridge_comms=[sender], rank_module_map={})
    communication.exchange_shapes_once(communicator)
    for _ in range(3):  # the encoder's steady state: send activations, receive their gradients
        assert sender._communicate_shapes(activation, recv_next=True) == ([], [(6, 8), (6, 8)])
    assert exchanged == [(True, True, False, False)] + [(False, False, False, False)] * 2
    with pytest.raises(MegatronCompatError, match="cross-grid vision->language .* changed shape"):
        sender._communicate_shapes(torch.zeros(7, 8))

    exchanged.clear()
    receiver = _stand_in_bridge("RECEIVER", exchanged)
    communication.exchange_shapes_once(SimpleNamespace(bridge_comms=[receiver],
                                                       rank_module_map={}))
    for _ in range(3):  # the language leader: receive activations, send their gradients
        assert receiver._communicate_shapes(recv_prev=True, tensor_to_send_prev=activation) == (
            [(6, 8)], [])
    assert exchanged == [(False, False, True, True)] + [(False, False, False, False)] * 2

    exchanged.clear()
    member = _stand_in_bridge("MEMBER", exchanged)
    communication.exchange_shapes_once(SimpleNamespace(bridge_comms=[member], rank_module_map={}))
    member._communicate_shapes(recv_prev=True)
    member._communicate_shapes(recv_prev=True)
    assert exchanged == [(False, False, True, False)] * 2  # not a leader: stock every time


def test_gap13_canary_stage_links_exchange_shapes_on_every_transfer() -> None:
    """Gap 13: with variable_seq_lengths (which the multi-module schedule insists on, Gap 9)
    every stage-to-stage transfer asks for a shape handshake."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    communicate = inspect.getsource(P2PCommunicator._communicate)
    assert "if config.variable_seq_lengths or config.mtp_standalone:" in communicate
    assert "self._communicate_shapes(" in communicate
    assert source_digest(P2PCommunicator._communicate_shapes) == "64129c790b8b6e3d"


def test_gap13_a_stage_link_exchanges_each_direction_once_and_refuses_new_shapes() -> None:
    exchanged = []

    def stock(send_next, send_prev, recv_prev, recv_next):
        exchanged.append((send_next is not None, send_prev is not None, recv_prev, recv_next))
        return ([4, 2, 8] if recv_prev else [0, 0, 0]), ([4, 2, 8] if recv_next else [0, 0, 0])

    p2p = SimpleNamespace(_communicate_shapes=stock)
    communication._static_stage_shapes(p2p, "language")
    activation = torch.zeros(4, 2, 8)
    for _ in range(3):  # a middle stage's steady state: send forward, receive backward, ...
        assert p2p._communicate_shapes(activation, None, False, True) == ([0, 0, 0], [4, 2, 8])
        assert p2p._communicate_shapes(None, activation, True, False) == ([4, 2, 8], [0, 0, 0])
    assert exchanged == [(True, False, False, True), (False, True, True, False)] + [
        (False, False, False, False)] * 4
    with pytest.raises(MegatronCompatError, match="changed shape"):
        p2p._communicate_shapes(torch.zeros(4, 3, 8), None, False, False)


def test_gap12_canary_bridge_broadcasts_after_every_transfer_in_its_grid_group():
    from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator

    calls = {name: inspect.getsource(getattr(BridgeCommunicator, name)).count("dist.broadcast(")
             for name in ("recv_forward", "recv_backward", "send_forward_recv_backward",
                          "send_backward_recv_forward")}
    assert all(count >= 4 for count in calls.values()), calls
    for name in calls:
        source = inspect.getsource(getattr(BridgeCommunicator, name))
        assert source.count("group=self.dest_grid_broadcast_pg") + source.count(
            "group=self.src_grid_broadcast_pg") == calls[name], name


def test_gap12_bridge_skips_only_broadcasts_in_one_member_groups(one_rank_world, monkeypatch):
    from megatron.core.pipeline_parallel import bridge_communicator

    monkeypatch.setattr(bridge_communicator, "dist", bridge_communicator.dist)
    issued = []
    monkeypatch.setattr(torch.distributed, "broadcast",
                        lambda tensor, src=None, group=None, async_op=False: issued.append(group))
    communication.skip_lone_broadcasts()
    lone = torch.distributed.new_group([0])
    bridge_communicator.dist.broadcast(torch.zeros(2), src=0, group=lone)
    assert issued == []
    bridge_communicator.dist.broadcast(torch.zeros(2), src=0, group=None)
    assert issued == [None]
    assert bridge_communicator.dist.all_reduce is torch.distributed.all_reduce


def test_gap15_canary_fan_in_gradients_split_equally_whatever_was_received() -> None:
    """Gap 15: a fan-in receiver concatenates what each replica sent, but a gradient (which
    carries no split sizes) is split into equal parts, and MimoModel refuses variable fan-in."""
    from megatron.core.models.mimo.model.base import MimoModel
    from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator

    assert "torch.cat(received_tensors_list" in inspect.getsource(BridgeCommunicator.recv_forward)
    bridge = SimpleNamespace(_batch_dim=0)
    gradient = torch.arange(8.0).view(8, 1)  # received as 6 rows from one replica, 2 from another
    parts = BridgeCommunicator._split_tensor_at_batch_dim(bridge, gradient, 2)
    assert [len(part) for part in parts] == [4, 4]
    assert "Fan-in with variable" in inspect.getsource(MimoModel._attach_modality_split_sizes)


def _fan_in_receiver(exchanged_sizes: list) -> SimpleNamespace:
    """A language leader receiving from two encoder replicas (ranks 0, 1) whose stock shape
    handshake reports the next of ``exchanged_sizes`` and whose receive returns their rows."""
    from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator

    def stock_shapes(tensor_to_send_next=None, recv_next=False, recv_prev=False,
                     tensor_to_send_prev=None):
        return ([(rows, 4) for rows in exchanged_sizes[0]] if recv_prev else []), []

    def receive():
        bridge._communicate_shapes(recv_prev=True)
        sizes = exchanged_sizes.pop(0)
        return torch.ones(sum(sizes), 4, requires_grad=True) * 1.0

    info = SimpleNamespace(role=SimpleNamespace(name="RECEIVER"), recv_from_ranks=[0, 1])
    bridge = SimpleNamespace(
        _communicate_shapes=stock_shapes, _batch_dim=0, current_rank=2, comm_map={2: info},
        src_module_name="vision", dest_module_name="language", recv_forward=receive,
        send_backward_recv_forward=receive,
        _split_tensor_at_batch_dim=lambda tensor, n: BridgeCommunicator._split_tensor_at_batch_dim(
            bridge, tensor, n))
    return bridge


def test_gap15_a_fan_in_gradient_is_split_as_its_activation_was_received() -> None:
    sizes = [[6, 2], [0, 3], [1, 1]]
    bridge = _fan_in_receiver(list(sizes))
    communication.split_fan_in_gradients_as_received(SimpleNamespace(bridge_comms=[bridge]))
    first = bridge.recv_forward()
    with torch.no_grad():  # an evaluation pass in between: no gradient, nothing left behind
        bridge.recv_forward()
    third = bridge.recv_forward()
    (first.sum() * 2).backward()
    assert [part.shape[0] for part in bridge._split_tensor_at_batch_dim(torch.zeros(8, 4), 2)] \
        == [6, 2]
    third.sum().backward()
    assert [part.shape[0] for part in bridge._split_tensor_at_batch_dim(torch.zeros(2, 4), 2)] \
        == [1, 1]
    with pytest.raises(MegatronCompatError, match="gradient of 5 rows split 2 ways matches no "
                                                  "received activation"):
        bridge._split_tensor_at_batch_dim(torch.zeros(5, 4), 2)


DENSE = ["tp", "cp", "dp", "pp"]


def test_gap18_canary_bridge_refuses_a_destination_grid_with_context_parallelism(monkeypatch):
    """Gap 18: a bridge asserts destination CP 1 before any collective, and neither backward send
    sums the CP ranks' gradients."""
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator

    monkeypatch.setenv("WORLD_SIZE", "3")
    encoder = HyperCommGrid([1, 1, 1, 1], DENSE, rank_offset=0)
    language = HyperCommGrid([1, 2, 1, 1], DENSE, rank_offset=1)
    with pytest.raises(AssertionError, match="Destination grid CP size must be 1, got 2"):
        BridgeCommunicator(encoder, language)
    for name in ("send_backward", "send_backward_recv_forward"):
        assert "reduce" not in inspect.getsource(getattr(BridgeCommunicator, name)), name


# (tp, cp, dp, pp, rank_offset) of language grids the bridge is built on.
FOLDED_SHAPES = [(1, 2, 1, 1, 1), (2, 2, 1, 1, 4), (1, 2, 2, 1, 2), (2, 2, 2, 2, 0),
                 (1, 4, 2, 3, 3), (3, 2, 1, 2, 1), (2, 3, 2, 1, 0)]


@pytest.mark.parametrize("tp, cp, dp, pp, offset", FOLDED_SHAPES)
def test_gap18_a_cp_folded_grid_routes_as_the_real_one(monkeypatch, tp, cp, dp, pp, offset):
    """Every rank sees the same replica leaders, own leader and first-stage broadcast rank sets
    on the folded grid as on the real one (no process group exists here, so folding made none)."""
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator

    monkeypatch.setenv("WORLD_SIZE", str(offset + tp * cp * dp * pp))
    real = HyperCommGrid([tp, cp, dp, pp], DENSE, rank_offset=offset)
    folded = communication._cp_folded(real)
    assert (folded.shape, folded.rank_offset, folded.size) == (
        [tp * cp, 1, dp, pp], offset, real.size)
    for rank in range(offset, offset + real.size):
        bridge = SimpleNamespace(current_rank=rank)
        assert BridgeCommunicator.get_leader_rank(bridge, folded, is_src=False) == \
            BridgeCommunicator.get_leader_rank(bridge, real, is_src=False)
    def broadcast_sets(grid):
        return {frozenset(ranks) for ranks in
                BridgeCommunicator.get_boundary_pp_stage_ranks(None, grid, is_src=False)}
    assert broadcast_sets(folded) == broadcast_sets(real)
    assert len(broadcast_sets(real)) == dp


def test_gap18_folding_refuses_a_grid_of_another_dim_order(monkeypatch):
    from megatron.core.hyper_comm_grid import HyperCommGrid

    monkeypatch.setenv("WORLD_SIZE", "4")
    grid = HyperCommGrid([2, 2, 1, 1], ["cp", "tp", "dp", "pp"])
    with pytest.raises(MegatronCompatError, match=r"dims \['cp', 'tp', 'dp', 'pp'\].*order "
                                                  r"\['tp', 'cp', 'dp', 'pp'\]"):
        communication._cp_folded(grid)


def test_gap18_only_the_leaders_cp_lane_sums_gradients_before_sending(monkeypatch):
    """Language grid tp=2, cp=2 on ranks 1-4 (leader 1): ranks 1 and 3 (tp 0) reduce onto rank 1
    before the stock send, also an empty gradient; ranks 2 and 4 and encoder rank 0 send as
    stock."""
    lanes = {1: (1, 3), 3: (1, 3), 2: (2, 4), 4: (2, 4)}
    monkeypatch.setattr(torch.distributed, "get_process_group_ranks", lambda group: list(group))
    calls = []
    monkeypatch.setattr(torch.distributed, "reduce", lambda tensor, dst, op, group: calls.append(
        ("reduce", dst, group, tensor.is_contiguous())))

    def bridge_on(rank):
        def stock(name):
            return lambda grad, *args: calls.append((name, tuple(grad.shape), args))
        language = rank in lanes
        return SimpleNamespace(
            current_rank=rank, dest_module_name="language", dest_local_leader_rank=1,
            dest_grid=SimpleNamespace(dim_names=DENSE, shape=[2, 2, 1, 1]),
            dest_grid_broadcast_ranks=[1, 3, 2, 4] if language else [],
            send_backward=stock("send_backward"),
            send_backward_recv_forward=stock("send_backward_recv_forward"))

    for rank in range(5):
        bridge = bridge_on(rank)
        communication.reduce_destination_cp_gradients(
            SimpleNamespace(bridge_comms=[bridge]), {"language": lanes[rank]} if rank else {})
        calls.clear()
        bridge.send_backward(torch.zeros(4, 3).t())
        bridge.send_backward_recv_forward(torch.zeros(0, 3), (5, 3))
        sends = [("send_backward", (3, 4), ()), ("send_backward_recv_forward", (0, 3), ((5, 3),))]
        if rank in (1, 3):
            assert calls == [("reduce", 1, (1, 3), True), sends[0],
                             ("reduce", 1, (1, 3), True), sends[1]], rank
        else:
            assert calls == sends, rank


def _destination_cp_rank(encoder_grids: list[tuple[int, int]], rows: dict) -> list[dict]:
    """On every rank of a 4-rank world, for each (tp, dp) of a vision grid on ranks 0-1 feeding a
    language grid with cp=2 on ranks 2-3, through our pipeline communicator: two microbatches
    (1F1B order); language CP rank c takes the gradient of row chunks (c, 3-c) of 4. Returns what
    each rank received."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    from megatron.core.model_parallel_config import ModelParallelConfig

    from megatron_plugins.parallel.layout import ModulePlacement, ParallelLayout
    from megatron_plugins.parallel.topology import build_topology, pipeline_communicator

    rank = torch.distributed.get_rank()
    reports = []
    for tp, dp in encoder_grids:
        layout = ParallelLayout((
            ModulePlacement(name="vision", provider="vit", tp=tp, pp=1, cp=1, dp=dp,
                            rank_offset=0),
            ModulePlacement(name="language", tp=1, pp=1, cp=2, dp=1, rank_offset=2)))
        topology = build_topology(layout)
        try:
            communicator = pipeline_communicator(
                topology, ModelParallelConfig(pipeline_dtype=torch.float32), static_shapes=False)
            sizes = rows[dp]
            if rank < 2:
                replica = rank if dp == 2 else 0
                out = [_activation(m, replica, sizes[m][replica]) for m in range(2)]
                communicator.send_forward({"vision": out[0]})
                first = communicator.send_forward_recv_backward({"vision": out[1]})["vision"]
                second = communicator.recv_backward()["vision"]
                reports.append({"grads": [first.tolist(), second.tolist()]})
            else:
                cp_rank = topology.module_pgs["language"].cp.rank()
                received = [communicator.recv_forward()["vision"]]
                grads = [_cp_gradient(received[0], 0, cp_rank)]
                received.append(communicator.send_backward_recv_forward(
                    {"vision": grads[0]})["vision"])
                grads.append(_cp_gradient(received[1], 1, cp_rank))
                communicator.send_backward({"vision": grads[1]})
                reports.append({"received": [x.tolist() for x in received]})
        finally:
            topology.destroy()
    return reports


HIDDEN = 3


def _activation(microbatch: int, replica: int, rows: int) -> torch.Tensor:
    """Distinct values per microbatch, encoder replica and element."""
    return torch.arange(rows * HIDDEN, dtype=torch.float32).view(rows, HIDDEN) + (
        100 * microbatch + 1000 * replica)


def _row_weights(microbatch: int, rows: int) -> torch.Tensor:
    """The full gradient of a microbatch's received rows: distinct, signed per chunk of 4."""
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0]).repeat_interleave(rows // 4)
    return signs[:, None] * (torch.arange(rows * HIDDEN, dtype=torch.float32).view(
        rows, HIDDEN) + 1 + 50 * microbatch)


def _cp_gradient(received: torch.Tensor, microbatch: int, cp_rank: int) -> torch.Tensor:
    """What CP rank ``cp_rank`` (of 2) backpropagates: the row weights of its chunks (cp_rank,
    3 - cp_rank) of 4, zero elsewhere (the Gap 15 hooks on ``received`` fire as in a run)."""
    rows = received.shape[0]
    chunk = torch.arange(rows) // (rows // 4)
    mine = ((chunk == cp_rank) | (chunk == 3 - cp_rank)).float()[:, None]
    loss = (received * _row_weights(microbatch, rows) * mine).sum()
    (grad,) = torch.autograd.grad(loss, received)
    return grad


@pytest.mark.multirank
def test_gap18_language_cp_ranks_receive_every_row_and_encoders_the_summed_gradient():
    """Mirrors upstream's test_cp_gradient_reconstruction through topology.pipeline_communicator:
    vision tp=2 (one replica) and vision dp=2 (fan-in of variable row counts, Gap 15 split) feed
    language cp=2. Both CP ranks receive the same full rows; every encoder rank gets exactly the
    sum of the complementary CP gradients for its own rows."""
    rows = {1: [[8], [8]], 2: [[5, 3], [2, 6]]}
    grids = [(2, 1), (1, 2)]
    per_rank = run_in_processes(_destination_cp_rank, 4, args=(grids, rows), timeout=120,
                                simulated=True)
    for index, (tp, dp) in enumerate(grids):
        for microbatch in range(2):
            sizes = rows[dp][microbatch]
            full = torch.cat([_activation(microbatch, replica, n)
                              for replica, n in enumerate(sizes)])
            for language_rank in (2, 3):
                received = per_rank[language_rank][index]["received"][microbatch]
                assert torch.equal(torch.tensor(received), full), (tp, dp, language_rank)
            weights = _row_weights(microbatch, sum(sizes))
            for encoder_rank in (0, 1):
                replica = encoder_rank if dp == 2 else 0
                start = sum(sizes[:replica])
                expected = weights[start:start + sizes[replica]]
                got = torch.tensor(per_rank[encoder_rank][index]["grads"][microbatch])
                assert torch.equal(got, expected), (tp, dp, microbatch, encoder_rank)
