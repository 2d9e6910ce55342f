"""Text to language inputs with a real tokenizer: placeholder ids as stock builds them, the loss
layout, truncation, the errors a user can cause, and the tokenizer-training tool."""

from __future__ import annotations

import json
import pickle
import shutil
from types import SimpleNamespace

import pytest
import torch

from megatron_plugins.data.text import SampleText, placeholder_token, special_tokens_flag
from megatron_plugins.data.tokenizer import PromptTokenizer
from megatron_plugins.errors import FlagError
from tools.train_tokenizer import main as train_tokenizer_main
from tools.train_tokenizer import train_tokenizer

ENCODERS = ("vision", "audio")
BLOCKS = (("vision", 3), ("audio", 2))
CORPUS = ["a red cat sits on the mat", "what color is the cat", "a blue dog runs",
          "the dog is blue", "what is on the mat"] * 4
BIG = 10_000
"""A padded vocabulary with room to spare."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        return str(train_tokenizer(CORPUS, 200, tmp_path_factory.mktemp("tok")))


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tokenizer(folder):
    return PromptTokenizer.load(folder, ENCODERS, BIG)


def _ids(tokenizer, text):
    return tokenizer._ids(text)


def _stock_args(folder, special_tokens):
    """The arguments stock ``build_tokenizer`` reads for ``--tokenizer-type HuggingFaceTokenizer``,
    padding to a multiple of 1 so its padded vocabulary is exactly the tokenizer's size."""
    return SimpleNamespace(
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=folder, chat_template=None,
        vocab_file=None, merge_file=None, special_tokens=special_tokens,
        tokenizer_hf_no_use_fast=False, trust_remote_code=False,
        tokenizer_hf_no_include_special_tokens=False, metadata_path=None, pad_vocab_size=True,
        padded_vocab_size=None, make_vocab_size_divisible_by=1, tensor_model_parallel_size=1,
        rank=0)


def _rewrite_config(folder, tmp_path, drop):
    """A copy of the tokenizer folder whose config lacks the ``drop`` special tokens."""
    copy = shutil.copytree(folder, tmp_path / "edited")
    config = json.loads((copy / "tokenizer_config.json").read_text())
    for key in drop:
        config.pop(key)
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    return str(copy)


@pytest.mark.parametrize("user_tokens", [None, ["<sep2>"]])
def test_placeholder_ids_are_the_ids_stock_megatron_gives_them(folder, user_tokens):
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    flag = special_tokens_flag(user_tokens, ENCODERS)
    args = _stock_args(folder, flag)
    stock = build_tokenizer(args)
    stock_ids = dict(zip(flag, stock.additional_special_tokens_ids))
    ours = PromptTokenizer.load(folder, ENCODERS, args.padded_vocab_size, user_tokens)
    for name in ENCODERS:
        token = placeholder_token(name)
        assert ours.placeholder_ids[name] == stock_ids[token]
        assert ours._hf(token, add_special_tokens=False)["input_ids"] == [ours.placeholder_ids[name]]
        assert ours._hf.convert_ids_to_tokens(ours.placeholder_ids[name]) == token
    assert len(set(ours.placeholder_ids.values())) == len(ENCODERS)
    assert (ours.eos_id, ours.pad_id, ours.bos_id) == (stock.eod, stock.pad, stock.bos)


def test_without_the_special_tokens_flag_stock_pads_too_few_rows(folder):
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    args = _stock_args(folder, None)
    build_tokenizer(args)
    with pytest.raises(FlagError, match=r"padded vocabulary .*placeholder token <audio>"):
        PromptTokenizer.load(folder, ENCODERS, args.padded_vocab_size)


def test_special_tokens_flag_keeps_the_users_tokens_and_is_idempotent():
    flag = special_tokens_flag(["<x>", "<audio>"], ENCODERS)
    assert flag == ["<x>", "<audio>", "<vision>"]
    assert special_tokens_flag(flag, ENCODERS) == flag
    assert special_tokens_flag(None, ENCODERS) == ["<vision>", "<audio>"]


