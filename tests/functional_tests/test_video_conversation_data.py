"""Video files inside conversations, end to end: a hand-made ms-swift folder (a 1.5 s mp4 with an
AAC sound track, a silent 16x16 webm, a still image; 0..3 items a record) converted by the README's
commands trains a tiny Qwen2.5-VL tower (``--encoder vision=qwen2_5_vl``, multimodal RoPE)
with a language model through the entry point, the loader workers decoding the files; the
tower at dp2 on ranks of its own trains identically, every sample keyed and consumed."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.harness.energon_data import convert_by_the_readme, energon_flags
from tests.harness.mimo_runs import TINY_MIMO, MimoLaunch, consumed_keys, shared_run
from tests.harness.multiprocess import REPO_ROOT, run_preforked
from tests.harness.tensorboard_scalars import read_scalars
from tests.harness.video_files import write_video
from tests.harness.worker_cache import once_per_run

pytestmark = pytest.mark.multirank

SCRIPT = REPO_ROOT / "examples" / "mimo" / "pretrain_mimo.py"
TEMPLATE = REPO_ROOT / "tests" / "fixtures" / "chat_template.jinja"
RECORDS = 16
ITERATIONS = ("--train-iters", "4", "--eval-interval", "4", "--eval-iters", "0",
              "--global-batch-size", "4")
ONE_RANK_EACH = ("--grid", "vision:", "--grid", "language:")
VISION_DP2 = ("--grid", "vision:dp=2", "--grid", "language:")


def _record(index: int) -> dict:
    """A video with sound, a silent one, both (and an image), or text only, in turn."""
    videos = [["sound.mp4"], ["silent.webm"], ["silent.webm", "sound.mp4"], []][index % 4]
    images = ["square.png"] if index % 4 == 2 else []
    question = "<video>" * len(videos) + "<image>" * len(images) + "what moves"
    answer = {0: "a loud clip", 1: "a quiet clip", 2: "two clips and a square", 3: "nothing"}
    return {"id": f"v{index:03d}", "videos": videos, "images": images, "messages": [
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer[index % 4]}]}


@once_per_run
def video_folder() -> Path:
    """The folder (``swift.jsonl``, two video files, an image, a tiny Qwen2.5-VL tower whose
    merger maps to the language model's 64 hidden), converted and a tokenizer trained by the
    README's commands, once per test run."""
    from tests.models.hf_vision import save_tiny_qwen

    root = Path(tempfile.mkdtemp(prefix="mimo-video-conversations-"))
    write_video(root / "sound.mp4", 1.5, 8, sound_rate=16000)
    write_video(root / "silent.webm", 1.0, 6, (16, 16), sound_rate=None)
    Image.fromarray(np.full((16, 16, 3), (220, 30, 30), np.uint8)).save(root / "square.png")
    save_tiny_qwen(root / "qwen", vision_only=True, text_hidden=64)
    records = [_record(index) for index in range(RECORDS)]
    (root / "swift.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    texts = [turn["content"].replace("<image>", "").replace("<video>", "")
             for record in records for turn in record["messages"]]
    return convert_by_the_readme(root, root / "swift.jsonl", texts, "--split", "1,0,0",
                                 "--quiet", in_process=True)


def _flags() -> tuple[str, ...]:
    root = video_folder()
    return (*ITERATIONS, "--optimizer", "sgd", "--lr", "0.05", "--min-lr", "0.005",
            "--seq-length", "96", "--max-position-embeddings", "96",
            "--chat-template", str(TEMPLATE), "--encoder", "vision=qwen2_5_vl",
            "--encoder-hf-weights", f"vision={root / 'qwen'}",
            "--position-embedding-type", "mrope", "--mrope-section", "2", "3", "3",
            *energon_flags(root, workers=1))


@once_per_run
def entry_point_run() -> dict[int, float]:
    """One rank per module through the entry point: ``lm loss`` per iteration."""
    logdir = tempfile.mkdtemp(prefix="mimo-video-tb-")
    run = run_preforked(SCRIPT, [*TINY_MIMO, *_flags(), *ONE_RANK_EACH, "--tensorboard-dir",
                                 logdir], nproc=2, timeout=300)
    assert run.returncode == 0, run.output[-4000:]
    assert "Traceback" not in run.output
    return read_scalars(logdir, "lm loss")


def test_video_file_conversations_train_through_the_entry_point() -> None:
    losses = entry_point_run()
    assert sorted(losses) == [1, 2, 3, 4]
    assert all(math.isfinite(value) for value in losses.values())


def test_the_video_tower_at_dp2_on_ranks_of_its_own_trains_identically() -> None:
    reference = entry_point_run()
    scalars, results = shared_run(MimoLaunch(3, (*_flags(), *VISION_DP2), timeout=300))
    losses = scalars["lm loss"]
    assert sorted(losses) == sorted(reference)
    worst = max(abs(losses[i] - value) / abs(value) for i, value in reference.items())
    print(f"video tower dp2: max relative lm loss difference {worst:.2e} over "
          f"{len(reference)} iterations")
    assert worst <= 1e-5, (reference, losses)
    assert sorted(r["dp_rank"] for r in results if r["module"] == "vision") == [0, 1]
    language = consumed_keys(results, "language")
    vision = [key for r in results if r["module"] == "vision" for batch in r["keys"]
              for key in batch]
    assert sorted(vision) == sorted(language)  # both replicas' shares: every sample keyed
    counts = {tuple(c) for r in results if r["module"] == "vision"
              for step in r["item_tokens"] for c in step["vision"]}
    assert counts == {(32,), (8,), (8, 32, 4), ()}, counts  # 4 frames: 2 steps of 4x4 or 2x2
