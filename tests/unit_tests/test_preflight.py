"""Checks before any Megatron import: upstream flags, freezing, the refused-layout fast path."""

from __future__ import annotations

import subprocess
import time

import pytest

from megatron_plugins.errors import FlagError
from megatron_plugins.parallel.layout import LayoutError
from megatron_plugins.launch.preflight import (
    EVERY_ENCODER,
    check_parser,
    check_run,
    resolve_freeze,
)
from tests.harness.multiprocess import run_python

TWO = ["--encoder", "vision=vit", "--encoder", "audio=audio", "--grid", "vision:",
       "--grid", "audio:", "--grid", "language:dp=2"]


def _freeze(flags: list[str]) -> list[str]:
    args, _ = check_parser().parse_known_args([*TWO, *flags])
    return resolve_freeze(args, check_run(TWO, 4).layout)


def test_upstream_freeze_flags_mean_what_they_mean_upstream():
    args, _ = check_parser().parse_known_args([*TWO, "--freeze-lm"])
    assert args.freeze_language_model is True
    assert _freeze(["--freeze-projection"]) == ["vision", "audio"]  # bare: every encoder's
    assert _freeze(["--freeze-projection", "audio"]) == ["audio"]
    assert EVERY_ENCODER not in _freeze(["--freeze-projection", "--freeze-projection", "vision"])


def test_freezing_every_module_is_refused_in_one_line():
    with pytest.raises(FlagError, match="^--freeze-language-model with --freeze-encoder for every "
                                        "encoder \\(vision, audio\\) leaves nothing to train"):
        check_run([*TWO, "--freeze-lm", "--freeze-encoder", "vision", "--freeze-encoder",
                   "audio"], 4)
    check_run([*TWO, "--freeze-lm", "--freeze-encoder", "vision"], 4)  # audio still trains


def test_upstream_layout_flags_are_accepted_with_their_meaning():
    layout = check_run(["--encoder-tp", "2", "--encoder-dp", "2", "--llm-offset", "4",
                        "--llm-tp", "2", "--llm-dp", "2"], 8).layout
    assert layout.language.rank_offset == 4 and layout.module("vision").tp == 2
    with pytest.raises(LayoutError, match="^--llm-offset 2: the language grid starts at rank 4"):
        check_run(["--encoder-tp", "2", "--encoder-dp", "2", "--llm-offset", "2",
                   "--llm-dp", "4"], 8)
    args, _ = check_parser().parse_known_args(["--encoder-ddp-overlap"])
    assert args.encoder_overlap_grad_reduce is True
    check_run(["--llm-dp", "2", "--encoder-ddp-overlap", "--overlap-grad-reduce"], 3)
    with pytest.raises(FlagError, match="^--encoder-ddp-overlap needs --overlap-grad-reduce"):
        check_run(["--llm-dp", "2", "--encoder-ddp-overlap"], 3)


@pytest.mark.parametrize("flag, instead", [
    ("--freeze-vit", "--freeze-encoder NAME"), ("--llm-only", "pretrain_gpt.py"),
    ("--model-provider=mock", "--encoder NAME=PROVIDER"), ("--image-size", "--vit-img-size"),
    ("--total-seq-length", "--seq-length"), ("--mimo-encoder-prefetch", "not supported"),
    ("--language-model-checkpoint", "--load"),
])
def test_upstream_flags_without_a_meaning_here_are_refused_in_one_line(flag, instead):
    with pytest.raises(FlagError) as error:
        check_run(["--llm-dp", "2", flag], 3)
    message = str(error.value)
    assert message.startswith(f"{flag.partition('=')[0]} is upstream Megatron-LM examples/mimo")
    assert instead in message and "\n" not in message


def test_other_flags_of_a_full_command_line_are_ignored():
    layout = check_run(["torchrun", "--nproc-per-node", "3", "train.py", "--llm-dp", "2",
                        "--num-layers", "2", "--lr", "1e-3", "--bf16", "--micro-batch-size", "2"],
                       3).layout
    assert layout.world_size == 3
    with pytest.raises(LayoutError, match="micro-batch-size 1 x --grid language"):
        check_run(["--encoder-dp", "2", "--micro-batch-size", "1"], 3)
    with pytest.raises(FlagError, match="argument --num-attention-heads: invalid int value"):
        check_run(["--llm-dp", "2", "--num-attention-heads", "four"], 3)


