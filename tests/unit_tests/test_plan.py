"""mimo-plan: the rank map of a good layout, one line and exit code 2 for a bad one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_plugins.plan import main
from tests.multiprocess import REPO_ROOT

GOOD = ["--encoder", "vision=vit", "--grid", "vision:tp=2", "--grid", "language:pp=2,dp=2,ep=2",
        "--num-experts", "4", "--nproc-per-node", "6"]


def test_prints_modules_and_rank_coordinates(capsys):
    assert main(GOOD) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.splitlines() == [
        "world: 6 ranks; modules in rank order: vision, language",
        "module vision provider=vit ranks=0-1 group sizes: tp=2 cp=1 dp=1 pp=1 | "
        "expt_tp=1 ep=1 expt_dp=2 pp=1",
        "module language ranks=2-5 group sizes: tp=1 cp=1 dp=2 pp=2 | "
        "expt_tp=1 ep=2 expt_dp=1 pp=2",
        "rank 0 vision: tp=0 cp=0 dp=0 pp=0 | expt_tp=0 ep=0 expt_dp=0 pp=0",
        "rank 1 vision: tp=1 cp=0 dp=0 pp=0 | expt_tp=0 ep=0 expt_dp=1 pp=0",
        "rank 2 language: tp=0 cp=0 dp=0 pp=0 | expt_tp=0 ep=0 expt_dp=0 pp=0",
        "rank 3 language: tp=0 cp=0 dp=1 pp=0 | expt_tp=0 ep=1 expt_dp=0 pp=0",
        "rank 4 language: tp=0 cp=0 dp=0 pp=1 | expt_tp=0 ep=0 expt_dp=0 pp=1",
        "rank 5 language: tp=0 cp=0 dp=1 pp=1 | expt_tp=0 ep=1 expt_dp=0 pp=1",
    ]


def test_nnodes_multiplies_the_world_size(capsys):
    assert main(["--llm-dp", "4", "--nproc-per-node", "4"]) == 2  # 1 encoder rank + 4
    assert "WORLD_SIZE / --nproc-per-node is 4 but the --grid sizes sum to 5" in (
        capsys.readouterr().err
    )
    assert main(["--llm-dp", "4", "--nproc-per-node", "1", "--nnodes", "5"]) == 0
    assert "world: 5 ranks; modules in rank order: vision, language" in capsys.readouterr().out


def test_bad_layout_prints_one_line_and_exits_2():
    command = [sys.executable, "-m", "megatron_plugins.plan", "--encoder", "vision=vit",
               "--grid", "vision:dp=2", "--grid", "language:tp=3", "--num-attention-heads", "4",
               "--nproc-per-node", "5"]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "mimo-plan: error: --grid language: tp=3 does not divide --num-attention-heads 4; "
        "choose tp in {1, 2, 4}"
    ]


def test_plan_launches_and_imports_nothing_heavy():
    code = ("import sys; from megatron_plugins.plan import main; main(['--nproc-per-node', '1']); "
            "heavy = {'torch', 'megatron', 'numpy'}; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & heavy))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"


LAUNCHERS = sorted((REPO_ROOT / "examples" / "mimo" / "scripts").glob("*.sh"))


@pytest.mark.parametrize("script", LAUNCHERS, ids=[path.stem for path in LAUNCHERS])
def test_gpu_launchers_pass_the_planning_view(script):
    env = {**os.environ, "MIMO_PLAN_ONLY": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    world = int(result.stdout.split()[1])
    assert world == len([line for line in result.stdout.splitlines() if line.startswith("rank ")])
    assert world >= 8
