"""Conversations train: a LLaVA-style folder converted by ``make_energon_dataset --kind
conversation`` (images of several sizes, system turns, the ``<image>`` marker before, after or
missing), rendered with ``--chat-template``, trains through the entry point with finite losses,
gives the same losses with the vision encoder at dp2, and is refused in one line without a template.
A folder with 0..3 images per record (text-only ones included) at varied resolutions trains with a
native-resolution vit by the README's commands, and identically (loss and item keys) whatever the
encoder and language DP sizes and at language context parallelism 2.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.harness.energon_data import (convert_by_the_readme, energon_flags,
                                         synthetic_dataset)
from tests.harness.mimo_runs import TINY_MIMO, MimoLaunch, shared_run, train_mimo
from tests.harness.multiprocess import REPO_ROOT, run_preforked
from tests.harness.tensorboard_scalars import read_scalars

pytestmark = pytest.mark.multirank

SCRIPT = REPO_ROOT / "examples" / "mimo" / "pretrain_mimo.py"
TEMPLATE = REPO_ROOT / "tests" / "fixtures" / "chat_template.jinja"
SGD = ("--optimizer", "sgd", "--lr", "0.05", "--min-lr", "0.005")
LONGER = ("--seq-length", "64", "--max-position-embeddings", "64")
VISION = ("--encoder", "vision=vit", "--grid")


def _flags() -> tuple[str, ...]:
    return (*LONGER, *SGD, *energon_flags(synthetic_dataset("conversation")),
            "--chat-template", str(TEMPLATE))


def test_a_converted_llava_folder_trains_through_the_entry_point(tmp_path: Path) -> None:
    run = run_preforked(SCRIPT, [*TINY_MIMO, *_flags(), *VISION, "vision:", "--grid",
                                 "language:", "--train-iters", "4", "--eval-interval", "2",
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
    # Rank 0 of 2 launched alone: it could not even form a process group.
    run = run_preforked(SCRIPT, [*TINY_MIMO, *LONGER, *VISION, "vision:", "--grid", "language:",
                                 *energon_flags(root)], nproc=1, world_size=2, timeout=90)
    assert run.returncode == 2, run.output[-3000:]
    errors = re.findall(r"^pretrain_mimo\.py: error: (.*)$", run.output, flags=re.M)
    assert errors == [f"--tokenizer-model {root / 'tokenizer'} has no chat template, which "
                      f"--data-path {root / 'energon'} needs to render its conversations; use a "
                      "tokenizer with one (chat_template in its tokenizer_config.json) or give "
                      "--chat-template FILE (a Jinja template)"], run.output
    assert "Traceback" not in run.output


# 0..N images per record, text-only records, varied resolutions, native-resolution vit

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (40, 60, 230)}
NATIVE = ("--encoder", "vision=vit", "--vit-native-resolution", "--vit-max-pixels", "1024")
"""At most 16 patches of 8 pixels per image, at least 4 (--vit-min-pixels 256)."""
MULTI_FLAGS = ("--seq-length", "128", "--max-position-embeddings", "128",
               "--chat-template", str(TEMPLATE))


def _llava_record(index: int, rng: np.random.Generator, folder: Path) -> dict:
    """One record with ``index % 4`` images (0: text-only), each a coloured image of its own
    size, and the question about them."""
    count = index % 4
    colours = [str(rng.choice(list(COLOURS))) for _ in range(count)]
    images = []
    for number, colour in enumerate(colours):
        height, width = (int(side) for side in rng.integers(12, 49, size=2))
        pixels = np.zeros((height, width, 3), dtype=np.uint8)
        pixels[:, :] = COLOURS[colour]
        name = f"images/{index:04d}_{number}.png"
        Image.fromarray(pixels).save(folder / name)
        images.append(name)
    if not count:
        turns = [{"from": "human", "value": "what is two and two ?"},
                 {"from": "gpt", "value": "four"}]
    else:
        marked = index % 8 < 4  # half with markers, half with the images put first
        question = "<image>\n" * count * marked + "what colours are these ?"
        turns = [{"from": "human", "value": question}, {"from": "gpt", "value": " ".join(colours)}]
    record = {"id": f"s{index:04d}", "conversations": turns}
    if count:
        record["image"] = images if count > 1 else images[0]
    return record


@lru_cache(maxsize=None)
def llava_folder() -> Path:
    """A LLaVA-style folder (``llava.json``, ``images/``, and ``texts.txt`` for a tokenizer),
    converted and a tokenizer trained by the README's commands, once per test process."""
    root = Path(tempfile.mkdtemp(prefix="mimo-llava-"))
    (root / "images").mkdir()
    rng = np.random.default_rng(0)
    records = [_llava_record(index, rng, root) for index in range(200)]
    (root / "llava.json").write_text(json.dumps(records, indent=1))
    texts = [turn["value"].replace("<image>", "") for r in records for turn in r["conversations"]]
    return convert_by_the_readme(root, root / "llava.json", texts)


