"""mimo-plan: the rank map of a good layout (with ``--gpu``, the advisor's memory per rank), one
line and exit code 2 for a bad one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_plugins.launch.plan import main
from tests.harness.multiprocess import REPO_ROOT, run_python
from tests.harness.worker_cache import once_per_run

GOOD = ["--encoder", "vision=vit", "--grid", "vision:tp=2", "--grid", "language:pp=2,dp=2,ep=2",
        "--num-experts", "4", "--nproc-per-node", "6"]


def test_prints_modules_and_rank_coordinates(capsys):
    assert main(GOOD) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.splitlines() == [
        "world: 6 ranks on 1 node(s) of 6; modules in rank order: vision, language",
        "module vision provider=vit ranks=0-1 nodes=0-0 group sizes: tp=2 cp=1 dp=1 pp=1 | "
        "expt_tp=1 ep=1 expt_dp=2 pp=1",
        "module language ranks=2-5 nodes=0-0 group sizes: tp=1 cp=1 dp=2 pp=2 | "
        "expt_tp=1 ep=2 expt_dp=1 pp=2",
        "rank 0 node 0 vision: tp=0 cp=0 dp=0 pp=0 | expt_tp=0 ep=0 expt_dp=0 pp=0",
        "rank 1 node 0 vision: tp=1 cp=0 dp=0 pp=0 | expt_tp=0 ep=0 expt_dp=1 pp=0",
        "rank 2 node 0 language: tp=0 cp=0 dp=0 pp=0 | expt_tp=0 ep=0 expt_dp=0 pp=0",
        "rank 3 node 0 language: tp=0 cp=0 dp=1 pp=0 | expt_tp=0 ep=1 expt_dp=0 pp=0",
        "rank 4 node 0 language: tp=0 cp=0 dp=0 pp=1 | expt_tp=0 ep=0 expt_dp=0 pp=1",
        "rank 5 node 0 language: tp=0 cp=0 dp=1 pp=1 | expt_tp=0 ep=1 expt_dp=0 pp=1",
    ]


def test_nnodes_multiplies_the_world_size(capsys):
    assert main(["--llm-dp", "4", "--nproc-per-node", "4"]) == 2  # 1 encoder rank + 4
    assert "WORLD_SIZE / --nproc-per-node is 4 but the --grid sizes sum to 5" in (
        capsys.readouterr().err
    )
    assert main(["--llm-dp", "4", "--nproc-per-node", "1", "--nnodes", "5"]) == 0
    assert "world: 5 ranks on 5 node(s) of 1; modules in rank order: vision, language" in (
        capsys.readouterr().out
    )


@pytest.mark.multirank
def test_bad_layout_prints_one_line_and_exits_2():
    command = [sys.executable, "-m", "megatron_plugins.launch.plan", "--encoder", "vision=vit",
               "--grid", "vision:dp=2", "--grid", "language:tp=3", "--num-attention-heads", "4",
               "--nproc-per-node", "5"]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "mimo-plan: error: --grid language: tp=3 does not divide --num-attention-heads 4; "
        "choose tp in {1, 2, 4}"
    ]


CLUSTER_COMMAND = (
    "torchrun --nnodes 136 --nproc-per-node 8 examples/mimo/pretrain_mimo.py "
    "--encoder vision=vit --grid vision:dp=64 --grid language:tp=16,pp=4,dp=16 "
    "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 "
    "--max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 256 --lr 1e-4 "
    "--bf16 --use-distributed-optimizer --tokenizer-type NullTokenizer --vocab-size 32000"
).split()


def test_full_training_command_line_gets_a_summary_and_a_cross_node_tp_warning(capsys):
    assert main(CLUSTER_COMMAND) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:5] == [
        "world: 1088 ranks on 136 node(s) of 8; modules in rank order: vision, language",
        "module vision provider=vit ranks=0-63 nodes=0-7 group sizes: tp=1 cp=1 dp=64 pp=1 | "
        "expt_tp=1 ep=1 expt_dp=64 pp=1",
        "module language ranks=64-1087 nodes=8-135 group sizes: tp=16 cp=1 dp=16 pp=4 | "
        "expt_tp=1 ep=1 expt_dp=256 pp=4",
        "WARNING: module language: 64 of 64 tp groups (16 ranks each) span nodes (8 ranks per "
        "node); tp traffic then crosses the network every layer: keep tp groups inside a node "
        "(a tp dividing 8, module sizes ending on node boundaries)",
        "(per-rank table: add --ranks; shown by default up to 64 ranks)",
    ]
    assert len(lines) == 5
    assert main([*CLUSTER_COMMAND, "--ranks"]) == 0
    table = capsys.readouterr().out.splitlines()[4:]
    assert len(table) == 1088 and table[1087].startswith("rank 1087 node 135 language: tp=15")


def test_groups_inside_nodes_get_no_warning_and_misaligned_ones_do(capsys):
    layout = ["--encoder", "vision=vit", "--grid", "vision:dp=4", "--num-attention-heads", "8",
              "--nproc-per-node", "4", "--nnodes", "3"]
    assert main([*layout, "--grid", "language:tp=4,dp=2"]) == 0
    assert "WARNING" not in capsys.readouterr().out
    assert main([*layout, "--grid", "language:tp=8"]) == 0  # ranks 4-11: one tp group, 2 nodes
    assert "WARNING: module language: 1 of 1 tp groups (8 ranks each) span nodes" in (
        capsys.readouterr().out
    )


def test_language_context_parallel_groups_across_nodes_are_warned_and_shown_per_rank(capsys):
    command = ["--encoder", "vision=vit", "--grid", "vision:dp=2", "--grid", "language:cp=2,dp=2",
               "--seq-length", "64", "--nproc-per-node", "3", "--nnodes", "2"]
    assert main(command) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == ("module language ranks=2-5 nodes=0-1 group sizes: tp=1 cp=2 dp=2 pp=1 | "
                        "expt_tp=1 ep=1 expt_dp=4 pp=1")
    # Ranks 2 and 3 (cp 0 and 1 of dp replica 0) sit on nodes 0 and 1; replica 1 on node 1.
    assert lines[3].startswith("WARNING: module language: 1 of 2 cp groups (2 ranks each) span "
                               "nodes (3 ranks per node); cp traffic then crosses the network")
    assert lines[-4:] == [
        "rank 2 node 0 language: tp=0 cp=0 dp=0 pp=0 | expt_tp=0 ep=0 expt_dp=0 pp=0",
        "rank 3 node 1 language: tp=0 cp=1 dp=0 pp=0 | expt_tp=0 ep=0 expt_dp=1 pp=0",
        "rank 4 node 1 language: tp=0 cp=0 dp=1 pp=0 | expt_tp=0 ep=0 expt_dp=2 pp=0",
        "rank 5 node 1 language: tp=0 cp=1 dp=1 pp=0 | expt_tp=0 ep=0 expt_dp=3 pp=0",
    ]
    layout = command[:8]
    assert main([*layout, "--nproc-per-node", "2", "--nnodes", "3"]) == 0
    assert "WARNING" not in capsys.readouterr().out  # each replica's cp pair on a node of its own
    assert main([*layout[:7], "62", "--nproc-per-node", "6"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "mimo-plan: error: --seq-length 62 is not a multiple of 4: --grid language: cp=2 cuts "
        "every row into 2 x cp = 4 equal context-parallel chunks; choose --seq-length 60 or 64"]


@pytest.mark.parametrize("flags, message", [
    (["--grid", "vision:tp=3", "--grid", "language:dp=2", "--nproc-per-node", "5"],
     "--grid vision: tp=3 does not divide the vision encoder's attention heads 4"),
    (["--encoder", "vísion=vit", "--grid", "vísion:", "--grid", "language:",
      "--nproc-per-node", "2"],
     "--encoder vísion=vit: module name 'vísion' is not valid: a module name starts with an "
     "ASCII letter"),
    (["--grid", "vision:", "--grid", "language:", "--nproc-per-node", "2", "--freeze-vit"],
     "--freeze-vit is upstream Megatron-LM examples/mimo's flag"),
    (["--grid", "vision:", "--grid", "language:", "--nproc-per-node", "2",
      "--freeze-lm", "--freeze-encoder", "vision"], "leaves nothing to train"),
])
def test_plan_refuses_what_the_launch_refuses(flags, message, capsys):
    assert main(["--encoder", "vision=vit", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.multirank
def test_plan_launches_and_imports_nothing_heavy():
    code = ("import sys; from megatron_plugins.launch.plan import main; main(['--nproc-per-node', '1']); "
            "heavy = {'torch', 'megatron', 'numpy'}; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & heavy))")
    result = run_python(code, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"


LAUNCHERS = sorted([*(REPO_ROOT / "examples" / "mimo" / "scripts").glob("*.sh"),
                    *(REPO_ROOT / "examples" / "mimo" / "recipes").glob("*/train_*.sh"),
                    *(REPO_ROOT / "examples" / "mimo" / "recipes").glob("*/train_*.sbatch")])
"""The GPU launch scripts and the recipes' (a recipe plans with its shipped config.json)."""
PLAN_COMMAND = ["-m", "megatron_plugins.launch.plan"]
RECORDING_PYTHON = '#!/bin/sh\nprintf \'%s\\0\' "$PWD" "$@" > "$MIMO_PLAN_COMMAND"\n'
"""A ``python`` for the launchers' PATH that records its folder and arguments, NUL-separated."""


