"""What a run measures about its own speed, part by part, without a run: the recorder, the
interval figures, the peaks, the flags, the timeline files and the profile (issue 39)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from PIL import Image

from megatron_plugins.errors import FlagError
from megatron_plugins.parallel.layout import LANGUAGE, ModulePlacement, ParallelLayout
from megatron_plugins.performance import flags, measurement
from megatron_plugins.performance.figures import interval_figures
from megatron_plugins.performance.meter import Columns
from megatron_plugins.performance.peaks import peak_for
from megatron_plugins.performance.picture import picture_size
from megatron_plugins.performance.profile import ProfileSink, StepTimes, profile
from megatron_plugins.performance.recorder import Consumed, Phase, Recorder, StepRecord
from megatron_plugins.performance.timeline import TimelineSink, chrome_trace, write_timeline
from megatron_plugins.step import phases

LAYOUT = ParallelLayout((
    ModulePlacement(name="vision", tp=1, pp=1, cp=1, dp=2, rank_offset=0, provider="vit"),
    ModulePlacement(name=LANGUAGE, tp=1, pp=2, cp=1, dp=1, rank_offset=2),
))
"""Vision at DP 2 on ranks 0-1, the language model in two pipeline stages on ranks 2-3."""


def _row(columns: Columns, step_seconds: float, **figures: float) -> list[float]:
    """A meter row: ``vision_compute=1.0`` puts 1.0 in vision's compute column."""
    row = [0.0] * columns.width
    for key, value in figures.items():
        module, _, what = key.rpartition("_")
        row[columns.of(module, what)] = value
    row[columns.step_seconds], row[columns.steps] = step_seconds, 2
    return row


def test_interval_figures_follow_their_definitions():
    columns = Columns(("vision", LANGUAGE))
    rows = [_row(columns, 2.0, vision_flops=3e12, vision_tokens=30, vision_compute=1.5,
                 vision_wait=0.4),
            _row(columns, 2.0, vision_flops=1e12, vision_tokens=10, vision_compute=0.5,
                 vision_wait=1.4),
            _row(columns, 2.0, language_flops=8e12, language_tokens=200, language_compute=1.0,
                 language_wait=0.5),
            _row(columns, 1.6, language_compute=0.8, language_wait=0.8)]
    figures = interval_figures(rows, columns, LAYOUT, {"vision", LANGUAGE}, peak_tflops=10.0)
    assert figures.seconds == 2.0 and figures.iterations == 2
    assert figures.tokens_per_second == 100.0
    assert figures.active_tokens_per_second_per_gpu == 25.0
    assert figures.flops == {"vision": 4e12, LANGUAGE: 8e12} and figures.total_flops == 12e12
    assert figures.tflops_per_gpu == {"vision": 1.0, LANGUAGE: 2.0}
    assert figures.total_tflops_per_gpu == 1.5 and figures.mfu == pytest.approx(0.15)
    assert figures.busy == {"vision": 0.5, LANGUAGE: 0.5}
    assert figures.wait == {"vision": pytest.approx(0.45), LANGUAGE: pytest.approx(0.375)}
    assert figures.imbalance == {"vision": (1.5, 1.5)}
    line = figures.log_fields()
    for field in ("tokens/s: 100.0 |", "active tokens/s/GPU: 25.0 |",
                  "model FLOPs: 1.200000E+13 |", "TFLOP/s/GPU: vision 1, language 2, total 1.5 |",
                  "MFU: 15.0% |", "busy: vision 50.0%, language 50.0% |",
                  "waiting: vision 45.0%, language 37.5% |",
                  "vision replica imbalance: compute 1.50, tokens 1.50 |"):
        assert f" {field}" in line
    scalars = figures.scalars()
    assert scalars["mimo/model-flops"] == 12e12 and scalars["mimo/busy-share/language"] == 0.5
    assert scalars["mimo/replica-imbalance-tokens/vision"] == 1.5
    assert scalars["mimo/mfu"] == pytest.approx(0.15)


def test_a_module_that_counts_no_flops_is_left_out_and_there_is_no_mfu_without_a_peak():
    columns = Columns(("vision", LANGUAGE))
    rows = [_row(columns, 1.0, vision_compute=1.0, vision_flops=0.0)] * 2 + \
        [_row(columns, 1.0, language_flops=4e12, language_compute=1.0)] * 2
    figures = interval_figures(rows, columns, LAYOUT, {LANGUAGE}, peak_tflops=None)
    assert figures.flops == {LANGUAGE: 8e12} and figures.mfu is None
    assert "MFU" not in figures.log_fields() and "mimo/mfu" not in figures.scalars()
    assert "vision" not in figures.tflops_per_gpu


