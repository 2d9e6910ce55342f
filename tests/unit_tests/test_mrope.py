"""Multimodal RoPE: the data's ``[3, S]`` positions equal transformers' Qwen2.5-VL
``get_rope_index`` (packed too), the mock lays them out from the items' grids, and a Qwen2.5-VL
folder's language model imported into Megatron's mrope GPT gives transformers' logits."""

from __future__ import annotations

import argparse
import itertools

import pytest
import torch

from megatron_plugins.data.mock import MockSource
from megatron_plugins.data.packing import pack_row
from megatron_plugins.data.positions import item_layout, mrope_position_ids
from megatron_plugins.encoders.base import EncoderPluginError
from megatron_plugins.encoders.vit import ViTEncoder
from megatron_plugins.parallel.layout import ModulePlacement
from megatron_plugins.weights.hf_config import find_family, read_config
from megatron_plugins.weights.language_families import FAMILIES
from megatron_plugins.weights.mapping import HFWeightsError
from tests.models.hf import rel_diff
from tests.models.mrope import (
    IMAGE_TOKEN,
    MROPE_SECTION,
    hf_language_logits,
    hf_rope_index,
    megatron_language_rank,
    save_tiny_qwen2_5_vl,
)
from tests.harness.multiprocess import run_in_processes

SAMPLES = {
    "text only": ([5, 6, 7, 8, 9, 10], []),
    "one image": ([5, 6, *[IMAGE_TOKEN] * 6, 7, 8], [(1, 2, 3)]),
    "images of different grids": (
        [5, *[IMAGE_TOKEN] * 4, 6, 7, *[IMAGE_TOKEN] * 3, 8, *[IMAGE_TOKEN] * 12, 9, 10],
        [(1, 2, 2), (1, 3, 1), (1, 3, 4)]),
    "image first and last": ([*[IMAGE_TOKEN] * 8, 5, 6, *[IMAGE_TOKEN] * 2],
                             [(1, 4, 2), (1, 1, 2)]),
}


def ours(tokens: list[int], grids: list[tuple[int, int, int]]) -> torch.Tensor:
    layouts = [(t * h * w, (t, h, w)) for t, h, w in grids]
    return mrope_position_ids(torch.tensor(tokens), {IMAGE_TOKEN: layouts})


@pytest.mark.parametrize("name", SAMPLES)
def test_positions_equal_transformers_get_rope_index(name: str) -> None:
    tokens, grids = SAMPLES[name]
    want = hf_rope_index(torch.tensor([tokens]), grids)[:, 0]
    assert torch.equal(ours(tokens, grids), want)


def test_padded_batch_positions_equal_transformers_on_the_unpadded_tokens() -> None:
    """A batch of samples of different lengths: HF skips the padding by its attention mask, ours
    positions it as text after the sample; the sample's own positions agree."""
    names = list(SAMPLES)
    length = max(len(SAMPLES[name][0]) for name in names)
    rows = torch.zeros(len(names), length, dtype=torch.long)
    mask = torch.zeros_like(rows)
    for row, name in enumerate(names):
        tokens = SAMPLES[name][0]
        rows[row, :len(tokens)] = torch.tensor(tokens)
        mask[row, :len(tokens)] = 1
    grids = [grid for name in names for grid in SAMPLES[name][1]]
    want = hf_rope_index(rows, grids, attention_mask=mask)
    for row, name in enumerate(names):
        tokens, sample_grids = SAMPLES[name]
        got = ours(rows[row].tolist(), sample_grids)
        assert torch.equal(got[:, :len(tokens)], want[:, row, :len(tokens)]), name
        padding = torch.arange(length - len(tokens)) + got[:, :len(tokens)].max() + 1
        assert torch.equal(got[:, len(tokens):], padding.expand(3, -1)), name


def test_packed_positions_restart_per_sample_as_transformers_gives_each() -> None:
    names = ["one image", "images of different grids", "text only"]
    seq_length = 48
    rows = {"tokens": [], "labels": [], "loss_mask": [], "position_ids": []}
    lengths = []
    for name in names:
        tokens, grids = SAMPLES[name]
        padded = torch.tensor(tokens + [0] * (seq_length - len(tokens)))
        rows["tokens"].append(padded)
        rows["labels"].append(padded)
        rows["loss_mask"].append(torch.ones(seq_length))
        rows["position_ids"].append(ours(padded.tolist(), grids))
        lengths.append(len(tokens))
    batch = {key: torch.stack(value) for key, value in rows.items()}
    row = pack_row(batch, lengths, names, {IMAGE_TOKEN})
    packed = row.fields["position_ids"]
    assert packed.shape == (1, 3, seq_length)
    start = 0
    for name, length in zip(names, lengths):
        tokens, grids = SAMPLES[name]
        want = hf_rope_index(torch.tensor([tokens]), grids)[:, 0]
        assert torch.equal(packed[0, :, start:start + length], want), name
        start += length
    padding = seq_length - start
    assert torch.equal(packed[0, :, start:], torch.arange(padding).expand(3, -1))


