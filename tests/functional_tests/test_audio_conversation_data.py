"""Audio clips inside conversations, end to end: a hand-made ms-swift folder (an 8 kHz stereo WAV,
a 44.1 kHz FLAC and an MP3, 0..3 clips and 0..1 image per record, tags in the text or none)
converted by the README's commands trains a vision + audio + language MiMo through the entry
point with packed rows, reporting the padding share; the audio encoder at dp2 on ranks of its own
(its replicas sharing the clips by work) trains identically, every clip keyed and consumed. A tiny
whole Qwen2.5-Omni and a tiny whole Qwen3-Omni with ``--use-audio-in-video`` train on a folder of
such clips, an image and videos with sound tracks (one a 29.97-fps file), identically with their
audio tower at dp2."""

from __future__ import annotations

import json
import math
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.harness.audio_files import CLIPS, write_clips
from tests.harness.energon_data import convert_by_the_readme, energon_flags
from tests.harness.mimo_runs import TINY_MIMO, MimoLaunch, consumed_keys, shared_run
from tests.harness.multiprocess import REPO_ROOT, run_preforked
from tests.harness.tensorboard_scalars import read_scalars
from tests.harness.worker_cache import once_per_run

pytestmark = pytest.mark.multirank

SCRIPT = REPO_ROOT / "examples" / "mimo" / "pretrain_mimo.py"
TEMPLATE = REPO_ROOT / "tests" / "fixtures" / "chat_template.jinja"
RECORDS = 80
PITCHES = {"low": 220.0, "high": 880.0}
FLAGS = ("--optimizer", "sgd", "--lr", "0.05", "--min-lr", "0.005",
         "--seq-length", "128", "--max-position-embeddings", "128",
         "--chat-template", str(TEMPLATE), "--pack-sequences", "--balance-encoder-work",
         "--encoder", "vision=vit", "--encoder", "audio=audio")
ONE_RANK_EACH = ("--grid", "vision:", "--grid", "audio:", "--grid", "language:")
AUDIO_DP2 = ("--grid", "vision:", "--grid", "audio:dp=2", "--grid", "language:")
PADDING = re.compile(r"padding share of language DP replica 0's training rows \((\d+) "
                     r"microbatches of (\d+) samples, --seq-length \d+\): ([\d.]+)% unpacked "
                     r"\(\d+ rows\), ([\d.]+)% packed")