@pytest.mark.parametrize("device, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA GH200 480GB", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA B200", 2250.0), ("NVIDIA L40S", 362.0)])
def test_known_gpus_have_their_dense_bf16_peak(device, tflops):
    assert peak_for(device, None).tflops == tflops
    assert peak_for(device, 123.0).tflops == 123.0


def test_an_unknown_device_has_no_peak_and_one_notice_naming_the_known_and_the_flag():
    peak = peak_for("cpu-simulation", None)
    assert peak.tflops is None
    assert "'cpu-simulation'" in peak.notice and "h100-sxm" in peak.notice
    assert "--peak-tflops" in peak.notice and "\n" not in peak.notice


def _args(**given: object) -> SimpleNamespace:
    values = {"log_throughput": False, "log_progress": False, "mimo_timeline": None,
              "mimo_timeline_steps": flags.DEFAULT_TIMELINE_STEPS, "mimo_profile": None,
              "peak_tflops": None, "train_iters": 10}
    return SimpleNamespace(**{**values, **given})


@pytest.mark.parametrize("text", ["3", "0:2", "4:2", "a:b", "3:", ":4", "2:x"])
def test_bad_timeline_steps_are_one_line_naming_the_flag(text):
    with pytest.raises(FlagError, match=rf"^--mimo-timeline-steps {text}: .*A:B.*3:4$"):
        flags.check_performance_args(_args(mimo_timeline_steps=text))


def test_timeline_steps_name_a_range_and_must_start_within_the_run(tmp_path):
    assert flags.timeline_steps("3:4") == range(3, 5)
    with pytest.raises(FlagError, match=r"^--mimo-timeline-steps 11:12: the run trains 10 steps"):
        flags.check_performance_args(_args(mimo_timeline=str(tmp_path),
                                           mimo_timeline_steps="11:12"))


@pytest.mark.parametrize("value", [0.0, -5.0])
def test_a_peak_that_is_not_positive_is_one_line_naming_the_flag(value):
    with pytest.raises(FlagError, match=rf"^--peak-tflops {value}: .*positive"):
        flags.check_performance_args(_args(peak_tflops=value))


def test_an_unwritable_timeline_folder_or_profile_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(FlagError, match=rf"^--mimo-timeline {blocker}/timeline: cannot create"):
        flags.check_performance_args(_args(mimo_timeline=str(blocker / "timeline")))
    with pytest.raises(FlagError, match=rf"^--mimo-profile {tmp_path}: it is a folder"):
        flags.check_performance_args(_args(mimo_profile=str(tmp_path)))
    with pytest.raises(FlagError, match=r"^--mimo-profile .*: cannot create folder"):
        flags.check_performance_args(_args(mimo_profile=str(blocker / "p.json")))
    flags.check_performance_args(_args(mimo_timeline=str(tmp_path / "new" / "timeline")))
    assert (tmp_path / "new" / "timeline").is_dir()


def test_a_profile_needs_a_step_after_the_warm_up(tmp_path):
    with pytest.raises(FlagError, match=r"^--mimo-profile measures the steps after the first 2 "
                                        r".*--train-iters 2 .* at least 3 steps$"):
        flags.check_performance_args(_args(mimo_profile=str(tmp_path / "p.json"), train_iters=2))
    flags.check_performance_args(_args(mimo_profile=str(tmp_path / "p.json"), train_iters=3))


def test_log_progress_needs_log_throughput():
    with pytest.raises(FlagError, match=r"^--log-progress .* add --log-throughput$"):
        flags.check_performance_args(_args(log_progress=True))


def test_a_run_that_measures_nothing_installs_nothing():
    import megatron.training.training as training
    from megatron.core.pipeline_parallel import schedules

    stock = (training.train, training.train_step, training.training_log,
             training.num_floating_point_operations, schedules.forward_step,
             schedules.backward_step_multimodule)
    assert measurement.install(SimpleNamespace(args=_args())) is None
    assert (training.train, training.train_step, training.training_log,
            training.num_floating_point_operations, schedules.forward_step,
            schedules.backward_step_multimodule) == stock
    assert phases.listener() is None
    assert phases.phase(phases.ENCODER_FORWARD, "vision", 0) is phases.phase(phases.STEP)


class _Clock:
    """perf_counter stand-in: each reading advances 1 s."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_the_recorder_times_phases_of_training_steps_only(monkeypatch):
    monkeypatch.setattr("megatron_plugins.performance.recorder.time.perf_counter", _Clock())
    records: list[StepRecord] = []
    sink = SimpleNamespace(add_step=records.append)
    recorder = Recorder(2, {LANGUAGE: 0, "vision": 0}, LANGUAGE,
                        lambda module, batch: Consumed(batch["flops"], 1.0, 0.0), sinks=[sink])
    phases.listen(recorder)
    try:
        with phases.phase(phases.LANGUAGE_FORWARD):  # evaluation: outside a step
            phases.consumed({"flops": 5.0})
        recorder.begin_step(7)
        phases.consumed({"flops": 2.0})
        phases.consumed({"flops": 3.0}, "vision")
        with phases.phase(phases.ENCODER_FORWARD, "vision", 0):
            pass
        with phases.phase(phases.RECV_WAIT):
            pass
        record = recorder.end_step()
    finally:
        phases.listen(None)
    assert records == [record] and record.iteration == 7 and recorder.last_iteration == 7
    assert [(p.kind, p.module, p.microbatch, p.rank) for p in record.phases] == [
        ("encoder-forward", "vision", 0, 2), ("recv-wait", LANGUAGE, None, 2),
        ("step", LANGUAGE, None, 2)]
    assert record.consumed[LANGUAGE].flops == 2.0 and record.consumed["vision"].flops == 3.0
    assert record.compute_seconds("vision") == 1.0 and record.wait_seconds(LANGUAGE) == 1.0
    assert record.seconds == 5.0 and record.compute_seconds(LANGUAGE) == 0.0


def _phase(rank: int, module: str, kind: str, start: float, end: float,
           microbatch: int | None = 0) -> Phase:
    return Phase(rank, module, kind, microbatch, LAYOUT.module(module).coordinates(rank)["pp"],
                 start, end)


PHASES = [(3, _phase(0, "vision", "encoder-forward", 100.0, 100.5)),
          (3, _phase(2, LANGUAGE, "recv-wait", 100.0, 100.6, None)),
          (3, _phase(2, LANGUAGE, "language-forward", 100.6, 100.8)),
          (4, _phase(3, LANGUAGE, "step", 101.0, 102.0, None))]


def test_the_chrome_trace_has_a_process_per_module_and_a_thread_per_rank():
    trace = json.loads(json.dumps(chrome_trace(PHASES, LAYOUT)))
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "vision", 1: LANGUAGE}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e["name"] == "thread_name"}
    assert threads == {(0, 0): "rank 0 (stage 0)", (0, 1): "rank 1 (stage 0)",
                       (1, 2): "rank 2 (stage 0)", (1, 3): "rank 3 (stage 1)"}
    complete = [e for e in events if e["ph"] == "X"]
    assert [(e["name"], e["pid"], e["tid"], e["ts"], e["dur"]) for e in complete] == [
        ("encoder-forward", 0, 0, 0.0, 500000.0), ("recv-wait", 1, 2, 0.0, 600000.0),
        ("language-forward", 1, 2, 600000.0, 200000.0), ("step", 1, 3, 1000000.0, 1000000.0)]
    assert complete[2]["args"] == {"step": 3, "stage": 0, "microbatch": 0}


def test_the_timeline_files_are_a_trace_and_a_picture_with_a_lane_per_rank(tmp_path):
    trace, picture = write_timeline(tmp_path / "t", PHASES, LAYOUT, range(3, 5))
    assert json.loads(trace.read_text())["displayTimeUnit"] == "ms"
    with Image.open(picture) as image:
        assert image.format == "PNG" and image.size == picture_size(LAYOUT)
    alone = ParallelLayout((ModulePlacement(name=LANGUAGE, tp=1, pp=2, cp=1, dp=1,
                                            rank_offset=0),))
    assert picture_size(LAYOUT)[1] > picture_size(alone)[1]


def test_the_timeline_sink_keeps_the_chosen_steps():
    sink = TimelineSink(range(3, 5))
    for iteration in range(1, 7):
        sink.add_step(StepRecord(iteration, [_phase(0, "vision", "step", iteration, iteration)]))
    assert [step for step, _ in sink.phases] == [3, 4]


def test_the_profile_takes_medians_of_times_and_means_of_what_was_consumed():
    def step(rank: int, seconds: float, compute: float, flops: float) -> StepTimes:
        module = "vision" if rank < 2 else LANGUAGE
        return StepTimes(rank, seconds, {module: (compute, seconds - compute)},
                         {module: (flops, 10.0, 2.0)} if rank in (0, 1, 2) else {})

    per_rank = [[step(0, 1.0, 0.2, 1.0), step(0, 1.2, 0.4, 3.0), step(0, 1.1, 0.3, 2.0)],
                [step(1, 1.0, 0.4, 1.0), step(1, 1.0, 0.4, 1.0), step(1, 1.0, 0.4, 1.0)],
                [step(2, 2.0, 1.0, 9.0), step(2, 2.0, 1.0, 9.0), step(2, 2.0, 1.0, 9.0)],
                [step(3, 2.0, 1.5, 0.0), step(3, 2.0, 1.5, 0.0), step(3, 2.0, 1.5, 0.0)]]
    content = profile(per_rank, LAYOUT, {"device": "cpu-simulation"})
    assert content["version"] == 1 and content["steps"] == 3 and content["step_s"] == 2.0
    vision, language = content["modules"]["vision"], content["modules"][LANGUAGE]
    assert vision["ranks"] == [0, 1] and language["ranks"] == [2, 3]
    assert vision["compute_s_per_rank"] == [0.3, 0.4]
    assert vision["compute_s_per_step"] == pytest.approx(0.35)
    assert vision["flops_per_step"] == 3.0 and vision["tokens_per_step"] == 20.0
    assert vision["items_per_step"] == 4.0 and language["items_per_step"] is None
    assert language["compute_s_per_step"] == 1.25 and language["wait_s_per_step"] == 0.75


def test_the_profile_leaves_out_the_first_two_steps():
    sink = ProfileSink(0, ["vision"])
    for iteration in range(1, 5):
        sink.add_step(StepRecord(iteration, [_phase(0, "vision", "step", 0.0, iteration)]))
    assert [times.seconds for times in sink.steps] == [3.0, 4.0]
