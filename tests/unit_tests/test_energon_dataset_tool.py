"""tools.make_energon_dataset and tools.make_synthetic_dataset: the datasets Energon reads back
(decoder off, as training reads them), every validation error, and synthetic data whose text
follows from its media."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import wave
from pathlib import Path

import numpy as np
import pytest
import yaml
from megatron.energon import (
    CaptioningSample,
    DefaultTaskEncoder,
    VQASample,
    WorkerConfig,
    get_loader,
    get_train_dataset,
)
from PIL import Image

from megatron_plugins.data.samples import (DATASET_KINDS, AudioTranscriptSample,
                                           ImageAudioCaptionSample, sample_kind)
from tools.annotations import KINDS
from tools.make_energon_dataset import SPLITS, main, make_dataset
from tools.make_synthetic_dataset import COLOURS, SAMPLE_RATE, TONES, make_synthetic

# Energon's loader asks torch for pinned memory whatever the machine; on CPU torch warns.
pytestmark = pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")

SAMPLE_TYPES = {
    "caption": CaptioningSample,
    "vqa": VQASample,
    "transcript": AudioTranscriptSample,
    "image_audio_caption": ImageAudioCaptionSample,
}


class RawTaskEncoder(DefaultTaskEncoder):
    """Energon's default task encoder with its decoder off, as the training loader runs it."""

    decoder = None


def load_split(path: Path, split: str) -> list:
    """Every sample of one split, once, in the order Energon yields them."""
    dataset = get_train_dataset(
        path,
        split_part=split,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        batch_size=None,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=RawTaskEncoder(),
        repeat=False,
    )
    return list(get_loader(dataset))


def fields(sample) -> dict:
    return {f.name: getattr(sample, f.name) for f in dataclasses.fields(sample)}


def expected_fields(kind: str, record: dict, source: Path) -> dict:
    """What a sample made from ``record`` must hold: the source files' bytes and the text."""
    media = {column: (source / record[column]).read_bytes()
             for column in ("image", "audio") if column in record}
    if kind == "vqa":
        return dict(media, context=record["question"], answers=[record["answer"]])
    if kind == "transcript":
        return dict(media, transcript=record["transcript"])
    return dict(media, caption=record["caption"])


@pytest.mark.parametrize("kind", list(SAMPLE_TYPES))
def test_dataset_reads_back_through_energon(tmp_path: Path, kind: str) -> None:
    source = make_synthetic(tmp_path / "source", 40, kind, seed=3, image_size=16)
    records = [json.loads(line) for line in (source / "annotations.jsonl").open()]
    path = make_dataset(source, source / "annotations.jsonl", kind, tmp_path / "energon",
                        samples_per_shard=8, split=(80, 10, 10), seed=1)
    keys_by_split = {}
    for split in SPLITS:
        samples = load_split(path, split)
        keys_by_split[split] = [sample.__key__ for sample in samples]
        for sample in samples:
            assert type(sample) is SAMPLE_TYPES[kind]
            want = expected_fields(kind, records[int(sample.__key__)], source)
            got = fields(sample)
            assert {name: got[name] for name in want} == want, sample.__key__
            # What the training loader reads of this sample type, all filled (one schema).
            assert all(getattr(sample, field) for field in sample_kind(sample).fields)
    keys = [key for split_keys in keys_by_split.values() for key in split_keys]
    assert sorted(keys) == [f"{i:06d}" for i in range(40)]  # a partition: no key lost or repeated
    assert [len(keys_by_split[split]) for split in SPLITS] == [32, 4, 4]


def test_the_tool_writes_every_kind_of_the_sample_schema() -> None:
    """A kind added to the schema is one the tool can write."""
    assert set(KINDS) == set(DATASET_KINDS)


