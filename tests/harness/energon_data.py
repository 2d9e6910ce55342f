"""The generated datasets and tokenizers the real-data tests train on: made by the README's tools,
or written as plain WebDataset shards and prepared by stock ``energon prepare``."""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tests.harness.multiprocess import REPO_ROOT
from tests.harness.worker_cache import once_per_run

SAMPLES = 300


@once_per_run
def synthetic_dataset(kind: str = "image_audio_caption") -> Path:
    """A prepared Energon dataset (``energon/``) and its tokenizer (``tokenizer/``), made once per
    test process by the README's own tools."""
    from tools.make_synthetic_dataset import make_synthetic, prepare

    root = Path(tempfile.mkdtemp(prefix=f"mimo-{kind}-"))
    make_synthetic(root, SAMPLES, kind, seed=0)
    prepare(root, kind, seed=0, quiet=True)
    return root


def convert_by_the_readme(root: Path, annotations: Path, texts: list[str],
                          *extra: str, in_process: bool = False) -> Path:
    """``root/energon`` from a conversation ``annotations`` file and ``root/tokenizer`` trained on
    ``texts`` (the chat template's role words added), by the README's two commands (``extra``:
    more ``make_energon_dataset`` flags); ``in_process``: their ``main`` called here, sparing
    two interpreter starts."""
    (root / "texts.txt").write_text("\n".join([*texts, "system : user : assistant :"]) + "\n")
    for tool, argv in (
            ("make_energon_dataset", ["--input", root, "--annotations", annotations,
                                      "--kind", "conversation", *extra,
                                      "--output", root / "energon"]),
            ("train_tokenizer", ["--texts", root / "texts.txt", "--vocab-size", "256",
                                 "--output", root / "tokenizer"])):
        if in_process:
            assert importlib.import_module(f"tools.{tool}").main([*map(str, argv)]) == 0
            continue
        run = subprocess.run([sys.executable, "-m", f"tools.{tool}", *map(str, argv)],
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
    return root


def energon_flags(root: Path, *, workers: int = 0) -> tuple[str, ...]:
    """Flags that put the tiny model on the real data (they override the mock's NullTokenizer)."""
    return ("--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", str(root / "tokenizer"),
            "--data-path", str(root / "energon"), "--num-workers", str(workers))


def source_args(root: Path, encoders: Iterable[Any], **overrides: Any) -> argparse.Namespace:
    """The flags an Energon run on ``root`` (its ``energon/`` and ``tokenizer/``) holds once parsed,
    with the ``encoders``' own flags at their defaults."""
    parser = argparse.ArgumentParser()
    for encoder in encoders:
        encoder.add_arguments(parser)
    args = parser.parse_args([])
    values = dict(data_path=[str(root / "energon")], tokenizer_type="HuggingFaceTokenizer",
                  tokenizer_model=str(root / "tokenizer"), seed=1234, seq_length=32,
                  num_workers=0, global_batch_size=8, micro_batch_size=2, eval_iters=1,
                  eval_interval=5, rampup_batch_size=None, special_tokens=None,
                  padded_vocab_size=None, vocab_size=None,
                  position_embedding_type="learned_absolute")
    values.update(overrides)
    for name, value in values.items():
        setattr(args, name, value)
    return args


STOCK_SAMPLES = 120
STOCK_SAMPLES_PER_SHARD = 12
"""Ten shards, so `energon prepare --split-ratio 8,1,1` gives train 96, val 12, test 12 samples."""

STOCK_FIELD_MAPS: dict[str, tuple[str, dict[str, str]]] = {
    "caption": ("CaptioningSample", {"image": "png", "caption": "txt"}),
    "vqa": ("VQASample", {"image": "png", "context": "question.txt", "answers": "answer.txt"}),
    "transcript": ("AudioTranscriptSample", {"audio": "wav", "transcript": "txt"}),
    "image_audio_caption": ("ImageAudioCaptionSample",
                            {"image": "png", "audio": "wav", "caption": "txt"}),
}
"""Each dataset kind's sample type and the ``--field-map`` the README gives for it."""

TEXT_PARTS = {"caption": "txt", "transcript": "txt", "question": "question.txt",
              "answer": "answer.txt"}
"""Annotation column -> the tar part a plain WebDataset stores it in."""


def energon_prepare(*argv: str) -> subprocess.CompletedProcess:
    """Energon's own ``energon prepare`` command line, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "megatron.energon.cli.main", "prepare", *argv],
                          capture_output=True, text=True, timeout=300)


@once_per_run
def stock_prepared_dataset(kind: str) -> Path:
    """Plain WebDataset shards (``<key>.png|wav`` and text parts) of a synthetic ``kind`` set in
    ``energon/``, prepared by stock ``energon prepare --field-map`` as the README says, and a
    tokenizer in ``tokenizer/``; made once per test process."""
    import megatron.energon
    import yaml
    from webdataset import ShardWriter

    from tools.make_synthetic_dataset import ANNOTATIONS, make_synthetic
    from tools.train_tokenizer import train_tokenizer

    root = Path(tempfile.mkdtemp(prefix=f"mimo-stock-{kind}-"))
    make_synthetic(root, STOCK_SAMPLES, kind, seed=0)
    records = [json.loads(line) for line in (root / ANNOTATIONS).read_text().splitlines()]
    shards = root / "energon"
    shards.mkdir()
    with ShardWriter(str(shards / "shard-%06d.tar"), maxcount=STOCK_SAMPLES_PER_SHARD,
                     verbose=0, encoder=False) as sink:
        for index, record in enumerate(records):
            parts: dict[str, bytes | str] = {"__key__": f"{index:06d}"}
            for column, value in record.items():
                if column in TEXT_PARTS:
                    parts[TEXT_PARTS[column]] = value.encode("utf-8")
                else:
                    parts[Path(value).suffix[1:]] = (root / value).read_bytes()
            sink.write(parts)
    sample_type, field_map = STOCK_FIELD_MAPS[kind]
    stock_type = hasattr(megatron.energon, sample_type)
    typing = (["--sample-type", sample_type, "--field-map", json.dumps(field_map)] if stock_type
              else ["--skip-dataset-yaml"])
    run = energon_prepare(str(shards), "--non-interactive", "--split-ratio", "8,1,1",
                          "--no-progress", *typing)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    if not stock_type:  # Ours: `energon prepare` names only its own types; the README's YAML.
        (shards / ".nv-meta" / "dataset.yaml").write_text(yaml.safe_dump({
            "sample_type": {"__module__": "megatron_plugins.data.samples",
                            "__class__": sample_type},
            "field_map": field_map}, sort_keys=False))
    train_tokenizer([text for record in records for column, text in record.items()
                     if column in TEXT_PARTS], 512, root / "tokenizer")
    return root
