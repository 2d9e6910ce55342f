"""Bad Megatron-checkpoint init input is one clear line before training: a missing folder, a
folder without a torch_dist checkpoint, HF and Megatron weights for one module, an unknown encoder,
shape flags that differ from the checkpoint's (both values named), tensors it lacks (named)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from megatron_plugins.weights.megatron_init import (
    SHAPE_FLAGS,
    CheckpointInitError,
    check_init_flags,
    check_language_shape,
    module_keys,
    split_key,
    tensor_problems,
)
from tests.harness.mimo_runs import TINY_MIMO
from tests.models.megatron_checkpoints import write_checkpoints

LAYOUT = ["--encoder", "vision=vit", "--grid", "vision:dp=1", "--grid", "language:dp=2"]
EMBEDDING = "embedding.word_embeddings.weight"
VIT = {"vision": SimpleNamespace(grid=SimpleNamespace(provider="vit"))}


def _parse(monkeypatch, *extra: str):
    from megatron_plugins.launch.pretrain import parse_mimo_args

    monkeypatch.setenv("WORLD_SIZE", "3")
    return parse_mimo_args([*TINY_MIMO, *LAYOUT, *extra])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A stock-GPT-like checkpoint (the embedding and the tiny model's saved args) and a MiMo-like
    one whose encoder 'vision' was an audio encoder."""
    from megatron_plugins.launch.pretrain import parse_mimo_args

    root = tmp_path_factory.mktemp("ckpts")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WORLD_SIZE", "3")
        args = parse_mimo_args([*TINY_MIMO, *LAYOUT]).args
    saved = {**{attr: getattr(args, attr) for attr, _ in SHAPE_FLAGS}, "padded_vocab_size": 128}
    embedding = {EMBEDDING: torch.randn(128, 64)}
    conv = {"modality_submodules.vision.module.encoders.vision.conv1.weight": torch.randn(4, 3)}
    write_checkpoints([(root / "gpt", embedding, saved),
                       (root / "audio", conv, {**saved, "mimo_encoders": ["vision=audio"]})])
    return root


def _flags(**given) -> argparse.Namespace:
    return argparse.Namespace(**{"language_megatron_checkpoint": None, "language_hf_weights": None,
                                 "encoder_megatron_checkpoint": [], "encoder_hf_weights": {},
                                 "init_model_with_meta_device": False,
                                 "untie_embeddings_and_output_weights": False, **given})


def test_a_missing_folder_or_one_without_a_torch_dist_checkpoint_is_named(tmp_path):
    with pytest.raises(CheckpointInitError) as error:
        check_init_flags(_flags(language_megatron_checkpoint=str(tmp_path / "no")), VIT, 1)
    assert str(error.value) == f"--language-megatron-checkpoint {tmp_path / 'no'}: no such folder"
    with pytest.raises(CheckpointInitError) as error:
        check_init_flags(_flags(encoder_megatron_checkpoint=[f"vision={tmp_path}"]), VIT, 1)
    assert str(error.value) == (
        f"--encoder-megatron-checkpoint vision= {tmp_path}: not a torch_dist checkpoint (neither "
        "latest_checkpointed_iteration.txt nor an iteration folder's metadata.json and "
        ".metadata); give a --save folder or one of its iter_NNNNNNN folders")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    (tmp_path / "iter_0000005").mkdir()
    with pytest.raises(CheckpointInitError, match=r"latest_checkpointed_iteration.txt names '5', "
                       r"but .*iter_0000005 is not a complete torch_dist checkpoint"):
        check_init_flags(_flags(language_megatron_checkpoint=str(tmp_path)), VIT, 1)


@pytest.mark.multirank
def test_a_pipelined_language_model_with_tied_embeddings_is_refused(checkpoints):
    with pytest.raises(CheckpointInitError) as error:
        check_init_flags(_flags(language_megatron_checkpoint=str(checkpoints / "gpt")), VIT, 2)
    assert str(error.value) == (
        f"--language-megatron-checkpoint {checkpoints / 'gpt'}: a pipelined language model (pp=2) "
        "with tied embeddings cannot load it on disjoint grids with megatron-core 0.19.2; add "
        "--untie-embeddings-and-output-weights")


def test_one_module_may_not_have_both_hf_and_megatron_weights():
    with pytest.raises(CheckpointInitError) as error:
        check_init_flags(_flags(language_megatron_checkpoint="ckpt", language_hf_weights="hf"),
                         VIT, 1)
    assert str(error.value) == ("--language-megatron-checkpoint ckpt and --language-hf-weights hf "
                                "both initialize the language model; give one")
    with pytest.raises(CheckpointInitError) as error:
        check_init_flags(_flags(encoder_megatron_checkpoint=["vision=ckpt"],
                                encoder_hf_weights={"vision": "hf"}), VIT, 1)
    assert str(error.value) == ("--encoder-megatron-checkpoint vision=ckpt and "
                                "--encoder-hf-weights vision=hf both initialize encoder vision; "
                                "give one")