def test_runs_side_by_side_are_told_apart_by_the_items_counts() -> None:
    """Two images with no text between them (the mock lays runs side by side): the second starts
    after the first's largest position."""
    got = mrope_position_ids(torch.tensor([5, *[IMAGE_TOKEN] * 6, 6]),
                             {IMAGE_TOKEN: [(2, (1, 1, 2)), (4, (1, 2, 2))]})
    assert got.tolist() == [[0, 1, 1, 3, 3, 3, 3, 5], [0, 1, 1, 3, 3, 4, 4, 5],
                            [0, 1, 2, 3, 4, 3, 4, 5]]


def test_an_item_without_a_grid_takes_consecutive_positions() -> None:
    got = mrope_position_ids(torch.tensor([5, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, 6]),
                             {IMAGE_TOKEN: [(3, None)]})
    assert torch.equal(got, torch.arange(5).expand(3, -1))


def test_runs_that_do_not_match_the_items_are_refused() -> None:
    with pytest.raises(ValueError, match="shorter than its item's 4 tokens"):
        mrope_position_ids(torch.tensor([5, IMAGE_TOKEN, IMAGE_TOKEN, 6]),
                           {IMAGE_TOKEN: [(4, (1, 2, 2))]})
    with pytest.raises(ValueError, match="items without a placeholder run"):
        mrope_position_ids(torch.tensor([5, 6]), {IMAGE_TOKEN: [(1, None)]})


def _vit(*flags: str) -> ViTEncoder:
    parser = argparse.ArgumentParser()
    ViTEncoder.add_arguments(parser)
    grid = ModulePlacement(name="vision", tp=1, pp=1, cp=1, dp=1, rank_offset=0, provider="vit")
    return ViTEncoder("vision", parser.parse_args(list(flags)), grid)


def test_native_vit_grid_is_its_patch_rows_and_columns() -> None:
    plugin = _vit("--vit-native-resolution")
    for size in [(20, 30), (16, 16), (37, 11), (64, 80)]:
        rows, columns = plugin.preprocessor().grid(*size)
        assert item_layout(plugin, size) == (rows * columns, (1, rows, columns))
    assert _vit().item_grid((64, 80)) is None


def test_a_grid_that_does_not_hold_the_items_tokens_names_the_plugin() -> None:
    plugin = _vit("--vit-native-resolution")
    plugin.item_grid = lambda size: (1, 2, 2)
    with pytest.raises(EncoderPluginError, match="--encoder vision: item_grid"):
        item_layout(plugin, (64, 80))


VIDEO_SAMPLE = [
    ("text", 3), ("video", (4, 16, 16, 2.0)), ("text", 2), ("image", (24, 40)),
    ("video", (3, 21, 30, 3.0)), ("text", 1), ("video", (5, 13, 21, 8.0)), ("text", 1),
    ("video", (2, 8, 8, 24.0)), ("image", (16, 16)), ("text", 2)]
"""Text, videos of several frame counts and rates (seconds per step 1, 2/3, 1/4, 1/12) and
images, an image and a video side by side (HF reads same-kind runs side by side as one)."""


def test_video_and_image_positions_equal_transformers_get_rope_index(tmp_path) -> None:
    """The ``qwen2_5_vl`` encoder's item grids (a video's time interval from tokens_per_second
    and its fps) through the data's position code equal HF's get_rope_index given the same
    items as images and videos (``video_grid_thw``, ``second_per_grid_ts``)."""
    from tests.models.hf_vision import plugin, save_tiny_qwen

    encoder = plugin("qwen2_5_vl", save_tiny_qwen(tmp_path / "qwen"))
    tokens, layouts, grids, seconds = [], [], [], []
    for kind, value in VIDEO_SAMPLE:
        if kind == "text":
            tokens += list(range(5, 5 + value))
            continue
        count, grid = item_layout(encoder, value)
        tokens += [IMAGE_TOKEN] * count
        layouts.append((count, grid))
        grids.append(grid[:3])
        seconds.append(2 / value[3] if kind == "video" else None)
    assert [grid[0] for grid in grids] == [2, 1, 2, 3, 1, 1]
    got = mrope_position_ids(torch.tensor(tokens), {IMAGE_TOKEN: layouts})
    want = hf_rope_index(torch.tensor([tokens]), grids, seconds=seconds)[:, 0]
    assert torch.equal(got, want)
    assert (got[0].diff() < 0).any()  # a video's time positions pass the text after it, as HF


