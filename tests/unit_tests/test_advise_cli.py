"""``mimo-plan --advise``: bad input is one line (exit 2) before anything heavy is imported; a
tiny model's command line gets ranked layouts whose flags the launch accepts."""

from __future__ import annotations

import json

import pytest

from megatron_plugins.launch.plan import main
from megatron_plugins.launch.preflight import check_run
from tests.harness.multiprocess import run_python
from tests.models.tiny import TINY_TRANSFORMER

GPUS = ["--advise", "--gpus", "2", "--gpus-per-node", "2", "--gpu", "h100"]
MODEL = ["--encoder", "vision=vit", *TINY_TRANSFORMER]


@pytest.mark.parametrize("flags, message", [
    (["--advise", "--gpus", "8", "--gpu", "v100"],
     "--gpu v100: unknown GPU; known: h100-sxm, h100-pcie, h100-nvl, h200, h200-nvl, gh200, "
     "a100-80gb, a100-40gb, b200, gb200, l40s (or give its figures: --peak-tflops, "
     "--gpu-memory-gib, --intra-node-gbps, --inter-node-gbps)"),
    (["--advise", "--gpus", "12", "--gpu", "h100"],
     "--gpus 12 is more than one node of --gpus-per-node 8 but not whole nodes; give 8 or 16 "
     "(a layout may leave GPUs of the last node idle)"),
    (["--advise", "--gpu", "h100"], "mimo-plan --advise needs --gpus N, the GPUs to plan for"),
    (["--advise", "--gpus", "2", "--gpu", "h100", "--num-layers", "2"],
     "mimo-plan --advise: no encoder; name each with --encoder NAME=PROVIDER (or give "
     "--hf-model)"),
    ([*GPUS, *MODEL, "--advise-item-tokens", "vision=40"],
     "the data (given by flags) has samples of 40 positions, more than --seq-length 32: raise "
     "--seq-length or describe smaller samples (--advise-item-tokens, "
     "--advise-clip-seconds, --advise-items-per-sample, --advise-text-tokens)"),
    ([*GPUS, *MODEL, "--advise-objective", "speed"],
     "argument --advise-objective: invalid choice: 'speed' (choose from 'per-gpu', "
     "'throughput')"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, flags, message):
    assert main(flags) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    # torch's own log line where a CUDA toolkit lies without a GPU (this host), when this is the
    # process's first import of torch
    lines = [line for line in captured.err.splitlines() if "No CUDA runtime is found" not in line]
    assert lines == [f"mimo-plan: error: {message}"]


@pytest.mark.multirank
def test_bad_input_is_refused_before_torch_is_imported():
    code = ("import sys; from megatron_plugins.launch.plan import main; "
            "code = main(['--advise', '--gpus', '3', '--gpus-per-node', '2', '--gpu', 'h100']); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(code)")
    result = run_python(code)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("mimo-plan: error: --gpus 3 is more than one node")


def _profile(tmp_path) -> str:
    """A measured run of the tiny model on vision:dp=1 language:dp=1 (figures made up)."""
    layout = [{"name": "vision", "provider": "vit", "tp": 1, "pp": 1, "cp": 1, "dp": 1,
               "ep": 1, "etp": 1},
              {"name": "language", "provider": None, "tp": 1, "pp": 1, "cp": 1, "dp": 1,
               "ep": 1, "etp": 1}]
    modules = {"vision": {"ranks": [0], "flops_per_step": 2e8, "compute_s_per_step": 0.05},
               "language": {"ranks": [1], "flops_per_step": 4e8, "compute_s_per_step": 0.08}}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"version": 1, "device": "cpu-simulation", "peak_tflops": None,
                                "layout": layout, "command": ["--micro-batch-size", "2"],
                                "steps": 8, "step_s": 0.2, "modules": modules}))
    return str(path)


def test_a_tiny_model_gets_layouts_the_launch_accepts(capsys, tmp_path):
    given = ["--grid", "vision:dp=2@language", "--grid", "language:dp=2"]
    assert main([*GPUS, *MODEL, *given, "--profile", _profile(tmp_path), "--advise-top",
                 "3", "--advise-samples", "32", "--advise-layer-overhead-ms", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("mimo-plan --advise: 2 GPUs (1 node(s) of 2) of h100-sxm")
    assert any(line.startswith("data (the mock data: 32 samples): a sample fills")
               for line in lines)
    assert any(line.startswith("  - language FLOPs run at") and "measured by" in line
               for line in lines)
    ranked = [line for line in lines if line[:2] in ("1.", "2.", "3.")]
    assert len(ranked) == 3
    flags = [line.split("flags: ", 1)[1].split() for line in lines if "flags: " in line]
    for launch in flags:
        assert check_run([*TINY_TRANSFORMER, *launch], 2).layout.world_size == 2
    assert any(line.startswith("baseline homogeneous:") for line in lines)
    given_rows = [index for index, line in enumerate(lines) if line.startswith("given ")]
    assert len(given_rows) == 2  # the command line's layout and the profiled one
    assert "vision tp=1 dp=2 (on language ranks)" in lines[given_rows[0]]


def test_the_data_of_a_dataset_folder_is_read_from_its_samples_metadata():
    from megatron_plugins.launch.advise import advisor_flags, plan_inputs
    from tests.harness.energon_data import energon_flags, synthetic_dataset

    root = synthetic_dataset("caption")
    own, rest = advisor_flags(["--gpus", "2", "--advise-samples", "40", *MODEL, "--seq-length",
                               "64", "--max-position-embeddings", "64", *energon_flags(root)])
    planned = plan_inputs(own, rest)
    data = planned.data
    assert data.source == f"--data-path {root / 'energon'}: 40 samples"
    vision = data.encoders["vision"]
    plugin = planned.run.plugins["vision"]
    assert vision.items_per_sample == 1 and vision.item_tokens == ((plugin.tokens_per_item, 40),)
    assert plugin.tokens_per_item + 1 < data.sample_tokens <= data.largest_sample <= 64
    assert planned.workload.language.sample_tokens == data.sample_tokens
