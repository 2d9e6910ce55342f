"""Conversations: rendering with a real tokenizer's chat template, the image placeholders at their
marker, the loss on assistant turns only (checked against a hand-rendered example), the template
errors, and ``make_energon_dataset --kind conversation`` with each record it refuses."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_plugins.data.energon.inputs import TextInputs
from megatron_plugins.media.codec import BadSampleError, encode_png
from megatron_plugins.data.samples import (DATASET_KINDS, SAMPLE_KINDS, ConversationSample,
                                           conversation_parts)
from megatron_plugins.data.text import (Conversation, SampleText, media_marker,
                                        read_chat_template)
from megatron_plugins.data.tokenizer import PromptTokenizer
from megatron_plugins.errors import FlagError
from tools.make_energon_dataset import make_dataset
from tools.train_tokenizer import train_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")

TEMPLATE_FILE = Path(__file__).parents[1] / "fixtures" / "chat_template.jinja"
TEMPLATE = TEMPLATE_FILE.read_text()
CORPUS = ["a red cat sits on the mat", "what color is the cat", "the dog is blue",
          "what is on the mat", "system : user : assistant :\n"] * 4
BIG = 10_000
RUN = 3
"""The vision encoder's tokens per sample."""
BLOCKS = (("vision", RUN),)
MARKERS = {"vision": media_marker("image")}
TURNS = (("system", "a cat"), ("user", "<image>\nwhat color is the cat"),
         ("assistant", "the cat is red"), ("user", "what is on the mat"), ("assistant", "a mat"))


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def plain_folder(tmp_path_factory):
    """A tokenizer without a chat template."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        return str(train_tokenizer(CORPUS, 200, tmp_path_factory.mktemp("plain")))


@pytest.fixture(scope="module")
def chat_folder(plain_folder, tmp_path_factory):
    """The same tokenizer with the chat template in its tokenizer_config.json."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(plain_folder, local_files_only=True)
    hf.chat_template = TEMPLATE
    folder = tmp_path_factory.mktemp("chat")
    hf.save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def tokenizer(chat_folder):
    return PromptTokenizer.load(chat_folder, ["vision"], BIG)


def encode(tokenizer, turns=TURNS, seq_length=64):
    return tokenizer.encode_conversation(Conversation(turns), BLOCKS, MARKERS, seq_length)


def _ids(tokenizer, text):
    return tokenizer._hf(text, add_special_tokens=False)["input_ids"]


def test_layout_and_loss_match_a_hand_rendered_conversation(tokenizer):
    encoded = encode(tokenizer)
    hf, eos, vision = tokenizer._hf, tokenizer.eos_id, tokenizer.placeholder_ids["vision"]
    # Hand-rendered by the template: each turn "role : content<eos>\n", the image at its marker.
    pieces = [([tokenizer.bos_id], False), (_ids(tokenizer, "system : a cat"), False),
              ([eos], False), (_ids(tokenizer, "\nuser : "), False), ([vision] * RUN, False),
              (_ids(tokenizer, "\nwhat color is the cat"), False), ([eos], False),
              (_ids(tokenizer, "\nassistant :"), False), (_ids(tokenizer, " the cat is red"), True),
              ([eos], True), (_ids(tokenizer, "\nuser : what is on the mat"), False),
              ([eos], False), (_ids(tokenizer, "\nassistant :"), False),
              (_ids(tokenizer, " a mat"), True), ([eos], True), (_ids(tokenizer, "\n"), False)]
    ids = [token for piece, _ in pieces for token in piece]
    trained = [flag for piece, flag in pieces for _ in piece]
    assert encoded.tokens[: len(ids)].tolist() == ids, hf.convert_ids_to_tokens(encoded.tokens)
    assert (encoded.tokens[len(ids):] == tokenizer.pad_id).all()
    assert encoded.labels[:-1].tolist() == encoded.tokens[1:].tolist()
    assert encoded.loss_mask[: len(ids) - 1].tolist() == [float(f) for f in trained[1:]]
    assert encoded.loss_mask[len(ids) - 1:].sum() == 0
    assert hf.decode(encoded.labels[encoded.loss_mask == 1]) == "the cat is red<eos> a mat<eos>"
    assert not encoded.truncated


def test_without_a_marker_the_image_opens_the_first_user_turn(tokenizer):
    turns = (("user", "what color is the cat"), ("assistant", "red"))
    tokens = encode(tokenizer, turns).tokens.tolist()
    vision = tokenizer.placeholder_ids["vision"]
    start = tokens.index(vision)
    assert tokens[start: start + RUN] == [vision] * RUN and tokens.count(vision) == RUN
    assert tokens[:start] == [tokenizer.bos_id] + _ids(tokenizer, "user : ")


