"""Audio clips inside conversations: ms-swift (JSON and JSONL) and LLaVA records with ``<audio>``
markers convert to Energon shards holding the clips (WAV, FLAC, MP3 as they are), both sides of
the grid agree on every clip's tokens (the language ranks from the headers, the audio encoder from
the decoded, resampled clip), a folder prepared by stock ``energon prepare`` with audio parts
reads the same way, and every bad input is one line naming the record or sample and the file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from megatron_plugins.data.energon.inputs import EncoderInputs, RankSliceEncoder, TextInputs
from megatron_plugins.data.samples import SAMPLE_KINDS
from megatron_plugins.data.text import media_marker
from megatron_plugins.data.tokenizer import PromptTokenizer
from megatron_plugins.encoders.audio import AudioFrameEncoder
from megatron_plugins.encoders.vit import ViTEncoder
from megatron_plugins.media.codec import BadSampleError
from megatron_plugins.parallel.layout import LANGUAGE, ModulePlacement, ParallelLayout
from tests.harness.audio_files import CLIPS, write_clips
from tools.make_energon_dataset import make_dataset
from tools.train_tokenizer import train_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")

TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "chat_template.jinja").read_text()
CORPUS = ["what do you hear", "a tone and a red square", "which is louder",
          "system : user : assistant :\n"] * 4
WAV, FLAC, MP3 = CLIPS
AUDIO_TOKENS = 4
"""The built-in audio encoder's tokens per clip at its defaults (8 frames, downsampled 2x)."""


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The three clips, a red image, and a tokenizer with the chat template."""
    root = tmp_path_factory.mktemp("audio-conversations")
    write_clips(root)
    Image.new("RGB", (16, 16), (200, 30, 30)).save(root / "red.png")
    for index in range(3):
        Image.new("RGB", (16, 16), (30, 30, 30 * index)).save(root / f"frame{index}.png")
    tokenizer = train_tokenizer(CORPUS, 200, root / "tokenizer")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    hf.chat_template = TEMPLATE
    hf.save_pretrained(str(tokenizer))
    return root


def _plugins() -> dict:
    parser = argparse.ArgumentParser()
    ViTEncoder.add_arguments(parser)
    AudioFrameEncoder.add_arguments(parser)
    args = parser.parse_args([])
    grid = {name: ModulePlacement(name=name, tp=1, pp=1, cp=1, dp=1, rank_offset=offset,
                                  provider=provider)
            for offset, (name, provider) in enumerate((("vision", "vit"), ("audio", "audio")))}
    return {"vision": ViTEncoder("vision", args, grid["vision"]),
            "audio": AudioFrameEncoder("audio", args, grid["audio"])}


def _swift(index: int, **overrides) -> dict:
    """An ms-swift record: an image, then all three clips, in two user turns."""
    record = {"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "<image> and <audio>: what do you hear"},
        {"role": "assistant", "content": "a tone"},
        {"role": "user", "content": "and <audio> <audio>, which is louder"},
        {"role": "assistant", "content": "the second"}],
        "images": ["red.png"], "audios": [WAV, FLAC, MP3]}
    record.update(overrides)
    return {"id": f"s{index}", **record}


def _load_all(path: Path) -> dict:
    from tests.unit_tests.test_energon_dataset_tool import load_split

    return {s.__key__: s for split in ("train", "val", "test") for s in load_split(path, split)}


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_ms_swift_records_convert_with_their_clips_in_marker_order(folder, tmp_path, suffix):
    records = [_swift(i) for i in range(10)]
    records[1] = _swift(1, audios=[MP3], messages=[  # a clip, a video and an image, in tag order
        {"role": "user", "content": "<audio> then <video> then <image>"},
        {"role": "assistant", "content": "a tone"}], videos=[[f"frame{i}.png" for i in range(3)]])
    records[2] = _swift(2, images=[], audios=[], messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
    annotations = tmp_path / f"swift{suffix}"
    annotations.write_text("".join(json.dumps(r) + "\n" for r in records) if suffix == ".jsonl"
                           else json.dumps(records))
    samples = _load_all(make_dataset(folder, annotations, "conversation", tmp_path / "energon",
                                     split=(80, 10, 10)))
    read = [(folder / name).read_bytes() for name in (WAV, FLAC, MP3)]
    assert samples["s0"].audios == read and samples["s0"].images == [
        (folder / "red.png").read_bytes()]
    assert SAMPLE_KINDS["ConversationSample"].text(samples["s0"]).turns[3] == (
        "user", "and <audio> <audio>, which is louder")
    assert samples["s1"].audios == [read[2]]
    assert samples["s1"].images == [[(folder / f"frame{i}.png").read_bytes() for i in range(3)],
                                    (folder / "red.png").read_bytes()]
    assert samples["s2"].audios == [] and samples["s2"].images == []


def test_llava_records_take_an_audio_list(folder, tmp_path):
    records = [{"id": f"r{i}", "image": "red.png", "audio": [FLAC, WAV], "conversations": [
        {"from": "human", "value": "<audio><image> what is this <audio>"},
        {"from": "gpt", "value": "a tone"}]} for i in range(10)]
    records[3]["audio"] = MP3  # one path
    records[3]["conversations"][0]["value"] = "what is this"  # no marker: it opens the turn
    (folder / "llava.json").write_text(json.dumps(records))
    samples = _load_all(make_dataset(folder, folder / "llava.json", "conversation",
                                     tmp_path / "energon", split=(80, 10, 10)))
    assert samples["r0"].audios == [(folder / n).read_bytes() for n in (FLAC, WAV)]
    assert samples["r3"].audios == [(folder / MP3).read_bytes()]


def _source(path: Path, folder: Path, plugins: dict, seq_length: int = 96):
    from megatron_plugins.data.energon.loader import EnergonSource

    tokenizer = PromptTokenizer.load(str(folder / "tokenizer"), list(plugins), 10_000)
    return EnergonSource(path, 0, 0, seq_length, 4, tokenizer, plugins,
                         SAMPLE_KINDS["ConversationSample"])


def test_both_sides_agree_on_every_clips_tokens_and_place_each_run_at_its_marker(folder,
                                                                                 tmp_path):
    from megatron_plugins.data.addressing import RankSlice
    from megatron_plugins.data.streams import ITEM_TOKENS

    records = [_swift(i, audios=[WAV, FLAC, MP3][: i % 4]) for i in range(12)]
    for record in records:  # as many <audio> tags as clips
        record["messages"][1]["content"] = "<image>" + "<audio>" * len(record["audios"]) + "hi"
        record["messages"][3]["content"] = "which is louder"
    (folder / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    path = make_dataset(folder, folder / "mixed.jsonl", "conversation", tmp_path / "energon",
                        split=(100, 0, 0))
    plugins = _plugins()
    source = _source(path, folder, plugins)
    layout = ParallelLayout(tuple(
        ModulePlacement(name=name, tp=1, pp=1, cp=1, dp=1, rank_offset=offset, provider=provider)
        for offset, (name, provider) in enumerate((("vision", "vit"), ("audio", "audio"),
                                                   (LANGUAGE, None)))))
    streams = {module: source.open("train", RankSlice.of(layout, module, 0, 4), 0, None)
               for module in ("vision", "audio", LANGUAGE)}
    placeholder = source.special_token_ids["audio"]
    clips_seen = set()
    for _ in range(3):
        keys, text = next(streams[LANGUAGE])
        audio_keys, audio = next(streams["audio"])
        assert audio_keys == keys
        counts = text[ITEM_TOKENS]["audio"]
        assert audio[ITEM_TOKENS]["audio"] == counts
        assert all(list(c) == [AUDIO_TOKENS] * len(c) for c in counts), (keys, counts)
        frames = audio["modality_inputs"]["audio"]["audio"]["frames"]
        assert frames.shape[0] == sum(len(c) for c in counts)  # every clip decoded, 3 formats
        assert (text["tokens"] == placeholder).sum(dim=1).tolist() == [sum(c) for c in counts]
        clips_seen.update(len(c) for c in counts)
    assert clips_seen == {0, 1, 2, 3}


def test_the_image_and_audio_runs_sit_where_their_markers_are(folder):
    from megatron_plugins.data.samples import ConversationSample

    plugins = _plugins()
    tokenizer = PromptTokenizer.load(str(folder / "tokenizer"), list(plugins), 10_000)
    turns = [{"role": "user", "content": "<audio> what <image> and <audio>"},
             {"role": "assistant", "content": "a tone"}]
    sample = ConversationSample(__key__="k", __restore_key__=(), __subflavors__={},
                                images=[(folder / "red.png").read_bytes()],
                                audios=[(folder / MP3).read_bytes(), (folder / WAV).read_bytes()],
                                conversation=json.dumps(turns))
    markers = tuple((name, media_marker(p.preprocessor().media)) for name, p in plugins.items())
    fields, counts, _ = TextInputs(tokenizer, plugins, markers, 96)(sample)
    vision = plugins["vision"].tokens_per_item
    assert counts == {"vision": (vision,), "audio": (AUDIO_TOKENS, AUDIO_TOKENS)}
    ids = fields["tokens"][: int(fields["length"])].tolist()
    order = [tokenizer.placeholder_ids[name] for name in ("audio", "vision", "audio")]
    runs = [token for index, token in enumerate(ids) if token in order
            and (index == 0 or ids[index - 1] != token)]
    assert runs == order  # audio, image, audio: in marker order
    items, encoder_counts, _ = EncoderInputs(plugins["audio"], plugins["audio"].preprocessor())(
        sample)
    assert encoder_counts == (AUDIO_TOKENS, AUDIO_TOKENS) and len(items) == 2


# Bad input: one line naming the record or sample and the file

def _run_failing(capsys, tmp_path: Path, folder: Path, records: list[dict]) -> str:
    from tests.unit_tests.test_energon_dataset_tool import run_failing

    (folder / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_failing(capsys, tmp_path, ["--input", str(folder), "--annotations",
                                          str(folder / "bad.jsonl"), "--kind", "conversation",
                                          "--split", "80,10,10"])


def test_a_clip_that_does_not_decode_is_refused_before_anything_is_written(capsys, folder,
                                                                           tmp_path):
    (folder / "broken.mp3").write_bytes(b"ID3 not really an mp3")
    records = [_swift(i) for i in range(10)]
    records[4]["audios"][2] = "broken.mp3"
    err = _run_failing(capsys, tmp_path, folder, records)
    assert "bad.jsonl line 5 (id 's4'): audio file" in err and "broken.mp3 does not decode as " \
                                                               "audio" in err, err


@pytest.mark.parametrize("overrides, problem", [
    (dict(audios=[WAV, FLAC]), "3 <audio> markers for 2 audio clips; give one marker per audio "
                               "clip, in audio clip order"),
    (dict(audios=[]), "3 <audio> markers for 0 audio clips"),
    (dict(images=[]), "1 <image> marker for 0 images"),
    (dict(videos=[["frame0.png"]]), "0 <video> markers for 1 video; give one marker per video, "
                                    "in video order (a record with <image> or <video> tags needs "
                                    "one for every image and video)"),
    (dict(videos=["clip.gif"]), "'videos[0]' is not a video (give each video as a video file "
                                "path (mp4, webm, mkv, mov, avi) or a list of its frames' image "
                                "paths"),
    (dict(audios=[WAV, FLAC, "tone.ogg"]), "audio FOLDER/tone.ogg must be a .wav, .flac, .mp3 "
                                           "file"),
    (dict(messages=[{"role": "tool", "content": "x"}]), "messages[0] is not {\"role\": "
                                                         "system|user|assistant"),
], ids=["fewer-clips", "no-clips", "no-images", "untagged-video", "gif-video", "ogg",
        "role"])
def test_ms_swift_records_that_cannot_train_are_refused_in_one_line(capsys, folder, tmp_path,
                                                                   overrides, problem):
    records = [_swift(i) for i in range(10)]
    records[6] = _swift(6, **overrides)
    err = _run_failing(capsys, tmp_path, folder, records)
    assert "bad.jsonl line 7 (id 's6')" in err and problem.replace("FOLDER", str(folder)) in err, \
        err


def test_llava_audio_markers_must_match_the_clips(capsys, folder, tmp_path):
    records = [{"id": f"r{i}", "audio": WAV, "conversations": [
        {"from": "human", "value": "<audio> what is this"},
        {"from": "gpt", "value": "a tone"}]} for i in range(10)]
    records[2]["conversations"][0]["value"] = "<audio><audio> what"
    err = _run_failing(capsys, tmp_path, folder, records)
    assert "line 3 (id 'r2'): 2 <audio> markers for 1 audio clip;" in err, err


def test_mid_run_a_bad_clip_or_marker_stops_naming_the_sample(folder):
    from megatron_plugins.data.samples import ConversationSample

    plugins = _plugins()
    tokenizer = PromptTokenizer.load(str(folder / "tokenizer"), list(plugins), 10_000)
    markers = tuple((name, media_marker(p.preprocessor().media)) for name, p in plugins.items())
    turns = json.dumps([{"role": "user", "content": "<audio> and <audio>"},
                        {"role": "assistant", "content": "a tone"}])
    good = (folder / FLAC).read_bytes()
    broken = ConversationSample(__key__="k7", __restore_key__=(), __subflavors__={}, images=[],
                                audios=[good, b"RIFF not a wav"], conversation=turns)
    for read in (TextInputs(tokenizer, plugins, markers, 96),
                 EncoderInputs(plugins["audio"], plugins["audio"].preprocessor())):
        with pytest.raises(BadSampleError, match=r"^sample 'k7': field 'audios\[1\]' does not "
                                                 r"decode as audio \("):
            read(broken)
    one = ConversationSample(__key__="k8", __restore_key__=(), __subflavors__={}, images=[],
                             audios=[good], conversation=turns)
    with pytest.raises(BadSampleError, match=r"^sample 'k8': field 'conversation' it holds 2 "
                                             r"<audio> markers for 1 item of that kind"):
        TextInputs(tokenizer, plugins, markers, 96)(one)


@pytest.mark.multirank
def test_a_folder_prepared_by_stock_energon_prepare_with_audio_parts_reads_on_both_sides(
        folder, tmp_path):
    """Plain shards (``<key>.png``, ``<key>.wav|flac|mp3``, ``<key>.json``), stock ``energon
    prepare``, the README's dataset.yaml: both sides read one clip per sample, at its marker."""
    import yaml
    from webdataset import ShardWriter

    from megatron_plugins.data.addressing import RankSlice
    from megatron_plugins.data.energon.dataset import check_dataset
    from megatron_plugins.data.streams import ITEM_TOKENS
    from tests.harness.energon_data import energon_prepare

    shards = tmp_path / "shards"
    shards.mkdir()
    turns = json.dumps([{"role": "user", "content": "<image> and <audio>: what do you hear"},
                        {"role": "assistant", "content": "a tone"}])
    with ShardWriter(str(shards / "shard-%06d.tar"), maxcount=4, verbose=0,
                     encoder=False) as sink:
        for index in range(40):
            clip = (WAV, FLAC, MP3)[index % 3]
            sink.write({"__key__": f"{index:06d}", "png": (folder / "red.png").read_bytes(),
                        clip.rpartition(".")[2]: (folder / clip).read_bytes(),
                        "json": turns.encode()})
    run = energon_prepare(str(shards), "--non-interactive", "--split-ratio", "8,1,1",
                          "--no-progress", "--skip-dataset-yaml")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    (shards / ".nv-meta" / "dataset.yaml").write_text(yaml.safe_dump({
        "sample_type": {"__module__": "megatron_plugins.data.samples",
                        "__class__": "ConversationSample"},
        "field_map": {"images": "png", "audios": "wav,flac,mp3", "conversation": "json"}}))
    plugins = _plugins()
    args = argparse.Namespace(eval_iters=0, eval_interval=0, global_batch_size=4, num_workers=0)
    assert check_dataset(shards, plugins, args) is SAMPLE_KINDS["ConversationSample"]
    source = _source(shards, folder, plugins)
    layout = ParallelLayout(tuple(
        ModulePlacement(name=name, tp=1, pp=1, cp=1, dp=1, rank_offset=offset, provider=provider)
        for offset, (name, provider) in enumerate((("vision", "vit"), ("audio", "audio"),
                                                   (LANGUAGE, None)))))
    keys, text = next(source.open("train", RankSlice.of(layout, LANGUAGE, 0, 4), 0, None))
    audio_keys, audio = next(source.open("train", RankSlice.of(layout, "audio", 0, 4), 0, None))
    assert audio_keys == keys
    assert [list(c) for c in text[ITEM_TOKENS]["audio"]] == [[AUDIO_TOKENS]] * 4
    assert audio["modality_inputs"]["audio"]["audio"]["frames"].shape[0] == 4
    # An audio-only run needs no image entry in the field map (the images then default to none).
    (shards / ".nv-meta" / "dataset.yaml").write_text(yaml.safe_dump({
        "sample_type": {"__module__": "megatron_plugins.data.samples",
                        "__class__": "ConversationSample"},
        "field_map": {"audios": "wav,flac,mp3", "conversation": "json"}}))
    check_dataset(shards, {"audio": plugins["audio"]}, args)