def test_caption_layout_and_loss_cover_only_the_target_and_eos(tokenizer):
    target = _ids(tokenizer, "a red cat")
    out = tokenizer.encode(SampleText("", "a red cat"), BLOCKS, 16)
    vision, audio = tokenizer.placeholder_ids["vision"], tokenizer.placeholder_ids["audio"]
    expected = ([tokenizer.bos_id, vision, vision, vision, audio, audio] + target
                + [tokenizer.eos_id])
    expected += [tokenizer.pad_id] * (16 - len(expected))
    assert out.tokens.tolist() == expected
    assert out.labels.tolist() == expected[1:] + [tokenizer.pad_id]
    # Position i predicts token i+1: the target starts at 6, so positions 5 .. 5+len(target).
    mask = [0.0] * 16
    for position in range(5, 6 + len(target)):
        mask[position] = 1.0
    assert out.loss_mask.tolist() == mask
    assert out.position_ids.tolist() == list(range(16))
    assert not out.truncated
    assert (out.tokens.dtype, out.labels.dtype, out.loss_mask.dtype) == (
        torch.int64, torch.int64, torch.float32)
    assert set(out.as_batch_fields()) == {"tokens", "labels", "loss_mask", "position_ids",
                                          "length"}
    assert out.length == 7 + len(target)


def test_vqa_question_is_context_not_loss(tokenizer):
    question, answer = _ids(tokenizer, "what color is the cat"), _ids(tokenizer, "red")
    out = tokenizer.encode(SampleText("what color is the cat", "red"), BLOCKS, 20)
    start = 6 + len(question)
    assert out.tokens[6:start].tolist() == question
    assert out.labels[out.loss_mask.bool()].tolist() == answer + [tokenizer.eos_id]
    assert out.loss_mask.nonzero().flatten().tolist() == list(range(start - 1, start + len(answer)))


def test_a_literal_placeholder_in_text_never_takes_an_encoder_position(tokenizer):
    out = tokenizer.encode(SampleText("<vision>", "<audio> cat"), BLOCKS, 40)
    placeholders = set(tokenizer.placeholder_ids.values())
    assert sum(token in placeholders for token in out.tokens.tolist()) == 5


def test_a_long_target_is_cut_and_the_mask_stays_on_kept_target_tokens(tokenizer):
    target = _ids(tokenizer, "a red cat sits on the mat a blue dog runs")
    out = tokenizer.encode(SampleText("", "a red cat sits on the mat a blue dog runs"), BLOCKS, 10)
    assert out.truncated
    assert out.tokens[6:].tolist() == target[:4]
    assert tokenizer.eos_id not in out.tokens.tolist()
    assert out.labels[out.loss_mask.bool()].tolist() == target[:4]


def test_target_and_eos_that_fit_exactly_are_not_truncated(tokenizer):
    target = _ids(tokenizer, "a red cat")
    out = tokenizer.encode(SampleText("", "a red cat"), BLOCKS, 6 + len(target) + 1)
    assert not out.truncated
    assert out.tokens[-1].item() == tokenizer.eos_id
    assert out.loss_mask.sum().item() == len(target) + 1


@pytest.mark.parametrize("prompt", ["", "what color is the cat what is on the mat"])
def test_when_no_target_token_fits_the_loss_mask_is_all_zero(tokenizer, prompt):
    out = tokenizer.encode(SampleText(prompt, "red"), BLOCKS, 6)
    assert out.truncated
    assert out.loss_mask.sum().item() == 0
    assert out.tokens.shape == (6,)


def test_without_pad_or_bos_tokens_eos_pads_and_no_bos_is_placed(folder, tmp_path):
    edited = PromptTokenizer.load(_rewrite_config(folder, tmp_path, ["pad_token", "bos_token"]),
                                  ENCODERS, BIG)
    assert edited.bos_id is None and edited.pad_id == edited.eos_id
    out = edited.encode(SampleText("", "red"), BLOCKS, 12)
    assert out.tokens[0].item() == edited.placeholder_ids["vision"]
    assert out.tokens[-1].item() == edited.eos_id
    assert out.loss_mask.sum().item() == len(_ids(edited, "red")) + 1


