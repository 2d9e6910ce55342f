"""Communication bridges (Gaps 9, 12, 13): canaries that the stock wheel still has each gap, and
the bridges' tests."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from megatron_plugins.compat import MegatronCompatError, communication
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
