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
  list of paths is a video, its frames (for an encoder that takes videos, e.g. ``qwen2_5_vl``).
  Item ``i`` sits at the ``i``-th ``<image>`` (or ``<video>``) marker; a record needs as many
  markers as items (or none: then the items open the first ``human`` turn) and at least one
  assistant (``gpt``) turn.

A record's ``key`` field (``id`` for conversations) names the sample (else its zero-padded
index). Samples are split into train/val/test by ``--split`` (seeded shuffle, so every split gets
its share however few shards there are) and written as WebDataset shards
``<split>/shard-NNNNNN.tar`` holding ``<key>.jpg|png`` (the source bytes; a conversation's images
as ``<key>.0.png``, ``<key>.1.jpg``, ..., a video's frames as ``<key>.2.0.jpg``, ``<key>.2.1.jpg``,
...), ``<key>.wav``, and the text as ``<key>.txt`` (one text
field) or ``<key>.json`` (VQA's question and answer, a conversation's turns). Energon's
``.nv-meta/`` (index, split.yaml, dataset.yaml) is then written as ``energon prepare`` writes it.
Every record and media file is checked first (annotations, files, that each image and WAV
decodes), with a progress bar, before anything is written: a problem is one line naming the
record's line (and id) and the field or file, exit code 2, and nothing is left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import random
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import megatron.energon
import yaml
from megatron.energon.flavors import BaseWebdatasetFactory
from megatron.energon.flavors.webdataset.config import MAIN_FOLDER_NAME
from tqdm import tqdm
from webdataset import ShardWriter

from megatron_plugins.media.codec import DECODERS, BadSampleError
from megatron_plugins.data.samples import (
    AUDIO_PART,
    DATASET_KINDS,
    ConversationKind,
    SampleKind,
    conversation_part,
)
from megatron_plugins.data.text import media_marker
from megatron_plugins.errors import UsageError, report

PROG = "make_energon_dataset"
SPLITS = ("train", "val", "test")
MEDIA_SUFFIXES: dict[str, dict[str, str]] = {
    "image": {".jpg": "jpg", ".jpeg": "jpg", ".png": "png"},
    "audio": {".wav": AUDIO_PART},
}
"""Media files accepted per column, and the tar part each is stored as (bytes kept as they are)."""
KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
"""Sample keys WebDataset can split from the part name (no dots, no slashes)."""
LLAVA_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
"""LLaVA's ``from`` values -> chat template roles."""


class DatasetError(UsageError):
    """An input the dataset cannot be made from; one line names the flag, record or file."""


@dataclass(frozen=True)
class Kind:
    """What one kind of dataset reads from each annotation record; its samples are of the
    schema's kind (:data:`~megatron_plugins.data.samples.DATASET_KINDS`), which the training
    loader reads too."""

    sample: SampleKind
    text: tuple[str, ...]
    """Columns holding text: one is stored as ``txt``, several as one ``json`` object."""

    @property
    def media(self) -> tuple[str, ...]:
        """Columns holding a media path: ``image`` and/or ``audio``."""
        return self.sample.media

    @property
    def conversation(self) -> bool:
        """LLaVA-style records, converted by :func:`_conversation_row` into 0..N images and
        ``text``."""
        return isinstance(self.sample, ConversationKind)

    @property
    def columns(self) -> tuple[str, ...]:
        return ("conversations",) if self.conversation else self.media + self.text

    @property
    def text_part(self) -> str:
        return "txt" if len(self.text) == 1 and not self.conversation else "json"

    @property
    def parts(self) -> list[str]:
        """Every tar part this kind's samples may hold (Energon's part filter)."""
        media = [dict.fromkeys(MEDIA_SUFFIXES[column].values()) for column in self.media]
        return [part for parts in media for part in parts] + [self.text_part]


KINDS: dict[str, Kind] = {name: Kind(DATASET_KINDS[name], text) for name, text in (
    ("caption", ("caption",)),
    ("vqa", ("question", "answer")),
    ("transcript", ("transcript",)),
    ("image_audio_caption", ("caption",)),
    ("conversation", ("conversation",)),
)}


