"""Write a tiny synthetic multimodal dataset whose text follows from its media, so loss can fall.

    python -m tools.make_synthetic_dataset --output DIR --samples 300 \\
        --kind caption|vqa|transcript|image_audio_caption|conversation [--image-size 32] \\
        [--seed 0] \\
        [--prepare [--vocab-size 512]]

Images are one solid-colour shape (square, circle or stripe, at a random place) on black; sounds are
a pure tone, low/mid/high (300/900/2500 Hz, 16 kHz, 0.25 s, random loudness and phase). Captions,
answers and transcripts name exactly what was drawn or played ("a red circle on a black
background", "what colour is the shape ?" -> "red", "a high tone"). The folder holds ``images/``,
``audio/`` and ``annotations.jsonl`` in the format ``tools.make_energon_dataset`` reads; the same
seed writes the same bytes. ``--prepare`` also writes the Energon dataset to ``DIR/energon`` and
trains a tokenizer on the texts into ``DIR/tokenizer``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from megatron_plugins.media.codec import Waveform, encode_png, encode_wav
from megatron_plugins.errors import UsageError, report
from tools.make_energon_dataset import KINDS, DatasetError, make_dataset

PROG = "make_synthetic_dataset"
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 80, 230),
    "yellow": (230, 210, 40),
    "white": (240, 240, 240),
}
SHAPES = ("square", "circle", "stripe")
TONES: dict[str, float] = {"low": 300.0, "mid": 900.0, "high": 2500.0}
"""Pitch class named in the text -> frequency in Hz, far enough apart to tell from a spectrum."""
SAMPLE_RATE = 16000
TONE_SECONDS = 0.25
QUESTIONS = {"colour": "what colour is the shape ?", "shape": "what shape is it ?"}
ANNOTATIONS = "annotations.jsonl"
FOLDERS = {"image": "images", "audio": "audio"}


def draw_shape(colour: str, shape: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """A uint8 [size, size, 3] image: one ``colour`` ``shape`` on black, placed at random."""
    cy, cx = rng.integers(size // 3, 2 * size // 3 + 1, size=2)
    radius = int(rng.integers(max(2, size // 5), max(3, size // 3) + 1))
    y, x = np.mgrid[:size, :size]
    if shape == "square":
        mask = (np.abs(y - cy) <= radius) & (np.abs(x - cx) <= radius)
    elif shape == "circle":
        mask = (y - cy) ** 2 + (x - cx) ** 2 <= radius**2
    else:
        mask = np.abs(y - cy) <= max(1, radius // 3)
    pixels = np.zeros((size, size, 3), dtype=np.uint8)
    pixels[mask] = COLOURS[colour]
    return pixels


def play_tone(pitch: str, rng: np.random.Generator) -> np.ndarray:
    """Float32 samples of a ``pitch`` tone at random loudness and phase."""
    t = np.arange(int(SAMPLE_RATE * TONE_SECONDS)) / SAMPLE_RATE
    loudness, phase = rng.uniform(0.3, 0.8), rng.uniform(0.0, 2 * np.pi)
    return (loudness * np.sin(2 * np.pi * TONES[pitch] * t + phase)).astype(np.float32)


def _sample(index: int, kind: str, image_size: int, rng: np.random.Generator,
            output: Path) -> dict[str, Any]:
    """Write one sample's media under ``output`` and return its annotation record."""
    name = f"{index:06d}"
    record: dict[str, Any] = {}
    seen = heard = ""
    if "image" in KINDS[kind].media:
        colour, shape = str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES))
        record["image"] = f"{FOLDERS['image']}/{name}.png"
        size = image_size if kind != "conversation" else int(rng.integers(image_size,
                                                                          2 * image_size + 1))
        pixels = draw_shape(colour, shape, size, rng)
        (output / record["image"]).write_bytes(encode_png(pixels))
        seen = f"a {colour} {shape}"
    if "audio" in KINDS[kind].media:
        pitch = str(rng.choice(list(TONES)))
        record["audio"] = f"{FOLDERS['audio']}/{name}.wav"
        (output / record["audio"]).write_bytes(encode_wav(Waveform(play_tone(pitch, rng), SAMPLE_RATE)))
        heard = f"a {pitch} tone"
    if kind == "caption":
        record["caption"] = f"{seen} on a black background"
    elif kind == "vqa":
        asked = str(rng.choice(list(QUESTIONS)))
        record["question"] = QUESTIONS[asked]
        record["answer"] = colour if asked == "colour" else shape
    elif kind == "transcript":
        record["transcript"] = heard
    elif kind == "conversation":
        record = {"id": name, **record, "conversations": _conversation(index, colour, shape)}
    else:
        record["caption"] = f"{seen} and {heard}"
    return record