def _omni(tmp_path: Path, qwen3: bool = False) -> tuple[Path, dict, PromptTokenizer]:
    """A tiny whole Qwen2.5-Omni (or Qwen3-Omni-MoE, whose tiny ids are the same) with its own
    tokenizer, its two towers' plugins and the tokenizer as ``--hf-model`` makes it (the
    checkpoint's tokens and bos / eos ids)."""
    from megatron_plugins.weights.flags import checkpoint_image_token, checkpoint_item_wrapping
    from tests.models.hf_vision import plugin
    from tests.models.qwen3_omni_whole import save_tiny_qwen3_omni
    from tests.models.qwen_omni import save_omni_tokenizer, save_tiny_omni

    save, family = (save_tiny_qwen3_omni, "qwen3_omni") if qwen3 else (save_tiny_omni,
                                                                       "qwen2_5_omni")
    omni = save_omni_tokenizer(save(tmp_path / family), CORPUS)
    plugins = {"image": plugin(f"{family}_vision", omni),
               "audio": plugin(f"{family}_audio", omni)}
    args = argparse.Namespace(hf_model=str(omni), encoder_hf_weights=[
        f"{name}={omni}" for name in plugins])
    return omni, plugins, PromptTokenizer.load(
        str(omni), list(plugins), 64, None, TEMPLATE, checkpoint_image_token(args),
        checkpoint_item_wrapping(args))