def test_the_marker_can_end_its_turn(tokenizer):
    turns = (("user", "what color is the cat\n<image>"), ("assistant", "red"))
    tokens = encode(tokenizer, turns).tokens.tolist()
    vision = tokenizer.placeholder_ids["vision"]
    end = tokens.index(vision) + RUN
    assert tokens[end] == tokenizer.eos_id and tokens.count(vision) == RUN


def test_a_long_conversation_is_cut_after_the_placeholders(tokenizer):
    full = encode(tokenizer)
    length = int((full.tokens != tokenizer.pad_id).sum())
    cut = encode(tokenizer, seq_length=length - 3)
    assert cut.truncated
    assert cut.tokens.tolist() == full.tokens[: length - 3].tolist()
    assert cut.loss_mask[:-1].tolist() == full.loss_mask[: length - 4].tolist()
    # Text before the run that does not fit is cut around it: the run is kept whole at the end.
    vision = tokenizer.placeholder_ids["vision"]
    short = encode(tokenizer, seq_length=6)
    assert short.truncated and short.tokens.tolist() == full.tokens[:3].tolist() + [vision] * RUN
    assert short.loss_mask.sum() == 0
    with pytest.raises(ValueError, match="3 placeholder positions do not fit in --seq-length 2"):
        encode(tokenizer, seq_length=2)


@pytest.mark.parametrize("turns, problem", [
    ((("user", "<image> <image> what"), ("assistant", "red")), "2 <image> markers"),
    ((("user", "what"), ("user", "is it")), "no assistant turn"),
    ((("user", "<vision> what"), ("assistant", "red")), "holds <vision> as text"),
    ((("system", "a cat"), ("assistant", "red")), "no user turn"),
])
def test_conversations_that_cannot_train_are_refused(tokenizer, turns, problem):
    with pytest.raises(ValueError, match=problem):
        encode(tokenizer, turns)


def test_a_bad_sample_stops_naming_its_key(tokenizer):
    vision = SimpleNamespace(name="vision", item_tokens=lambda size: RUN,
                             preprocessor=lambda: SimpleNamespace(media="image"))
    inputs = TextInputs(tokenizer, {"vision": vision}, tuple(MARKERS.items()), 64)
    image = encode_png(np.zeros((8, 8, 3), dtype=np.uint8))
    sample = ConversationSample(__key__="k7", __restore_key__=(), __subflavors__={},
                                images=[image], conversation=json.dumps(
                                    [{"role": "user", "content": "what"}]))
    with pytest.raises(BadSampleError, match="sample 'k7': field 'conversation' .*no assistant"):
        inputs(sample)
    sample.conversation = '[{"role": "robot", "content": "x"}]'
    with pytest.raises(BadSampleError, match="role one of system, user, assistant"):
        inputs(sample)


def test_the_sample_kind_reads_the_turns(tokenizer):
    sample = SimpleNamespace(__key__="k", conversation=json.dumps(
        [{"role": role, "content": content} for role, content in TURNS]).encode())
    assert SAMPLE_KINDS["ConversationSample"].text(sample) == Conversation(TURNS)


def test_a_tokenizer_without_a_template_is_refused_naming_the_flags(plain_folder):
    plain = PromptTokenizer.load(plain_folder, ["vision"], BIG)
    with pytest.raises(FlagError, match=f"--tokenizer-model {plain_folder} has no chat template"
                                        ".*--chat-template FILE"):
        plain.require_chat_template("--data-path X")
    with pytest.raises(FlagError, match="no chat template"):
        encode(plain)


def test_a_template_file_replaces_the_missing_one(plain_folder, tokenizer):
    given = PromptTokenizer.load(plain_folder, ["vision"], BIG,
                                 chat_template=read_chat_template(str(TEMPLATE_FILE)))
    given.require_chat_template("--data-path X")
    assert torch.equal(encode(given).tokens, encode(tokenizer).tokens)
    assert torch.equal(encode(pickle.loads(pickle.dumps(given))).loss_mask,
                       encode(tokenizer).loss_mask)


def test_chat_template_flag_values(tmp_path):
    assert read_chat_template(None) is None
    assert read_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(FlagError, match="--chat-template nowhere.jinja: no such file"):
        read_chat_template("nowhere.jinja")


def test_a_template_that_is_not_incremental_is_refused(plain_folder):
    odd = ("{% for message in messages %}{{ message['content'] }}{% endfor %}"
           "{{ messages | length }}")
    tokenizer = PromptTokenizer.load(plain_folder, ["vision"], BIG, chat_template=odd)
    with pytest.raises(ValueError, match="does not render it incrementally"):
        encode(tokenizer)


# make_energon_dataset --kind conversation

