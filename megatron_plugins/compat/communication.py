"""Bridges over MiMo's pipeline communication, applied by our pipeline communicator's builder in
MiMo processes only: dropping needless handshakes and broadcasts (Gaps 9, 12 and 13), splitting
fan-in gradients of variable-size encoder outputs (Gap 15) and letting the language grid use
context parallelism behind a bridge (Gap 18).

Shared context of Gaps 9 and 13: the multi-module schedule refuses pipelines without
``variable_seq_lengths`` (schedules.py:2182), so every transfer is preceded by a shape handshake,
though MiMo transfer shapes are fixed by ``--seq-length``, the micro-batch sizes and, when every
sample holds the same items, each encoder's ``tokens_per_item``.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from megatron_plugins.compat import MegatronCompatError, record

__all__ = [
    "exchange_shapes_once", "fold_destination_cp", "reduce_destination_cp_gradients",
    "skip_lone_broadcasts", "split_fan_in_gradients_as_received",
]


class _ShapeMemo:
    """The shapes one side of a link exchanged on its first transfer of each kind."""

    def __init__(self, link: str) -> None:
        self.link = link
        self.known: dict[str, Any] = {}

    def sent_before(self, kind: str, shapes: Any) -> bool:
        """True when ``kind`` was exchanged before (and ``shapes`` match it); remembers them."""
        if kind not in self.known:
            self.known[kind] = shapes
            return False
        if shapes != self.known[kind]:
            raise MegatronCompatError(
                f"{self.link} transfer changed shape {self.known[kind]} -> {shapes}; the layout "
                "declared static shapes")
        return True

    def new(self, kind: str, receiving: bool) -> bool:
        """Whether a receive of ``kind`` still needs the peer's shape."""
        return receiving and kind not in self.known


def exchange_shapes_once(communicator: Any, bridges: bool = True) -> None:
    """Make each pipeline-stage link (Gap 13) of this rank's modules and, with ``bridges``, each
    cross-grid bridge (Gap 9) exchange each direction's shapes once.

    Stage links always carry ``[seq-length, micro-batch, hidden]``; bridges keep one shape when
    every sample fills the same positions per encoder. A later transfer of another shape raises
    instead of hanging.
    """
    for bridge in communicator.bridge_comms if bridges else ():
        _static_bridge_shapes(bridge)
    for name, info in communicator.rank_module_map.items():
        if info.pp_size > 1:
            _static_stage_shapes(info.p2p_communicator, name)


def _static_bridge_shapes(bridge: Any) -> None:
    """Gap 9 (cross-grid shape handshake): ``BridgeCommunicator`` exchanges tensor shapes before
    every activation and gradient transfer (``_communicate_shapes``, core/pipeline_parallel/
    bridge_communicator.py:864), whatever ``tensor_shape`` the schedule passes. Bridge: ``bridge``
    exchanges each direction's shapes on its first transfer and reuses them; a transfer of
    another shape raises."""
    stock = bridge._communicate_shapes
    memo = _ShapeMemo(f"cross-grid {bridge.src_module_name}->{bridge.dest_module_name}")

    def communicate_shapes(tensor_to_send_next=None, recv_next=False, recv_prev=False,
                           tensor_to_send_prev=None):
        info = bridge.comm_map.get(bridge.current_rank)
        if not info or info.role.name == "MEMBER":
            return stock(tensor_to_send_next, recv_next, recv_prev, tensor_to_send_prev)

        def sent_before(kind: str, tensors: Any, peers: list[int]) -> bool:
            return memo.sent_before(kind, [tuple(t.shape) for t in
                                           bridge._as_per_peer_tensors(tensors, len(peers))])

        if tensor_to_send_next is not None and sent_before("fwd", tensor_to_send_next,
                                                           info.send_to_ranks):
            tensor_to_send_next = None
        if tensor_to_send_prev is not None and sent_before("grad", tensor_to_send_prev,
                                                           info.recv_from_ranks):
            tensor_to_send_prev = None
        new_next, new_prev = memo.new("grad", recv_next), memo.new("fwd", recv_prev)
        forward, grads = stock(tensor_to_send_next, new_next, new_prev, tensor_to_send_prev)
        if new_next:
            memo.known["grad"] = grads
        if new_prev:
            memo.known["fwd"] = forward
        return (memo.known["fwd"] if recv_prev else [], memo.known["grad"] if recv_next else [])

    bridge._communicate_shapes = communicate_shapes
    record("9")