@dataclass(frozen=True)
class Record:
    """One annotation record, resolved: where it was (file and line, for messages), its key,
    media (``(column, path, item)`` in order: a conversation's images in marker order, ``item``
    their part's index, ``"2.0"`` for a video's first frame) and text."""

    where: str
    key: str
    media: tuple[tuple[str, Path, str], ...]
    text: dict[str, str]


def _image_paths(row: dict[str, Any], where: str) -> list[str | list[str]]:
    """A LLaVA-style record's image paths: ``image`` one path, a list of them (a video: a list
    of its frames' paths), or absent."""
    image = row.get("image")
    images = [] if image is None else image if isinstance(image, list) else [image]
    for index, path in enumerate(images):
        frames = path if isinstance(path, list) and isinstance(image, list) else [path]
        if not frames or not all(isinstance(frame, str) and frame for frame in frames):
            what = "image" if not isinstance(image, list) else f"image[{index}]"
            raise DatasetError(f"{where}: {what!r} is not a file path (give a path, a list of "
                               "paths (a video: a list of frame paths), or no 'image' for a "
                               "text-only record)")
    return images


def _conversation_row(row: dict[str, Any], where: str) -> dict[str, Any]:
    """A LLaVA-style (or ShareGPT) record as the columns of the ``conversation`` kind: its image
    paths and its turns as JSON ``{role, content}`` text; records that cannot train are
    refused."""
    turns = row.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise DatasetError(f"{where}: no 'conversations' list; each record needs conversations "
                           "[{from, value}, ...] (and image: a path or a list, if it has any)")
    images = _image_paths(row, where)
    converted = []
    for index, turn in enumerate(turns):
        speaker = turn.get("from") if isinstance(turn, dict) else None
        value = turn.get("value") if isinstance(turn, dict) else None
        if speaker not in LLAVA_ROLES or not isinstance(value, str):
            raise DatasetError(f"{where}: conversations[{index}] is not {{\"from\": "
                               f"{'|'.join(LLAVA_ROLES)}, \"value\": text}}")
        converted.append({"role": LLAVA_ROLES[speaker], "content": value})
    markers = sum(turn["content"].count(media_marker(media)) for turn in converted
                  for media in ("image", "video"))
    if markers and markers != len(images):
        raise DatasetError(f"{where}: {markers} <image> marker{'s' * (markers != 1)} for "
                           f"{len(images)} image{'s' * (len(images) != 1)}; give one marker per "
                           "image, in image order (or none: the images then open the first "
                           "'human' turn)")
    if not any(turn["role"] == "assistant" for turn in converted):
        raise DatasetError(f"{where}: no assistant ('gpt') turn, so nothing to train on")
    if images and not markers and not any(turn["role"] == "user" for turn in converted):
        raise DatasetError(f"{where}: no <image> marker and no 'human' turn to put the images in")
    return {"key": row.get("id"), "images": images,
            "conversation": json.dumps(converted, ensure_ascii=False)}


def _json_rows(annotations: Path) -> list[tuple[str, dict[str, Any]]]:
    """(where, record) of every record of a .jsonl (one object a line) or .json (a list) file."""
    rows: list[tuple[str, Any]] = []
    with annotations.open(encoding="utf-8") as f:
        if annotations.suffix == ".json":
            try:
                records = json.load(f)
            except json.JSONDecodeError as error:
                raise DatasetError(f"{annotations}: not JSON ({error})") from None
            if not isinstance(records, list):
                raise DatasetError(f"{annotations}: not a JSON list of records")
            rows = [(f"{annotations} record {index}", row) for index, row in enumerate(records)]
        else:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append((f"{annotations} line {line_no}", json.loads(line)))
                except json.JSONDecodeError as error:
                    where = f"{annotations} line {line_no}"
                    raise DatasetError(f"{where}: not JSON ({error})") from None
    for where, row in rows:
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: not a JSON object")
    return rows