def test_a_qwen2_5_omni_folder_s_clips_fill_runs_of_their_length_in_its_own_tokens(folder,
                                                                                   tmp_path):
    """With a whole Qwen2.5-Omni folder (``--hf-model``, its tokenizer inside) each clip's run
    is ``<|audio_bos|>``, one ``<|AUDIO|>`` per token of the clip's length after resampling to
    16 kHz (transformers' feature mask and output-length formula), ``<|audio_eos|>``; the audio
    tower's side counts the same from the decoded clips, the image's run has the vision ids."""
    import transformers

    from megatron_plugins.data.samples import ConversationSample
    from megatron_plugins.media.codec import decode_audio, resample
    from tests.models.qwen_omni import (
        AUDIO_TOKEN, AUDIO_WRAPPING, IMAGE_TOKEN, MEL_BINS, RATE, VISION_WRAPPING)

    _, plugins, tokenizer = _omni(tmp_path)
    clips = [(folder / name).read_bytes() for name in (MP3, WAV, FLAC)]
    turns = [{"role": "user", "content": "<audio> what <image> and <audio><audio>"},
             {"role": "assistant", "content": "a tone"}]
    sample = ConversationSample(__key__="k", __restore_key__=(), __subflavors__={},
                                images=[(folder / "red.png").read_bytes()], audios=clips,
                                conversation=json.dumps(turns))
    markers = tuple((name, media_marker(p.preprocessor().media)) for name, p in plugins.items())
    fields, counts, _ = TextInputs(tokenizer, plugins, markers, 128)(sample)
    extractor = transformers.WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=RATE)
    model_type = transformers.models.qwen2_5_omni.modeling_qwen2_5_omni
    want = []
    for clip in clips:
        waveform = resample(decode_audio(clip, "k"), RATE)
        mask = extractor([waveform.samples], sampling_rate=RATE, return_attention_mask=True,
                         padding="max_length", return_tensors="pt")["attention_mask"]
        _, tokens = model_type.Qwen2_5OmniAudioEncoder._get_feat_extract_output_lengths(
            None, mask.sum(-1))
        want.append(int(tokens))
    assert counts["audio"] == tuple(want) and len(set(want)) > 1, want
    ids = fields["tokens"][: int(fields["length"])].tolist()
    runs, index = [], 0
    while index < len(ids):  # each item's run: (start id, placeholder, count, end id)
        if ids[index] in (AUDIO_WRAPPING[0], VISION_WRAPPING[0]):
            end = ids.index(ids[index] + 1, index)
            body = ids[index + 1:end]
            assert len(set(body)) == 1
            runs.append((ids[index], body[0], len(body), ids[end]))
            index = end
        index += 1
    image = (VISION_WRAPPING[0], IMAGE_TOKEN, counts["image"][0], VISION_WRAPPING[1])
    assert runs == [(AUDIO_WRAPPING[0], AUDIO_TOKEN, want[0], AUDIO_WRAPPING[1]), image,
                    *[(AUDIO_WRAPPING[0], AUDIO_TOKEN, n, AUDIO_WRAPPING[1]) for n in want[1:]]]
    items, encoder_counts, _ = EncoderInputs(plugins["audio"], plugins["audio"].preprocessor())(
        sample)
    assert encoder_counts == tuple(want) and len(items) == 3


