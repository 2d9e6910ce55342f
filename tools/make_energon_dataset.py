"""Turn media files on disk plus an annotation file into a prepared Energon dataset.

    python -m tools.make_energon_dataset --input DIR --annotations FILE.jsonl|FILE.json|FILE.csv \\
        --kind caption|vqa|transcript|image_audio_caption|conversation --output DIR \\
        [--samples-per-shard N] [--split 90,5,5] [--seed S] [--quiet]

One annotation record per sample (a ``.json`` file holds a list of them); media paths are
relative to ``--input``:

* caption: ``image``, ``caption``        * vqa: ``image``, ``question``, ``answer``
* transcript: ``audio``, ``transcript``  * image_audio_caption: ``image``, ``audio``, ``caption``
* conversation: LLaVA-style ``conversations`` (``[{"from": "human"|"gpt"|"system", "value":
  ...}]``) with ``image`` one path, a list of paths, or absent (text-only; ShareGPT records are
  the same shape), stored as ``{role, content}`` turns; an entry of the list that is itself a
  list of paths is a video, its frames, and a video file (mp4, webm, mkv, mov, avi) is a video
  too (for an encoder that takes videos, e.g. ``qwen2_5_vl``; LLaVA-Video's ``video`` entries
  follow the ``image`` ones).
  Item ``i`` sits at the ``i``-th ``<image>`` (or ``<video>``) marker; a record needs as many
  markers as items (or none: then the items open the first ``human`` turn) and at least one
  assistant (``gpt``) turn. Audio clips: ``audio`` one path or a list (wav, flac, mp3), clip
  ``i`` at the ``i``-th ``<audio>`` marker, by the same rule. ms-swift records convert too:
  ``{"messages": [{"role", "content"}], "images": [...], "videos": [...], "audios": [...]}``,
  the ``<image>`` / ``<video>`` / ``<audio>`` tags filled in order (a video: a video file or a
  list of its frame image paths).

A record's ``key`` field (``id`` for conversations) names the sample (else its zero-padded
index). Samples are split into train/val/test by ``--split`` (seeded shuffle, so every split gets
its share however few shards there are) and written as WebDataset shards
``<split>/shard-NNNNNN.tar`` holding ``<key>.jpg|png`` (the source bytes; a conversation's images
as ``<key>.0.png``, ``<key>.1.jpg``, ..., a video's frames as ``<key>.2.0.jpg``, ``<key>.2.1.jpg``,
..., a video file as ``<key>.3.mp4``), ``<key>.wav|flac|mp3`` (a conversation's clips as
``<key>.0.wav``, ``<key>.1.mp3``, ...), and the text as ``<key>.txt`` (one text field) or
``<key>.json`` (VQA's question and answer, a conversation's turns). Energon's ``.nv-meta/``
(index, split.yaml, dataset.yaml) is then written as ``energon prepare`` writes it.
Every record and media file is checked first (annotations, files, that each image, audio and
video file decodes), with a progress bar, before anything is written: a problem is one line
naming the record's line (and id) and the field or file, exit code 2, and nothing is left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import megatron.energon
import yaml
from megatron.energon.flavors import BaseWebdatasetFactory
from megatron.energon.flavors.webdataset.config import MAIN_FOLDER_NAME
from tqdm import tqdm
from webdataset import ShardWriter

from megatron_plugins.data.samples import conversation_part
from megatron_plugins.errors import UsageError, report
from tools.annotations import (
    KINDS,
    MEDIA_SUFFIXES,
    PROG,
    DatasetError,
    Kind,
    Record,
    check_media,
    read_records,
)

__all__ = ["SPLITS", "main", "make_dataset", "split_records"]

SPLITS = ("train", "val", "test")
"""The splits a dataset is written in, in ``--split``'s order."""


def _parts(record: Record, kind: Kind) -> dict[str, bytes | str]:
    """The tar parts of one sample: media bytes as they are on disk (checked before), numbered
    for conversations (:func:`conversation_part`), and the text."""
    parts: dict[str, bytes | str] = {"__key__": record.key}
    for column, path, item in record.media:
        extension = MEDIA_SUFFIXES[column][path.suffix.lower()]
        parts[conversation_part(item, extension) if kind.conversation else extension] = (
            path.read_bytes())
    text = (
        record.text[kind.text[0]] if len(kind.text) == 1
        else json.dumps(record.text, ensure_ascii=False)
    )
    parts[kind.text_part] = text.encode("utf-8")
    return parts


def split_records(
    records: Sequence[Record], split: Sequence[float], seed: int
) -> dict[str, list[Record]]:
    """Assign records to train/val/test in the ``split`` ratio by a seeded shuffle (each split in
    annotation order); a split with a share must get at least one record."""
    label = ",".join(f"{share:g}" for share in split)
    if len(split) != 3 or any(share < 0 for share in split) or split[0] <= 0:
        raise DatasetError(
            f"--split {label}: give three shares train,val,test with train > 0, e.g. 90,5,5"
        )
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    total = sum(split)
    counts = [int(len(records) * share / total) for share in split[1:]]
    bounds = {"val": (0, counts[0]), "test": (counts[0], counts[0] + counts[1]),
              "train": (counts[0] + counts[1], len(records))}
    assigned: dict[str, list[Record]] = {}
    for name, share in zip(SPLITS, split):
        start, end = bounds[name]
        if share > 0 and end == start:
            raise DatasetError(
                f"--split {label} leaves the {name} split empty with {len(records)} samples; "
                f"give it a larger share or add samples"
            )
        if end > start:
            assigned[name] = [records[i] for i in sorted(order[start:end])]
    return assigned


