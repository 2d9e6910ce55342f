"""examples/mimo/pretrain_mimo.py as users run it: torchrun, the README command, bad flags."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness.mimo_runs import TINY_MIMO
from tests.harness.multiprocess import (
    REPO_ROOT,
    run_in_processes,
    run_preforked,
    run_script,
)
from tests.harness.tensorboard_scalars import read_scalars
from tests.models.hf import MIMO_FLAGS, VIT, save_tiny

pytestmark = pytest.mark.multirank

SCRIPT = REPO_ROOT / "examples" / "mimo" / "pretrain_mimo.py"


def test_readme_main_command_trains_evaluates_and_checkpoints(tmp_path: Path) -> None:
    start = time.monotonic()
    result = subprocess.run(["bash", "scripts/run_default.sh"], cwd=REPO_ROOT, text=True,
                            env={**os.environ, "MIMO_RUN_DIR": str(tmp_path)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=240)
    assert result.returncode == 0, result.stdout[-4000:]
    assert time.monotonic() - start < 180
    losses = read_scalars(tmp_path / "tensorboard", "lm loss")
    assert sorted(losses)[-1] == 60
    assert losses[60] < losses[1] - 1.5, losses
    assert "validation loss at iteration 60 on validation set" in result.stdout
    assert "validation loss at iteration 60 on test set" in result.stdout
    checkpoint = tmp_path / "checkpoints"
    assert (checkpoint / "latest_checkpointed_iteration.txt").read_text().strip() == "60"
    assert len(list((checkpoint / "iter_0000060").glob("*.distcp"))) == 3  # one file per rank


def test_custom_encoder_from_its_own_file_trains(tmp_path: Path) -> None:
    """Preforked ranks: the encoder's file, found on PYTHONPATH, is the point; torchrun's launch
    is the README commands'."""
    run = run_preforked(
        SCRIPT,
        [*TINY_MIMO, "--train-iters", "20", "--lr", "3e-3", "--tensorboard-dir", str(tmp_path),
         "--encoder", "sensors=sensor_encoder:SensorEncoder", "--sensor-windows", "3",
         "--grid", "sensors:dp=1", "--grid", "language:dp=2"],
        3, timeout=150,
        env={"PYTHONPATH": f"{REPO_ROOT / 'examples' / 'mimo' / 'custom_encoder'}"},
    )
    assert run.returncode == 0, run.output[-4000:]
    losses = read_scalars(tmp_path, "lm loss")
    assert losses[20] < losses[1] - 0.5, losses


BAD_FLAGS = {  # name: (flags, the error's start), each launched on 3 ranks
    "world-size": (("--encoder", "vision=vit", "--grid", "vision:", "--grid", "language:tp=3"),
                   "WORLD_SIZE / --nproc-per-node is 3 but the --grid sizes sum to 4"),
    "grid-key": (("--encoder", "vision=vit", "--grid", "vision:", "--grid",
                  "language:dp=2,zz=1"), "--grid language:dp=2,zz=1: unknown key 'zz'"),
    "encoder": (("--encoder", "vision=nope", "--grid", "vision:", "--grid", "language:dp=2"),
                "--encoder vision=nope: unknown built-in encoder 'nope'"),
    "encoder-batch": (("--encoder", "vision=vit", "--grid", "vision:dp=2", "--grid", "language:",
                       "--micro-batch-size", "1", "--global-batch-size", "4"),
                      "--micro-batch-size 1 x --grid language: dp=1 = 1 samples per microbatch "
                      "cannot be split"),
    "missing-checkpoint": (("--encoder", "vision=vit", "--grid", "vision:", "--grid",
                            "language:dp=2", "--load", "/nonexistent/checkpoints"),
                           "--load /nonexistent/checkpoints: no checkpoint at "
                           "/nonexistent/checkpoints/latest"),
    "lr-nan": (("--encoder", "vision=vit", "--grid", "vision:", "--grid", "language:dp=2",
                "--lr", "nan"),
               "--lr nan is not a finite number; give a learning rate such as --lr 1e-4"),
    "missing-tokenizer": (("--encoder", "vision=vit", "--grid", "vision:", "--grid",
                           "language:dp=2", "--tokenizer-type", "HuggingFaceTokenizer",
                           "--tokenizer-model", "/nonexistent/tokenizer"),
                          "--tokenizer-model /nonexistent/tokenizer: "),
    # scripts/run_default.sh --train-iters 4 was a bare AssertionError from stock's scheduler.
    "lr-warmup": (("--encoder", "vision=vit", "--grid", "vision:", "--grid", "language:dp=2",
                   "--lr-warmup-iters", "12"),
                  "--lr-warmup-iters 12 must be below --train-iters 10 (the iterations the "
                  "learning rate decays over)"),
}


