"""The advisor's cost model (megatron_plugins/performance): the GPU table, the layouts it
enumerates, memory per rank, step time and calibration, on hand-built workloads (no torch)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from megatron_plugins.errors import FlagError
from megatron_plugins.parallel.flags import layout_from_args, required_world_size
from megatron_plugins.parallel.layout import ModulePlacement
from megatron_plugins.performance.assumptions import Assumptions, assumptions_from_args
from megatron_plugins.performance.calibration import ProfileError, calibrate, read_profile
from megatron_plugins.performance.candidates import (
    COLOCATED,
    HOMOGENEOUS,
    SEPARATE,
    Candidate,
    EncoderPlacement,
    enumerate_candidates,
    layout_candidate,
)
from megatron_plugins.performance.cost_model import estimate, module_busy
from megatron_plugins.performance.data import DataDescription, EncoderData, given_description
from megatron_plugins.performance.gpus import GPUS, gpu_by_device_name, gpu_by_name, hardware
from megatron_plugins.performance.memory import candidate_memory
from tests.models.advisor import bridge_layouts, qwen35_27b, small_workload, space

H100 = hardware(8, 8, "h100-sxm", {})
IDEAL = Assumptions(kernel_us=0, layer_overhead_ms=0, latency_us=0, link_efficiency=1)


def _layout(grids: list[str], encoders: list[str], heads: int = 8,
            encoder_heads: dict[str, int] | None = None):
    """A layout checked as the launch checks it."""
    args = argparse.Namespace(mimo_encoders=encoders, mimo_grids=grids, num_attention_heads=heads,
                              llm_offset=None)
    return layout_from_args(args, required_world_size(args), encoder_heads or {"vision": 4})


@pytest.mark.parametrize("name, spec", [("H100", "h100-sxm"), ("a100", "a100-80gb"),
                                        ("L40S", "l40s"), ("b200", "b200")])
def test_a_known_gpu_is_found_by_name_or_alias(name, spec):
    assert gpu_by_name(name) is GPUS[spec]


def test_an_unknown_gpu_is_one_line_listing_the_known():
    with pytest.raises(FlagError) as error:
        gpu_by_name("v100")
    message = str(error.value)
    assert "\n" not in message and message.startswith("--gpu v100: unknown GPU; known: h100-sxm")
    assert all(name in message for name in GPUS)


@pytest.mark.parametrize("device, spec", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H100 NVL", "h100-nvl"), ("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", "h200-nvl"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA B200", "b200"), ("NVIDIA GB200", "gb200"), ("NVIDIA L40S", "l40s")])
def test_a_device_name_finds_its_gpu(device, spec):
    assert gpu_by_device_name(device) is GPUS[spec]
    assert gpu_by_device_name("Tesla V100-SXM2-16GB") is None


@pytest.mark.parametrize("gpus, per_node, gpu, figures, message", [
    (0, 8, "h100", {}, "--gpus 0: give the number of GPUs to plan for (>= 1)"),
    (12, 8, "h100", {}, "--gpus 12 is more than one node of --gpus-per-node 8 but not whole "
                        "nodes; give 8 or 16 (a layout may leave GPUs of the last node idle)"),
    (8, 8, None, {"peak_tflops": 100.0}, "--gpu is not given: name a known GPU"),
    (8, 8, "h100", {"memory_gib": -1.0}, "--gpu-memory-gib -1 must be positive"),
])
def test_an_impossible_gpu_count_or_figure_is_one_line(gpus, per_node, gpu, figures, message):
    with pytest.raises(FlagError, match="^" + message.replace("(", r"\(").replace(")", r"\)")
                       .replace(".", r"\.")):
        hardware(gpus, per_node, gpu, figures)


def test_given_figures_override_the_table_and_stand_in_for_an_unknown_gpu():
    assert hardware(8, 8, "h100", {"peak_tflops": 500.0}).gpu.peak_tflops == 500.0
    custom = hardware(4, 4, None, {"peak_tflops": 1.0, "memory_gib": 2.0,
                                   "intra_node_gbps": 3.0, "inter_node_gbps": 4.0}).gpu
    assert (custom.peak_tflops, custom.memory_gib, custom.inter_node_gbps) == (1.0, 2.0, 4.0)
    assert hardware(24, 8, "h100", {}).fewest_gpus == 17
    assert hardware(6, 8, "h100", {}).fewest_gpus == 6


@pytest.mark.parametrize("flags, message", [
    ({"advise_link_efficiency": 1.5}, "--advise-link-efficiency 1.5 must be between 0 and 1"),
    ({"advise_kernel_us": -1.0}, "--advise-kernel-us -1 must be positive"),
    ({"advise_efficiency": ["language"]}, "--advise-efficiency language: give MODULE=F"),
])
def test_an_assumption_out_of_range_is_one_line(flags, message):
    with pytest.raises(FlagError, match="^" + message):
        assumptions_from_args(argparse.Namespace(**flags))


def test_every_assumption_is_printed_with_the_flag_that_overrides_it():
    lines = Assumptions(efficiency={"vision": 0.4}).lines(["language", "vision"])
    assert lines[0].startswith("language FLOPs run at 65.0% of peak (default; "
                               "--advise-efficiency language=F)")
    assert lines[1].startswith("vision FLOPs run at 40.0% of peak (given;")
    flags = " ".join(lines)
    for flag in ("--advise-kernel-us", "--advise-layer-overhead-ms", "--advise-link-efficiency",
                 "--advise-latency-us", "--advise-grad-overlap", "--advise-cp-overlap",
                 "--advise-usable-memory", "--advise-reserved-gib", "--advise-optimizer-bytes"):
        assert flag in flags


def _data_flags(**values):
    return argparse.Namespace(**{"advise_items_per_sample": [], "advise_item_tokens": [],
                                 "advise_clip_seconds": [], "advise_text_tokens": None,
                                 **values})


def test_a_data_description_beyond_the_rows_is_one_line_naming_the_flags():
    flags = _data_flags(advise_items_per_sample=["vision=2"], advise_item_tokens=["vision=20"])
    with pytest.raises(FlagError) as error:
        given_description(flags, {"vision": 16}, 32)
    assert str(error.value) == (
        "the data (given by flags) has samples of 40 positions, more than --seq-length 32: "
        "raise --seq-length or describe smaller samples (--advise-item-tokens, "
        "--advise-clip-seconds, --advise-items-per-sample, --advise-text-tokens)")
    with pytest.raises(FlagError, match="^--advise-item-tokens audio=3: no encoder 'audio'"):
        given_description(_data_flags(advise_item_tokens=["audio=3"]), {"vision": 16}, 32)
    described = given_description(_data_flags(advise_text_tokens=5.0), {"vision": 16}, 32)
    assert described.sample_tokens == 21 and described.encoders["vision"].items_per_sample == 1
    assert given_description(_data_flags(), {"vision": 16}, 32) is None


def test_every_enumerated_layout_passes_the_launch_checks_and_fills_the_gpus():
    work = small_workload()
    gpus = hardware(4, 4, "h100", {})
    found = list(enumerate_candidates(space(work, gpus, 8, 4, "vision"), (1, 2)))
    kinds = {candidate.kind for candidate in found}
    assert kinds == {HOMOGENEOUS, COLOCATED, SEPARATE}
    for candidate in found:
        assert candidate.ranks <= 4
        if candidate.kind != HOMOGENEOUS:
            assert candidate.ranks == 4
        if candidate.launchable:
            args = argparse.Namespace(mimo_encoders=["vision=qwen3_vl"],
                                      mimo_grids=candidate.grids(), num_attention_heads=8,
                                      llm_offset=None)
            assert layout_from_args(args, candidate.ranks, {"vision": 4}) == candidate.layout
        assert 8 % candidate.language.tp == 0 and 4 % candidate.encoder_grid("vision").tp == 0
    references = [c for c in found if not c.launchable]
    assert references and all(c.kind == HOMOGENEOUS and c.language.pp * c.language.cp > 1
                              for c in references)


def test_memory_counts_state_by_precision_and_shards_the_optimizer_over_dp():
    work = small_workload()
    language = ModulePlacement(name="language", tp=1, pp=1, cp=1, dp=2, rank_offset=1)
    grid = EncoderPlacement("vision", "vit", SEPARATE, 1, 1)
    candidate = Candidate(language, (grid,), 1, False)
    sharded = candidate_memory(candidate, work, H100, IDEAL).ranks["language stage 0"]
    whole = candidate_memory(candidate, replace(work, distributed_optimizer=False), H100,
                             IDEAL).ranks["language stage 0"]
    params = work.language.params
    assert whole - sharded == pytest.approx(params * 12 / 2 / 1024 ** 3)
    recomputed = candidate_memory(replace(candidate, recompute=True), work, H100, IDEAL)
    assert recomputed.ranks["language stage 0"] < sharded


def test_a_colocated_encoder_holds_every_microbatch_unless_it_recomputes():
    language = ModulePlacement(name="language", tp=1, pp=1, cp=1, dp=2, rank_offset=0)
    colocated = Candidate(language, (EncoderPlacement("vision", "vit", COLOCATED, 1, 2),), 2,
                          False)

    def peak(global_batch: int, recompute: bool = False) -> float:
        candidate = replace(colocated, colocated_recompute=recompute)
        return candidate_memory(candidate, small_workload(global_batch), H100, IDEAL).peak

    held = [peak(batch) for batch in (32, 64, 96)]  # 8, 16, 24 microbatches
    assert held[2] - held[1] == pytest.approx(held[1] - held[0]) and held[1] > held[0]
    assert peak(32, True) == peak(96, True) < held[0]


def test_the_pipeline_adds_the_slowest_stage_per_microbatch_and_keeps_its_bubble():
    language = ModulePlacement(name="language", tp=1, pp=2, cp=1, dp=1, rank_offset=1)
    separate = Candidate(language, (EncoderPlacement("vision", "vit", SEPARATE, 1, 1),), 1, False)
    runs = [estimate(separate, small_workload(batch), H100, IDEAL) for batch in (16, 32, 48)]
    pipelines = [run.parts["pipeline"] for run in runs]
    assert pipelines[2] - pipelines[1] == pytest.approx(pipelines[1] - pipelines[0])
    assert runs[0].parts["bubble"] == pytest.approx(runs[2].parts["bubble"])
    assert runs[0].parts["bubble"] > 0
    slowest = (pipelines[1] - pipelines[0]) / 16
    assert pipelines[0] == pytest.approx(runs[0].parts["bubble"] + 16 * slowest)
    # The slowest stage is the language model's last (it holds the output layer), not the encoder.
    assert slowest * 16 > runs[0].busy["language"] > runs[0].busy["vision"]


def test_a_tp_group_across_nodes_is_slower_than_one_inside_a_node():
    work = qwen35_27b(2048, 32)
    gpus = hardware(24, 8, "h100", {})
    offset_by_one = layout_candidate(_qwen_layout(["images:tp=1,dp=1"]), 1, False, False)
    aligned = layout_candidate(_qwen_layout(["images:tp=1,dp=4"]), 1, False, False)
    slow, fast = estimate(offset_by_one, work, gpus, Assumptions()), \
        estimate(aligned, work, gpus, Assumptions())
    assert slow.busy["language"] > 2 * fast.busy["language"]


def _qwen_layout(encoder: list[str]):
    return _layout([*encoder, "language:tp=4,pp=2,dp=2"], ["images=qwen3_vl"], 24,
                   {"images": 16})


def test_an_encoder_off_the_first_stage_shortens_the_step_when_it_slows_that_stage():
    work = qwen35_27b(2048, 32)
    baseline, separate = bridge_layouts()
    gpus = hardware(24, 8, "h100", {})
    before, after = estimate(baseline, work, gpus, Assumptions()), \
        estimate(separate, work, gpus, Assumptions())
    assert after.step < before.step
    assert after.busy["language"] == pytest.approx(before.busy["language"])


def test_calibration_recovers_the_efficiency_a_measured_run_reached(tmp_path):
    work = small_workload(global_batch=16)
    gpus = hardware(2, 2, None, {"peak_tflops": 2.0, "memory_gib": 64.0, "intra_node_gbps": 5.0,
                                 "inter_node_gbps": 1.0})
    layout = _layout(["vision:dp=1", "language:dp=1"], ["vision=vit"])
    candidate = layout_candidate(layout, 4, False, False)
    truth = Assumptions(efficiency={"language": 0.3, "vision": 0.45})
    modules = {}
    for name in ("language", "vision"):
        flops = (work.language.microbatch_flops(4, False).model * 4 if name == "language"
                 else work.encoder(name).flops.model * 16)
        modules[name] = {"flops_per_step": flops * 2, "compute_s_per_step": 2 * module_busy(
            candidate, work, gpus, truth, name)}
    path = tmp_path / "profile.json"
    record = [{"name": m.name, "provider": m.provider, "tp": m.tp, "pp": m.pp, "cp": m.cp,
               "dp": m.dp, "ep": m.ep, "etp": m.etp} for m in layout.modules]
    path.write_text(json.dumps({"version": 1, "device": "cpu-simulation", "layout": record,
                                "command": ["--micro-batch-size", "4"], "modules": modules}))
    calibrated = calibrate(read_profile(str(path)), work, gpus, Assumptions())
    assert calibrated.efficiency == pytest.approx({"language": 0.3, "vision": 0.45}, rel=1e-6)
    assert calibrated.sources["vision"] == f"measured by {path} on cpu-simulation"


@pytest.mark.parametrize("content, message", [
    ("{", "not JSON"),
    ('{"version": 2}', "expected a --mimo-profile file of version 1"),
    ('{"version": 1, "modules": {"language": {"flops_per_step": 0, "compute_s_per_step": 1}}}',
     "modules.language.flops_per_step must be a positive number (is 0)"),
    ('{"version": 1, "command": [], "layout": [{"name": "x"}], "modules": {"language": '
     '{"flops_per_step": 1, "compute_s_per_step": 1}}}', "field 'layout' is not a layout record"),
])
def test_a_bad_profile_is_one_line_naming_the_file(tmp_path, content, message):
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(ProfileError) as error:
        read_profile(str(path))
    assert str(error.value).startswith(f"--profile {path}: ") and message in str(error.value)
    assert "\n" not in str(error.value)


def test_the_data_description_reports_what_a_sample_holds():
    data = DataDescription({"vision": EncoderData(1.5, ((4, 2), (8, 1)))}, 20.0, "given")
    assert data.encoders["vision"].mean_item_tokens == pytest.approx(16 / 3)
    assert data.lines()[1] == "  vision: 1.50 items per sample of 5.3 positions on average"
