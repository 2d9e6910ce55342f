"""A launch over two "nodes" trains like one node: two torchrun agents on this machine, started
by the Qwen3.5-VL recipe's per-node launcher (``torchrun_node.sh``, which its Slurm script runs
on every node), with nodes of unequal sizes as the recipe's 1 + 8 + 8 layout has them: the
encoder's rank alone on node 0, the language model's TP pair on node 1. The losses must equal,
exactly (same host, fp32), those of the same three ranks launched together on one machine
(forked from the simulation's preloaded server: the two agents are the launch under test)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.mimo_runs import TINY_MIMO
from tests.harness.multiprocess import REPO_ROOT, kill_session, run_preforked, start_session
from tests.harness.tensorboard_scalars import read_scalars

pytestmark = pytest.mark.multirank

NODE_LAUNCHER = REPO_ROOT / "examples" / "mimo" / "recipes" / "qwen3_5_vl" / "torchrun_node.sh"
SCRIPT = "examples/mimo/pretrain_mimo.py"
LAYOUT = ["--encoder", "vision=vit", "--grid", "vision:", "--grid", "language:tp=2"]
FLAGS = [*TINY_MIMO, *LAYOUT, "--train-iters", "6", "--eval-interval", "6"]
THREADS = {"OMP_NUM_THREADS": "1"}
"""torchrun sets this only where a node runs more than one rank: the 1-rank node would otherwise
compute its matmuls with every core, in another summation order (grad norms then differ in the
last bit)."""


def _free_port() -> int:
    """A port free now on localhost: the static rendezvous needs node 0's port before it starts."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _launch_nodes(node_sizes: str, argv: list[str], logs: Path, timeout: float) -> list[str]:
    """Start one ``torchrun_node.sh`` per node of ``node_sizes``; return each node's output
    (torchrun's agent logging at INFO: its rendezvous result names the node's global ranks)."""
    env = {**os.environ, "NODE_SIZES": node_sizes, "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "PYTHON": sys.executable, "LOGLEVEL": "INFO",
           "PYTHONUNBUFFERED": "1", **THREADS}
    nodes = []
    try:
        for node in range(len(node_sizes.split(","))):
            log = (logs / f"node{node}.log").open("w")
            nodes.append(start_session(["bash", str(NODE_LAUNCHER), SCRIPT, *argv], cwd=REPO_ROOT,
                                       env={**env, "NODE_RANK": str(node)}, stdout=log,
                                       stderr=subprocess.STDOUT))
        for node, (process, _) in enumerate(nodes):
            returncode = process.wait(timeout=timeout)
            output = (logs / f"node{node}.log").read_text()
            assert returncode == 0, f"node {node}:\n{output[-4000:]}"
    finally:
        for process, started in nodes:
            kill_session(process, started)
    return [(logs / f"node{node}.log").read_text() for node in range(len(nodes))]


@pytest.mark.timeout(400)
def test_two_torchrun_agents_with_unequal_nodes_train_as_one_torchrun(tmp_path):
    one = run_preforked(REPO_ROOT / SCRIPT, [*FLAGS, "--tensorboard-dir", str(tmp_path / "one")],
                        3, timeout=150, env=THREADS)
    assert one.returncode == 0, one.output[-4000:]
    outputs = _launch_nodes("1,2", [*FLAGS, "--tensorboard-dir", str(tmp_path / "two")],
                            tmp_path, timeout=150)
    # Static rendezvous: global ranks follow node ranks, whatever the nodes' sizes.
    assert "global_ranks=[0]\n" in outputs[0] and "group_rank=0\n" in outputs[0]
    assert "global_ranks=[1, 2]\n" in outputs[1] and "group_rank=1\n" in outputs[1]
    for tag in ("lm loss", "grad-norm"):
        single = read_scalars(tmp_path / "one", tag)
        assert sorted(single) == list(range(1, 7)), (tag, single)
        assert read_scalars(tmp_path / "two", tag) == single, tag
    losses = read_scalars(tmp_path / "one", "lm loss")
    assert losses[6] < losses[1], losses


def test_a_node_rank_outside_the_node_sizes_is_one_line():
    env = {**os.environ, "NODE_SIZES": "1,8,8", "NODE_RANK": "3", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}
    result = subprocess.run(["bash", str(NODE_LAUNCHER), SCRIPT], env=env, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "torchrun_node.sh: NODE_RANK 3 is not a node of NODE_SIZES=1,8,8 (3 nodes); give each "
        "node a rank from 0 to 2"]