def _conversation(index: int, colour: str, shape: str) -> list[dict[str, str]]:
    """A LLaVA-style conversation about one image (marker place and system turn vary by index)."""
    first = [f"<image>\n{QUESTIONS['colour']}", f"{QUESTIONS['colour']}\n<image>",
             QUESTIONS["colour"]][index % 3]
    turns = [{"from": "human", "value": first}, {"from": "gpt", "value": colour},
             {"from": "human", "value": QUESTIONS["shape"]}, {"from": "gpt", "value": shape}]
    if index % 3 == 0:
        turns.insert(0, {"from": "system", "value": "answer with one word"})
    return turns


def _texts(record: dict[str, Any], kind: str) -> list[str]:
    """The texts of one annotation record a tokenizer should cover."""
    if kind == "conversation":
        return [turn["value"] for turn in record["conversations"]]
    return [record[column] for column in KINDS[kind].text]


def make_synthetic(output: Path, samples: int, kind: str, seed: int = 0,
                   image_size: int = 32) -> Path:
    """Write ``samples`` synthetic samples of ``kind`` into the new or empty folder ``output``."""
    output = Path(output)
    if kind not in KINDS:
        raise DatasetError(f"--kind {kind}: choose one of {', '.join(KINDS)}")
    if samples < 1:
        raise DatasetError(f"--samples {samples}: must be at least 1")
    if image_size < 8:
        raise DatasetError(f"--image-size {image_size}: must be at least 8")
    if output.exists() and any(output.iterdir()):
        raise DatasetError(f"--output {output} is not empty; give a new folder")
    output.mkdir(parents=True, exist_ok=True)
    for column in KINDS[kind].media:
        (output / FOLDERS[column]).mkdir()
    rng = np.random.default_rng(seed)
    records = [_sample(index, kind, image_size, rng, output) for index in range(samples)]
    (output / ANNOTATIONS).write_text(
        "".join(json.dumps(record) + "\n" for record in records), encoding="utf-8"
    )
    return output


def prepare(output: Path, kind: str, seed: int = 0, vocab_size: int = 512,
            quiet: bool = False) -> None:
    """Make ``output/energon`` from a synthetic folder; train ``output/tokenizer`` on its texts."""
    from tools.train_tokenizer import train_tokenizer

    output = Path(output)
    make_dataset(output, output / ANNOTATIONS, kind, output / "energon", seed=seed, quiet=quiet)
    with (output / ANNOTATIONS).open(encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    texts = [text for record in records for text in _texts(record, kind)]
    if kind == "conversation":  # the role names a chat template writes
        texts.append("system : user : assistant :")
    train_tokenizer(texts, vocab_size, output / "tokenizer")


def main(argv: list[str] | None = None) -> int:
    """Command line entry; a usage problem is one ``make_synthetic_dataset: error:`` line."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True, help="new or empty folder")
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--kind", required=True, choices=list(KINDS))
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prepare", action="store_true",
                        help="also write DIR/energon and train DIR/tokenizer")
    parser.add_argument("--vocab-size", type=int, default=512, help="tokenizer size for --prepare")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        make_synthetic(args.output, args.samples, args.kind, args.seed, args.image_size)
        if args.prepare:
            prepare(args.output, args.kind, args.seed, args.vocab_size, args.quiet)
    except UsageError as error:
        return report(PROG, error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