@pytest.mark.parametrize("name", list(BAD_FLAGS))
def test_bad_flags_fail_fast_with_one_line(name: str) -> None:
    """Preforked ranks: their verdicts are the point; torchrun's handling of such an exit is the
    unknown-flag test's."""
    flags, message = BAD_FLAGS[name]
    run = run_preforked(SCRIPT, [*TINY_MIMO, *flags], nproc=3, timeout=90)
    assert run.returncode != 0
    errors = re.findall(r"^pretrain_mimo\.py: error: (.*)$", run.output, flags=re.M)
    assert errors and all(error == errors[0] for error in errors), run.output[-3000:]
    assert message in errors[0]
    assert "[rank" not in run.output, "a rank printed a traceback"
    assert run.seconds < 60


def _parse_on_rank(flags: list[str]) -> str:
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    from megatron_plugins.errors import UsageError
    from megatron_plugins.launch.pretrain import parse_mimo_args

    try:
        parse_mimo_args([*TINY_MIMO, *flags])
    except UsageError as error:
        return str(error)
    return "no error"


def test_every_rank_reaches_the_same_verdict() -> None:
    flags, message = BAD_FLAGS["grid-key"]
    verdicts = run_in_processes(_parse_on_rank, 3, args=(flags,), timeout=90, simulated=True)
    assert len(set(verdicts)) == 1 and message in verdicts[0]


def test_a_truncated_safetensors_file_stops_every_rank_before_any_process_group(
        tmp_path: Path) -> None:
    folder = save_tiny("llama", tmp_path / "llama")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    run = run_preforked(SCRIPT, [*MIMO_FLAGS, *VIT, "--grid", "language:dp=1",
                                 "--language-hf-weights", str(folder)], nproc=2, timeout=150)
    errors = re.findall(r"^pretrain_mimo\.py: error: (.*)$", run.output, flags=re.M)
    assert errors and set(errors) == {
        f"--language-hf-weights {weights}: not a readable safetensors file (Error while "
        "deserializing header: incomplete metadata, file not fully covered); copy the folder "
        "again"}, run.output[-3000:]
    assert "[rank" not in run.output and "Connection closed" not in run.output, run.output[-3000:]
    assert run.returncode == 2, run.output[-3000:]
    # A rank left waiting for its peer would hang until the distributed timeout (minutes).
    assert run.seconds < 60


README_LAUNCH = ["--cpu-simulation", "--encoder", "vision=vit", "--grid", "vision:dp=1",
                 "--grid", "language:dp=2", "--num-layers", "2", "--hidden-size", "64",
                 "--num-attention-heads", "4", "--seq-length", "32",
                 "--max-position-embeddings", "32", "--micro-batch-size", "2",
                 "--global-batch-size", "8", "--train-iters", "3", "--eval-iters", "1",
                 "--lr", "1e-3", "--vocab-size", "128"]
"""The README's launch example: model, batch, optimizer and tokenizer flags only."""

README_BRIDGED_GAPS = ("pretrain_mimo.py: megatron-core 0.19.2; gaps bridged on rank 0: 1, 2, 3, "
                       "5, 6, 7, 8, 10, 11, 12, 16, 27, 35 (index: megatron_plugins.compat.GAPS)")
"""The start-up line README shows for that launch (rank 0 runs the vision encoder)."""


