"""The annotation side of ``tools.make_energon_dataset``: each kind's columns, the records read
from a JSONL / JSON / CSV annotation file (LLaVA / ShareGPT and ms-swift conversations converted
to turns and 0..N images, videos and audio clips), and every media file checked to decode, before
anything is written."""

from __future__ import annotations

import csv
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from tqdm import tqdm

from megatron_plugins.data.samples import DATASET_KINDS, ConversationKind, SampleKind
from megatron_plugins.data.text import ROLES, media_marker
from megatron_plugins.errors import UsageError
from megatron_plugins.media.codec import DECODERS, BadSampleError, decode_video
from megatron_plugins.media.video import VIDEO_CONTAINERS

__all__ = ["KINDS", "MEDIA_SUFFIXES", "PROG", "DatasetError", "Kind", "Record", "check_media",
           "read_records"]

PROG = "make_energon_dataset"
MEDIA_SUFFIXES: dict[str, dict[str, str]] = {
    "image": {".jpg": "jpg", ".jpeg": "jpg", ".png": "png"},
    "audio": {".wav": "wav", ".flac": "flac", ".mp3": "mp3"},
    "video": {f".{container}": container for container in VIDEO_CONTAINERS},
}
"""Media files accepted per column, and the tar part each is stored as (bytes kept as they are);
``video``: a conversation's video file, an item of the image encoder."""
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


VIDEO_FRAMES = (f"a video file path ({', '.join(VIDEO_CONTAINERS)}) or a list of its frames' "
                "image paths")
"""How a conversation record gives a video."""


def _paths(row: dict[str, Any], column: str, where: str,
           videos: bool | None = False) -> list[str | list[str]]:
    """A record's ``column`` entries: one, a list of them, or absent (none). An entry is a path
    (a video file's is a video); with ``videos`` True a video (a video file or a list of frame
    paths); with None either (LLaVA's ``image`` list, where a list entry is a video)."""
    value = row.get(column)
    entries = [] if value is None else value if isinstance(value, list) else [value]
    for index, entry in enumerate(entries):
        frames = entry if isinstance(entry, list) and isinstance(value, list) else [entry]
        shape_ok = videos is None or isinstance(entry, list) == videos or (
            videos and _is_video_file(entry))
        if not (shape_ok and frames and all(isinstance(path, str) and path for path in frames)):
            what = column if not isinstance(value, list) else f"{column}[{index}]"
            give = (f"give each video as {VIDEO_FRAMES}" if videos
                    else "give a path, a list of paths (a video: a list of frame paths)"
                    if videos is None else "give a path or a list of paths")
            raise DatasetError(f"{where}: {what!r} is not {'a video' if videos else 'a file path'}"
                               f" ({give}, or no {column!r} for a record without them)")
    return entries


def _is_video_file(entry: object) -> bool:
    return isinstance(entry, str) and Path(entry).suffix.lower() in MEDIA_SUFFIXES["video"]


def _llava_turns(row: dict[str, Any], where: str) -> list[dict[str, str]]:
    """LLaVA / ShareGPT ``conversations`` (``from`` / ``value``) as ``{role, content}`` turns."""
    converted = []
    for index, turn in enumerate(row["conversations"]):
        speaker = turn.get("from") if isinstance(turn, dict) else None
        value = turn.get("value") if isinstance(turn, dict) else None
        if speaker not in LLAVA_ROLES or not isinstance(value, str):
            raise DatasetError(f"{where}: conversations[{index}] is not {{\"from\": "
                               f"{'|'.join(LLAVA_ROLES)}, \"value\": text}}")
        converted.append({"role": LLAVA_ROLES[speaker], "content": value})
    return converted


def _swift_turns(row: dict[str, Any], where: str) -> list[dict[str, str]]:
    """ms-swift ``messages``, already ``{role, content}`` turns, checked."""
    for index, turn in enumerate(row["messages"]):
        if not (isinstance(turn, dict) and turn.get("role") in ROLES
                and isinstance(turn.get("content"), str)):
            raise DatasetError(f"{where}: messages[{index}] is not {{\"role\": "
                               f"{'|'.join(ROLES)}, \"content\": text}}")
    return [{"role": turn["role"], "content": turn["content"]} for turn in row["messages"]]


def _count(turns: list[dict[str, str]], media: str) -> int:
    return sum(turn["content"].count(media_marker(media)) for turn in turns)


