"""``--hf-model DIR`` with a whole Qwen3-VL folder: its vision tower on the encoder grid, its
merger and DeepStack mergers as the encoder's projection, its Qwen3 language model with
interleaved multimodal RoPE and DeepStack on the language grid give transformers' logits on a
sample of several images of different sizes at one rank per module and at encoder TP 2 +
language PP 2; every tensor streams back unchanged; a trained run exports one folder
transformers loads as Qwen3-VL, the same bytes from two saving layouts; DeepStack trains
identically at language TP 2 (with sequence parallelism too) and in packed rows as at one rank
per module; a config Megatron would compute differently, or a pipeline split putting DeepStack
layers off the first stage, is one line."""

from __future__ import annotations

import json

import pytest
import torch

from tests.models.hf import safetensors_of
from tests.models.hf_vlm import (
    assert_trains_identically,
    LAYOUTS,
    bad_input,
    check_export,
    edited,
    export,
    identical_exports,
    resave,
    train_and_export,
    vlm_flags,
)
from tests.models.qwen3_whole import hf_logits, save_whole
from tests.models.qwen_vlm import forward_diff, images, sample

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    folder = save_whole(tmp_path_factory.mktemp("qwen3_vlm") / "qwen3")
    pictures = images()
    ids = sample(folder, pictures)
    return folder, ids, pictures, hf_logits(folder, ids, pictures)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.multirank
def test_whole_qwen3_vl_reproduces_transformers_logits_on_three_images_and_streams_back(
        qwen3, layout):
    folder, ids, pictures, want = qwen3
    grids, nproc = LAYOUTS[layout]
    assert forward_diff(folder, grids, nproc, ids, pictures, want) < TOLERANCE


@pytest.fixture(scope="module")
def exported(qwen3, tmp_path_factory):
    """The folder trained, saved from two layouts and exported (:func:`train_and_export`)."""
    folder = qwen3[0]
    root = tmp_path_factory.mktemp("qwen3_export")
    return root, folder, train_and_export(folder, root)


@pytest.mark.timeout(600)
@pytest.mark.multirank
def test_a_colocated_saving_layout_exports_the_same_qwen3_vl_folder(exported):
    """The trained weights re-saved with the tower on the language ranks (tower TP 2 on language
    DP 2) export byte-identical files: checkpoint keys do not depend on where modules ran."""
    root, folder, _ = exported
    resave(folder, root, "colocated", 2, ("image:tp=2@language", "language:dp=2"))
    export(root, ("colocated",))
    assert "model.safetensors" in identical_exports(root, "out_colocated")


@pytest.mark.timeout(600)
@pytest.mark.multirank
def test_two_saving_layouts_export_one_identical_qwen3_vl_folder_transformers_loads(exported):
    import transformers

    root, folder, pieces = exported
    out = root / "out_first"
    assert identical_exports(root) == ["config.json", "generation_config.json",
                                       "model.safetensors", "preprocessor_config.json"]
    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(out,
                                                                         dtype=torch.float32)
    written, original = check_export(out, folder, pieces, ()), safetensors_of(folder)
    for name in ("model.visual.merger.linear_fc1.weight",
                 "model.visual.deepstack_merger_list.1.linear_fc2.weight",
                 "model.visual.blocks.0.attn.qkv.weight",
                 "model.language_model.layers.1.self_attn.q_norm.weight", "lm_head.weight"):
        assert not torch.equal(written[name], original[name]), name  # it trained
    loaded = model.state_dict()
    for name in ("lm_head.weight", "model.visual.deepstack_merger_list.0.norm.bias",
                 "model.language_model.layers.3.mlp.up_proj.weight"):
        assert torch.equal(loaded[name], written[name]), name


@pytest.mark.timeout(600)
@pytest.mark.multirank
def test_training_starts_from_transformers_loss_on_the_first_batch(exported):
    """Step 1 of the run (weights still the folder's; DeepStack in the forward step) is
    transformers' loss on the same first global batch, which the deterministic mock source
    regenerates here with its positions (the mock lays image runs side by side, which
    transformers' Qwen3-VL positions cannot read; ``test_qwen3_vl_language.py`` checks the
    positions against them where they can)."""
    from tests.harness.tensorboard_scalars import read_scalars
    from tests.models.qwen_vlm import hf_first_batch_loss

    root, folder, _ = exported
    losses = read_scalars(root / "tensorboard", "lm loss")
    # train_and_export's first run: global batch 4, seq-length 64, 1:2 images, seed 1234.
    want = hf_first_batch_loss(folder, 4, 64, (1, 2), 1234, mock_positions=True)
    assert abs(losses[1] - want) / want < 1e-5, (losses[1], want)