def _record(index: int) -> dict:
    """``index % 4`` clips of one pitch (in the three formats in turn), an image every other
    record; tags in the text for three records in four."""
    pitch = list(PITCHES)[index // 4 % 2]
    clips = [f"{pitch}/{name}" for name in list(CLIPS)[: index % 4]]
    images = ["square.png"] if index % 2 else []
    tagged = index % 4 != 3
    question = ("<image>" * len(images) + "<audio>" * len(clips)) * tagged + "what do you hear"
    answer = f"a {pitch} tone" if clips else "nothing"
    return {"id": f"c{index:03d}", "images": images, "audios": clips, "messages": [
        {"role": "system", "content": "answer briefly"},
        {"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


@once_per_run
def swift_folder() -> Path:
    """The folder (``swift.jsonl``, clips, an image), converted and a tokenizer trained by the
    README's commands, once per test run."""
    root = Path(tempfile.mkdtemp(prefix="mimo-audio-conversations-"))
    for pitch, hz in PITCHES.items():
        write_clips(root / pitch, hz)
    Image.fromarray(np.full((16, 16, 3), (220, 30, 30), np.uint8)).save(root / "square.png")
    records = [_record(index) for index in range(RECORDS)]
    (root / "swift.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    texts = [turn["content"].replace("<image>", "").replace("<audio>", "")
             for record in records for turn in record["messages"]]
    return convert_by_the_readme(root, root / "swift.jsonl", texts, "--split", "80,10,10")


def _flags() -> tuple[str, ...]:
    return (*FLAGS, *energon_flags(swift_folder()))


@once_per_run
def entry_point_run() -> tuple[dict[int, float], str]:
    """One rank per module through the entry point: ``lm loss`` per iteration and the output."""
    logdir = tempfile.mkdtemp(prefix="mimo-audio-tb-")
    run = run_preforked(SCRIPT, [*TINY_MIMO, *_flags(), *ONE_RANK_EACH, "--tensorboard-dir",
                                 logdir], nproc=3, timeout=300)
    assert run.returncode == 0, run.output[-4000:]
    assert "Traceback" not in run.output
    return read_scalars(logdir, "lm loss"), run.output


def test_audio_conversations_train_packed_through_the_entry_point_reporting_padding() -> None:
    losses, output = entry_point_run()
    assert sorted(losses) == list(range(1, 11))
    assert all(math.isfinite(value) for value in losses.values())
    [(microbatches, samples, unpacked, packed)] = PADDING.findall(output)
    assert (int(microbatches), int(samples)) == (40, 80)  # 10 steps of 4 packed microbatches
    print(f"padding share: {unpacked}% unpacked, {packed}% packed")
    assert float(packed) < float(unpacked)


def test_the_audio_encoder_at_dp2_on_ranks_of_its_own_trains_identically() -> None:
    reference, _ = entry_point_run()
    scalars, results = shared_run(MimoLaunch(4, (*_flags(), *AUDIO_DP2), timeout=300))
    losses = scalars["lm loss"]
    assert sorted(losses) == sorted(reference)
    worst = max(abs(losses[i] - value) / abs(value) for i, value in reference.items())
    print(f"audio dp2: max relative lm loss difference {worst:.2e} over {len(reference)} "
          "iterations")
    assert worst <= 1e-5, (reference, losses)
    language = consumed_keys(results, "language")
    audio = [key for r in results if r["module"] == "audio" for batch in r["keys"]
             for key in batch]
    assert sorted(audio) == sorted(language)  # both replicas' shares: every sample keyed
    counts = [len(c) for r in results if r["module"] == "audio"
              for step in r["item_tokens"] for c in step["audio"]]
    assert set(counts) == {0, 1, 2, 3}


OMNI_GRIDS = {"one-rank-each": (3, ("--grid", "image:", "--grid", "audio:", "--grid",
                                    "language:")),
              "audio-dp2-balanced": (4, ("--grid", "image:", "--grid", "audio:dp=2", "--grid",
                                         "language:"))}


VIDEOS = ("talk.mp4", "talk.webm", "film.mp4")
"""2.5 s at 8 fps with AAC, 1.5 s at 8 fps with Opus, 3 s at 29.97 fps with AAC: sampled at 1.6,
1.33 and 1.998 frames a second, so Qwen3-Omni's temporal positions (13 a second) are fractional."""


def _video_record(index: int) -> dict:
    """A video with sound one record in two (:data:`VIDEOS` in turn), ``index % 3`` clips and an
    image every third record; the video's tag between the others."""
    video = VIDEOS[index // 2 % len(VIDEOS)] if index % 2 == 0 else None
    clips = list(CLIPS)[: index % 3]
    images = ["square.png"] if index % 3 == 0 else []
    question = ("<image>" * len(images) + ("<video>" if video else "") + "<audio>" * len(clips)
                + "what do you hear")
    return {"id": f"v{index:03d}", "images": images, "videos": [video] if video else [],
            "audios": clips, "messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": "a talk" if video else "nothing"}]}


VIDEO_TEXTS = ["what do you hear", "a talk", "nothing"]


@once_per_run
def omni_video_folder() -> Path:
    """A converted folder of videos with sound (:data:`VIDEOS`), clips and an image."""
    from fractions import Fraction

    from tests.harness.video_files import write_video

    root = Path(tempfile.mkdtemp(prefix="mimo-omni-video-"))
    write_clips(root, 330.0)
    Image.fromarray(np.full((16, 16, 3), (30, 220, 30), np.uint8)).save(root / "square.png")
    write_video(root / "talk.mp4", seconds=2.5, fps=8, sound_rate=16000)
    write_video(root / "talk.webm", seconds=1.5, fps=8, sound_rate=48000)
    write_video(root / "film.mp4", seconds=3, fps=Fraction(30000, 1001), sound_rate=44100)
    records = [_video_record(index) for index in range(40)]
    (root / "swift.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    convert_by_the_readme(root, root / "swift.jsonl", VIDEO_TEXTS, "--split", "80,10,10",
                          in_process=True)
    return root


@once_per_run
def omni_video_runs(family: str) -> dict[str, tuple[dict[int, float], str]]:
    """A tiny whole ``family`` (qwen2_5_omni, qwen3_omni) with ``--use-audio-in-video`` on
    :func:`omni_video_folder`, packed, at one rank per module and with the audio tower at DP 2
    (balanced): ``lm loss`` per iteration and the output, by layout."""
    from tests.models.hf import MIMO_FLAGS
    from tests.models.qwen3_omni_whole import save_tiny_qwen3_omni
    from tests.models.qwen_omni import save_omni_tokenizer, save_tiny_omni

    root = omni_video_folder()
    save = {"qwen2_5_omni": save_tiny_omni, "qwen3_omni": save_tiny_qwen3_omni}[family]
    folder = save_omni_tokenizer(save(Path(tempfile.mkdtemp(prefix=f"mimo-{family}-"))
                                      / "omni"), VIDEO_TEXTS)
    runs = {}
    for name, (nproc, grids) in OMNI_GRIDS.items():
        logdir = tempfile.mkdtemp(prefix=f"mimo-omni-video-{name}-")
        run = run_preforked(SCRIPT, [
            *MIMO_FLAGS, "--hf-model", str(folder), "--seq-length", "256", "--optimizer", "sgd",
            "--lr", "0.05", "--chat-template", str(TEMPLATE), "--pack-sequences",
            "--balance-encoder-work", "--use-audio-in-video", *energon_flags(root),
            "--tokenizer-model", str(folder), *grids, "--tensorboard-dir", logdir],
            nproc=nproc, timeout=300)
        assert run.returncode == 0, run.output[-4000:]
        runs[name] = read_scalars(logdir, "lm loss"), run.output
    return runs


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni"])
def test_videos_with_their_sound_train_a_whole_omni_identically_at_two_layouts(family) -> None:
    """``--use-audio-in-video`` with the folder's own tokenizer: each clip's run is the
    checkpoint's audio run of its resampled length and each video's sound track (decoded from
    the file on both sides) the audio tower's item where the video is, its tokens interleaved
    with the frames' as the family does (Qwen2.5-Omni: 2-s chunks; Qwen3-Omni: by time, at
    fractional positions), else the alignment guard stops the run; packed rows report their
    padding; with the audio tower at DP 2 sharing clips and sounds by work the losses are the
    same."""
    runs = omni_video_runs(family)
    reference, output = runs["one-rank-each"]
    assert sorted(reference) == [1, 2, 3, 4]
    assert all(math.isfinite(value) for value in reference.values())
    [(_, _, unpacked, packed)] = PADDING.findall(output)
    assert float(packed) < float(unpacked)
    losses, _ = runs["audio-dp2-balanced"]
    worst = max(abs(losses[i] - value) / abs(value) for i, value in reference.items())
    print(f"{family}, audio in video, audio dp2 balanced: max relative lm loss difference "
          f"{worst:.2e}; padding {unpacked}% unpacked, {packed}% packed")
    assert worst <= 1e-5, (reference, losses)