def test_readme_launch_with_only_model_batch_optimizer_flags_trains(tmp_path: Path) -> None:
    run = run_script(SCRIPT, [*README_LAUNCH, "--tensorboard-dir", str(tmp_path)], nproc=3,
                     timeout=240)
    assert run.returncode == 0, run.output[-4000:]
    notices = re.findall(r"^pretrain_mimo\.py: notice: defaults set .*$", run.output, flags=re.M)
    assert len(notices) == 1 and "--transformer-impl local" in notices[0], run.output[-4000:]
    bridged = re.findall(r"^pretrain_mimo\.py: megatron-core .*$", run.output, flags=re.M)
    assert bridged == [README_BRIDGED_GAPS], run.output[-4000:]
    assert f"\n{README_BRIDGED_GAPS}\n" in (REPO_ROOT / "README.md").read_text()
    assert "Transformer Engine and Apex are not installed" not in run.output
    losses = read_scalars(tmp_path, "lm loss")
    assert sorted(losses) == [1, 2, 3] and losses[3] < losses[1], losses


def test_unknown_flag_is_one_line_per_rank_with_the_closest_flag() -> None:
    run = run_script(SCRIPT, [*TINY_MIMO, "--freeze-lmm", "--grid", "language:dp=2"], nproc=2,
                     timeout=150)
    errors = re.findall(r"^pretrain_mimo\.py: error: (.*)$", run.output, flags=re.M)
    assert errors and set(errors) == {
        "unknown flag --freeze-lmm (did you mean --freeze-lm?); see --help"}, run.output[-3000:]
    assert "usage:" not in run.output
    assert run.returncode == 1  # torchrun's own code when its ranks exit 2
    # torchrun stops the other ranks (SIGTERM, -15) once the first one exits.
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", run.output)
    assert "2" in codes and set(codes) <= {"2", "-15"}, codes


def test_help_prints_mimo_and_encoder_flags_first_and_exits_0() -> None:
    """``--help`` in a fresh interpreter, as a GPU user's first command runs; the encoder's own
    help from a preforked rank (the same parser, without another interpreter's imports)."""
    plain = subprocess.run([sys.executable, str(SCRIPT), "--help"], cwd=REPO_ROOT, text=True,
                           capture_output=True, timeout=120)
    assert plain.returncode == 0, plain.stderr[-3000:]
    encoder = run_preforked(SCRIPT, ["--cpu-simulation", "--encoder", "vision=vit", "--help"],
                            nproc=1, timeout=60)
    assert encoder.returncode == 0, encoder.output[-3000:]
    for output, first in ((plain.stdout, "--grid"), (encoder.output, "--vit-num-layers")):
        assert output.startswith("usage: pretrain_mimo.py [--encoder NAME=PROVIDER ...]"), (
            output[:3000])
        text = output[output.index("options:"):]
        assert text.index(first) < text.index("--num-layers") < text.index("--moe-paged-stash")
        assert text.index("--freeze-lm") < text.index("--num-layers")


CPU_DEFAULT_CASES = [
    (["--transformer-impl", "transformer_engine"],
     "--transformer-impl cannot run on the CPU simulation (Transformer Engine needs a GPU); use "
     "--transformer-impl local"),
    (["--moe-grouped-gemm"], "--moe-grouped-gemm cannot run on the CPU simulation"),
    (["--fp4-param-gather"], "stock Megatron argument check failed: --fp4-param-gather must be "
     "used together with --fp4-format."),  # stock raises ValueError, not only AssertionError
    (["--lrr", "1"], "unknown flag --lrr (did you mean --lr?); see --help"),
]


def _verdicts(cases: list[list[str]]) -> list[str]:
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    from megatron_plugins.errors import UsageError
    from megatron_plugins.launch.pretrain import parse_mimo_args

    stripped = [flag for flag in TINY_MIMO if flag not in ("--tokenizer-type", "NullTokenizer")]
    verdicts = []
    for flags in [[], *cases]:
        try:
            run = parse_mimo_args([*stripped, *flags, "--grid", "language:dp=1"])
        except UsageError as error:
            verdicts.append(str(error))
        else:
            verdicts.append(f"{run.args.tokenizer_type} {run.args.eval_interval}")
    return verdicts


def test_cpu_simulation_defaults_and_explicit_gpu_flags() -> None:
    [verdicts] = run_in_processes(_verdicts, 1, args=([flags for flags, _ in CPU_DEFAULT_CASES],),
                                  timeout=150, simulated=True)
    assert verdicts[0] == "NullTokenizer 5"  # tokenizer defaulted; TINY_MIMO's interval kept
    for verdict, (_, message) in zip(verdicts[1:], CPU_DEFAULT_CASES):
        assert verdict.startswith(message), verdict
