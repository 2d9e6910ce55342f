"""Throughput in the log, the step timeline and the profile of real runs (issue 39 items 2, 3).

Two measured runs of the tiny model (vision on rank 0, language on rank 1, six steps logged at
1, 2, 4 and 6) serve every test: the plain ViT with a timeline and a profile, and the same layout
with an encoder that sleeps in every forward, with a timeline.
"""

from __future__ import annotations

import json
import re

import pytest
from PIL import Image

from megatron_plugins.parallel.layout import LANGUAGE, ModulePlacement, ParallelLayout
from megatron_plugins.performance.picture import picture_size
from tests.fixtures.slow_encoder import SLEEP_SECONDS
from tests.harness.multiprocess import REPO_ROOT, run_preforked
from tests.harness.tensorboard_scalars import read_scalars
from tests.harness.throughput_runs import MEASURED, measured_run

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(1800)]

GRIDS = ("--grid", "vision:", "--grid", "language:")
PLAIN = ("--encoder", "vision=vit", *GRIDS, "--mimo-timeline", "{run}/timeline",
         "--mimo-profile", "{run}/profile.json")
SLOW = ("--encoder", "vision=tests.fixtures.slow_encoder:SlowViT", *GRIDS,
        "--mimo-timeline", "{run}/timeline")
PEAK = 1e-3
COLOCATED = ("--encoder", "vision=vit", "--grid", "vision:dp=2@language", "--grid",
             "language:dp=2", "--mimo-timeline", "{run}/timeline", "--peak-tflops", str(PEAK))
LAYOUT = ParallelLayout((
    ModulePlacement(name="vision", tp=1, pp=1, cp=1, dp=1, rank_offset=0, provider="vit"),
    ModulePlacement(name=LANGUAGE, tp=1, pp=1, cp=1, dp=1, rank_offset=1)))
COLOCATED_LAYOUT = ParallelLayout((
    ModulePlacement(name="vision", tp=1, pp=1, cp=1, dp=2, rank_offset=0, provider="vit",
                    host=LANGUAGE),
    ModulePlacement(name=LANGUAGE, tp=1, pp=1, cp=1, dp=2, rank_offset=0)))
LOGGED = [1, 2, 4, 6]


def _plain():
    return measured_run(2, PLAIN)


def _slow():
    return measured_run(2, SLOW)


def _colocated():
    return measured_run(2, COLOCATED)


def _scalar(folder, tag: str) -> dict[int, float]:
    return read_scalars(folder / "tensorboard", tag)


def _logged_value(line: str, field: str) -> str:
    match = re.search(rf" {re.escape(field)}: ([^|]*) \|", line)
    assert match, (field, line)
    return match.group(1)


def test_the_log_line_and_tensorboard_carry_the_throughput_figures():
    folder, ranks = _plain()
    lines = ranks[-1]["lines"]  # stock prints its line on the last rank
    assert [int(re.search(r"iteration +(\d+)/", line).group(1)) for line in lines] == LOGGED
    for line in lines:
        assert float(_logged_value(line, "tokens/s")) > 0
        assert float(_logged_value(line, "active tokens/s/GPU")) > 0
        assert re.fullmatch(r"vision [\d.e+-]+, language [\d.e+-]+, total [\d.e+-]+",
                            _logged_value(line, "TFLOP/s/GPU"))
        assert re.fullmatch(r"vision \d+\.\d%, language \d+\.\d%", _logged_value(line, "busy"))
        assert re.fullmatch(r"vision \d+\.\d%, language \d+\.\d%",
                            _logged_value(line, "waiting"))
        assert "MFU" not in line  # the CPU simulation has no peak without --peak-tflops
        _logged_value(line, "throughput per GPU (TFLOP/s/GPU)")  # stock's field, MiMo's count
    for tag in ("tokens-per-second", "active-tokens-per-second-per-gpu", "model-flops",
                "tflops-per-gpu", "tflops-per-gpu/vision", "tflops-per-gpu/language",
                "busy-share/vision", "busy-share/language", "wait-share/language"):
        values = _scalar(folder, f"mimo/{tag}")
        assert sorted(values) == LOGGED and all(value >= 0 for value in values.values()), tag
    assert all(0 < value <= 1 for value in _scalar(folder, "mimo/busy-share/language").values())
    # One gather per logged interval on every rank, none per step.
    assert [rank["gathers"] for rank in ranks] == [len(LOGGED)] * 2