def test_a_pickled_tokenizer_encodes_the_same(tokenizer):
    copy = pickle.loads(pickle.dumps(tokenizer))
    sample = SampleText("what is on the mat", "a blue dog")
    assert copy.placeholder_ids == tokenizer.placeholder_ids
    assert copy.encode(sample, BLOCKS, 24).tokens.tolist() == \
        tokenizer.encode(sample, BLOCKS, 24).tokens.tolist()


def test_missing_folder_names_the_flag(tmp_path):
    with pytest.raises(FlagError, match=r"--tokenizer-model .*no such folder"):
        PromptTokenizer.load(str(tmp_path / "absent"), ENCODERS, BIG)


def test_a_folder_without_a_tokenizer_names_the_flag_and_the_files(tmp_path):
    with pytest.raises(FlagError, match=r"--tokenizer-model .*tokenizer\.json") as error:
        PromptTokenizer.load(str(tmp_path), ENCODERS, BIG)
    assert "\n" not in str(error.value)


def test_a_tokenizer_without_eos_is_refused(folder, tmp_path):
    with pytest.raises(FlagError, match=r"--tokenizer-model .*end-of-sequence"):
        PromptTokenizer.load(_rewrite_config(folder, tmp_path, ["eos_token"]), ENCODERS, BIG)


def test_no_room_names_the_placeholder_its_id_and_the_flags(folder, tokenizer):
    size = len(tokenizer._hf)
    PromptTokenizer.load(folder, ENCODERS, size)
    with pytest.raises(FlagError) as error:
        PromptTokenizer.load(folder, ENCODERS, size - 1)
    message = str(error.value)
    for part in ("--use-checkpoint-args", f"<audio> (id {size - 1})", f"{size} tokens"):
        assert part in message


def test_the_tool_reads_jsonl_fields_and_saves_a_loadable_tokenizer(tmp_path, capsys):
    texts = tmp_path / "qa.jsonl"
    texts.write_text(json.dumps({"question": "zebra stripes", "answer": "yes", "id": 7}) + "\n")
    assert train_tokenizer_main(["--texts", str(texts), "--vocab-size", "64",
                                 "--output", str(tmp_path / "tok")]) == 0
    loaded = PromptTokenizer.load(str(tmp_path / "tok"), ENCODERS, BIG)
    assert loaded._hf.decode(_ids(loaded, "zebra yes")) == "zebra yes"
    assert capsys.readouterr().out.strip() == str(tmp_path / "tok")


def test_the_tool_names_a_missing_texts_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as error:
        train_tokenizer_main(["--texts", str(tmp_path / "none.txt"), "--vocab-size", "64",
                              "--output", str(tmp_path / "tok")])
    assert error.value.code == 2
    assert "--texts: no such file" in capsys.readouterr().err


def test_a_checkpoint_token_marks_its_encoder_positions(folder):
    """``--hf-model``'s image token (Qwen's ``<|image_pad|>``, an id the tokenizer already has)
    marks the encoder's run instead of the added ``<vision>``, survives pickling for the loader
    workers, and an id outside the tokenizer is one line naming the folder."""
    plain = PromptTokenizer.load(folder, ENCODERS, BIG)
    chosen = 7
    tokenizer = PromptTokenizer.load(folder, ENCODERS, BIG, checkpoint_tokens={"vision": chosen})
    assert tokenizer.placeholder_ids == {"vision": chosen, "audio": plain.placeholder_ids["audio"]}
    sample = SampleText("what color is the cat", "blue")
    before = plain.encode(sample, BLOCKS, 32).tokens
    after = tokenizer.encode(sample, BLOCKS, 32).tokens
    marked = before == plain.placeholder_ids["vision"]
    assert int(marked.sum()) == 3
    assert torch.equal(after, torch.where(marked, torch.tensor(chosen), before))
    assert pickle.loads(pickle.dumps(tokenizer)).placeholder_ids == tokenizer.placeholder_ids
    with pytest.raises(FlagError, match=r"has \d+ tokens, but the checkpoint marks encoder vision"):
        PromptTokenizer.load(folder, ENCODERS, BIG, checkpoint_tokens={"vision": 10**6})