def _static_stage_shapes(p2p: Any, module: str) -> None:
    """Gap 13 (pipeline-stage shape handshake): with ``variable_seq_lengths`` each language
    pipeline stage's ``P2PCommunicator`` exchanges shapes before every stage-to-stage transfer
    (``_communicate_shapes``, core/pipeline_parallel/p2p_communication.py:186, called from
    ``_communicate`` at :322), though MiMo stage activations are always ``[seq, micro-batch,
    hidden]``. Bridge: ``p2p`` exchanges each direction's shapes on its first transfer and reuses
    them; a transfer of another shape raises."""
    stock = p2p._communicate_shapes
    memo = _ShapeMemo(f"{module} pipeline-stage")

    def communicate_shapes(tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        if tensor_send_next is not None and memo.sent_before("fwd out", list(tensor_send_next.shape)):
            tensor_send_next = None
        if tensor_send_prev is not None and memo.sent_before("grad out", list(tensor_send_prev.shape)):
            tensor_send_prev = None
        new_prev, new_next = memo.new("fwd in", recv_prev), memo.new("grad in", recv_next)
        prev_shape, next_shape = stock(tensor_send_next, tensor_send_prev, new_prev, new_next)
        if new_prev:
            memo.known["fwd in"] = prev_shape
        if new_next:
            memo.known["grad in"] = next_shape
        return (memo.known["fwd in"] if recv_prev else [0, 0, 0],
                memo.known["grad in"] if recv_next else [0, 0, 0])

    p2p._communicate_shapes = communicate_shapes
    record("13")


class _LoneBroadcastSkipping:
    """``torch.distributed`` as the bridge module sees it: a broadcast in a one-member group,
    the identity, is skipped; everything else is torch's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)

    @staticmethod
    def broadcast(tensor: torch.Tensor, src: int | None = None, group: Any = None,
                  async_op: bool = False, **kwargs: Any) -> Any:
        if group is not None and not async_op and torch.distributed.get_world_size(group) == 1:
            return None
        return torch.distributed.broadcast(tensor, src=src, group=group, async_op=async_op,
                                           **kwargs)


def skip_lone_broadcasts() -> None:
    """Apply Gap 12 to every ``BridgeCommunicator``. Idempotent; MiMo processes only.

    Gap 12 (bridge broadcasts inside one-rank grids): after every cross-grid transfer the
    receiving grid's leader broadcasts the shape and then the tensor to the rest of its grid
    (bridge_communicator.py:436-446 and the same pair in each transfer method), also when that
    grid is the leader alone, where a broadcast is the identity. Bridge: the
    ``torch.distributed`` the bridge module sees skips broadcasts in one-member groups; every
    other call is torch's.
    """
    from megatron.core.pipeline_parallel import bridge_communicator

    if not isinstance(bridge_communicator.dist, _LoneBroadcastSkipping):
        bridge_communicator.dist = _LoneBroadcastSkipping()
    record("12")


def split_fan_in_gradients_as_received(communicator: Any) -> None:
    """Apply Gap 15 to each cross-grid bridge where this rank receives from several encoder
    replicas (encoder DP larger than language DP).

    Gap 15 (fan-in of variable-size outputs): a language leader receiving from several encoder
    replicas concatenates what each sent (bridge_communicator.py:431), but splits the gradient it
    returns into equal parts (``_split_tensor_at_batch_dim``, :1036: no split sizes ride on a
    gradient), so replicas whose samples hold different token counts get gradient rows of other
    samples; ``MimoModel`` asserts rather than support it (``_attach_modality_split_sizes``,
    core/models/mimo/model/base.py). Bridge: each activation the leader receives carries a
    gradient hook noting the rows each replica sent (from the stock shape handshake, which
    variable runs keep); when the schedule sends that gradient back, it is split by them.
    Forward-only passes (evaluation) compute no gradient, so they leave nothing behind.
    """
    for bridge in communicator.bridge_comms:
        info = bridge.comm_map.get(bridge.current_rank)
        if info and info.role.name == "RECEIVER" and len(info.recv_from_ranks) > 1:
            _split_as_received(bridge, len(info.recv_from_ranks))


def _split_as_received(bridge: Any, sources: int) -> None:
    link = f"cross-grid {bridge.src_module_name}->{bridge.dest_module_name}"
    stock_shapes = bridge._communicate_shapes
    received: list[list[int]] = []
    """Rows per replica of the activation being received (set by its shape handshake)."""
    gradients: deque[list[int]] = deque()
    """Rows per replica of each gradient computed and not yet sent."""

    def communicate_shapes(tensor_to_send_next=None, recv_next=False, recv_prev=False,
                           tensor_to_send_prev=None):
        forward, grads = stock_shapes(tensor_to_send_next, recv_next, recv_prev,
                                      tensor_to_send_prev)
        if recv_prev:
            received[:] = [[int(shape[bridge._batch_dim]) for shape in forward]]
        return forward, grads

    def noting_sizes(receive: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
            activation = receive(*args, **kwargs)
            sizes = received.pop()
            if activation.requires_grad:  # not under evaluation's no_grad
                activation.register_hook(lambda grad: gradients.append(sizes))
            return activation
        return wrapped

    def split(tensor: torch.Tensor, num_splits: int) -> list[torch.Tensor]:
        rows = tensor.shape[bridge._batch_dim]
        sizes = gradients.popleft() if gradients else ([0] * sources if rows == 0 else None)
        if num_splits != sources or sizes is None or sum(sizes) != rows:
            raise MegatronCompatError(
                f"{link}: a gradient of {rows} rows split {num_splits} ways matches no received "
                f"activation (pending: {list(gradients)}); the fan-in bridge expects one "
                "gradient per received activation, in order")
        return [part.contiguous() for part in torch.split(tensor, sizes, dim=bridge._batch_dim)]

    bridge._communicate_shapes = communicate_shapes
    bridge.recv_forward = noting_sizes(bridge.recv_forward)
    bridge.send_backward_recv_forward = noting_sizes(bridge.send_backward_recv_forward)
    bridge._split_tensor_at_batch_dim = split
    record("15")


_FOLDABLE_DIMS = ["tp", "cp", "dp", "pp"]
"""The grid dim order CP folding relies on: tp fastest, then cp."""


def _cp_folded(grid: Any) -> Any:
    """``grid``'s ranks as a grid without CP: ``[tp*cp, 1, dp, pp]``, same offset and backend.

    A new ``HyperCommGrid`` creates no process group, and with tp varying fastest and cp next
    every (dp, pp) block of ``tp*cp`` consecutive ranks stays one block, so DP replicas, their
    first ranks and each PP stage's ranks are the same rank sets.
    """
    from megatron.core.hyper_comm_grid import HyperCommGrid

    if list(grid.dim_names) != _FOLDABLE_DIMS:
        raise MegatronCompatError(
            f"cannot fold context parallelism out of a grid with dims {list(grid.dim_names)}; "
            f"the cross-grid bridge needs them in the order {_FOLDABLE_DIMS}")
    tp, cp, dp, pp = grid.shape
    return HyperCommGrid([tp * cp, 1, dp, pp], list(_FOLDABLE_DIMS),
                         rank_offset=grid.rank_offset, backend=grid.backend)


def _has_cp(grid: Any) -> bool:
    return "cp" in grid.dim_names and grid.shape[grid.dim_names.index("cp")] > 1


@contextlib.contextmanager
def fold_destination_cp() -> Iterator[None]:
    """While active, the bridges ``MultiModulePipelineCommunicator`` builds accept a destination
    grid with CP (Gap 18, construction half; :func:`reduce_destination_cp_gradients` is the
    backward half, and must follow).

    Each bridge is built on :func:`_cp_folded` of its destination grid, which passes the stock
    assert with the routing the real grid gives (stock reads no CP coordinate but the assert),
    and then holds the real grid again. Source grids are left as they are (their CP stays
    refused). Restores the stock constructor on exit.
    """
    from megatron.core.pipeline_parallel import multimodule_communicator

    stock = multimodule_communicator.BridgeCommunicator

    def bridge(src_grid: Any, dest_grid: Any, **kwargs: Any) -> Any:
        if not _has_cp(dest_grid):
            return stock(src_grid=src_grid, dest_grid=dest_grid, **kwargs)
        built = stock(src_grid=src_grid, dest_grid=_cp_folded(dest_grid), **kwargs)
        built.dest_grid = dest_grid
        record("18")
        return built

    multimodule_communicator.BridgeCommunicator = bridge
    try:
        yield
    finally:
        multimodule_communicator.BridgeCommunicator = stock


def reduce_destination_cp_gradients(communicator: Any, cp_groups: Mapping[str, Any]) -> None:
    """Apply Gap 18 to each cross-grid bridge whose destination grid has CP, on the ranks of the
    destination leader's CP group. ``cp_groups``: this rank's CP group per module it is in.

    Gap 18 (destination context parallelism): a bridge refuses a destination grid with CP > 1
    (``assert`` in ``BridgeCommunicator.__init__``, core/pipeline_parallel/
    bridge_communicator.py:112-116), though forward already gives every tp x cp rank of the
    first stage all rows (``get_boundary_pp_stage_ranks``, :248-284, broadcast at :436-446), and
    in backward ``send_backward`` (:481) and ``send_backward_recv_forward`` (:734) send only the
    replica leader's gradient, which under CP holds only the rows of its own sequence chunks.
    Bridge (upstream commit 95271c1902): built on a CP-folded view (:func:`fold_destination_cp`),
    and on the ranks of the leader's CP group (the tp-0 lane of the first stage; every TP rank of
    a CP rank holds the same gradient) both methods first sum the gradient onto the leader with
    one ``reduce`` over that group, also for empty tensors, so every rank issues it each time.
    """
    for bridge in communicator.bridge_comms:
        group = cp_groups.get(bridge.dest_module_name)
        leader = bridge.dest_local_leader_rank
        if (group is None or not _has_cp(bridge.dest_grid)
                or bridge.current_rank not in bridge.dest_grid_broadcast_ranks
                or leader not in torch.distributed.get_process_group_ranks(group)):
            continue
        bridge.send_backward = _reducing_first(bridge.send_backward, leader, group)
        bridge.send_backward_recv_forward = _reducing_first(bridge.send_backward_recv_forward,
                                                            leader, group)


def _reducing_first(send: Any, leader: int, group: Any) -> Any:
    def wrapped(grad_tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        grad_tensor = grad_tensor.contiguous()
        torch.distributed.reduce(grad_tensor, dst=leader, op=torch.distributed.ReduceOp.SUM,
                                 group=group)
        return send(grad_tensor, *args, **kwargs)
    return wrapped