def test_mock_video_items_are_laid_out_and_embedded_alike(tmp_path) -> None:
    """``--mock-video-frames 3``: about half the items are 3-frame videos; each one's run, its
    positions and the encoder's preprocessed grid follow from its drawn size alone."""
    from megatron_plugins.media.codec import Video
    from megatron_plugins.errors import DataFlagError
    from tests.models.hf_vision import plugin, save_tiny_qwen

    encoder = plugin("qwen2_5_vl", save_tiny_qwen(tmp_path / "qwen"))
    source = MockSource(seed=5, seq_length=160, vocab_size=128, plugins={"vision": encoder},
                        items_per_sample=(1, 2), mrope=True, video_frames=3)
    preprocessor = encoder.preprocessor()
    videos = 0
    for index in range(8):
        sizes = source.item_sizes("vision", "train", index)
        media = source.media("vision", "train", index)
        for size, item in zip(sizes, media):
            grid = preprocessor(item)["grid_thw"].tolist()
            assert encoder.item_tokens(size) == grid[0] * grid[1] * grid[2] // 4
            if isinstance(item, Video):
                videos += 1
                assert item.frames.shape[:3] == size[:3] and grid[0] == 2
        sample = source.text("train", index)
        assert int((sample["tokens"] == source.special_token_ids["vision"]).sum()) == sum(
            encoder.item_tokens(size) for size in sizes)
    assert 3 <= videos < sum(len(source.item_sizes("vision", "train", i)) for i in range(8))
    slow = MockSource(seed=5, seq_length=160, vocab_size=128, plugins={"vision": encoder},
                      items_per_sample=(1, 2), mrope=True, video_frames=3, video_fps=1.5)
    rates = {item.fps for index in range(8) for item in slow.media("vision", "train", index)
             if isinstance(item, Video)}
    assert rates == {1.5}  # --mock-video-fps: the videos' rate, which their positions follow
    with pytest.raises(DataFlagError, match="--mock-video-frames 3: no --encoder takes videos"):
        MockSource(seed=5, seq_length=160, vocab_size=128, plugins={"vision": _vit()},
                   video_frames=3)


@pytest.mark.parametrize("native", [True, False], ids=["native-vit", "fixed-vit"])
def test_mock_mrope_positions_follow_the_items_grids(native: bool) -> None:
    plugin = _vit(*(["--vit-native-resolution"] if native else []))
    source = MockSource(seed=1234, seq_length=160, vocab_size=128, plugins={"vision": plugin},
                        mrope=True)
    placeholder = source.special_token_ids["vision"]
    compared = 0
    for index in range(16):
        sample = source.text("train", index)
        positions, length = sample["position_ids"], int(sample["length"])
        assert positions.shape == (3, 160)
        if not native:
            assert torch.equal(positions, torch.arange(160).expand(3, -1)), index
            continue
        grids = [(1, *plugin.preprocessor().grid(*size))
                 for size in source.item_sizes("vision", "train", index)]
        tokens = sample["tokens"].masked_fill(sample["tokens"] == placeholder, IMAGE_TOKEN)
        runs = [key for key, _ in itertools.groupby(tokens.tolist())].count(IMAGE_TOKEN)
        if not grids or runs != len(grids):  # HF reads runs side by side as one image
            continue
        want = hf_rope_index(tokens[None], grids)[:, 0]
        assert torch.equal(positions[:, :length], want[:, :length]), index
        compared += 1
    assert compared >= 3 or not native


def test_qwen2_5_vl_folder_implies_mrope_and_refuses_sections_megatron_splits_otherwise(
        tmp_path) -> None:
    def language_args(folder):
        family = find_family(read_config(folder, "--language-hf-weights"), FAMILIES, "test")
        return family, family.megatron_args(read_config(folder, "--language-hf-weights"))

    folder = save_tiny_qwen2_5_vl(tmp_path / "qwen2_5_vl")
    family, implied = language_args(str(folder))
    assert family.name == "qwen2_5_vl"
    assert implied["position_embedding_type"] == "mrope"
    assert implied["mrope_section"] == MROPE_SECTION
    assert implied["add_qkv_bias"] and implied["vocab_size"] == 100
    bad = save_tiny_qwen2_5_vl(tmp_path / "bad", rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 2]})
    with pytest.raises(HFWeightsError, match="^config.json rope_parameters.mrope_section = "
                                             r"\[2, 1, 2\] is not supported"):
        language_args(str(bad))