def _dataset_yaml(kind_name: str) -> dict[str, Any]:
    """``.nv-meta/dataset.yaml``: the sample type, loaded by ``sample_loader.py`` (text as str,
    media as raw bytes whether Energon's decoder is on or off) from this kind's parts."""
    kind = KINDS[kind_name]
    sample_type = kind.sample.sample_type
    exported = getattr(megatron.energon, sample_type.__name__, None) is sample_type
    module = "megatron.energon" if exported else sample_type.__module__
    return {
        "sample_type": {"__module__": module, "__class__": sample_type.__name__},
        "sample_loader": "sample_loader.py:sample_loader",
        "part_filter": "sample_loader.py:part_filter" if kind.sample.part_filter else kind.parts,
    }


def _write_meta(root: Path, kind_name: str, splits: dict[str, list[Record]]) -> None:
    """Index the shards and write split.yaml as ``energon prepare`` does, then dataset.yaml and
    the sample loader it names."""
    tars = sorted(str(p.relative_to(root)) for p in root.glob("*/*.tar"))
    with contextlib.redirect_stdout(io.StringIO()):
        BaseWebdatasetFactory.prepare_dataset(
            root,
            tars,
            split_parts_patterns=[(name, rf"{name}/.*\.tar") for name in splits],
            workers=min(len(tars), os.cpu_count() or 1),
        )
    meta = root / MAIN_FOLDER_NAME
    (meta / "dataset.yaml").write_text(yaml.safe_dump(_dataset_yaml(kind_name), sort_keys=False))
    loader, part_filter = KINDS[kind_name].sample.loader, KINDS[kind_name].sample.part_filter
    lines = [f'"""Written by tools.make_energon_dataset: text parts as str, media as raw bytes."""',
             f"from {loader.__module__} import {loader.__name__} as sample_loader  # noqa: F401"]
    if part_filter is not None:
        lines.append(f"from {part_filter.__module__} import {part_filter.__name__} as part_filter"
                     "  # noqa: F401")
    (meta / "sample_loader.py").write_text("\n".join(lines) + "\n")


def make_dataset(
    input_dir: Path,
    annotations: Path,
    kind: str,
    output: Path,
    *,
    samples_per_shard: int = 1000,
    split: Sequence[float] = (90, 5, 5),
    seed: int = 0,
    quiet: bool = False,
) -> Path:
    """Write the prepared Energon dataset to ``output`` (which must not exist) and return it."""
    input_dir, annotations, output = Path(input_dir), Path(annotations), Path(output)
    if kind not in KINDS:
        raise DatasetError(f"--kind {kind}: choose one of {', '.join(KINDS)}")
    if samples_per_shard < 1:
        raise DatasetError(f"--samples-per-shard {samples_per_shard}: must be at least 1")
    if output.exists():
        raise DatasetError(f"--output {output} already exists; give a new folder")
    records = read_records(input_dir, annotations, KINDS[kind])
    splits = split_records(records, split, seed)
    check_media(records, quiet)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        bar = tqdm(total=len(records), unit="sample", desc=f"{PROG}: writing",
                   disable=quiet or not sys.stderr.isatty())
        with bar:
            for name, members in splits.items():
                (staging / name).mkdir()
                pattern = str(staging / name / "shard-%06d.tar")
                writer = ShardWriter(pattern, maxcount=samples_per_shard, verbose=0, encoder=False)
                with writer as sink:
                    for record in members:
                        sink.write(_parts(record, KINDS[kind]))
                        bar.update()
        _write_meta(staging, kind, splits)
        staging.rename(output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output


def _split_flag(value: str) -> list[float]:
    try:
        return [float(share) for share in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r}: give three shares train,val,test, e.g. 90,5,5"
        ) from None


def main(argv: list[str] | None = None) -> int:
    """Command line entry; a usage problem is one ``make_energon_dataset: error:`` line, exit 2."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, required=True,
                        help="folder the media paths are relative to")
    parser.add_argument("--annotations", type=Path, required=True,
                        help=".jsonl, .json (a list) or .csv, one record per sample")
    parser.add_argument("--kind", required=True, choices=list(KINDS))
    parser.add_argument("--output", type=Path, required=True, help="new folder for the dataset")
    parser.add_argument("--samples-per-shard", type=int, default=1000)
    parser.add_argument("--split", type=_split_flag, default=[90.0, 5.0, 5.0],
                        help="train,val,test shares")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/val/test assignment")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        path = make_dataset(args.input, args.annotations, args.kind, args.output,
                            samples_per_shard=args.samples_per_shard, split=args.split,
                            seed=args.seed, quiet=args.quiet)
    except UsageError as error:
        return report(PROG, error)
    if not args.quiet:
        print(f"{PROG}: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