@pytest.mark.parametrize("run", [_plain, _colocated], ids=["own-ranks", "colocated"])
def test_the_logged_flops_are_the_flops_of_the_batches_the_run_consumed(run):
    folder, ranks = run()
    expected = {module: sum(rank["expected"].get(module, [0.0])[0] for rank in ranks)
                for module in ("vision", LANGUAGE)}
    assert all(value > 0 for value in expected.values())
    total = sum(expected.values())
    assert sum(_scalar(folder, "mimo/model-flops").values()) == pytest.approx(total, rel=1e-9)
    for module, flops in expected.items():
        logged = _scalar(folder, f"mimo/model-flops/{module}")
        assert sum(logged.values()) == pytest.approx(flops, rel=1e-9), module
    on_lines = [float(_logged_value(line, "model FLOPs")) for line in ranks[-1]["lines"]]
    assert sum(on_lines) == pytest.approx(total, rel=1e-6)
    # Stock's own running total (checkpoints, --log-progress) is the MiMo model's on every rank.
    assert [rank["flops_so_far"] for rank in ranks] == [pytest.approx(total, rel=1e-9)] * 2


def test_the_profile_holds_positive_compute_times_and_the_logged_flops():
    folder, ranks = _plain()
    content = json.loads((folder / "profile.json").read_text())
    assert content["version"] == 1 and content["device"] == "cpu-simulation"
    assert content["peak_tflops"] is None and content["steps"] == 4  # six less two of warm-up
    assert content["layout"][0] == {"name": "vision", "provider": "vit", "tp": 1, "pp": 1,
                                    "cp": 1, "dp": 1, "ep": 1, "etp": 1}
    assert "--mimo-profile" in content["command"] and content["step_s"] > 0
    modules = content["modules"]
    assert [modules[name]["ranks"] for name in ("vision", LANGUAGE)] == [[0], [1]]
    for name, module in modules.items():
        assert module["compute_s_per_step"] > 0 and module["wait_s_per_step"] >= 0, name
        assert len(module["compute_s_per_rank"]) == 1 and module["compute_s_per_rank"][0] > 0
        assert module["tokens_per_step"] > 0
        # Steps 3-6 are what the log's intervals ending at 4 and 6 counted.
        logged = _scalar(folder, f"mimo/model-flops/{name}")
        assert module["flops_per_step"] * 4 == pytest.approx(logged[4] + logged[6], rel=1e-9)
    assert modules["vision"]["items_per_step"] >= 0 and modules[LANGUAGE]["items_per_step"] is None


def _timeline(folder) -> list[dict]:
    trace = json.loads((folder / "timeline" / "timeline.json").read_text())
    return trace["traceEvents"]


def test_the_timeline_is_a_chrome_trace_of_every_rank_and_a_picture():
    folder, _ = _plain()
    events = _timeline(folder)
    threads = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"}
    assert threads == {(0, 0), (1, 1)}
    phases = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in phases} == {0, 1}
    assert {e["args"]["step"] for e in phases} == {3, 4}
    kinds = {(e["pid"], e["name"]) for e in phases}
    assert {(0, "encoder-forward"), (0, "encoder-backward"), (0, "send-wait"),
            (1, "language-forward"), (1, "language-backward"), (1, "recv-wait"),
            (0, "optimizer"), (1, "grad-reduce"), (0, "step"), (1, "step")} <= kinds
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in phases)
    with Image.open(folder / "timeline" / "timeline.png") as picture:
        assert picture.format == "PNG" and picture.size == picture_size(LAYOUT)