@pytest.mark.multirank
def test_an_unknown_encoder_or_a_checkpoint_without_it_is_named(checkpoints):
    with pytest.raises(CheckpointInitError) as error:
        check_init_flags(_flags(encoder_megatron_checkpoint=["image=ckpt"]), VIT, 1)
    assert str(error.value) == ("--encoder-megatron-checkpoint image=ckpt: no encoder 'image'; "
                                "encoders are vision")
    gpt, audio = checkpoints / "gpt", checkpoints / "audio"
    with pytest.raises(CheckpointInitError) as error:
        check_init_flags(_flags(encoder_megatron_checkpoint=[f"vision={gpt}"]), VIT, 1)
    assert str(error.value) == (
        f"--encoder-megatron-checkpoint vision={gpt}: {gpt} holds no encoder 'vision' (its "
        "modules: none, a stock GPT checkpoint); give the checkpoint of a MiMo run that trained "
        "an encoder of this name")
    with pytest.raises(CheckpointInitError) as error:
        check_init_flags(_flags(encoder_megatron_checkpoint=[f"vision={audio}"]), VIT, 1)
    assert str(error.value) == (f"--encoder-megatron-checkpoint vision={audio}: the checkpoint's "
                                "encoder vision is --encoder vision=audio, this run's is "
                                "vision=vit")


@pytest.mark.multirank
def test_shape_flags_that_differ_from_the_checkpoint_name_both_values(checkpoints, monkeypatch):
    gpt = checkpoints / "gpt"
    args = _parse(monkeypatch, "--language-megatron-checkpoint", str(gpt))
    assert args.args.language_megatron_checkpoint == str(gpt)
    with pytest.raises(CheckpointInitError) as error:
        _parse(monkeypatch, "--language-megatron-checkpoint", str(gpt), "--num-layers", "3")
    assert str(error.value) == (f"--language-megatron-checkpoint {gpt}: the checkpoint was saved "
                                "with --num-layers 2, this run has --num-layers 3; give this run "
                                "the checkpoint's")
    with pytest.raises(CheckpointInitError, match="saved with a vocabulary padded to 128 rows .*"
                       "this run has a vocabulary padded to 136 rows"):
        _parse(monkeypatch, "--language-megatron-checkpoint", str(gpt),
               "--make-vocab-size-divisible-by", "8", "--vocab-size", "130")
    saved = argparse.Namespace(**vars(args.args))
    ours = argparse.Namespace(**{**vars(args.args), "swiglu": True, "add_bias_linear": False})
    with pytest.raises(CheckpointInitError, match="saved with no --swiglu, this run has --swiglu;"):
        check_language_shape(ours, saved, "x")
    with pytest.raises(CheckpointInitError, match="saved with no --disable-bias-linear, this run "
                                                  "has --disable-bias-linear;"):
        check_language_shape(argparse.Namespace(**{**vars(saved), "add_bias_linear": False}),
                             saved, "x")


def test_tensors_the_checkpoint_lacks_or_holds_otherwise_are_named():
    meta = {EMBEDDING: SimpleNamespace(global_shape=(128, 64), dtype=torch.float32),
            "output_layer.weight": SimpleNamespace(global_shape=(128, 64), dtype=torch.bfloat16)}
    keys = module_keys(meta, "language")
    assert tensor_problems([(EMBEDDING, (128, 64), torch.float32),
                            ("output_layer.weight", (128, 64), torch.float32)], keys, meta) == []
    assert tensor_problems([(EMBEDDING, (128, 64), torch.float32),
                            ("decoder.final_layernorm.weight", (64,), torch.float32)], keys,
                           meta) == [
        "the checkpoint has no tensor decoder.final_layernorm.weight of this model (never left "
        "at init: give a checkpoint of this model, or this run the checkpoint's flags)"]
    assert tensor_problems([(EMBEDDING, (136, 64), torch.float32),
                            ("output_layer.weight", (128, 64), torch.float16)], keys, meta) == [
        "embedding.word_embeddings.weight is [128, 64] in the checkpoint, [136, 64] in this model",
        "output_layer.weight is bfloat16 in the checkpoint, float16 in this model (train in the "
        "checkpoint's precision: --bf16 / --fp16 / neither)"]


def test_checkpoint_keys_map_to_module_names_for_stock_and_mimo_checkpoints():
    mimo = ["language_model.module.decoder.final_layernorm.weight",
            "modality_submodules.vision.module.module.encoders.vision.conv1.weight",
            "modality_submodules.vision.module.module.input_projections.0.encoder.linear_fc1.bias",
            "mimo.vision.optimizer.state.exp_avg.modality_submodules.vision.module.conv1.weight"]
    assert [split_key(key) for key in mimo] == [
        ("language", "decoder.final_layernorm.weight"), ("vision", "conv1.weight"),
        ("vision:projection", "0.encoder.linear_fc1.bias"), None]
    assert module_keys(mimo, "vision") == {"conv1.weight": mimo[1]}
    assert module_keys(mimo, "language") == {"decoder.final_layernorm.weight": mimo[0]}
    assert module_keys([EMBEDDING, "optimizer.state.exp_avg." + EMBEDDING], "language")[
        EMBEDDING] == EMBEDDING
    assert module_keys([EMBEDDING], "vision") == {}
