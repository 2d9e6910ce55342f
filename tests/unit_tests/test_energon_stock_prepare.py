"""Folders prepared by stock ``energon prepare --field-map`` (the README's commands) train: Energon
hands their text parts over as raw bytes with its decoder off, and they are read as UTF-8 text;
a field map that cannot fill a sample is refused in one line before any process group."""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import tarfile
from pathlib import Path

import pytest
import yaml
from megatron.energon import DefaultTaskEncoder, WorkerConfig, get_loader, get_val_dataset

from megatron_plugins.data.addressing import RankSlice
from megatron_plugins.data.energon.dataset import DataPathError, check_dataset
from megatron_plugins.data.samples import SAMPLE_KINDS
from megatron_plugins.media.codec import BadSampleError
from megatron_plugins.data.sources import build_source
from megatron_plugins.data.text import SampleText
from megatron_plugins.encoders.audio import AudioFrameEncoder
from megatron_plugins.encoders.vit import ViTEncoder
from megatron_plugins.parallel.layout import LANGUAGE, ModulePlacement, ParallelLayout
from tests.harness.energon_data import (
    STOCK_FIELD_MAPS,
    energon_prepare,
    source_args,
    stock_prepared_dataset,
)

ENCODERS = {"image": ("vision", "vit", ViTEncoder), "audio": ("audio", "audio", AudioFrameEncoder)}
"""Media kind -> (module name, provider, plugin class) of the encoder that reads it."""


class _RawSamples(DefaultTaskEncoder):
    """Energon's samples as training gets them: decoder off, no batching."""

    decoder = None


def _raw_samples(dataset: Path, count: int) -> list:
    worker_config = WorkerConfig(rank=0, world_size=1, num_workers=0)
    loader = get_loader(get_val_dataset(str(dataset), split_part="val", batch_size=None,
                                        worker_config=worker_config, task_encoder=_RawSamples()))
    return list(itertools.islice(loader, count))


def _annotations(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "annotations.jsonl").read_text().splitlines()]


def _source(root: Path, kind: str, **overrides):
    """The run's source on the stock folder, with an encoder for each media kind it carries."""
    encoders = [ENCODERS[m] for m in SAMPLE_KINDS[STOCK_FIELD_MAPS[kind][0]].media]
    layout = ParallelLayout((
        *(ModulePlacement(name=name, tp=1, pp=1, cp=1, dp=1, rank_offset=i, provider=provider)
          for i, (name, provider, _) in enumerate(encoders)),
        ModulePlacement(name=LANGUAGE, tp=1, pp=1, cp=1, dp=1, rank_offset=len(encoders))))
    args = source_args(root, (plugin for *_, plugin in encoders), **overrides)
    plugins = {name: plugin(name, args, layout.module(name)) for name, _, plugin in encoders}
    return build_source(args, plugins), layout, args, plugins


@pytest.fixture(scope="module")
def caption_root() -> Path:
    return stock_prepared_dataset("caption")


@pytest.mark.multirank
def test_the_stock_cli_writes_a_field_map_and_training_reads_its_text_as_str(caption_root):
    spec = yaml.safe_load((caption_root / "energon" / ".nv-meta" / "dataset.yaml").read_text())
    assert spec["field_map"] == {"image": "png", "caption": "txt"} and "sample_loader" not in spec
    captions = {f"{i:06d}": r["caption"] for i, r in enumerate(_annotations(caption_root))}
    [sample] = _raw_samples(caption_root / "energon", 1)
    assert isinstance(sample.caption, bytes)  # what Energon hands over with its decoder off
    assert SAMPLE_KINDS["CaptioningSample"].text(sample) == SampleText("", captions[sample.__key__])
    # The language rank tokenizes every caption of a global batch; its tokens spell them.
    source, layout, _, _ = _source(caption_root, "caption")
    keys, batch = next(source.open("train", RankSlice.of(layout, LANGUAGE, 0, 2), 0, None))
    spelled = source.tokenizer._hf.decode(batch["tokens"][0], skip_special_tokens=True)
    assert captions[keys[0]].replace(" ", "") in spelled.replace(" ", "")


@pytest.mark.parametrize("kind", ["vqa", "transcript", "image_audio_caption"])
@pytest.mark.multirank
def test_every_sample_type_reads_from_a_stock_prepared_folder(kind):
    root = stock_prepared_dataset(kind)
    records = {f"{i:06d}": record for i, record in enumerate(_annotations(root))}
    kind_spec = SAMPLE_KINDS[STOCK_FIELD_MAPS[kind][0]]
    for sample in _raw_samples(root / "energon", 4):
        record = records[sample.__key__]
        text = kind_spec.text(sample)
        expected = (SampleText(record["question"], record["answer"]) if kind == "vqa"
                    else SampleText("", record.get("caption") or record["transcript"]))
        assert text == expected
        assert all(isinstance(getattr(sample, m), bytes) for m in kind_spec.media)
    source, layout, _, _ = _source(root, kind)
    for module in (*(p.name for p in layout.encoders), LANGUAGE):
        keys, _ = next(source.open("train", RankSlice.of(layout, module, 0, 2), 0, None))
        assert len(keys) == 2