def _read_rows(annotations: Path, kind: Kind) -> list[tuple[str, dict[str, Any]]]:
    """(where, record) of every record in a .jsonl, .json or .csv file, all columns present."""
    if not annotations.is_file():
        raise DatasetError(f"--annotations {annotations}: no such file")
    need = ", ".join(kind.columns)
    rows: list[tuple[str, dict[str, Any]]] = []
    if annotations.suffix in (".jsonl", ".json"):
        rows = _json_rows(annotations)
    elif annotations.suffix == ".csv" and not kind.conversation:
        with annotations.open(encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in kind.columns if c not in (reader.fieldnames or [])]
            if missing:
                raise DatasetError(
                    f"{annotations} line 1: no {missing[0]!r} column; the header needs {need}"
                )
            rows = [(f"{annotations} line {reader.line_num}", row) for row in reader]
    else:
        endings = ".jsonl or .json" if kind.conversation else ".jsonl, .json or .csv"
        raise DatasetError(f"--annotations {annotations}: must end in {endings}")
    if not rows:
        raise DatasetError(f"--annotations {annotations}: no records")
    if kind.conversation:
        named = [(where if row.get("id") in (None, "") else f"{where} (id {row['id']!r})", row)
                 for where, row in rows]
        return [(where, _conversation_row(row, where)) for where, row in named]
    for where, row in rows:
        for column in kind.columns:
            value = row.get(column)
            if not isinstance(value, str) or not value:
                problem = "no" if value is None else "an empty or non-text"
                raise DatasetError(
                    f"{where}: {problem} {column!r} field; each record needs {need}"
                )
    return rows


def _conversation_items(images: list[str | list[str]]) -> list[tuple[str, str]]:
    """Each image (a video: each frame) path of a conversation with its part's index."""
    return [(name, f"{index}.{frame}" if isinstance(entry, list) else str(index))
            for index, entry in enumerate(images)
            for frame, name in enumerate(entry if isinstance(entry, list) else [entry])]


def read_records(input_dir: Path, annotations: Path, kind: Kind) -> list[Record]:
    """The annotation records with keys and media paths checked (media not yet decoded)."""
    if not input_dir.is_dir():
        raise DatasetError(f"--input {input_dir}: no such folder")
    rows = _read_rows(annotations, kind)
    width = max(6, len(str(len(rows) - 1)))
    records: list[Record] = []
    seen: dict[str, str] = {}
    for index, (where, row) in enumerate(rows):
        key = str(row["key"]) if row.get("key") not in (None, "") else f"{index:0{width}d}"
        if not KEY_RE.fullmatch(key):
            raise DatasetError(f"{where}: key {key!r} may hold only letters, digits, _ and -")
        if key in seen:
            raise DatasetError(f"{where}: key {key!r} is already used by {seen[key]}")
        seen[key] = where
        named = ([("image", name, item) for name, item in _conversation_items(row["images"])]
                 if kind.conversation else [(column, row[column], "") for column in kind.media])
        media = []
        for column, name, item in named:
            path = input_dir / name
            suffixes = MEDIA_SUFFIXES[column]
            if path.suffix.lower() not in suffixes:
                raise DatasetError(
                    f"{where}: {column} {path} must be a {', '.join(suffixes)} file"
                )
            if not path.is_file():
                raise DatasetError(f"{where}: {column} file {path} does not exist")
            media.append((column, path, item))
        records.append(Record(where, key, tuple(media), {c: row[c] for c in kind.text}))
    return records


def check_media(records: Sequence[Record], quiet: bool = False) -> None:
    """Decode every media file exactly as training will (a progress bar on a terminal), so a
    broken file fails here, before anything is written, not mid-run."""
    with tqdm(records, unit="sample", desc=f"{PROG}: checking",
              disable=quiet or not sys.stderr.isatty()) as bar:
        for record in bar:
            frame_sizes: dict[str, tuple[int, ...]] = {}
            for column, path, item in record.media:
                where = f"{record.where}: {column} file {path}"
                try:
                    decoded = DECODERS[column](path.read_bytes(), where, column)
                except BadSampleError as error:
                    raise DatasetError(f"{where} does not decode as {column}: {error}") from None
                if "." in item:  # a video's frame: all of one size
                    size = frame_sizes.setdefault(item.partition(".")[0], decoded.shape[:2])
                    if decoded.shape[:2] != size:
                        raise DatasetError(f"{where} is {decoded.shape[0]}x{decoded.shape[1]} "
                                           f"(height x width), not the {size[0]}x{size[1]} of "
                                           "its video's first frame; give frames of one size")


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