@once_per_run  # the Qwen3.5-VL recipe's launchers are checked by two tests
def _plan_only(script: Path) -> str:
    """What ``script`` run with MIMO_PLAN_ONLY=1 prints: the script's bash builds and runs its
    ``python -m megatron_plugins.launch.plan`` command line, which a recording ``python``
    hands to this process's :func:`main` (with encoders at TP > 1 the plan imports Megatron:
    ~12 s of CPU in a fresh interpreter per launcher)."""
    import contextlib
    import io
    import tempfile

    with tempfile.TemporaryDirectory() as shims:
        python, recorded = Path(shims) / "python", Path(shims) / "command"
        python.write_text(RECORDING_PYTHON)
        python.chmod(0o755)
        env = {**os.environ, "MIMO_PLAN_ONLY": "1", "MIMO_PLAN_COMMAND": str(recorded),
               "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}"}
        result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stderr
        folder, *argv = recorded.read_text().split("\0")[:-1]
    assert argv[:2] == PLAN_COMMAND, argv
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(folder), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv[2:])
    assert code == 0, err.getvalue()
    return out.getvalue()


@pytest.mark.parametrize("script", LAUNCHERS,
                         ids=[path.stem for path in LAUNCHERS])
@pytest.mark.multirank
def test_gpu_launchers_pass_the_planning_view(script):
    printed = _plan_only(script)
    world = int(printed.split()[1])
    assert world == len([line for line in printed.splitlines() if line.startswith("rank ")])
    assert "WARNING" not in printed
    assert world >= 8