CP2 = ["torchrun", "--nproc-per-node", "3", "train.py", "--encoder", "vision=vit",
       "--grid", "vision:", "--grid", "language:cp=2", "--num-layers", "2"]


@pytest.mark.parametrize("flags, world_size, message", [
    ([*CP2, "--seq-length", "30"], 3,
     "^--seq-length 30 is not a multiple of 4: --grid language: cp=2"),
    (["--llm-tp", "2", "--llm-cp", "2", "--seq-length", "36", "--pack-sequences",
      "--sequence-parallel"], 5,
     "^--seq-length 36 is not a multiple of 8: .*--pack-sequences pads .* and "
     "--sequence-parallel splits"),
    ([*CP2, "--seq-length", "32", "--cp-comm-type", "p2p", "a2a+p2p"], 3,
     "^--cp-comm-type a2a\\+p2p with --grid language: cp=2 needs Megatron's global "
     "hierarchical CP groups"),
    ([*CP2, "--seq-length", "32", "--hybrid-context-parallel"], 3,
     "^--hybrid-context-parallel with --grid language: cp=2"),
], ids=["seq-length", "alias-packed-sp", "a2a+p2p", "hybrid-cp"])
def test_language_context_parallel_flags_are_checked_from_the_raw_command_line(
        flags, world_size, message):
    with pytest.raises(LayoutError, match=message):
        check_run(flags, world_size)


def test_language_context_parallelism_passes_the_preflight():
    layout = check_run([*CP2, "--seq-length", "64", "--pack-sequences", "--sequence-parallel",
                        "--cp-comm-type", "all_gather", "--micro-batch-size", "2"], 3).layout
    assert layout.language.cp == 2 and layout.language.size == 2
    args, _ = check_parser().parse_known_args([*CP2, "--cp-comm-type", "p2p", "a2a"])
    assert args.cp_comm_type == ["p2p", "a2a"]  # one per layer, as stock parses it


@pytest.mark.multirank
def test_a_process_spawned_by_a_rank_re_imports_the_entry_point_without_torch():
    """Stock's first checkpoint save spawns a Manager per rank, which re-imports the launched
    script as ``__mp_main__``: importing torch and Megatron there cost ~6 s and ~750 MiB a rank."""
    code = ("import sys; sys.argv = ['pretrain_mimo.py', '--cpu-simulation', '--grid', "
            "'language:dp=4']; sys.modules['torch'] = None\n"
            "import runpy; runpy.run_path('examples/mimo/pretrain_mimo.py', run_name='__mp_main__')"
            "\nprint(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'torch')))")
    result = run_python(code, timeout=60, env={"WORLD_SIZE": "3", "PATH": ""})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["['torch']"]  # only the stand-in set above


def _entry_point(flags: list[str], world_size: int) -> subprocess.CompletedProcess:
    """The example entry point under ``WORLD_SIZE``, with torch made unimportable."""
    code = (f"import sys; sys.argv = ['pretrain_mimo.py', '--cpu-simulation', *{flags!r}]; "
            "sys.modules['torch'] = None\n"
            "import runpy; runpy.run_path('examples/mimo/pretrain_mimo.py', run_name='__main__')")
    return run_python(code, timeout=60, env={"WORLD_SIZE": str(world_size), "PATH": ""})


@pytest.mark.multirank
def test_a_refused_layout_exits_2_before_torch_is_imported():
    start = time.monotonic()
    result = _entry_point(["--grid", "language:dp=4"], 3)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "pretrain_mimo.py: error: WORLD_SIZE / --nproc-per-node is 3 but the --grid sizes sum "
        "to 4 (language 4); launch 4 ranks or change the grids"]
    assert time.monotonic() - start < 10


COLOCATED = ["--encoder", "vision=vit", "--grid", "vision:dp=4@language",
             "--grid", "language:tp=2,dp=2"]
MIXED = ["--encoder", "vision=vit", "--encoder", "audio=audio", "--grid", "vision:dp=2@language",
         "--grid", "audio:dp=1", "--grid", "language:dp=2"]


