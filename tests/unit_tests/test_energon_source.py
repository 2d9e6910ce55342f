"""The Energon source on one process: each rank's slice, and every bad input of the real-data
path refused in one line (configuration) or stopped naming the sample (a bad sample mid-run)."""

from __future__ import annotations

import argparse
import shutil
import tarfile
from pathlib import Path

import pytest

from megatron_plugins.data.addressing import RankSlice
from megatron_plugins.data.sources import build_source
from megatron_plugins.data.energon.dataset import DataPathError
from megatron_plugins.media.codec import BadSampleError
from megatron_plugins.encoders.audio import AudioFrameEncoder
from megatron_plugins.encoders.vit import ViTEncoder
from megatron_plugins.errors import UsageError
from megatron_plugins.parallel.layout import LANGUAGE, ModulePlacement, ParallelLayout
from tests.harness.energon_data import source_args, synthetic_dataset

LAYOUT = ParallelLayout((
    ModulePlacement(name="vision", tp=1, pp=1, cp=1, dp=2, rank_offset=0, provider="vit"),
    ModulePlacement(name="audio", tp=1, pp=1, cp=1, dp=1, rank_offset=2, provider="audio"),
    ModulePlacement(name=LANGUAGE, tp=1, pp=1, cp=1, dp=1, rank_offset=3),
))


def _args(root: Path, **overrides) -> argparse.Namespace:
    return source_args(root, (ViTEncoder, AudioFrameEncoder), **overrides)


def _plugins(args: argparse.Namespace, names=("vision", "audio")) -> dict:
    classes = {"vision": ViTEncoder, "audio": AudioFrameEncoder}
    return {name: classes[name](name, args, LAYOUT.module(name)) for name in names}


def _source(root: Path, names=("vision", "audio"), **overrides):
    args = _args(root, **overrides)
    return build_source(args, _plugins(args, names))


@pytest.fixture(scope="module")
def root() -> Path:
    return synthetic_dataset()


def test_each_rank_reads_its_slice_of_one_global_stream(root):
    source = _source(root)
    streams = {(m, r): source.open("train", RankSlice.of(LAYOUT, m, r, 2), 0, None)
               for m, dp in (("vision", 2), ("audio", 1), (LANGUAGE, 1)) for r in range(dp)}
    for _ in range(5):  # more than one global batch (4 microbatches of 2)
        batches = {rank: next(stream) for rank, stream in streams.items()}
        language_keys, language = batches[(LANGUAGE, 0)]
        assert batches[("vision", 0)][0] + batches[("vision", 1)][0] == language_keys
        assert batches[("audio", 0)][0] == language_keys
        assert language["tokens"].shape == (2, 32)
        x = batches[("vision", 0)][1]["modality_inputs"]["vision"]["vision"]["x"]
        assert x.shape == (1, 3, 16, 16)
        placeholder = source.special_token_ids["vision"]
        assert int((language["tokens"][0] == placeholder).sum()) == 4


def test_placeholders_are_special_tokens_of_the_real_tokenizer(root):
    source = _source(root)
    ids = source.special_token_ids
    assert ids["vision"] != ids["audio"]
    assert source.tokenizer._hf.convert_ids_to_tokens([ids["vision"]]) == ["<vision>"]


@pytest.mark.parametrize("overrides, match", [
    ({"data_path": ["/nonexistent/set"]}, r"--data-path /nonexistent/set does not exist"),
    ({"tokenizer_type": "NullTokenizer"}, r"--data-path needs a real tokenizer"),
    ({"tokenizer_model": "/nonexistent/tok"}, r"--tokenizer-model /nonexistent/tok"),
    ({"global_batch_size": 1000}, r"train split holds 270 samples, fewer than one global batch "
                                  r"\(--global-batch-size 1000\)"),
    ({"global_batch_size": 16}, r"val split holds 15 samples.*--eval-iters 0"),
    ({"global_batch_size": 8, "num_workers": 3},
     r"val split holds 15 samples, fewer than one global batch \(--global-batch-size 8\) in "
     r"any of its 3 loader workers' shares \(--num-workers\).*or lower --num-workers"),
    ({"seq_length": 8}, r"--seq-length 8 leaves no room for text"),
    ({"rampup_batch_size": ["4", "4", "16"]}, r"--rampup-batch-size cannot be used"),
    ({"data_path": ["a", "b"]}, r"--data-path takes one Energon dataset"),
], ids=["missing-folder", "no-tokenizer", "missing-tokenizer", "train-too-small",
        "val-too-small", "val-too-small-per-worker", "seq-too-short", "rampup", "two-paths"])
def test_configuration_problems_are_one_line_errors(root, overrides, match):
    with pytest.raises(UsageError, match=match) as error:
        _source(root, **overrides)
    assert "\n" not in str(error.value)


def test_an_unprepared_folder_is_refused(tmp_path, root):
    (tmp_path / "energon").mkdir()
    shutil.copytree(root / "tokenizer", tmp_path / "tokenizer")
    with pytest.raises(DataPathError, match=r"is not a prepared Energon dataset.*energon prepare"):
        _source(tmp_path)


def test_a_dataset_without_the_media_an_encoder_reads_is_refused(tmp_path):
    from tools.make_synthetic_dataset import make_synthetic, prepare

    make_synthetic(tmp_path, 40, "caption")
    prepare(tmp_path, "caption", quiet=True)
    with pytest.raises(DataPathError, match=r"holds CaptioningSample samples, which carry no "
                                            r"'audio' media for --encoder audio=audio"):
        _source(tmp_path, global_batch_size=4)


def _corrupt_images(root: Path, target: Path) -> Path:
    """A copy of the dataset whose train images are garbage of the same length (the index
    still points at them, as on a disk that went bad)."""
    shutil.copytree(root, target)
    for shard in (target / "energon" / "train").glob("*.tar"):
        with tarfile.open(shard) as tar:
            members = [(m.name, m.offset_data, m.size) for m in tar.getmembers()]
        with open(shard, "r+b") as f:
            for name, offset, size in members:
                if name.endswith(".png"):
                    f.seek(offset)
                    f.write(b"\x00" * size)
    return target


def test_an_image_that_does_not_decode_stops_the_encoder_naming_the_sample(root, tmp_path):
    source = _source(_corrupt_images(root, tmp_path / "copy"))
    stream = source.open("train", RankSlice.of(LAYOUT, "vision", 0, 2), 0, None)
    with pytest.raises(BadSampleError, match=r"sample '\d+': field 'image' does not decode") as on_encoder:
        next(stream)
    # The language ranks read only the image's header (its size sets the placeholder run), and a
    # header this broken stops them too, naming the same sample.
    with pytest.raises(BadSampleError, match="does not decode as an image") as on_language:
        next(source.open("train", RankSlice.of(LAYOUT, LANGUAGE, 0, 2), 0, None))
    assert on_language.value.key == on_encoder.value.key


def test_text_longer_than_the_sequence_is_cut_and_noticed_once(root, capsys):
    from megatron_plugins.data.streams import MicrobatchStream

    source = _source(root, seq_length=12)  # 8 encoder positions leave 4 for text
    this = RankSlice.of(LAYOUT, LANGUAGE, 0, 2)
    stream = MicrobatchStream(source.open("train", this, 0, None), this, None, writes_state=True)
    for _ in range(3):
        batch = next(stream)
        assert "truncated_keys" not in batch and batch["tokens"].shape == (2, 12)
    notices = capsys.readouterr().err.count("is longer than --seq-length")
    assert notices == 1