def test_a_vqa_answer_list_of_bytes_takes_the_first_answer():
    vqa = SAMPLE_KINDS["VQASample"]
    sample = argparse.Namespace(__key__="k", context=b"what colour ?",
                                answers=[b"red", b"crimson"])
    assert vqa.text(sample) == SampleText("what colour ?", "red")
    with pytest.raises(BadSampleError, match=r"sample 'k': field 'answers' is an empty list"):
        vqa.text(argparse.Namespace(__key__="k", context="q", answers=[]))


@pytest.mark.multirank
def test_text_that_is_not_utf8_stops_the_language_rank_naming_the_sample(caption_root, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(caption_root, copy)
    for shard in (copy / "energon").glob("*.tar"):
        with tarfile.open(shard) as tar:
            members = [(m.offset_data, m.size) for m in tar.getmembers() if m.name.endswith(".txt")]
        with open(shard, "r+b") as f:
            for offset, size in members:
                f.seek(offset)
                f.write(b"\xff" * size)
    source, layout, _, _ = _source(copy, "caption")
    stream = source.open("train", RankSlice.of(layout, LANGUAGE, 0, 2), 0, None)
    with pytest.raises(BadSampleError, match=r"^sample '\d{6}': field 'caption' is not UTF-8 "
                                             r"text \(invalid start byte at byte 0\)$"):
        next(stream)


def _with_field_map(root: Path, target: Path, field_map: dict[str, str]) -> Path:
    shutil.copytree(root, target)
    spec_file = target / "energon" / ".nv-meta" / "dataset.yaml"
    spec = yaml.safe_load(spec_file.read_text())
    spec["field_map"] = field_map
    spec_file.write_text(yaml.safe_dump(spec, sort_keys=False))
    return target


@pytest.mark.parametrize("field_map, match", [
    ({"image": "png"}, r"maps no tar part to the 'caption' field of "
                       r"CaptioningSample; add \"caption\": \"<part extension>\" to its field_map "
                       r"\(or re-run `energon prepare --force-overwrite` with that entry in "
                       r"--field-map\)"),
    ({"image": "jpg", "caption": "txt"}, r"maps 'image' to 'jpg', but no sample of its shards "
                                         r"holds such a part \(they hold: png, txt\)"),
    ({"image": "jpg,png", "caption": "json[caption]"},
     r"maps 'caption' to 'json\[caption\]', inside a part, which needs Energon's decoder"),
], ids=["missing-field", "missing-part", "inside-a-part"])
@pytest.mark.multirank
def test_a_field_map_that_cannot_fill_the_sample_is_one_line(caption_root, tmp_path, field_map,
                                                             match):
    root = _with_field_map(caption_root, tmp_path / "copy", field_map)
    _, _, args, plugins = _source(caption_root, "caption")
    with pytest.raises(DataPathError, match=rf"^--data-path {root / 'energon'}: its "
                                                 rf"\.nv-meta/dataset\.yaml {match}") as error:
        check_dataset(root / "energon", plugins, args)
    assert "\n" not in str(error.value)


def test_a_sample_loader_dataset_needs_no_field_map(tmp_path):
    from tools.make_synthetic_dataset import make_synthetic, prepare

    make_synthetic(tmp_path, 40, "caption")
    prepare(tmp_path, "caption", quiet=True)
    spec = yaml.safe_load((tmp_path / "energon" / ".nv-meta" / "dataset.yaml").read_text())
    assert "field_map" not in spec and spec["sample_loader"]
    _, _, args, plugins = _source(tmp_path, "caption", global_batch_size=4, eval_iters=0)
    check_dataset(tmp_path / "energon", plugins, args)


@pytest.mark.multirank
def test_the_stock_cli_names_only_energons_own_sample_types(tmp_path):
    """Why the README writes the audio types' dataset.yaml by hand."""
    shutil.copytree(stock_prepared_dataset("caption") / "energon", tmp_path / "energon")
    run = energon_prepare(str(tmp_path / "energon"), "--non-interactive", "--force-overwrite",
                          "--split-ratio", "8,1,1", "--sample-type", "AudioTranscriptSample",
                          "--field-map", '{"audio": "wav", "transcript": "txt"}')
    assert run.returncode != 0 and "Sample type 'AudioTranscriptSample' not found" in run.stderr