def test_a_video_s_sound_interleaves_with_its_frames_as_each_omni_lays_and_positions_it(
        folder, tmp_path, monkeypatch):
    """``--use-audio-in-video``: a video with a 3-s sound track between an image and a clip
    becomes ``<|vision_bos|><|audio_bos|>`` + 2-s chunks (each chunk's video tokens, then its
    sound's, as transformers' processor lays them out) + ``<|audio_eos|><|vision_eos|>``; the
    audio encoder's items are the clip and the sound in that order on both sides, and the
    positions equal the thinker's ``get_rope_index(use_audio_in_video=True)``. With a
    Qwen3-Omni folder the same sample's video and sound merge by time, as its processor and
    its ``get_rope_index`` have them. Building a global microbatch decodes each sound once per
    rank: on a balanced audio replica (for its balance weight, its size and the item itself) and
    on a language rank (for its length), again only in the next microbatch."""
    import transformers

    from megatron_plugins.data.addressing import RankSlice
    from megatron_plugins.media import codec

    from megatron_plugins.data.audio_in_video import AudioInVideo
    from megatron_plugins.data.energon.inputs import SoundOrder
    from megatron_plugins.encoders.qwen2_5_omni_audio import mel_frames
    from tests.harness.video_files import write_video
    from tests.models.qwen3_omni_whole import POSITIONS_PER_SECOND, hf_thinker
    from tests.models.qwen_omni import AUDIO_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN, VISION_WRAPPING
    from tests.models.qwen_omni import video_with_sound_ids

    omni, plugins, tokenizer = _omni(tmp_path)
    write_video(folder / "talk.mp4", seconds=3.0, fps=8, size=(32, 32), sound_rate=16000)
    record = _swift(0, images=["red.png"], videos=["talk.mp4"], audios=[WAV], messages=[
        {"role": "user", "content": "<image> then <video> then <audio>: what do you hear"},
        {"role": "assistant", "content": "a tone"}])
    (folder / "video.jsonl").write_text(json.dumps(record) + "\n" + "".join(
        json.dumps(_swift(i, images=[], audios=[], messages=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "a tone"}]))
        + "\n" for i in range(1, 10)))
    loaded = _load_all(make_dataset(folder, folder / "video.jsonl", "conversation",
                                    tmp_path / "energon", split=(80, 10, 10)))
    sample = loaded["s0"]
    sounds = SoundOrder(AudioInVideo("image", "audio", 50), plugins)
    markers = tuple((name, media_marker(p.preprocessor().media)) for name, p in plugins.items())
    fields, counts, _ = TextInputs(tokenizer, plugins, markers, 512, True, sounds)(sample)
    items, encoder_counts, _ = EncoderInputs(plugins["audio"], plugins["audio"].preprocessor(),
                                             sounds)(sample)
    assert counts["audio"] == encoder_counts == (75, 12)  # the sound (3 s), then the clip
    assert counts["image"][1] == 3 * 16  # 3 temporal steps of 4 x 4 merged tokens
    ids = fields["tokens"][: int(fields["length"])].tolist()

    # transformers' processor's layout of that video with its sound
    composite = [IMAGE_TOKEN if token == VIDEO_TOKEN else token
                 for token in video_with_sound_ids(torch.tensor([3, 8, 8]), 1.0, 75)]
    start = ids.index(VISION_WRAPPING[0], ids.index(VISION_WRAPPING[1]) + 1)
    assert ids[start:start + len(composite)] == composite
    first_sound = composite.index(AUDIO_TOKEN)
    assert composite.count(IMAGE_TOKEN) == 48 and first_sound == 2 + 32  # chunk 0: 2 steps

    # ... and its TMRoPE positions
    model = transformers.Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(omni)
    model.config.vision_start_token_id = VISION_WRAPPING[0]
    hf_ids = torch.tensor([ids])
    hf_ids[0, start + 1:start + len(composite) - 1][
        hf_ids[0, start + 1:start + len(composite) - 1] == IMAGE_TOKEN] = VIDEO_TOKEN
    image_grid = torch.tensor([[1, 4, 4]])  # the 16 x 16 red square
    assert counts["image"][0] == 4
    want, _ = model.model.get_rope_index(
        hf_ids, image_grid, torch.tensor([[3, 8, 8]]), torch.ones_like(hf_ids), True,
        torch.tensor([300, mel_frames(int(0.5 * 16000), 160, 480000)]), torch.tensor([1.0]))
    assert torch.equal(fields["position_ids"][:, :len(ids)], want[:, 0])
    assert len(items) == 2

    # Qwen3-Omni's folder: the same sample merged by time, token by token (its processor's
    # layout, its float positions whole numbers at 2 frames a second)
    omni, plugins, tokenizer = _omni(tmp_path, qwen3=True)
    sounds = SoundOrder(AudioInVideo("image", "audio", None), plugins)
    fields, counts, _ = TextInputs(tokenizer, plugins, markers, 512, True, sounds)(sample)
    assert counts["audio"] == EncoderInputs(plugins["audio"], plugins["audio"].preprocessor(),
                                            sounds)(sample)[1] == (39, 7)  # 13 a second
    ids = fields["tokens"][: int(fields["length"])].tolist()
    composite = video_with_sound_ids(torch.tensor([3, 8, 8]), 1.0, 39, "Qwen3OmniMoeProcessor",
                                     POSITIONS_PER_SECOND)
    assert ids[start:start + len(composite)] == [IMAGE_TOKEN if token == VIDEO_TOKEN else token
                                                 for token in composite]
    hf_ids = torch.tensor([ids[:start] + composite + ids[start + len(composite):]])
    want, _ = hf_thinker(omni).model.get_rope_index(
        hf_ids, image_grid, torch.tensor([[3, 8, 8]]), torch.ones_like(hf_ids), True,
        torch.tensor([300, 50]), torch.tensor([1.0]))
    assert torch.equal(fields["position_ids"][:, :len(ids)], want[:, 0].long())

    # each rank decodes a sample's sound once per global microbatch it builds
    decoded: list[str] = []
    decode = codec.decode_sound
    monkeypatch.setattr(codec, "decode_sound",
                        lambda data, key, field: decoded.append(key) or decode(data, key, field))
    two_microbatches = [sample, loaded["s1"]] * 2
    audio_inputs = EncoderInputs(plugins["audio"], plugins["audio"].preprocessor(), sounds)
    held = []
    for replica in range(2):  # --balance-encoder-work: 2 audio replicas share 2 positions
        built = RankSliceEncoder(RankSlice("audio", replica, 2, 2, 2, balance_replicas=2),
                                 audio_inputs).encode_batch(two_microbatches)
        held += [keys for keys, _ in built]
        assert decoded == ["s0", "s0"]
        decoded.clear()
    assert sorted(key for keys in held for key in keys) == ["s0", "s0", "s1", "s1"]
    built = RankSliceEncoder(RankSlice(LANGUAGE, 0, 2, 2, 2), TextInputs(
        tokenizer, plugins, markers, 512, True, sounds)).encode_batch(two_microbatches)
    assert [keys for keys, _ in built] == [["s0", "s1"]] * 2 and decoded == ["s0", "s0"]