@pytest.mark.multirank
def test_qwen2_5_vl_language_model_reproduces_transformers_logits(tmp_path) -> None:
    """Same embeddings, same 3D positions (two samples with images of different grids): the
    imported Megatron mrope GPT's logits equal transformers' language model + lm_head."""
    folder = save_tiny_qwen2_5_vl(tmp_path / "qwen2_5_vl")
    tokens = torch.tensor([[5, 6, *[IMAGE_TOKEN] * 6, 7, 8, 9, 10],
                           [*[IMAGE_TOKEN] * 8, 5, *[IMAGE_TOKEN] * 2, 6]])
    positions = hf_rope_index(tokens, [(1, 2, 3), (1, 4, 2), (1, 1, 2)])
    assert positions[1].ne(positions[2]).any()  # the height and width rotations differ
    embeddings = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(3))
    [result] = run_in_processes(megatron_language_rank, 1, args=(str(folder), embeddings,
                                                                 positions),
                                timeout=120, simulated=True)
    assert result["family"] == "qwen2_5_vl"
    assert result["position_embedding_type"] == "mrope"
    assert result["mrope_section"] == MROPE_SECTION
    got = result["logits"][..., :100]
    want = hf_language_logits(folder, embeddings, positions)
    assert rel_diff(got, want) < 1e-5
    consecutive = torch.arange(12).expand(3, 2, -1)
    assert rel_diff(got, hf_language_logits(folder, embeddings, consecutive)) > 1e-3


def test_a_flag_contradicting_the_folders_mrope_is_one_line(tmp_path) -> None:
    import sys

    from megatron.training.arguments import parse_args

    from megatron_plugins.weights.flags import add_weights_args, implied_language_args

    folder = save_tiny_qwen2_5_vl(tmp_path / "qwen2_5_vl")
    saved, sys.argv = sys.argv, ["test", "--language-hf-weights", str(folder),
                                 "--position-embedding-type", "rope"]
    try:
        args = parse_args(add_weights_args)
    finally:
        sys.argv = saved
    given = {"position_embedding_type": "--position-embedding-type"}
    with pytest.raises(HFWeightsError) as error:
        implied_language_args(args, given.get)
    assert str(error.value) == (f"--position-embedding-type rope contradicts "
                                f"--language-hf-weights {folder}/config.json, which gives mrope; "
                                "drop --position-embedding-type")


def test_the_language_config_written_back_implies_the_same_flags_and_loads(tmp_path) -> None:
    import transformers

    from megatron_plugins.weights.language_families import QWEN2_5_VL

    folder = save_tiny_qwen2_5_vl(tmp_path / "qwen2_5_vl")
    implied = QWEN2_5_VL.megatron_args(read_config(folder, "--language-hf-weights"))
    args = argparse.Namespace(**implied, params_dtype=torch.float32)
    written = QWEN2_5_VL.hf_config(args, 100)
    assert QWEN2_5_VL.megatron_args(written) == implied
    text = transformers.Qwen2_5_VLConfig(**written).text_config
    assert text.rope_parameters["mrope_section"] == MROPE_SECTION
    assert (text.num_hidden_layers, text.num_key_value_heads, text.vocab_size) == (2, 2, 100)


def test_a_transformers_4_config_with_top_level_text_fields_imports_alike(tmp_path) -> None:
    """Published Qwen2.5-VL folders keep the text fields at the top level and name the rope
    type 'mrope' in ``rope_scaling``."""
    from megatron_plugins.weights.language_families import QWEN2_5_VL

    config = read_config(save_tiny_qwen2_5_vl(tmp_path / "qwen2_5_vl"), "--language-hf-weights")
    text = config.pop("text_config")
    params = text.pop("rope_parameters")
    old = {**config, **text, "rope_theta": params["rope_theta"],
           "rope_scaling": {"type": "mrope", "mrope_section": params["mrope_section"]}}
    assert QWEN2_5_VL.megatron_args(old) == QWEN2_5_VL.megatron_args(
        read_config(tmp_path / "qwen2_5_vl", "--language-hf-weights"))


def test_sections_that_do_not_split_a_heads_rotary_pairs_are_one_line() -> None:
    from megatron_plugins.errors import FlagError
    from megatron_plugins.launch.flag_checks import check_mrope

    def args(section):
        return argparse.Namespace(position_embedding_type="mrope", mrope_section=section,
                                  kv_channels=16, rotary_percent=1.0)

    check_mrope(args([2, 3, 3]))
    with pytest.raises(FlagError, match=r"^--mrope-section 2 3 4 must be three counts \(temporal, "
                                        r"height, width\) summing to the 8 rotary frequency"):
        check_mrope(args([2, 3, 4]))
    with pytest.raises(FlagError, match="^--mrope-section 4 4 must be three counts"):
        check_mrope(args([4, 4]))