def test_a_config_megatron_would_compute_differently_is_one_line(qwen3, tmp_path, monkeypatch):
    folder = qwen3[0]
    text = json.loads((folder / "config.json").read_text())["text_config"]
    other = edited(folder, tmp_path / "other", config={
        "text_config": {**text, "attention_bias": True}})
    assert bad_input(vlm_flags(other, ("image:dp=1", "language:dp=1")), monkeypatch) == (
        "config.json attention_bias = True is not supported (o_proj bias needs "
        "--add-bias-linear on every layer); only False can be imported")


def test_deepstack_layers_off_the_first_language_stage_are_one_line(qwen3, tmp_path,
                                                                    monkeypatch):
    folder = save_whole(tmp_path / "three_layers", num_hidden_layers=3)
    message = bad_input(vlm_flags(folder, ("image:dp=1", "language:pp=3")), monkeypatch,
                        world_size=4)
    assert message == (
        "encoder image adds 2 DeepStack feature levels after language layers 0-1, but the "
        "language pipeline (--pipeline-model-parallel-size 3) puts only 1 of its --num-layers 3 "
        "on the first stage; give the first stage at least 2 layers "
        "(--decoder-first-pipeline-num-layers 2) or fewer language stages")


def test_the_folder_splits_into_tower_mergers_and_language_parts(qwen3):
    from megatron_plugins.weights.vision_families import QWEN3_VL_VISION
    from megatron_plugins.weights.vlm_families import QWEN3_VL, part_families

    folder = qwen3[0]
    config = json.loads((folder / "config.json").read_text())
    names = set(safetensors_of(folder))
    parts = part_families(QWEN3_VL, config, QWEN3_VL_VISION, names)
    assert parts.tower.bind("pos_embed").hf == ("model.visual.pos_embed.weight",)
    assert parts.projector.bind("0.deepstack.1.mlp.encoder.linear_fc2.weight").hf == (
        "model.visual.deepstack_merger_list.1.linear_fc2.weight",)
    assert parts.language.bind("output_layer.weight").hf == ("lm_head.weight",)
    for name in names:
        assert sum(not part.is_unused(name) for part in parts.__dict__.values()) == 1, name


def test_tied_word_embeddings_at_the_top_level_tie_the_language_model(qwen3, tmp_path):
    from megatron_plugins.weights.vlm_families import QWEN3_VL, language_family

    config = json.loads((qwen3[0] / "config.json").read_text())
    implied = language_family(QWEN3_VL).megatron_args(QWEN3_VL.text_config(
        {**config, "tie_word_embeddings": True}))
    assert implied["untie_embeddings_and_output_weights"] is False
    assert implied["mrope_interleaved"] and implied["num_layers"] == 4


@pytest.mark.timeout(400)
@pytest.mark.multirank
def test_deepstack_trains_identically_at_language_tp2_packed_and_colocated(tmp_path):
    """DeepStack's levels, scattered to several images of varied sizes per sample, shard as
    MiMo shards the text embeddings: language TP 2 (with sequence parallelism too, on packed
    rows so that both TP ranks' shares hold tokens in the loss), packed rows, and the tower on
    the language ranks (its rows and levels routed to the replica that merges them) train as
    one rank per module does (the same losses, the same trained weights)."""
    folder = save_whole(tmp_path / "two_kv_heads", num_key_value_heads=2)  # TP 2 splits them
    assert_trains_identically(folder, tmp_path, (
            ("tp2", 3, ("image:dp=1", "language:tp=2"), ()),
            ("tp2-sequence-parallel", 3, ("image:dp=1", "language:tp=2"),
             ("--sequence-parallel", "--pack-sequences")),
            ("packed", 2, ("image:dp=1", "language:dp=1"), ("--pack-sequences",)),
            ("colocated", 2, ("image:tp=2@language", "language:dp=2"), ())))
