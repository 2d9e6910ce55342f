"""Collectives in one MiMo training step, counted by wrapping torch.distributed (issue 15).

The benchmark's probe (benchmarks/collective_probe.py) records every outermost torch.distributed
call inside stock ``train_step`` on each rank: a 1-layer ViT on rank 0, the tiny GPT on rank 1,
4 microbatches per step, against stock ``pretrain_gpt`` of the same GPT on one rank. A new
world-wide synchronisation, a shape handshake per transfer or an extra per-module reduction
fails here.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from tests.harness.multiprocess import (
    REPO_ROOT,
    launch_preforked,
    run_script,
    start_simulation_server,
)

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import step_overhead  # noqa: E402

pytestmark = pytest.mark.multirank

ENCODERS = 1
MICROBATCHES = 4
WORLD_WIDE_TARGET = 2
"""The global token count, which also carries the rerun state machine's check (compat
Gap 11; gradients are divided by the count before the grad norm is taken, so it cannot join the
optimizer's reduction without changing results), and the MiMo optimizer's folded scalars."""

P2P = ("send", "recv", "batch_isend_irecv")


def _cross_grid_transfer(call: dict) -> bool:
    return call["kind"] in P2P


def preforked(script: Path, args: list[str], nproc: int, env: dict[str, str],
              timeout: float) -> None:
    """The benchmark's launcher with each rank forked from the simulation's preloaded server
    (what it counts is the point here, not torchrun's start-up)."""
    start_simulation_server()
    with tempfile.TemporaryDirectory(prefix="step-probe-") as folder:
        log = Path(folder) / "launch.log"
        code = launch_preforked(script, args, nproc, env=env, log=log, timeout=timeout)
        assert code == 0, f"{args[0]} run failed ({code}):\n{log.read_text()[-4000:]}"


def record(tmp_path: Path, **options: str) -> list[list[dict]]:
    """Every MiMo rank's steps after the warm-up step, recorded by the probe."""
    return step_overhead.record("mimo", 2, 1, str(tmp_path / "mimo"), timeout=240,
                                launch=preforked, **options)


@pytest.fixture(scope="module")
def smoke_round() -> dict:
    """One round of the benchmark's CI mode: the collectives below are its first steps'."""
    return step_overhead.measure_round(3, 1, 240, launch=preforked)


@pytest.fixture(scope="module")
def counts(smoke_round: dict) -> dict[str, list[dict]]:
    return {"stock": smoke_round["stock"][0]["collectives"],
            **{f"rank {r}": steps[0]["collectives"]
               for r, steps in enumerate(smoke_round["hetero"])}}


def test_world_wide_synchronisations(counts: dict[str, list[dict]]) -> None:
    assert sum(c["world"] for c in counts["stock"]) == 1
    for rank in ("rank 0", "rank 1"):
        world = [c for c in counts[rank] if c["world"]]
        assert len(world) <= WORLD_WIDE_TARGET, world
        assert all(c["kind"] == "all_reduce" and c["bytes"] <= 32 for c in world), world


def test_module_collectives_within_stock_plus_two_per_encoder(
        counts: dict[str, list[dict]]) -> None:
    stock = len(counts["stock"])
    for rank in ("rank 0", "rank 1"):
        own = [c for c in counts[rank] if not _cross_grid_transfer(c)]
        assert len(own) <= stock + 2 * ENCODERS, (len(own), stock)


def test_one_rank_grids_broadcast_nothing(counts: dict[str, list[dict]]) -> None:
    # Each grid is one rank: what its bridge leader receives needs no broadcast (Gap 12).
    for rank in ("rank 0", "rank 1"):
        assert [c for c in counts[rank] if c["kind"] == "broadcast"] == []


def test_no_shape_handshake_per_transfer(counts: dict[str, list[dict]]) -> None:
    # Static shapes: after the first step a transfer is the tensor itself (>= 2 KiB here); an
    # int64 shape message (<= 32 bytes) would be a handshake.
    for rank in ("rank 0", "rank 1"):
        p2p = [c for c in counts[rank] if _cross_grid_transfer(c)]
        assert len(p2p) == MICROBATCHES + 1, p2p
        assert all(c["bytes"] >= 2048 for c in p2p), p2p


def test_variable_items_add_one_small_shape_message_per_transfer(
        tmp_path: Path) -> None:
    # 0..2 images per sample: transfer sizes change from microbatch to microbatch, so each
    # cross-grid transfer (a send, a receive, or a send paired with a receive) is preceded by
    # one batched shape message of one or two int64 pairs (<= 32 bytes), and nothing else.
    ranks = record(tmp_path, items="0:2")
    for rank, steps in enumerate(ranks):
        for step in steps:
            p2p = [c for c in step["collectives"] if _cross_grid_transfer(c)]
            shapes, transfers = p2p[0::2], p2p[1::2]
            assert len(transfers) == MICROBATCHES + 1, (rank, p2p)
            assert all(c["kind"] == "batch_isend_irecv" and c["bytes"] <= 32 for c in shapes), (
                rank, p2p)


def test_pipeline_stages_exchange_shapes_only_on_the_first_step(
        tmp_path: Path) -> None:
    # Language pp=2 (ranks 1, 2): stage activations are [seq, micro-batch, hidden] every time, so
    # after the warm-up step no stage-to-stage (or cross-grid) message is a 24-byte shape (Gap 13).
    ranks = record(tmp_path, language_grid="pp=2")
    for rank, steps in enumerate(ranks):
        p2p = [c for c in steps[0]["collectives"] if _cross_grid_transfer(c)]
        assert p2p and all(c["bytes"] >= 2048 for c in p2p), (rank, p2p)
    stage_links = [c for c in ranks[1][0]["collectives"] if c["ranks"] == [1, 2]]
    assert len(stage_links) >= MICROBATCHES, stage_links


def test_benchmark_smoke_writes_every_figure(smoke_round: dict, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # The CI mode of the benchmark end to end: stock GPT, the encoder alone (its data, DDP,
    # forward + backward) and the MiMo step, each measured (the shared round: the counts above
    # are its); the ratio is computed from them.
    monkeypatch.setattr(step_overhead, "measure_round",
                        lambda steps, warmup, timeout: smoke_round if (steps, warmup) == (3, 1)
                        else pytest.fail(f"--smoke measured {steps} steps after {warmup}"))
    assert step_overhead.main(["--smoke", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "step_overhead.json").read_text())
    [measured] = report["rounds"]
    assert 0 < measured["encoder_data"] < measured["encoder_step"]
    alone = measured["language_step"] + measured["encoder_step"]
    assert measured["ratio"] == pytest.approx(measured["mimo_step"] / alone)
    assert measured["ratio_encoder_model_only"] == pytest.approx(
        measured["mimo_step"] / (alone - measured["encoder_data"]))
    assert set(report["collectives"]) == {"stock", "mimo rank 0", "mimo rank 1"}
    for parts in report["breakdown"].values():
        assert parts["forward"] > 0 and parts["backward"] > 0
        assert sum(v for k, v in parts.items() if k != "step") == pytest.approx(parts["step"])
    assert "Ratio (a), median of 1 rounds" in (tmp_path / "step_overhead.md").read_text()


def test_gloo_latency_benchmark_reports_every_row() -> None:
    # The transport figures docs/step-overhead.md quotes come from this script.
    run = run_script(REPO_ROOT / "benchmarks" / "gloo_latency.py", ["--tries", "2"], nproc=2,
                     env={"OMP_NUM_THREADS": "1"}, timeout=120)
    assert run.returncode == 0, run.output[-3000:]
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:]
            for line in run.output.splitlines() if line.startswith("| ") and "---" not in line}
    for name in ("round trip, 2 KiB", "all-reduce, 2 ranks, 4 floats",
                 "receive while the sender sleeps", "receive while the sender runs Python",
                 "receive while the sender runs torch"):
        median, maximum, _ = rows[name]
        assert 0 < float(median) <= float(maximum), (name, rows[name])