def _image(path: Path, size: tuple[int, int]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (200, 30, 30)).save(path)
    return path.name


def _llava(index: int, **overrides) -> dict:
    record = {"id": f"r{index}", "image": f"img{index}.png", "conversations": [
        {"from": "human", "value": "<image>\nwhat color is it"}, {"from": "gpt", "value": "red"},
        {"from": "human", "value": "and the shape"}, {"from": "gpt", "value": "a square"}]}
    record.update(overrides)
    return record


@pytest.fixture
def llava(tmp_path: Path) -> Path:
    source = tmp_path / "source"
    for index in range(10):
        _image(source / f"img{index}.png", (16 + 3 * index, 20))
    return source


def _load_all(path: Path) -> dict:
    from tests.unit_tests.test_energon_dataset_tool import load_split

    return {s.__key__: s for split in ("train", "val", "test") for s in load_split(path, split)}


def test_llava_json_with_several_text_only_and_varied_images_converts(tmp_path: Path,
                                                                      llava: Path) -> None:
    records = [_llava(i) for i in range(10)]
    records[1]["image"] = ["img1.png", "img7.jpg", "img2.png"]  # markers in two turns
    records[1]["conversations"][0]["value"] = "<image>\n<image>\nwhich is red"
    records[1]["conversations"][2]["value"] = "and this <image>"
    records[2] = {"id": "r2", "conversations": [{"from": "human", "value": "two plus two"},
                                                {"from": "gpt", "value": "four"}]}
    records[3]["image"] = [records[3]["image"]]  # a one-element list is one image
    records[4]["conversations"].insert(0, {"from": "system", "value": "be brief"})
    records[5]["image"] = ["img5.png", "img6.png"]  # no marker: both open the first human turn
    records[5]["conversations"][0]["value"] = "what colors are they"
    _image(llava / "img7.jpg", (40, 12))
    (llava / "llava.json").write_text(json.dumps(records))
    samples = _load_all(make_dataset(llava, llava / "llava.json", "conversation",
                                     tmp_path / "energon", split=(80, 10, 10)))
    assert sorted(samples) == sorted(f"r{i}" for i in range(10))
    kind = SAMPLE_KINDS["ConversationSample"]
    assert type(samples["r4"]).__name__ == "ConversationSample"
    assert samples["r4"].images == [(llava / "img4.png").read_bytes()]
    assert kind.text(samples["r4"]) == Conversation((
        ("system", "be brief"), ("user", "<image>\nwhat color is it"), ("assistant", "red"),
        ("user", "and the shape"), ("assistant", "a square")))
    assert samples["r1"].images == [(llava / name).read_bytes()
                                    for name in ("img1.png", "img7.jpg", "img2.png")]
    assert samples["r2"].images == [] and kind.text(samples["r2"]).turns[1] == ("assistant",
                                                                               "four")
    assert len(samples["r5"].images) == 2 and len(samples["r3"].images) == 1


def test_a_record_with_a_video_of_frame_files_converts_to_frame_parts(tmp_path: Path,
                                                                     llava: Path) -> None:
    """An ``image`` entry that is a list of paths is a video: its frames become parts
    ``<key>.<item>.<frame>.<ext>`` and the loaded sample's item is the list of frame files."""
    from tools.annotations import DatasetError

    frames = [_image(llava / f"frame{i}.png", (24, 16)) for i in range(3)]
    records = [_llava(i) for i in range(10)]
    records[0]["image"] = ["img0.png", frames]
    records[0]["conversations"][2]["value"] = "and the shape in <video>"
    (llava / "llava.json").write_text(json.dumps(records))
    samples = _load_all(make_dataset(llava, llava / "llava.json", "conversation",
                                     tmp_path / "energon", split=(80, 10, 10)))
    assert samples["r0"].images == [(llava / "img0.png").read_bytes(),
                                    [(llava / name).read_bytes() for name in frames]]
    records[0]["image"][1] = [*frames, "img3.png"]
    (llava / "llava.json").write_text(json.dumps(records))
    with pytest.raises(DatasetError, match=r"record 0 \(id 'r0'\): image file .*img3.png is "
                                           r"20x25 \(height x width\), not the 16x24 of its "
                                           "video's first frame"):
        make_dataset(llava, llava / "llava.json", "conversation", tmp_path / "again",
                     split=(80, 10, 10))