QWEN3_5_RECIPE = REPO_ROOT / "examples" / "mimo" / "recipes" / "qwen3_5_vl"


@pytest.mark.parametrize("script, kinds", [
    ("train_slurm.sbatch", ["image", "language stage 0", "language stage 1"]),
    ("train_colocated_16gpu.sh", ["language stage 0", "language stage 1"]),
])
@pytest.mark.multirank
def test_the_qwen3_5_vl_recipe_plans_with_its_memory_per_rank(script, kinds):
    """The 27B recipe's config-only folder: the rank map, then each kind of rank's memory by the
    advisor's model (Gated DeltaNet layers counted as such), every one within an H100's usable
    memory."""
    lines = _plan_only(QWEN3_5_RECIPE / script).splitlines()
    assert lines[0].startswith("world: ")
    [line] = [line for line in lines if line.startswith("memory per rank")]
    assert line.startswith("memory per rank (GiB, the advisor's model; h100-sxm: ")
    usable = float(re.search(r"([\d.]+) usable\): ", line).group(1))
    per_rank = {kind: float(gib) for kind, gib in
                re.findall(r"([a-z][a-z0-9 ]*?) ([\d.]+)(?:, |;)", line.split("usable): ")[1])}
    assert list(per_rank) == kinds
    assert all(0 < gib <= usable for gib in per_rank.values())
    assert line.endswith("; fits")


