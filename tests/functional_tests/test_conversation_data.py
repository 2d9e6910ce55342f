"""Conversations train: a LLaVA-style folder converted by ``make_energon_dataset --kind
conversation`` (images of several sizes, system turns, the ``<image>`` marker before, after or
missing), rendered with ``--chat-template``, trains through the entry point with finite losses,
gives the same losses with the vision encoder at dp2, and is refused in one line without a template.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.energon_data import energon_flags, synthetic_dataset
from tests.mimo_runs import TINY_MIMO, train_mimo
from tests.multiprocess import REPO_ROOT, run_script
from tests.tensorboard_scalars import read_scalars

SCRIPT = REPO_ROOT / "examples" / "mimo" / "pretrain_mimo.py"
TEMPLATE = REPO_ROOT / "tests" / "fixtures" / "chat_template.jinja"
SGD = ("--optimizer", "sgd", "--lr", "0.05", "--min-lr", "0.005")
LONGER = ("--seq-length", "64", "--max-position-embeddings", "64")
VISION = ("--encoder", "vision=vit", "--grid")


def _flags() -> tuple[str, ...]:
    return (*LONGER, *SGD, *energon_flags(synthetic_dataset("conversation")),
            "--chat-template", str(TEMPLATE))


def test_a_converted_llava_folder_trains_through_the_entry_point(tmp_path: Path) -> None:
    run = run_script(SCRIPT, [*TINY_MIMO, *_flags(), *VISION, "vision:", "--grid", "language:",
                              "--train-iters", "4", "--eval-interval", "2",
                              "--tensorboard-dir", str(tmp_path)], nproc=2, timeout=240)
    assert run.returncode == 0, run.output[-4000:]
    losses = read_scalars(tmp_path, "lm loss")
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values())
    assert "Traceback" not in run.output


def test_conversations_train_the_same_with_the_encoder_at_dp2() -> None:
    reference, _ = train_mimo(2, (*VISION, "vision:", "--grid", "language:"), extra=_flags(),
                              timeout=240)
    scalars, _ = train_mimo(3, (*VISION, "vision:dp=2", "--grid", "language:"), extra=_flags(),
                            timeout=240)
    assert sorted(scalars["lm loss"]) == list(range(1, 11))
    assert all(math.isfinite(value) for value in scalars["lm loss"].values())
    for iteration, value in reference["lm loss"].items():
        assert scalars["lm loss"][iteration] == pytest.approx(value, rel=1e-5), iteration


def test_without_a_chat_template_the_launch_exits_2_in_one_line() -> None:
    root = synthetic_dataset("conversation")
    # One plain process, no rendezvous address: it could not even form a process group.
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    run = subprocess.run([sys.executable, str(SCRIPT), *TINY_MIMO, *LONGER, *VISION, "vision:",
                          "--grid", "language:", *energon_flags(root)],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-3000:]
    errors = re.findall(r"^pretrain_mimo\.py: error: (.*)$", run.stderr, flags=re.M)
    assert errors == [f"--tokenizer-model {root / 'tokenizer'} has no chat template, which "
                      f"--data-path {root / 'energon'} needs to render its conversations; use a "
                      "tokenizer with one (chat_template in its tokenizer_config.json) or give "
                      "--chat-template FILE (a Jinja template)"], run.stderr
    assert "Traceback" not in run.stderr