def _multi_flags() -> tuple[str, ...]:
    return (*MULTI_FLAGS, *energon_flags(llava_folder()))


def test_multi_image_and_text_only_conversations_train_by_the_readme_commands(
        tmp_path: Path) -> None:
    root = llava_folder()
    counts = {index % 4 for index in range(200)}
    assert counts == {0, 1, 2, 3}
    # The README's command, tiny flags and all (its ranks forked ready: torchrun's own launch is
    # the README main command's test).
    run = run_preforked(SCRIPT, [
        "--cpu-simulation", *NATIVE, "--grid", "vision:", "--grid", "language:",
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "4",
        "--global-batch-size", "8", "--train-iters", "20", "--lr", "1e-3",
        "--eval-interval", "10", "--eval-iters", "1",
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(root / "tokenizer"),
        "--data-path", str(root / "energon"), "--num-workers", "1",
        "--chat-template", str(TEMPLATE),
        "--tensorboard-dir", str(tmp_path), "--log-interval", "1"], nproc=2, timeout=400)
    assert run.returncode == 0, run.output[-4000:]
    assert "Traceback" not in run.output
    losses = read_scalars(tmp_path, "lm loss")
    assert sorted(losses) == list(range(1, 21))
    assert all(math.isfinite(value) for value in losses.values())
    first = np.mean([losses[i] for i in (1, 2, 3)])
    last = np.mean([losses[i] for i in (18, 19, 20)])
    assert last < first - 0.5, losses


MULTI_LAYOUTS = {  # name: (processes, layout flags)
    "encoder1-language1": (2, ("--grid", "vision:", "--grid", "language:")),
    "encoder-dp2-language-dp1": (3, ("--grid", "vision:dp=2", "--grid", "language:")),
    "encoder-dp1-language-dp2": (3, ("--grid", "vision:", "--grid", "language:dp=2")),
    "encoder1-language-cp2": (3, ("--grid", "vision:", "--grid", "language:cp=2")),
}


def _multi_run(name: str) -> tuple[dict[int, float], list[str]]:
    """lm loss per iteration and the sample keys the language ranks consumed, in order."""
    nproc, layout = MULTI_LAYOUTS[name]
    scalars, results = shared_run(MimoLaunch(nproc, (*_multi_flags(), *SGD, *NATIVE, *layout),
                                             timeout=400))
    # One rank per replica: a replica's context-parallel ranks hold the same samples.
    replicas = {(r["module"], r["dp_rank"]): r["keys"] for r in results}
    keys = {module: [key for (name, _), held in replicas.items() if name == module
                     for batch in held for key in batch]
            for module in ("vision", "language")}
    assert sorted(keys["vision"]) == sorted(keys["language"])  # every item keyed and consumed
    return scalars["lm loss"], sorted(keys["language"])


@pytest.mark.parametrize("name", list(MULTI_LAYOUTS)[1:])
def test_multi_image_conversations_train_identically_on_every_layout(name: str) -> None:
    reference, reference_keys = _multi_run("encoder1-language1")
    losses, keys = _multi_run(name)
    assert sorted(losses) == list(range(1, 11))
    assert all(math.isfinite(value) for value in losses.values())
    worst = max(abs(losses[i] - value) / abs(value) for i, value in reference.items())
    print(f"{name}: max relative lm loss difference {worst:.2e} over {len(reference)} iterations")
    assert worst <= 1e-5, (reference, losses)
    assert keys == reference_keys