def _overlap(waits: list[dict], work: list[dict]) -> float:
    """Microseconds of ``work`` during which some of ``waits`` ran."""
    return sum(max(0.0, min(a["ts"] + a["dur"], b["ts"] + b["dur"]) - max(a["ts"], b["ts"]))
               for a in work for b in waits)


def test_a_slow_encoder_lowers_the_language_busy_share_and_the_timeline_shows_the_wait():
    plain, _ = _plain()
    slow, _ = _slow()

    def share(folder, tag: str) -> float:
        values = _scalar(folder, f"mimo/{tag}/language")
        return (values[4] + values[6]) / 2  # after the first two steps

    assert share(slow, "busy-share") < share(plain, "busy-share")
    assert share(slow, "wait-share") > share(plain, "wait-share")
    phases = [e for e in _timeline(slow) if e["ph"] == "X"]
    encoder = [e for e in phases if e["pid"] == 0 and e["name"] == "encoder-forward"]
    receiving = [e for e in phases if e["pid"] == 1 and e["name"] == "recv-wait"]
    assert len(encoder) == 8  # 4 microbatches in each of steps 3 and 4
    assert all(e["dur"] >= SLEEP_SECONDS * 1e6 for e in encoder)
    # The language rank waits through much of each encoder forward (it computes its previous
    # microbatch's forward and backward through the rest).
    assert _overlap(receiving, encoder) >= 0.3 * sum(e["dur"] for e in encoder)


def test_a_bad_timeline_step_range_stops_the_launch_with_one_line():
    run = run_preforked(REPO_ROOT / "examples" / "mimo" / "pretrain_mimo.py",
                        [*MEASURED, "--encoder", "vision=vit", *GRIDS, "--mimo-timeline", "/tmp/t",
                         "--mimo-timeline-steps", "5:2"], nproc=2, timeout=300)
    assert run.returncode != 0
    errors = re.findall(r"^pretrain_mimo\.py: error: (.*)$", run.output, flags=re.M)
    assert errors and set(errors) == {"--mimo-timeline-steps 5:2: give the first and last step "
                                      "to record as A:B with 1 <= A <= B, e.g. "
                                      "--mimo-timeline-steps 3:4"}, run.output[-3000:]
    assert "[rank" not in run.output, "a rank printed a traceback"


def test_a_colocated_run_times_the_hosted_encoder_its_replicas_and_the_mfu():
    folder, ranks = _colocated()
    mfu, tflops = _scalar(folder, "mimo/mfu"), _scalar(folder, "mimo/tflops-per-gpu")
    assert sorted(mfu) == LOGGED
    assert all(mfu[i] == pytest.approx(tflops[i] / PEAK, rel=1e-6) for i in LOGGED)
    for line in ranks[-1]["lines"]:
        assert re.fullmatch(r"\d+\.\d%", _logged_value(line, "MFU"))
        compute, tokens = re.search(r" vision replica imbalance: compute ([\d.]+), tokens "
                                    r"([\d.]+) \|", line).groups()
        assert float(compute) >= 1 and float(tokens) >= 1
    assert sorted(_scalar(folder, "mimo/replica-imbalance-tokens/vision")) == LOGGED
    events = _timeline(folder)
    assert {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"} == {
        (0, 0), (0, 1), (1, 0), (1, 1)}
    kinds = {(e["pid"], e["tid"], e["name"]) for e in events if e["ph"] == "X"}
    for rank in (0, 1):
        assert {(0, rank, "encoder-forward"), (0, rank, "encoder-backward"),
                (0, rank, "colocated-routing"), (1, rank, "language-forward"),
                (1, rank, "language-backward"), (1, rank, "grad-reduce")} <= kinds
    with Image.open(folder / "timeline" / "timeline.png") as picture:
        assert picture.size == picture_size(COLOCATED_LAYOUT)
