"""Video files (mp4, webm, mkv) in conversations: frames sampled as transformers' Qwen2-VL video
processor samples them and decoded bit-equal to its PyAV loader, sizes probed from the container
alone, the sound track decoded with the video (or None), ms-swift and LLaVA-Video records
converted to file parts both sides of the grid agree on, and each bad file one line naming the
record or sample and the file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_plugins.data.energon.inputs import EncoderInputs, TextInputs
from megatron_plugins.data.samples import SAMPLE_KINDS
from megatron_plugins.media.codec import (
    BadSampleError,
    Video,
    decode_item,
    decode_sound,
    media_size,
    probe_item,
    resample,
)
from tests.harness.video_files import tone, write_video
from tools.make_energon_dataset import make_dataset

pytestmark = pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")

CLIPS = {  # file: (seconds, fps, sound rate)
    "sound.mp4": (1.5, 8, 16000),  # 12 frames: the 4-frame minimum
    "long.mp4": (3.0, 10, None),  # 30 frames: 6 at 2 per second
    "sound.webm": (1.5, 8, 48000),  # no frame count in the container
    "silent.mkv": (1.0, 6, None),
}


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("video-files")
    for name, (seconds, fps, rate) in CLIPS.items():
        write_video(root / "clips" / name, seconds, fps, sound_rate=rate)
    return root


def _item(path: Path) -> dict:
    return {"file": path.read_bytes(), "container": path.suffix[1:]}


@pytest.mark.parametrize("name", ["sound.mp4", "long.mp4"])
def test_frames_fps_and_times_are_transformers_pyav_loaders(clips, name):
    """transformers' ``load_video`` (PyAV) with ``Qwen2VLVideoProcessor.sample_frames`` at fps 2:
    the same frames bit for bit, its ``sampled_fps`` and timestamps; the probe (container
    metadata only) gives the decoded video's size."""
    from transformers import Qwen2VLVideoProcessor
    from transformers.video_utils import load_video

    path = clips / "clips" / name
    processor = Qwen2VLVideoProcessor()
    frames, metadata = load_video(str(path), backend="pyav", sample_indices_fn=lambda metadata,
                                  **_: processor.sample_frames(metadata, fps=2))
    video = decode_item("image", _item(path), "k", "images[0]")
    assert video.frames.shape == frames.shape and np.array_equal(video.frames, frames)
    assert len(frames) == {"sound.mp4": 4, "long.mp4": 6}[name]
    assert video.fps == metadata.sampled_fps
    assert np.allclose(video.timestamps, metadata.timestamps, atol=1e-9)
    assert probe_item("image", _item(path), "k", "images[0]") == media_size(video)


@pytest.mark.parametrize("name", ["sound.webm", "silent.mkv"])
def test_containers_without_a_frame_count_sample_from_their_packets(clips, name):
    """webm / mkv store no frame count (transformers' loader cannot sample them): the packets
    are counted, and the frames are those of a full decode at Qwen2-VL's indices."""
    import av

    from megatron_plugins.media.video import VideoSampling

    path = clips / "clips" / name
    with av.open(str(path)) as container:
        assert container.streams.video[0].frames == 0
        every = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    seconds, fps, _ = CLIPS[name]
    indices = VideoSampling().indices(len(every), fps)
    video = decode_item("image", _item(path), "k", "images[0]")
    assert np.array_equal(video.frames, every[indices])
    assert video.fps == pytest.approx(len(indices) / (seconds * fps) * fps)
    assert probe_item("image", _item(path), "k", "images[0]") == media_size(video)