def test_sharegpt_text_only_records_convert(tmp_path: Path, llava: Path) -> None:
    turns = [{"from": "system", "value": "be kind"}, {"from": "human", "value": "hi"},
             {"from": "gpt", "value": "hello"}, {"from": "human", "value": "bye"},
             {"from": "gpt", "value": "goodbye"}]
    lines = "".join(json.dumps({"id": f"s{i}", "conversations": turns}) + "\n" for i in range(10))
    (llava / "sharegpt.jsonl").write_text(lines)
    samples = _load_all(make_dataset(llava, llava / "sharegpt.jsonl", "conversation",
                                     tmp_path / "energon", split=(80, 10, 10)))
    assert sorted(samples) == [f"s{i}" for i in range(10)]
    assert all(sample.images == [] for sample in samples.values())
    assert SAMPLE_KINDS["ConversationSample"].text(samples["s3"]).turns[-1] == ("assistant",
                                                                                "goodbye")


def test_datasets_written_with_one_image_part_stay_readable() -> None:
    load_conversation = DATASET_KINDS["conversation"].loader
    turns = json.dumps([{"role": "user", "content": "hi"}]).encode()
    assert load_conversation({"__key__": "k", "png": b"P", "json": turns}) == dict(
        images=[b"P"], audios=[], conversation=turns.decode())
    assert conversation_parts("png") and conversation_parts("12.jpg")
    assert conversation_parts("1.wav") and conversation_parts("0.mp3")
    assert not conversation_parts("1.ogg") and not conversation_parts("x.png")
    with pytest.raises(BadSampleError, match=r"sample 'k': field 'images' has image parts "
                                             r"numbered \[0, 2\]; they must run 0..N-1"):
        load_conversation({"__key__": "k", "0.png": b"P", "2.png": b"Q", "json": turns})


REFUSED = [
    (dict(image=["img0.png", "img1.png"]), "1 <image> marker for 2 images; give one marker per "
                                           "image"),
    ({"image": ""}, "'image' is not a file path"),
    (dict(image=["img0.png", 3]), "'image[1]' is not a file path"),
    (dict(conversations=[{"from": "human", "value": "<image> <image> what"},
                         {"from": "gpt", "value": "red"}]), "2 <image> markers for 1 image"),
    (dict(image=None, conversations=[{"from": "human", "value": "<image> what"},
                                     {"from": "gpt", "value": "red"}]),
     "1 <image> marker for 0 images"),
    (dict(conversations=[{"from": "human", "value": "<image> what"}]), "no assistant ('gpt') turn"),
    (dict(image=None, conversations=[{"from": "human", "value": "hi"}]),
     "no assistant ('gpt') turn"),
    (dict(conversations=[{"from": "system", "value": "x"}, {"from": "gpt", "value": "red"}]),
     "no <image> marker and no 'human' turn"),
    (dict(conversations=[{"from": "robot", "value": "beep"}]), "conversations[0] is not"),
    (dict(conversations=[]), "no 'conversations' list"),
    (dict(image="missing.png"), "image file"),
    (dict(image=["img0.png", "missing.png"], conversations=[
        {"from": "human", "value": "<image><image>"}, {"from": "gpt", "value": "red"}]),
     "missing.png does not exist"),
    (dict(id="a/b"), "key 'a/b'"),
]


@pytest.mark.parametrize("overrides, problem", REFUSED)
def test_records_that_cannot_train_yet_are_refused_in_one_line(
        capsys, tmp_path: Path, llava: Path, overrides: dict, problem: str) -> None:
    from tests.unit_tests.test_energon_dataset_tool import run_failing

    records = [_llava(i) for i in range(10)]
    records[6] = _llava(6, **overrides)
    lines = "".join(json.dumps(record) + "\n" for record in records)
    (llava / "llava.jsonl").write_text(lines)
    err = run_failing(capsys, tmp_path, ["--input", str(llava), "--annotations",
                                         str(llava / "llava.jsonl"), "--kind", "conversation"])
    assert "llava.jsonl line 7" in err and problem in err, err
    assert "(id 'r6')" in err or "key 'a/b'" in err


def test_an_image_that_does_not_decode_is_refused(capsys, tmp_path: Path, llava: Path) -> None:
    from tests.unit_tests.test_energon_dataset_tool import run_failing

    (llava / "img2.png").write_bytes(b"not a png")
    (llava / "llava.json").write_text(json.dumps([_llava(i) for i in range(10)]))
    err = run_failing(capsys, tmp_path, ["--input", str(llava), "--annotations",
                                         str(llava / "llava.json"), "--kind", "conversation",
                                         "--split", "80,10,10"])
    assert "llava.json record 2 (id 'r2')" in err and "img2.png does not decode as image" in err


def test_conversations_cannot_come_as_csv(capsys, tmp_path: Path, llava: Path) -> None:
    from tests.unit_tests.test_energon_dataset_tool import run_failing

    (llava / "a.csv").write_text("image,conversations\n")
    err = run_failing(capsys, tmp_path, ["--input", str(llava), "--annotations",
                                         str(llava / "a.csv"), "--kind", "conversation"])
    assert "must end in .jsonl or .json" in err