def test_csv_annotations_own_keys_and_jpeg(tmp_path: Path) -> None:
    source = make_synthetic(tmp_path / "source", 12, "caption", image_size=16)
    records = [json.loads(line) for line in (source / "annotations.jsonl").open()]
    for record in records[::2]:  # half the images as JPEG: stored as .jpg, bytes kept
        png = source / record["image"]
        record["image"] = str(Path(record["image"]).with_suffix(".jpeg"))
        Image.open(png).save(source / record["image"], format="JPEG")
    with (source / "annotations.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["key", "image", "caption"])
        writer.writeheader()
        for index, record in enumerate(records):
            writer.writerow(dict(record, key=f"img-{index}"))
    path = make_dataset(source, source / "annotations.csv", "caption", tmp_path / "energon",
                        split=(50, 25, 25))
    samples = [sample for split in SPLITS for sample in load_split(path, split)]
    assert sorted(s.__key__ for s in samples) == sorted(f"img-{i}" for i in range(12))
    for sample in samples:
        record = records[int(sample.__key__.split("-")[1])]
        assert sample.caption == record["caption"]
        assert sample.image == (source / record["image"]).read_bytes()


def test_dataset_yaml_names_the_sample_type(tmp_path: Path) -> None:
    source = make_synthetic(tmp_path / "source", 20, "transcript")
    path = make_dataset(source, source / "annotations.jsonl", "transcript", tmp_path / "energon")
    config = yaml.safe_load((path / ".nv-meta" / "dataset.yaml").read_text())
    assert config["sample_type"] == {"__module__": "megatron_plugins.data.samples",
                                     "__class__": "AudioTranscriptSample"}
    assert config["part_filter"] == ["wav", "flac", "mp3", "txt"]


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def run_failing(capsys, tmp_path: Path, args: list[str]) -> str:
    """Run the tool expecting a usage error: exit 2, one error line, no output folder left."""
    output = tmp_path / "out" / "energon"
    assert main([*args, "--output", str(output), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("make_energon_dataset: error: ") and err.count("\n") == 1, err
    assert not output.exists()
    assert not (output.parent.exists() and any(output.parent.iterdir()))
    return err


@pytest.fixture
def source(tmp_path: Path) -> Path:
    return make_synthetic(tmp_path / "source", 20, "image_audio_caption", image_size=16)


def _args(source: Path, annotations: Path, kind: str = "image_audio_caption") -> list[str]:
    return ["--input", str(source), "--annotations", str(annotations), "--kind", kind]


def test_missing_input_folder(capsys, tmp_path: Path, source: Path) -> None:
    err = run_failing(capsys, tmp_path, _args(tmp_path / "nowhere", source / "annotations.jsonl"))
    assert "--input" in err and "nowhere" in err


def test_missing_annotation_file(capsys, tmp_path: Path, source: Path) -> None:
    err = run_failing(capsys, tmp_path, _args(source, source / "labels.jsonl"))
    assert "--annotations" in err and "labels.jsonl" in err


def test_jsonl_record_without_a_column(capsys, tmp_path: Path, source: Path) -> None:
    records = [json.loads(line) for line in (source / "annotations.jsonl").open()]
    del records[2]["audio"]
    err = run_failing(capsys, tmp_path, _args(source, _write_jsonl(source / "a.jsonl", records)))
    assert "line 3" in err and "'audio'" in err


def test_csv_header_without_a_column(capsys, tmp_path: Path, source: Path) -> None:
    (source / "a.csv").write_text("image,question\nimages/000000.png,what ?\n")
    err = run_failing(capsys, tmp_path, _args(source, source / "a.csv", kind="vqa"))
    assert "line 1" in err and "'answer'" in err


def test_missing_media_file(capsys, tmp_path: Path, source: Path) -> None:
    (source / "images" / "000004.png").unlink()
    err = run_failing(capsys, tmp_path, _args(source, source / "annotations.jsonl"))
    assert "line 5" in err and "images/000004.png" in err and "does not exist" in err


def test_image_that_does_not_decode(capsys, tmp_path: Path, source: Path) -> None:
    (source / "images" / "000001.png").write_bytes(b"not a png")
    err = run_failing(capsys, tmp_path, _args(source, source / "annotations.jsonl"))
    assert "line 2" in err and "images/000001.png" in err and "does not decode as image" in err


def test_wav_that_does_not_parse(capsys, tmp_path: Path, source: Path) -> None:
    (source / "audio" / "000003.wav").write_bytes(b"RIFF....WAVEjunk")
    err = run_failing(capsys, tmp_path, _args(source, source / "annotations.jsonl"))
    assert "line 4" in err and "audio/000003.wav" in err and "does not decode as audio" in err


def test_split_that_leaves_a_split_empty(capsys, tmp_path: Path, source: Path) -> None:
    err = run_failing(capsys, tmp_path,
                      [*_args(source, source / "annotations.jsonl"), "--split", "98,1,1"])
    assert "--split 98,1,1" in err and "val split empty with 20 samples" in err


def test_duplicate_keys(capsys, tmp_path: Path, source: Path) -> None:
    records = [dict(json.loads(line), key="same") for line in (source / "annotations.jsonl").open()]
    err = run_failing(capsys, tmp_path, _args(source, _write_jsonl(source / "a.jsonl", records)))
    assert "line 2" in err and "'same'" in err and "line 1" in err


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_synthetic_is_deterministic_per_seed(tmp_path: Path) -> None:
    first = _tree(make_synthetic(tmp_path / "a", 10, "image_audio_caption", seed=5))
    again = _tree(make_synthetic(tmp_path / "b", 10, "image_audio_caption", seed=5))
    other = _tree(make_synthetic(tmp_path / "c", 10, "image_audio_caption", seed=6))
    assert first == again
    assert first.keys() == other.keys() and first != other


def seen(image_bytes: bytes) -> tuple[str, str]:
    """(colour, shape) read off a synthetic image: the palette colour nearest the lit pixels, and
    the shape from its mask (a stripe spans the width, a square fills its bounding box)."""
    pixels = np.asarray(Image.open(io.BytesIO(image_bytes)).convert("RGB")).astype(int)
    mask = pixels.sum(axis=2) > 0
    colour = min(COLOURS, key=lambda name: np.abs(pixels[mask].mean(0) - COLOURS[name]).sum())
    rows, cols = np.nonzero(mask)
    box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
    if mask.all(axis=1).any():
        return colour, "stripe"
    return colour, "square" if mask.sum() == box else "circle"


def heard(wav_bytes: bytes) -> str:
    """The pitch class whose frequency is nearest the tone's spectral peak."""
    with wave.open(io.BytesIO(wav_bytes)) as wav:
        assert wav.getframerate() == SAMPLE_RATE and wav.getsampwidth() == 2
        samples = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
    peak = np.fft.rfftfreq(len(samples), 1 / SAMPLE_RATE)[np.abs(np.fft.rfft(samples)).argmax()]
    return min(TONES, key=lambda pitch: abs(TONES[pitch] - peak))


@pytest.mark.parametrize("kind", list(SAMPLE_TYPES))
def test_synthetic_text_follows_from_the_media(tmp_path: Path, kind: str) -> None:
    source = make_synthetic(tmp_path / kind, 30, kind, seed=2)
    texts = set()
    for line in (source / "annotations.jsonl").open():
        record = json.loads(line)
        colour, shape, pitch = "", "", ""
        if "image" in record:
            colour, shape = seen((source / record["image"]).read_bytes())
        if "audio" in record:
            pitch = heard((source / record["audio"]).read_bytes())
        if kind == "caption":
            text = record["caption"]
            assert text == f"a {colour} {shape} on a black background"
        elif kind == "vqa":
            text = record["answer"]
            assert text == (colour if "colour" in record["question"] else shape)
        elif kind == "transcript":
            text = record["transcript"]
            assert text == f"a {pitch} tone"
        else:
            text = record["caption"]
            assert text == f"a {colour} {shape} and a {pitch} tone"
        texts.add(text)
    assert len(texts) > 2  # the text varies with the media, it is not one constant


def test_prepare_writes_dataset_and_tokenizer(tmp_path: Path) -> None:
    pytest.importorskip("tools.train_tokenizer")
    from tools.make_synthetic_dataset import prepare

    source = make_synthetic(tmp_path / "synthetic", 40, "caption")
    prepare(source, "caption", quiet=True)
    assert len(load_split(source / "energon", "train")) == 36
    assert (source / "tokenizer").is_dir() and any((source / "tokenizer").iterdir())


def test_the_same_texts_train_the_same_tokenizer(tmp_path: Path) -> None:
    # Goldens of runs on a generated dataset need the same token ids every time (an end-of-word
    # suffix numbered symbols in hash order: 4 trainings gave 4 different files).
    from tools.train_tokenizer import train_tokenizer

    texts = [f"a {colour} {shape} and a {pitch} tone" for colour in COLOURS
             for shape in ("square", "circle") for pitch in TONES]
    files = {(train_tokenizer(texts, 64, tmp_path / str(i)) / "tokenizer.json").read_bytes()
             for i in range(4)}
    assert len(files) == 1