def test_the_sound_track_comes_with_the_video_mono_at_its_rate_or_none(clips):
    """AAC at 16 kHz and Opus at 48 kHz decode to the tone written (within the codecs' loss),
    resampled to an encoder's rate as clips are; a file without an audio stream: None."""
    for name in ("sound.mp4", "sound.webm"):
        seconds, _, rate = CLIPS[name]
        audio = decode_sound(_item(clips / "clips" / name), "k", "images[0]")
        assert audio.sample_rate == rate and audio.samples.dtype == np.float32
        want = tone(rate, seconds)
        assert len(audio.samples) == len(want)
        middle = slice(len(want) // 8, -len(want) // 8)
        assert np.abs(audio.samples[middle] - want[middle]).max() < 0.02
        assert len(resample(audio, 16000).samples) == int(seconds * 16000)
    for name in ("long.mp4", "silent.mkv"):
        assert decode_sound(_item(clips / "clips" / name), "k", "images[0]") is None


def _audio_only_mp4(path: Path) -> bytes:
    import av

    with av.open(str(path), "w") as out:
        out.add_stream("libx264", rate=8)  # a video stream no frame is written to
        sound = out.add_stream("aac", rate=16000, layout="mono")
        chunk = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp",
                                           layout="mono")
        chunk.sample_rate, chunk.pts = 16000, 0
        out.mux(sound.encode(chunk))
        out.mux(sound.encode())
    return path.read_bytes()