# 0..N images per conversation through the Energon inputs, with a native-resolution vit

SIZES = ((16, 16), (16, 40), (33, 20))
"""Image sizes (height, width): 4, 10 and 8 patches of 8 pixels at native resolution."""


def _native_vit(*flags: str):
    import argparse

    from megatron_plugins.encoders.vit import ViTEncoder
    from megatron_plugins.parallel.layout import ModulePlacement

    parser = argparse.ArgumentParser()
    ViTEncoder.add_arguments(parser)
    args = parser.parse_args(["--vit-native-resolution", "--vit-min-pixels", "64", *flags])
    grid = ModulePlacement(name="vision", tp=1, pp=1, cp=1, dp=1, rank_offset=0, provider="vit")
    return ViTEncoder("vision", args, grid)


def _sample(key: str, sizes, turns) -> ConversationSample:
    return ConversationSample(
        __key__=key, __restore_key__=(), __subflavors__={},
        images=[encode_png(np.full((h, w, 3), 60, dtype=np.uint8)) for h, w in sizes],
        conversation=json.dumps([{"role": role, "content": content} for role, content in turns]))


MULTI = (("user", "<image> and <image>\nwhich is red"), ("assistant", "the cat is red"),
         ("user", "and this <image>"), ("assistant", "a mat"))


def _runs(tokens: torch.Tensor, placeholder: int) -> list[tuple[int, int]]:
    """(start, length) of each run of ``placeholder`` in ``tokens``."""
    runs, flags = [], (tokens == placeholder).tolist() + [False]
    for index, flag in enumerate(flags[:-1]):
        if flag and (index == 0 or not flags[index - 1]):
            runs.append([index, 0])
        if flag:
            runs[-1][1] += 1
    return [tuple(run) for run in runs]


def test_each_image_gets_a_run_at_its_marker_sized_by_its_resolution(tokenizer):
    from megatron_plugins.data.energon.inputs import EncoderInputs

    vit = _native_vit()
    sample = _sample("m1", SIZES, MULTI)
    fields, counts, cut = TextInputs(tokenizer, {"vision": vit}, tuple(MARKERS.items()),
                                     96)(sample)
    assert counts == {"vision": (4, 10, 8)} and not cut
    vision = tokenizer.placeholder_ids["vision"]
    runs = _runs(fields["tokens"], vision)
    assert [length for _, length in runs] == [4, 10, 8]
    tokens = fields["tokens"].tolist()
    # Runs one and two sit in the first user turn around " and", run three in the second.
    between = tokenizer._hf.decode(tokens[runs[0][0] + 4: runs[1][0]])
    assert between.strip() == "and"
    assert tokenizer._hf.decode(tokens[runs[1][0] + 10: runs[2][0]]).count("the cat is red") == 1
    assert tokenizer._hf.decode(fields["labels"][fields["loss_mask"] == 1]) == \
        "the cat is red<eos> a mat<eos>"
    items, encoder_counts, _ = EncoderInputs(vit, vit.preprocessor())(sample)
    assert encoder_counts == (4, 10, 8)
    assert [item["patches"].shape[0] for item in items] == [4, 10, 8]


def test_mrope_positions_of_a_conversation_equal_transformers(tokenizer):
    """Three images of different grids at their markers: the [3, S] positions the language
    ranks compute from the headers are Qwen2.5-VL's ``get_rope_index`` of the same layout."""
    from tests.models.mrope import IMAGE_TOKEN, hf_rope_index

    vit = _native_vit()
    fields, _, _ = TextInputs(tokenizer, {"vision": vit}, tuple(MARKERS.items()), 96,
                              mrope=True)(_sample("m1", SIZES, MULTI))
    length = int(fields["length"])
    is_image = fields["tokens"][:length] == tokenizer.placeholder_ids["vision"]
    grids = [vit.item_grid(size) for size in SIZES]
    assert grids == [(1, 2, 2), (1, 2, 5), (1, 4, 2)]
    want = hf_rope_index((is_image * IMAGE_TOKEN)[None], grids)[:, 0]
    assert fields["position_ids"].shape == (3, 96)
    assert torch.equal(fields["position_ids"][:, :length], want)


def test_without_markers_every_image_opens_the_first_user_turn(tokenizer):
    vit = _native_vit()
    turns = (("system", "a cat"), ("user", "what colors"), ("assistant", "red"))
    fields, counts, _ = TextInputs(tokenizer, {"vision": vit}, tuple(MARKERS.items()),
                                   96)(_sample("m2", SIZES[:2], turns))
    vision = tokenizer.placeholder_ids["vision"]
    runs = _runs(fields["tokens"], vision)
    assert [length for _, length in runs] == [4, 10]
    user = _ids(tokenizer, "\nuser : ")
    tokens = fields["tokens"].tolist()
    assert tokens[runs[0][0] - len(user): runs[0][0]] == user