@pytest.mark.parametrize("flags, world_size", [(COLOCATED, 4), (MIXED, 3)],
                         ids=["colocated", "mixed"])
def test_a_launch_takes_colocated_layouts(flags, world_size):
    layout = check_run(flags, world_size).layout
    assert layout.world_size == world_size and layout.hosted == (layout.module("vision"),)


def test_colocated_refusals_read_the_raw_command_line():
    with pytest.raises(LayoutError,
                       match="^--balance-encoder-work with --grid vision:dp=4@language"):
        check_run([*COLOCATED, "--balance-encoder-work"], 4)
    with pytest.raises(LayoutError, match="^--grid vision:dp=4@language: colocated on language's "
                                          "2 ranks, tp x dp must be 2 \\(is 4\\)"):
        check_run([*COLOCATED[:4], "--grid", "language:dp=2"], 2)


def test_encoder_recompute_needs_an_encoder_on_the_language_ranks():
    assert check_run([*COLOCATED, "--colocated-encoder-recompute"], 4).layout.hosted
    separate = ["--encoder", "vision=vit", "--grid", "vision:dp=2", "--grid", "language:dp=2"]
    with pytest.raises(FlagError) as refused:
        check_run([*separate, "--colocated-encoder-recompute"], 4)
    assert str(refused.value) == (
        "--colocated-encoder-recompute: no encoder is on the language model's ranks, so no "
        "encoder forward is kept until the backward; drop the flag or colocate an encoder with "
        "--grid NAME:...@language")


@pytest.mark.multirank
def test_the_entry_point_refuses_a_colocated_grid_of_the_wrong_size_before_torch_is_imported():
    result = _entry_point([*COLOCATED[:4], "--grid", "language:dp=2"], 2)
    assert result.returncode == 2
    assert result.stderr.splitlines()[0].startswith(
        "pretrain_mimo.py: error: --grid vision:dp=4@language: colocated on language's 2 ranks, "
        "tp x dp must be 2 (is 4)")


def test_only_flags_the_mimo_parse_does_not_read_are_left_for_stocks_parser():
    argv = ["--encoder", "vision=vit", "--num-layers", "2", "--grid", "vision:",
            "--encoder-hf-weights=vision=/hf", "--lr", "1e-3", "--grid", "language:dp=2",
            "--cpu-simulation", "--freeze-lm", "--data-path", "a", "b"]
    checked = check_run(argv, 3)
    assert checked.command_line.stock_argv == ("--num-layers", "2", "--lr", "1e-3",
                                                "--data-path", "a", "b")
    assert checked.command_line.flags.mimo_encoders == {"vision": "vit"}
    assert checked.command_line.flags.cpu_simulation is True
    assert not hasattr(checked.command_line.flags, "num_layers")  # stock's, read by stock


ACTIVATION = """
import atexit, runpy, sys
from megatron_plugins.cpu_simulation import patches
seen, activate = [], patches.activate
def recording():
    seen.append(sorted(name for name in sys.modules if name.split(".")[0] == "megatron"))
    activate()
patches.activate = recording
atexit.register(lambda: print("megatron modules at activation:", seen, flush=True))
sys.argv = ["pretrain_mimo.py", *{flags!r}]
runpy.run_path("examples/mimo/pretrain_mimo.py", run_name="__main__")
"""


@pytest.mark.multirank
@pytest.mark.parametrize("tp", [1, 2])
def test_the_cpu_simulation_is_active_before_megatron_is_imported(tp):
    """An encoder at tp > 1 makes the pre-import checks build its plugin (its head count),
    which imports Megatron: the simulation is switched on before, as on every other path."""
    flags = ["--cpu-simulation", "--encoder", "vision=vit", "--grid", f"vision:tp={tp}",
             "--grid", "language:dp=1", "--lrr", "1"]
    result = run_python(ACTIVATION.format(flags=flags),
                            env={"WORLD_SIZE": str(tp + 1), "PATH": ""})
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "megatron modules at activation: [[]]"
    # Stock's parser (Megatron) then read the flags: the unknown one is its verdict.
    assert result.stderr.splitlines()[-1] == (
        "pretrain_mimo.py: error: unknown flag --lrr (did you mean --lr?); see --help")
