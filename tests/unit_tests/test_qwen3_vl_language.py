"""Qwen3-VL's language side: a Qwen3-VL folder implies Qwen3 with interleaved multimodal RoPE,
whose Megatron logits at 3D positions, with DeepStack levels added after the first layers, are
transformers'; the data's positions are Qwen3-VL's ``get_rope_index``; DeepStack layers off the
first pipeline stage, or recomputed, are one line."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron_plugins.data.positions import mrope_position_ids
from megatron_plugins.weights.hf_config import find_family, read_config
from megatron_plugins.weights.language_families import FAMILIES
from tests.harness.multiprocess import run_in_processes
from tests.models.hf import rel_diff
from tests.models.qwen3_text import (
    HIDDEN,
    IMAGE_TOKEN,
    LEVELS,
    MROPE_SECTION,
    VOCAB,
    hf_language_logits,
    hf_rope_index,
    megatron_rank,
    save_tiny_qwen3_vl,
)

GRIDS = [(1, 2, 3), (1, 3, 1), (1, 1, 2)]
TOKENS = torch.tensor([[5, 6, *[IMAGE_TOKEN] * 6, 7, *[IMAGE_TOKEN] * 3, 8, 9],
                       [*[IMAGE_TOKEN] * 2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]])
"""Two samples: two images of different grids in the first, one image first in the second."""


def test_qwen3_vl_folder_implies_qwen3_with_interleaved_mrope(tmp_path) -> None:
    folder = save_tiny_qwen3_vl(tmp_path / "qwen3_vl")
    config = read_config(folder, "--language-hf-weights")
    family = find_family(config, FAMILIES, "test")
    implied = family.megatron_args(config)
    assert family.name == "qwen3_vl"
    assert implied["position_embedding_type"] == "mrope" and implied["mrope_interleaved"]
    assert implied["mrope_section"] == MROPE_SECTION
    assert implied["qk_layernorm"] and not implied["add_qkv_bias"]
    assert implied["untie_embeddings_and_output_weights"]
    written = family.hf_config(argparse.Namespace(**implied, params_dtype=torch.float32), VOCAB)
    assert family.megatron_args(written) == implied
    assert written["text_config"]["rope_parameters"]["mrope_interleaved"] is True


def test_positions_equal_qwen3_vl_get_rope_index() -> None:
    want = hf_rope_index(TOKENS, GRIDS)
    layouts = [(t * h * w, (t, h, w)) for t, h, w in GRIDS]
    assert torch.equal(mrope_position_ids(TOKENS[0], {IMAGE_TOKEN: layouts[:2]}), want[:, 0])
    assert torch.equal(mrope_position_ids(TOKENS[1], {IMAGE_TOKEN: layouts[2:]}), want[:, 1])


@pytest.mark.multirank
def test_language_logits_with_deepstack_equal_transformers_at_3d_positions(tmp_path) -> None:
    """Same embeddings and 3D positions; the image positions' rows ``[main, level 0, level 1]``
    split by DeepStack: the logits are transformers' (which adds the levels after layers 0
    and 1), without the levels they differ, and the levels' columns get gradient."""
    folder = save_tiny_qwen3_vl(tmp_path / "qwen3_vl")
    positions = hf_rope_index(TOKENS, GRIDS)
    generator = torch.Generator().manual_seed(3)
    text = torch.randn(*TOKENS.shape, HIDDEN, generator=generator)
    mask = TOKENS == IMAGE_TOKEN
    rows = torch.randn(int(mask.sum()), (1 + LEVELS) * HIDDEN, generator=generator)
    [result] = run_in_processes(megatron_rank, 1, args=(str(folder), TOKENS, text, rows,
                                                        positions),
                                timeout=120, simulated=True)
    assert result["family"] == "qwen3_vl" and result["position_embedding_type"] == "mrope"
    assert result["mrope_interleaved"]
    assert result["rotary"] == "InterleavedMultimodalRotaryEmbedding"
    embeddings = text.masked_scatter(mask.unsqueeze(-1), rows[:, :HIDDEN].contiguous())
    levels = list(rows[:, HIDDEN:].split(HIDDEN, dim=-1))
    want = hf_language_logits(folder, embeddings, positions, mask, levels)
    assert rel_diff(result["logits"][..., :VOCAB], want) < 1e-5
    plain = hf_language_logits(folder, embeddings, positions)
    assert rel_diff(result["plain"][..., :VOCAB], plain) < 1e-5
    assert rel_diff(want, plain) > 1e-3
    grad = abs(result["rows_grad"]).reshape(len(rows), 1 + LEVELS, HIDDEN).sum(axis=(0, 2))
    assert (grad > 0).all(), grad