def test_use_audio_in_video_refusals_are_one_line(folder, tmp_path):
    """A video without a sound track names the sample and the file; the flag without real data
    or without a checkpoint that interleaves names what it needs (before any process group)."""
    from megatron_plugins.data.audio_in_video import AudioInVideo
    from megatron_plugins.data.energon.inputs import SoundOrder
    from megatron_plugins.data.sources import audio_in_video
    from megatron_plugins.errors import DataFlagError
    from tests.harness.video_files import write_video
    from tests.models.hf_vision import plugin
    from tests.models.qwen_omni import save_tiny_omni

    omni = save_tiny_omni(tmp_path / "omni")
    write_video(folder / "silent.mp4", seconds=1.0, fps=8, sound_rate=None)
    records = [_swift(i, images=[], audios=[], videos=["silent.mp4"], messages=[
        {"role": "user", "content": "<video> what"}, {"role": "assistant", "content": "a"}])
        for i in range(10)]
    (folder / "silent.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    sample = _load_all(make_dataset(folder, folder / "silent.jsonl", "conversation",
                                    tmp_path / "energon", split=(80, 10, 10)))["s0"]
    plugins = {"image": plugin("qwen2_5_omni_vision", omni),
               "audio": plugin("qwen2_5_omni_audio", omni)}
    sounds = SoundOrder(AudioInVideo("image", "audio", 50), plugins)
    with pytest.raises(BadSampleError) as error:
        EncoderInputs(plugins["audio"], plugins["audio"].preprocessor(), sounds)(sample)
    assert str(error.value) == (
        "sample 's0': field 'images[0]' is a video without a sound track, but --use-audio-in-video "
        "feeds each video's sound to encoder audio; give videos with sound or drop "
        "--use-audio-in-video")
    flags = dict(use_audio_in_video=True, encoder_hf_weights={"image": str(omni)},
                 mimo_encoders={"image": "qwen2_5_vl"})
    with pytest.raises(DataFlagError) as error:
        audio_in_video(argparse.Namespace(data_path=None, hf_model=str(omni), **flags))
    assert str(error.value) == ("--use-audio-in-video needs --data-path: the mock data's "
                                "videos have no sound track")
    with pytest.raises(DataFlagError) as error:
        audio_in_video(argparse.Namespace(data_path=["d"], hf_model=None, **flags))
    assert str(error.value) == (
        "--use-audio-in-video interleaves each video's sound with its frames as the "
        "checkpoint's family does (Qwen2.5-Omni, Qwen3-Omni); no --hf-model is given, so no "
        "checkpoint does; drop the flag or give such a folder")