def test_nodes_of_unequal_sizes_keep_the_language_tp_groups_inside_nodes(capsys):
    """Bridge's 17 ranks on three nodes: the encoder's rank alone on node 0 (torchrun there with
    --nproc-per-node 1), the language model's TP-4 groups on nodes 1 and 2."""
    layout = ["--encoder", "vision=vit", "--grid", "vision:", "--grid", "language:tp=4,pp=2,dp=2",
              "--num-attention-heads", "8"]
    assert main([*layout, "--nproc-per-node", "1,8,8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [
        "world: 17 ranks on 3 node(s) of 1,8,8; modules in rank order: vision, language",
        "module vision provider=vit ranks=0-0 nodes=0-0 group sizes: tp=1 cp=1 dp=1 pp=1 | "
        "expt_tp=1 ep=1 expt_dp=1 pp=1",
        "module language ranks=1-16 nodes=1-2 group sizes: tp=4 cp=1 dp=2 pp=2 | "
        "expt_tp=1 ep=1 expt_dp=8 pp=2",
    ]
    assert [line.split(" language:")[0] for line in lines[3:] if " language:" in line] == [
        f"rank {rank} node {1 if rank <= 8 else 2}" for rank in range(1, 17)]
    assert main([*layout, "--nproc-per-node", "8,8,1", "--nnodes", "3"]) == 0
    assert ("WARNING: module language: 2 of 4 tp groups (4 ranks each) span nodes (8,8,1 ranks "
            "per node)") in capsys.readouterr().out
    assert main([*layout, "--nproc-per-node", "1,8,8", "--nnodes", "2"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "mimo-plan: error: --nnodes 2 but --nproc-per-node 1,8,8 names 3 nodes; give one count "
        "per node"]
    assert main([*layout, "--nproc-per-node", "1,0,8"]) == 2
    assert "'1,0,8' is not a rank count (8) or one per node in node-rank order (1,8,8)" in (
        capsys.readouterr().err)


def test_colocated_layout_is_described_with_both_modules_per_rank(capsys):
    assert main(["--encoder", "vision=vit", "--grid", "vision:dp=4@language",
                 "--grid", "language:tp=2,dp=2", "--nproc-per-node", "4",
                 "--micro-batch-size", "2"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "world: 4 ranks on 1 node(s) of 4; modules in rank order: language; vision on language",
        "module language ranks=0-3 nodes=0-0 group sizes: tp=2 cp=1 dp=2 pp=1 | "
        "expt_tp=1 ep=1 expt_dp=4 pp=1",
        "module vision provider=vit ranks=0-3 (on language) nodes=0-0 group sizes: tp=1 cp=1 "
        "dp=4 pp=1 | expt_tp=1 ep=1 expt_dp=4 pp=1",
        # Language replica 0 (ranks 0, 1) merges positions 0 and 1, computed by ranks 0 and 1:
        # each rank holds one of its two rows and receives the other; gradients stay.
        "routing vision -> language (--micro-batch-size 2): 50% of the rows the first language "
        "stage merges are computed on the merging rank; per vision row, 1 copies cross ranks "
        "forward and 0 gradients back",
        "rank 0 node 0 language: tp=0 cp=0 dp=0 pp=0 | expt_tp=0 ep=0 expt_dp=0 pp=0; "
        "vision: tp=0 cp=0 dp=0 pp=0 | expt_tp=0 ep=0 expt_dp=0 pp=0",
        "rank 1 node 0 language: tp=1 cp=0 dp=0 pp=0 | expt_tp=0 ep=0 expt_dp=1 pp=0; "
        "vision: tp=0 cp=0 dp=1 pp=0 | expt_tp=0 ep=0 expt_dp=1 pp=0",
        "rank 2 node 0 language: tp=0 cp=0 dp=1 pp=0 | expt_tp=0 ep=0 expt_dp=2 pp=0; "
        "vision: tp=0 cp=0 dp=2 pp=0 | expt_tp=0 ep=0 expt_dp=2 pp=0",
        "rank 3 node 0 language: tp=1 cp=0 dp=1 pp=0 | expt_tp=0 ep=0 expt_dp=3 pp=0; "
        "vision: tp=0 cp=0 dp=3 pp=0 | expt_tp=0 ep=0 expt_dp=3 pp=0",
    ]


def test_mixed_layout_lists_modules_in_rank_order(capsys):
    command = ["--encoder", "vision=vit", "--encoder", "audio=audio",
               "--grid", "vision:dp=2@language", "--grid", "audio:dp=1", "--grid", "language:dp=2"]
    assert main([*command, "--nproc-per-node", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("world: 3 ranks on 1 node(s) of 3; modules in rank order: audio, "
                        "language; vision on language")
    assert [line.split(" ranks=")[0] for line in lines[1:4]] == [
        "module audio provider=audio", "module language", "module vision provider=vit"]
    assert "ranks=1-2 (on language) nodes=0-0" in lines[3]
    assert lines.pop(4) == ("routing vision -> language: add --micro-batch-size to see how many "
                            "of its rows cross ranks")
    assert [line.split(" | ")[0] for line in lines[4:]] == [
        "rank 0 node 0 audio: tp=0 cp=0 dp=0 pp=0",
        "rank 1 node 0 language: tp=0 cp=0 dp=0 pp=0",
        "rank 2 node 0 language: tp=0 cp=0 dp=1 pp=0",
    ]
    assert lines[5].endswith("; vision: tp=0 cp=0 dp=0 pp=0 | expt_tp=0 ep=0 expt_dp=0 pp=0")
    assert main([*command, "--nproc-per-node", "4"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "mimo-plan: error: WORLD_SIZE / --nproc-per-node is 4 but the --grid sizes sum to 3 "
        "(audio 1 + language 2; vision on language); launch 3 ranks or change the grids"]


GPU_MODEL = ["--encoder", "vision=vit", "--num-layers", "2", "--hidden-size", "64",
             "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings",
             "32", "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16",
             "--use-distributed-optimizer", "--vocab-size", "128", "--position-embedding-type",
             "rope", "--lr", "1e-4", "--train-iters", "10"]
"""A plain GPU command line's model: stock defaults, so RoPE fusion (Transformer Engine) is on."""

GPU_LAYOUT = ["--grid", "vision:dp=1", "--grid", "language:tp=2,pp=2,dp=2", "--nproc-per-node",
              "9"]


@pytest.mark.parametrize("mode, flags", [
    ("plain", GPU_LAYOUT),
    ("gpu", [*GPU_LAYOUT, "--gpu", "h100-sxm"]),
    ("advise", ["--advise", "--gpus", "8", "--gpu", "h100-sxm", "--advise-samples", "8"]),
])
def test_a_gpu_command_line_plans_where_transformer_engine_is_missing(mode, flags, capsys,
                                                                      monkeypatch):
    """Planning reads the command the GPUs will run (compat Gap 34): stock's RoPE fusion check
    does not ask this machine, which may have no Transformer Engine."""
    from megatron_plugins import cpu_simulation

    monkeypatch.setattr(cpu_simulation, "is_active", lambda: False)  # a login node's process
    assert main([*GPU_MODEL, *flags]) == 0
    captured = capsys.readouterr()
    assert "error" not in captured.err
    out = captured.out.splitlines()
    if mode == "advise":
        assert out[0].startswith("mimo-plan --advise: 8 GPUs (1 node(s) of 8) of h100-sxm")
    else:
        assert out[0] == ("world: 9 ranks on 1 node(s) of 9; modules in rank order: vision, "
                          "language")
        assert [line.startswith("memory per rank") for line in out].count(True) == (
            mode == "gpu")
