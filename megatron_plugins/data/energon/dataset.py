"""A prepared Energon dataset folder (``--data-path``): its metadata, and the checks that refuse,
in one line before any process group, a folder this run cannot read."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Collection
from pathlib import Path
from typing import Any

import yaml
from braceexpand import braceexpand

from megatron_plugins.data.samples import SAMPLE_KINDS, SampleKind
from megatron_plugins.encoders import EncoderPlugin
from megatron_plugins.errors import UsageError

__all__ = ["DataPathError", "check_dataset", "split_sizes"]


class DataPathError(UsageError):
    """A ``--data-path`` that cannot be trained on; the message says what to fix."""


def dataset_spec(path: Path) -> dict[str, Any]:
    """A prepared dataset folder's ``.nv-meta/dataset.yaml``."""
    return yaml.safe_load((path / ".nv-meta" / "dataset.yaml").read_text()) or {}


def dataset_sample_type(spec: dict[str, Any]) -> str:
    """The sample class a ``dataset.yaml`` declares."""
    sample_type = spec.get("sample_type") or {}
    return sample_type.get("__class__") or spec.get("__class__", "").replace("Webdataset",
                                                                               "Sample")


def _other_parts(path: Path, parts: list[str]) -> list[str] | None:
    """The part names the folder's samples hold when none holds any of ``parts``; None when one
    does, or without Energon's index to ask (a cheap query: it stops at the first match)."""
    index = path / ".nv-meta" / "index.sqlite"
    if not index.is_file():
        return None
    try:
        with contextlib.closing(sqlite3.connect(f"{index.as_uri()}?mode=ro", uri=True)) as db:
            marks = ",".join("?" * len(parts))
            if db.execute(f"SELECT 1 FROM sample_parts WHERE part_name IN ({marks}) LIMIT 1",
                          parts).fetchone():
                return None
            return [name for (name,) in db.execute(
                "SELECT DISTINCT part_name FROM sample_parts ORDER BY part_name LIMIT 20")]
    except sqlite3.Error:
        return None  # An index of another Energon version: Energon itself reads the parts.


def _check_field_map(path: Path, sample_type: str, spec: dict[str, Any],
                     media: Collection[str]) -> None:
    """Refuse a ``field_map`` (what ``energon prepare --field-map`` writes) that leaves a field
    training reads (of the ``media`` the run's encoders read) unfilled, looks inside a part, or
    names parts no sample holds: Energon would fail on every rank at the first sample."""
    if spec.get("sample_loader"):
        return  # The loader fills the fields itself (tools.make_energon_dataset writes one).
    where = f"--data-path {path}: its .nv-meta/dataset.yaml"
    field_map = spec.get("field_map") or {}
    for field in SAMPLE_KINDS[sample_type].read_fields(media):
        if field not in field_map:
            raise DataPathError(
                f"{where} maps no tar part to the {field!r} field of {sample_type}; add "
                f"\"{field}\": \"<part extension>\" to its field_map (or re-run `energon "
                "prepare --force-overwrite` with that entry in --field-map)")
        parts = str(field_map[field]).split(",")
        nested = next((part for part in parts if "[" in part), None)
        if nested is not None:
            raise DataPathError(
                f"{where} maps {field!r} to {nested!r}, inside a part, which needs Energon's "
                "decoder (off in training); map it to a whole part holding just that text, or "
                "write a sample_loader (as python -m tools.make_energon_dataset does)")
        held = _other_parts(path, parts)
        if held is not None:
            raise DataPathError(
                f"{where} maps {field!r} to {field_map[field]!r}, but no sample of its shards "
                f"holds such a part (they hold: {', '.join(held) or 'none'}); map {field!r} to "
                "one of those in its field_map")


def split_sizes(path: Path) -> dict[str, int | None]:
    """Samples per Energon split part of a prepared dataset folder, from its metadata (None where
    a part names shards the metadata does not count)."""
    meta = path / ".nv-meta"
    info_file = next((meta / name for name in (".info.json", ".info.yaml")
                      if (meta / name).is_file()), None)
    counts = yaml.safe_load(info_file.read_text()).get("shard_counts", {}) if info_file else {}
    parts = yaml.safe_load((meta / "split.yaml").read_text()).get("split_parts", {})
    sizes: dict[str, int | None] = {}
    for part, patterns in parts.items():
        shards = [shard for pattern in patterns or [] for shard in braceexpand(pattern)]
        known = all(shard in counts for shard in shards)
        sizes[part] = sum(counts[shard] for shard in shards) if known else None
    return sizes


def check_dataset(path: Path, plugins: dict[str, EncoderPlugin], args: Any) -> SampleKind | None:
    """Refuse, in one line, a dataset folder this run cannot read (before any process group);
    returns its sample kind (None for a metadataset, whose datasets Energon resolves)."""
    flag = f"--data-path {path}"
    if not path.exists():
        raise DataPathError(f"{flag} does not exist; give a folder prepared with `energon "
                            "prepare` (or tools.make_energon_dataset) or a metadataset YAML")
    if path.is_file():
        return None  # A metadataset: Energon resolves and checks the datasets it blends.
    if not (path / ".nv-meta" / "dataset.yaml").is_file():
        raise DataPathError(
            f"{flag} is not a prepared Energon dataset (no .nv-meta/dataset.yaml); prepare it "
            f"with `energon prepare {path}` or `python -m tools.make_energon_dataset`")
    spec = dataset_spec(path)
    sample_type = dataset_sample_type(spec)
    if sample_type not in SAMPLE_KINDS:
        raise DataPathError(f"{flag} holds {sample_type or 'unknown'} samples; supported: "
                            f"{', '.join(SAMPLE_KINDS)}")
    read = {plugin.preprocessor().media for plugin in plugins.values()}
    _check_field_map(path, sample_type, spec, read)
    carried = SAMPLE_KINDS[sample_type].media
    for name, plugin in plugins.items():
        media = plugin.preprocessor().media
        if media not in carried:
            raise DataPathError(
                f"{flag} holds {sample_type} samples, which carry no {media!r} media for "
                f"--encoder {name}={plugin.grid.provider}; use a dataset with "
                f"{media} or drop that encoder")
    sizes = split_sizes(path)
    needed = {"train": "or lower --global-batch-size"}
    if args.eval_iters and args.eval_interval:
        needed["val"] = "or set --eval-iters 0"
    for part, fix in needed.items():
        size = sizes.get(part, 0)
        # A finite split is dealt out evenly to the loader workers: one must fill a batch.
        workers = max(1, args.num_workers) if part == "val" else 1
        if size is not None and -(-size // workers) < args.global_batch_size:
            per = (f" in any of its {workers} loader workers' shares (--num-workers)"
                   if workers > 1 else "")
            raise DataPathError(
                f"{flag}: its {part} split holds {size} samples, fewer than one global batch "
                f"(--global-batch-size {args.global_batch_size}){per}; add samples to it {fix}"
                + (" or lower --num-workers" if workers > 1 else ""))
    return SAMPLE_KINDS[sample_type]