def _in_marker_order(turns: list[dict[str, str]], images: list[str | list[str]],
                     videos: list[str | list[str]]) -> list[str | list[str]]:
    """ms-swift's separate ``images`` and ``videos`` as the one list of the image encoder's items,
    in the order of their ``<image>`` / ``<video>`` tags (no tags: images, then videos)."""
    pattern = f"{re.escape(media_marker('image'))}|{re.escape(media_marker('video'))}"
    tags = [tag for turn in turns for tag in re.findall(pattern, turn["content"])]
    if not tags:
        return [*images, *videos]
    queues = {media_marker("image"): iter(images), media_marker("video"): iter(videos)}
    return [next(queues[tag]) for tag in tags]


def _check_count(where: str, markers: int, items: int, media: str, what: str,
                 tagged: bool = False) -> None:
    """One ``media`` marker per item, or none (unless ``tagged``: the record's other visual tags
    place its items, so these need theirs too)."""
    if (markers or tagged) and markers != items:
        none = (f" (or none: the {what}s then open the first 'human' turn)" if not tagged
                else " (a record with <image> or <video> tags needs one for every image and "
                     "video)")
        raise DatasetError(f"{where}: {markers} {media_marker(media)} marker"
                           f"{'s' * (markers != 1)} for {items} {what}{'s' * (items != 1)}; give "
                           f"one marker per {what}, in {what} order{none}")


def _conversation_row(row: dict[str, Any], where: str) -> dict[str, Any]:
    """A LLaVA-style (or ShareGPT) record (``conversations``, ``image``, ``audio``; LLaVA-Video's
    ``video`` items after the ``image`` ones) or an ms-swift
    record (``messages``, ``images``, ``videos``, ``audios``) as the columns of the
    ``conversation`` kind: its image (and video) paths, its audio paths and its turns as JSON
    ``{role, content}`` text; records that cannot train are refused."""
    swift = "messages" in row
    column = "messages" if swift else "conversations"
    if not isinstance(row.get(column), list) or not row[column]:
        raise DatasetError(f"{where}: no {column!r} list; each record needs conversations "
                           "[{from, value}, ...] (LLaVA, ShareGPT; and image / audio: a path or "
                           "a list, if it has any) or messages [{role, content}, ...] (ms-swift; "
                           "and images / videos / audios lists)")
    if swift:
        converted = _swift_turns(row, where)
        stills, videos = _paths(row, "images", where), _paths(row, "videos", where, videos=True)
        tagged = bool(_count(converted, "image") + _count(converted, "video"))
        for media, items in (("image", stills), ("video", videos)):
            _check_count(where, _count(converted, media), len(items), media, media, tagged)
        images = _in_marker_order(converted, stills, videos)
        audios = _paths(row, "audios", where)
    else:
        converted = _llava_turns(row, where)
        images = [*_paths(row, "image", where, videos=None),
                  *_paths(row, "video", where, videos=True)]
        audios = _paths(row, "audio", where)
        _check_count(where, _count(converted, "image") + _count(converted, "video"),
                     len(images), "image", "image")
    _check_count(where, _count(converted, "audio"), len(audios), "audio", "audio clip")
    if not any(turn["role"] == "assistant" for turn in converted):
        raise DatasetError(f"{where}: no assistant ('gpt') turn, so nothing to train on")
    unmarked = [what for what, items, markers in (
        ("image", images, _count(converted, "image") + _count(converted, "video")),
        ("audio", audios, _count(converted, "audio"))) if items and not markers]
    if unmarked and not any(turn["role"] == "user" for turn in converted):
        raise DatasetError(f"{where}: no {media_marker(unmarked[0])} marker and no 'human' turn "
                           f"to put the {unmarked[0]} items in")
    return {"key": row.get("id"), "images": images, "audios": audios,
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


def _conversation_items(entries: list[str | list[str]]) -> list[tuple[str, str]]:
    """Each image or clip (a video: each frame) path of a conversation with its part's index."""
    return [(name, f"{index}.{frame}" if isinstance(entry, list) else str(index))
            for index, entry in enumerate(entries)
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
        named = ([("video" if "." not in item and _is_video_file(name) else media, name, item)
                  for media in ("image", "audio")
                  for name, item in _conversation_items(row[f"{media}s"])]
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
                    decoded = (decode_video({"file": path.read_bytes(), "container":
                                             MEDIA_SUFFIXES["video"][path.suffix.lower()]},
                                            where, column) if column == "video"
                               else DECODERS[column](path.read_bytes(), where, column))
                except BadSampleError as error:
                    raise DatasetError(f"{where} does not decode as {column}: {error}") from None
                if "." in item:  # a video's frame: all of one size
                    size = frame_sizes.setdefault(item.partition(".")[0], decoded.shape[:2])
                    if decoded.shape[:2] != size:
                        raise DatasetError(f"{where} is {decoded.shape[0]}x{decoded.shape[1]} "
                                           f"(height x width), not the {size[0]}x{size[1]} of "
                                           "its video's first frame; give frames of one size")