def test_deepstack_layers_off_the_first_stage_or_recomputed_are_one_line() -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_plugins.model.deepstack import check_layers
    from megatron_plugins.errors import FlagError

    def config(**parallel):
        return TransformerConfig(num_layers=4, hidden_size=8, num_attention_heads=2,
                                 pipeline_dtype=torch.float32,
                                 **parallel)

    check_layers({"image": 3}, config())
    check_layers({"image": 2}, config(pipeline_model_parallel_size=2))
    check_layers({"audio": 0}, config(pipeline_model_parallel_size=4))
    with pytest.raises(FlagError) as error:
        check_layers({"image": 3, "audio": 0}, config(pipeline_model_parallel_size=2))
    assert str(error.value) == (
        "encoder image adds 3 DeepStack feature levels after language layers 0-2, but the "
        "language pipeline (--pipeline-model-parallel-size 2) puts only 2 of its --num-layers 4 "
        "on the first stage; give the first stage at least 3 layers "
        "(--decoder-first-pipeline-num-layers 3) or fewer language stages")
    check_layers({"image": 3}, config(pipeline_model_parallel_size=2,
                                      num_layers_in_first_pipeline_stage=3))
    with pytest.raises(FlagError, match="^--recompute-granularity full recomputes the language "
                                        "layers encoder image's 3 DeepStack levels"):
        check_layers({"image": 3}, config(recompute_granularity="full",
                                          recompute_method="uniform", recompute_num_layers=1))


def test_interleaved_mrope_without_mrope_is_one_line() -> None:
    from megatron_plugins.errors import FlagError
    from megatron_plugins.launch.flag_checks import check_mrope

    args = argparse.Namespace(position_embedding_type="rope", mrope_interleaved=True)
    with pytest.raises(FlagError, match=r"^--mrope-interleaved lays out multimodal RoPE's "
                                        r"frequency pairs; it needs --position-embedding-type "
                                        r"mrope \(got rope\)$"):
        check_mrope(args)


def test_received_rows_of_another_width_name_the_encoder_and_an_empty_payload_adds_nothing():
    from types import SimpleNamespace

    from megatron_plugins.model.deepstack import DeepStack
    from megatron_plugins.encoders.base import EncoderPluginError

    deepstack = DeepStack({"image": LEVELS}, HIDDEN)
    mimo = SimpleNamespace(input_tensors={"image": torch.zeros(11, 2 * HIDDEN)},
                           special_token_ids={"image": IMAGE_TOKEN})
    with pytest.raises(EncoderPluginError) as error:
        deepstack.split_received(mimo, TOKENS, None)
    assert str(error.value) == (
        "--encoder image: its rows are 48 wide, but its deepstack_levels 2 and the language "
        "hidden size 24 make 72; the encoder must return [main, 2 levels]")
    empty = torch.zeros(0, HIDDEN)
    mimo.input_tensors = {"image": empty}
    deepstack.split_received(mimo, TOKENS[:, :0], None)
    assert mimo.input_tensors["image"] is empty and deepstack.additions == []
    assert deepstack.add_after(0, ("hidden", None)) == ("hidden", None)


def test_mimo_still_shards_its_merged_embeddings_the_way_deepstack_shards_the_levels():
    """DeepStack shards its levels with MiMo's own ``_build_packed_seq_params`` and
    ``_shard_language_inputs``, as MiMo shards the merged embeddings on the first language stage;
    a release that shards them otherwise must be followed here."""
    import inspect

    from megatron.core.models.mimo import MimoModel

    source = inspect.getsource(MimoModel._forward_language_module)
    assert "packed_seq_params = self._build_packed_seq_params(packing_kwargs)" in source
    assert "self.align_embeddings_by_token_positions(" in source
    assert ("combined_embeddings, labels, loss_mask, packed_seq_params = "
            "self._shard_language_inputs(") in source
    assert list(inspect.signature(MimoModel._shard_language_inputs).parameters) == [
        "self", "embeddings", "labels", "loss_mask", "packed_seq_params"]