def test_a_text_only_conversation_has_no_items_on_either_side(tokenizer):
    from megatron_plugins.data.energon.inputs import EncoderInputs

    vit = _native_vit()
    sample = _sample("t1", (), (("user", "two plus two"), ("assistant", "four")))
    fields, counts, _ = TextInputs(tokenizer, {"vision": vit}, tuple(MARKERS.items()),
                                   32)(sample)
    assert counts == {"vision": ()}
    assert not (fields["tokens"] == tokenizer.placeholder_ids["vision"]).any()
    assert fields["loss_mask"].sum() > 0
    assert EncoderInputs(vit, vit.preprocessor())(sample) == ([], (), False)


def test_runs_that_fill_the_row_keep_every_run_and_cut_the_text(tokenizer):
    vit = _native_vit()
    inputs = TextInputs(tokenizer, {"vision": vit}, tuple(MARKERS.items()), 96)
    full, _, _ = inputs(_sample("m3", SIZES, MULTI))
    fields, _, cut = dataclasses.replace(inputs, seq_length=30)(_sample("m3", SIZES, MULTI))
    vision = tokenizer.placeholder_ids["vision"]
    tokens, whole = fields["tokens"], full["tokens"]
    assert cut and int((tokens == vision).sum()) == 22  # all three runs, whole
    # The text kept is the conversation's first 8 text tokens, in place around the runs.
    assert tokens[tokens != vision].tolist() == whole[whole != vision][:8].tolist()
    assert fields["loss_mask"].sum() == 0  # no answer token survives


@pytest.mark.parametrize("sizes, turns, seq_length, problem", [
    (SIZES, MULTI, 22, r"sample 'bad': field 'images' needs 23 positions for its placeholder "
                       r"runs \(3 vision items \(4\+10\+8 tokens\)\) and a bos token, more than "
                       r"--seq-length 22; raise --seq-length"),
    (SIZES[:2], MULTI, 96, r"sample 'bad': field 'conversation' it holds 3 <image> markers for 2 "
                           r"items"),
    (SIZES, (("user", "<image> <image> <image>"),), 96,
     r"sample 'bad': field 'conversation' it has no assistant turn"),
])
def test_samples_that_cannot_train_stop_naming_the_key(tokenizer, sizes, turns, seq_length,
                                                       problem):
    inputs = TextInputs(tokenizer, {"vision": _native_vit()}, tuple(MARKERS.items()), seq_length)
    with pytest.raises(BadSampleError, match=problem):
        inputs(_sample("bad", sizes, turns))


def test_an_image_below_the_towers_minimum_stops_every_rank_that_sees_it(tokenizer):
    from megatron_plugins.data.energon.inputs import EncoderInputs

    vit = _native_vit()
    sample = _sample("tiny", ((16, 16), (4, 30), (16, 16)), MULTI)
    problem = (r"sample 'tiny': field 'images\[1\]' cannot be embedded by --encoder vision: image "
               r"4x30 \(height x width\): its shorter side is below the patch size 8")
    with pytest.raises(BadSampleError, match=problem):  # language ranks: from the header alone
        TextInputs(tokenizer, {"vision": vit}, tuple(MARKERS.items()), 96)(sample)
    with pytest.raises(BadSampleError, match=problem):
        EncoderInputs(vit, vit.preprocessor())(sample)


def test_shapes_are_static_only_for_one_fixed_item_per_encoder(tokenizer):
    from megatron_plugins.data.energon.loader import EnergonSource

    fixed = _native_vit()
    fixed.args.vit_native_resolution = False
    source = EnergonSource(Path("x"), 0, 0, 64, 8, tokenizer, {"vision": fixed},
                           SAMPLE_KINDS["CaptioningSample"])
    assert source.static_shapes
    assert not dataclasses.replace(source, kind=SAMPLE_KINDS["ConversationSample"]).static_shapes
    assert not dataclasses.replace(source, kind=None).static_shapes  # a metadataset
    assert not dataclasses.replace(source, plugins={"vision": _native_vit()}).static_shapes