@pytest.mark.parametrize("case, problem", [
    ("garbage", r"\(a video file\) does not open \(Invalid data found"),
    ("truncated", r"\(a video file\) does not open"),
    ("gif", r"is a video file of container 'gif', which is not read; give one of mp4, webm"),
    ("no-frames", r"\(a video file\) has no video stream"),
    ("one-frame", r"\(a video file\) has 1 frame, fewer than the 2 of one temporal patch"),
])
def test_bad_video_files_stop_naming_the_sample_and_field(clips, tmp_path, case, problem):
    good = (clips / "clips" / "sound.mp4").read_bytes()
    item = {"garbage": {"file": b"not a video", "container": "mp4"},
            "truncated": {"file": good[:len(good) // 2], "container": "mp4"},
            "gif": {"file": good, "container": "gif"},
            "no-frames": {"file": _audio_only_mp4(tmp_path / "a.mp4"), "container": "mp4"},
            "one-frame": _item(write_video(tmp_path / "one.mp4", 0.125))}[case]
    for read in (decode_item, probe_item):
        with pytest.raises(BadSampleError, match=rf"^sample 'v7': field 'images\[1\]' {problem}"):
            read("image", item, "v7", "images[1]")


def _records() -> list[dict]:
    """ms-swift: a video file with sound then an image; LLaVA-Video: a silent webm."""
    return [{"id": "swift", "videos": ["clips/sound.mp4"], "images": ["red.png"], "messages": [
                {"role": "user", "content": "<video> then <image>: what moves"},
                {"role": "assistant", "content": "colours"}]},
            {"id": "llava", "video": "clips/silent.mkv", "conversations": [
                {"from": "human", "value": "<image>\nwhat is this"},
                {"from": "gpt", "value": "a clip"}]}]


@pytest.fixture(scope="module")
def converted(clips) -> dict:
    """The records converted; the shard's part names and the samples read back."""
    import tarfile

    from PIL import Image

    from tests.unit_tests.test_energon_dataset_tool import load_split

    Image.new("RGB", (16, 16), (200, 30, 30)).save(clips / "red.png")
    (clips / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    output = make_dataset(clips, clips / "records.jsonl", "conversation", clips / "energon",
                          split=(1, 0, 0), quiet=True)
    with tarfile.open(next((output / "train").glob("*.tar"))) as shard:
        parts = sorted(shard.getnames())
    return {"parts": parts, "samples": {s.__key__: s for s in load_split(output, "train")}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from megatron_plugins.data.tokenizer import PromptTokenizer
    from tools.train_tokenizer import train_tokenizer

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        folder = train_tokenizer(["what moves", "colours then a clip", "what is this"] * 4, 120,
                                 tmp_path_factory.mktemp("tokenizer"))
        hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        hf.chat_template = (Path(__file__).parents[1] / "fixtures" /
                            "chat_template.jinja").read_text()
        hf.save_pretrained(str(folder))
        return PromptTokenizer.load(str(folder), ["vision"], 10_000)


def test_records_with_video_files_convert_to_file_parts_both_sides_agree_on(converted, clips,
                                                                            tokenizer):
    """Each video file is stored as its bytes (``<key>.N.mp4``) and read back as a file item;
    the language ranks size and place its run from the container's metadata as transformers'
    get_rope_index places a video (seconds per step: 2 / the sampled fps), the encoder ranks
    decode it, sound track and all, to that many tokens."""
    from megatron_plugins.data.text import media_marker
    from tests.models.hf_vision import plugin, save_tiny_qwen
    from tests.models.mrope import IMAGE_TOKEN, hf_rope_index

    assert converted["parts"] == ["llava.0.mkv", "llava.json", "swift.0.mp4", "swift.1.png",
                                  "swift.json"]
    swift, llava = converted["samples"]["swift"], converted["samples"]["llava"]
    assert swift.images[0] == {"file": (clips / "clips" / "sound.mp4").read_bytes(),
                               "container": "mp4"}
    assert SAMPLE_KINDS["ConversationSample"].items(llava, "image")[0][1]["container"] == "mkv"
    qwen = plugin("qwen2_5_vl", save_tiny_qwen(clips / "qwen"))
    text = TextInputs(tokenizer, {"vision": qwen}, (("vision", media_marker("image")),), 96,
                      mrope=True)
    encoder = EncoderInputs(qwen, qwen.preprocessor())
    fields, counts, _ = text(swift)
    items, encoder_counts, _ = encoder(swift)
    assert counts == {"vision": (2 * 16, 4)} and encoder_counts == (32, 4)
    assert [item["grid_thw"].tolist() for item in items] == [[2, 8, 8], [1, 4, 4]]
    length = int(fields["length"])
    tokens = fields["tokens"][:length] == tokenizer.placeholder_ids["vision"]
    want = hf_rope_index((tokens * IMAGE_TOKEN)[None], [(2, 4, 4), (1, 2, 2)],
                         seconds=[2 / (4 / 12 * 8), None])[:, 0]
    assert torch.equal(fields["position_ids"][:, :length], want)
    video = decode_item("image", swift.images[0], "swift", "images[0]")
    assert isinstance(video, Video)
    assert decode_sound(swift.images[0], "swift", "images[0]").sample_rate == 16000
    assert text(llava)[1] == {"vision": (2 * 16,)} and encoder(llava)[1] == (32,)


@pytest.mark.parametrize("video, problem", [
    ("broken.mp4", "video file CLIPS/broken.mp4 does not decode as video: "),
    ("one.mp4", "has 1 frame, fewer than the 2 of one temporal patch"),
    ("clip.gif", "'videos[0]' is not a video (give each video as a video file path (mp4, webm, "
                 "mkv, mov, avi)"),
], ids=["does-not-decode", "one-frame", "unknown-container"])
def test_a_bad_video_file_is_one_line_and_nothing_is_written(capsys, clips, tmp_path, video,
                                                             problem):
    from tools.make_energon_dataset import main

    (clips / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 and then nothing")
    write_video(clips / "one.mp4", 0.125)
    record = {"id": "v0", "videos": [video], "messages": [
        {"role": "user", "content": "<video> what"}, {"role": "assistant", "content": "x"}]}
    (tmp_path / "bad.jsonl").write_text(json.dumps(record) + "\n")
    assert main(["--input", str(clips), "--annotations", str(tmp_path / "bad.jsonl"), "--kind",
                 "conversation", "--output", str(tmp_path / "out"), "--split", "1,0,0",
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "bad.jsonl line 1 (id 'v0')" in err, err
    assert problem.replace("CLIPS", str(clips)) in err, err
    if video == "broken.mp4":
        assert err.rstrip().endswith("(a video file) does not open (Invalid data found when "
                                     "processing input)"), err
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == [tmp_path / "bad.jsonl"]