@pytest.mark.parametrize("balance", [False, True], ids=["fixed", "balanced"])
def test_both_sides_of_a_converted_folder_agree_on_every_items_tokens(tmp_path, llava,
                                                                     tokenizer, balance):
    from megatron_plugins.data.addressing import RankSlice
    from megatron_plugins.data.balance import assign_samples
    from megatron_plugins.data.energon.loader import EnergonSource
    from megatron_plugins.data.streams import ITEM_TOKENS, POSITIONS
    from megatron_plugins.parallel.layout import LANGUAGE, ModulePlacement, ParallelLayout

    images = [[f"img{i % 10}.png", f"img{(i + 3) % 10}.png"][: i % 3] for i in range(20)]
    records = [_llava(i, image=names, conversations=[
        {"from": "human", "value": "<image>" * len(names) + "what color"},
        {"from": "gpt", "value": "red"}]) for i, names in enumerate(images)]
    (llava / "llava.json").write_text(json.dumps(records))
    path = make_dataset(llava, llava / "llava.json", "conversation", tmp_path / "energon",
                        split=(100, 0, 0))
    vit = _native_vit()
    source = EnergonSource(path, 0, 0, 96, 4, tokenizer, {"vision": vit},
                           SAMPLE_KINDS["ConversationSample"])
    layout = ParallelLayout((
        ModulePlacement(name="vision", tp=1, pp=1, cp=1, dp=2, rank_offset=0, provider="vit"),
        ModulePlacement(name=LANGUAGE, tp=1, pp=1, cp=1, dp=1, rank_offset=2)))
    language = source.open("train", RankSlice.of(layout, LANGUAGE, 0, 2), 0, None)
    encoders = [source.open("train", RankSlice.of(layout, "vision", r, 2, balance), 0, None)
                for r in range(2)]
    seen, moved = set(), False
    for _ in range(6):
        keys, text = next(language)
        counts = text[ITEM_TOKENS]["vision"]
        # Balanced: the vision replicas share the microbatch by work, as the headers say.
        held = assign_samples(counts, 2) if balance else [[0], [1]]
        moved |= held != [[0], [1]]
        parts = [next(stream) for stream in encoders]
        assert [part_keys for part_keys, _ in parts] == [[keys[i] for i in h] for h in held]
        assert [batch[POSITIONS] for _, batch in parts] == held
        assert [batch[ITEM_TOKENS]["vision"] for _, batch in parts] == [
            [counts[i] for i in h] for h in held]
        placeholder = source.special_token_ids["vision"]
        assert (text["tokens"] == placeholder).sum(dim=1).tolist() == [sum(c) for c in counts]
        seen.update(len(c) for c in counts)
    assert seen == {0, 1, 2}
    assert moved == balance


def _frames(count: int, size: tuple[int, int]) -> list[bytes]:
    return [encode_png(np.full((*size, 3), 30 * index, dtype=np.uint8)) for index in range(count)]


def test_a_video_given_as_frame_images_is_an_item_of_the_qwen_encoder(tokenizer, tmp_path):
    """A conversation's second item is a video (a list of frame images, 4 fps): the language
    ranks size its run from the frames' headers and place it as transformers' get_rope_index
    places a video; the encoder ranks decode and preprocess it to that many tokens."""
    from megatron_plugins.data.energon.inputs import EncoderInputs
    from tests.models.hf_vision import plugin, save_tiny_qwen
    from tests.models.mrope import IMAGE_TOKEN, hf_rope_index

    qwen = plugin("qwen2_5_vl", save_tiny_qwen(tmp_path / "qwen"))
    sample = _sample("v1", SIZES[:2], MULTI[:2])
    sample.images[1] = {"frames": _frames(3, (16, 40)), "fps": 4}
    fields, counts, _ = TextInputs(tokenizer, {"vision": qwen}, tuple(MARKERS.items()), 96,
                                   mrope=True)(sample)
    assert counts == {"vision": (4, 2 * 10)}  # two temporal steps of 2x5 merged patches
    items, encoder_counts, _ = EncoderInputs(qwen, qwen.preprocessor())(sample)
    assert encoder_counts == (4, 20)
    assert [item["grid_thw"].tolist() for item in items] == [[1, 4, 4], [2, 4, 10]]
    length = int(fields["length"])
    tokens = fields["tokens"][:length] == tokenizer.placeholder_ids["vision"]
    want = hf_rope_index((tokens * IMAGE_TOKEN)[None], [(1, 2, 2), (2, 2, 5)],
                         seconds=[None, 2 / 4])[:, 0]
    assert torch.equal(fields["position_ids"][:, :length], want)
    # A <video> marker at the video gives the same prompt; one at the image is refused.
    marked = dataclasses.replace(sample, conversation=sample.conversation.replace(
        " and <image>", " and <video>"))
    again, _, _ = TextInputs(tokenizer, {"vision": qwen}, tuple(MARKERS.items()), 96)(marked)
    assert torch.equal(again["tokens"], fields["tokens"])
    swapped = dataclasses.replace(sample, conversation=sample.conversation.replace(
        "<image> and <image>", "<video> and <image>"))
    with pytest.raises(BadSampleError, match=r"^sample 'v1': field 'conversation' has the "
                                             r"markers <video> <image> for the items <image> "
                                             r"<video>; give one marker per item"):
        TextInputs(tokenizer, {"vision": qwen}, tuple(MARKERS.items()), 96)(swapped)


def test_unreadable_or_mismatched_video_frames_stop_naming_the_sample_and_frame(tokenizer,
                                                                               tmp_path):
    from megatron_plugins.data.energon.inputs import EncoderInputs
    from tests.models.hf_vision import plugin, save_tiny_qwen

    qwen = plugin("qwen2_5_vl", save_tiny_qwen(tmp_path / "qwen"))
    text = TextInputs(tokenizer, {"vision": qwen}, tuple(MARKERS.items()), 96)
    encoder = EncoderInputs(qwen, qwen.preprocessor())
    sample = _sample("v2", SIZES[:1], TURNS)
    sample.images[0] = [*_frames(2, (16, 16)), b"\x89PNG broken"]
    for inputs in (text, encoder):
        with pytest.raises(BadSampleError, match=r"^sample 'v2': field 'images\[0\]\[2\]' does "
                                                 "not decode as an image"):
            inputs(sample)
    sample.images[0] = [*_frames(1, (16, 16)), *_frames(1, (16, 24))]
    with pytest.raises(BadSampleError, match=r"field 'images\[0\]\[1\]' is 16x24 .* not the "
                                             "16x16 of the video's first frame"):
        text(sample)
    vit = _native_vit()
    with pytest.raises(BadSampleError, match=r"field 'images\[0\]' is a video, which "
                                             "--encoder vision=vit does not take"):
        TextInputs(tokenizer, {"vision": vit}, tuple(MARKERS.items()), 96)(sample)


QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]


@pytest.fixture(scope="module")
def qwen_tokenizer_folder(chat_folder, tmp_path_factory):
    """The chat tokenizer with Qwen's vision tokens, special as in Qwen's own tokenizer."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(chat_folder, local_files_only=True)
    hf.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    folder = tmp_path_factory.mktemp("qwen_tokenizer")
    hf.save_pretrained(str(folder))
    return str(folder)


def test_plain_image_markers_give_the_prompt_qwens_processor_gives(qwen_tokenizer_folder,
                                                                    monkeypatch):
    """With the checkpoint's start / end ids, each ``<image>`` marker's run is wrapped in
    ``<|vision_start|>`` / ``<|vision_end|>`` (a marker the record already wraps is not wrapped
    twice): the ids equal Qwen2_5_VLProcessor's on the template's text with Qwen's own image
    prompt."""
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

    hf = AutoTokenizer.from_pretrained(qwen_tokenizer_folder, local_files_only=True)
    start, end, pad = hf.convert_tokens_to_ids(QWEN_TOKENS)
    images = [np.full((h, w, 3), 90, dtype=np.uint8) for h, w in SIZES]
    # The image path only: the processor's video processor needs torchvision, absent here.
    monkeypatch.setattr(Qwen2_5_VLProcessor, "check_argument_for_proper_class",
                        lambda self, name, argument: None)
    processor = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=128, max_pixels=1280),
        tokenizer=hf)
    turns = (("user", "<image> and <image>\nwhich is red"), ("assistant", "the cat is red"),
             ("user", "and this <|vision_start|><image><|vision_end|>"), ("assistant", "a mat"))
    qwen_prompt = "<|vision_start|><|image_pad|><|vision_end|>"
    text = hf.apply_chat_template(
        [{"role": role, "content": content.replace("<|vision_start|><image><|vision_end|>",
                                                   "<image>").replace("<image>", qwen_prompt)}
         for role, content in turns], tokenize=False)
    inputs = processor(text=[text], images=images)
    want = inputs["input_ids"][0]
    counts = [int(grid.prod()) // 4 for grid in inputs["image_grid_thw"]]
    tokenizer = PromptTokenizer.load(qwen_tokenizer_folder, ["image"], BIG,
                                     checkpoint_tokens={"image": pad},
                                     wrapping={"image": (start, end)})
    ours = tokenizer.encode_conversation(Conversation(turns), [("image", c) for c in counts],
                                         {"image": "<image>"}, 160)
    assert ours.tokens[:ours.length].tolist() == want
    assert want.count(start) == want.count(end) == 3 and want.count(pad) == sum(counts)
    plain = tokenizer.encode(SampleText("", "a cat"), [("image", 4)], 16).tokens.tolist()
    assert plain[plain.index(start):plain.index(end) + 1] == [start, *[pad] * 4, end]
