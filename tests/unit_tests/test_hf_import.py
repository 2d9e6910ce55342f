"""HF checkpoints imported into stock GPT models give transformers' own logits (fp32, CPU)."""

from __future__ import annotations

import dataclasses

import pytest

import torch

from megatron_plugins.weights.streaming import AssembleError, assemble
from tests.models.hf import (
    hf_logits,
    mimo_import,
    rel_diff,
    safetensors_of,
    save_tiny,
    stock_gpt_rank,
    train_from_hf,
)
from tests.harness.multiprocess import run_in_processes

pytestmark = pytest.mark.multirank

TOLERANCE = 1e-5


@pytest.mark.parametrize("family, overrides", [
    ("llama", {}), ("qwen2", {}), ("qwen3", {}), ("qwen3_moe", {}), ("dots1", {}),
    ("dots1", {"n_group": 2, "topk_group": 1}),  # group-limited routing: a group of 2 of 4
], ids=["llama", "qwen2", "qwen3", "qwen3_moe", "dots1", "dots1-groups"])
def test_one_rank_import_reproduces_transformers_logits(family, overrides, tmp_path):
    folder = save_tiny(family, tmp_path / family, **overrides)
    [result] = run_in_processes(stock_gpt_rank, 1, args=(str(folder), 1, 1, []), timeout=120,
                                simulated=True)
    assert result["family"] == family
    assert result["padded_vocab"] == 128  # 100 HF rows padded to Megatron's multiple of 128
    want = hf_logits(folder)
    got = result["logits"]
    assert abs(got[..., 100:]).max() == 0  # padded rows are zero
    assert rel_diff(got[..., :100], want) < TOLERANCE


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = save_tiny("llama", tmp_path_factory.mktemp("hf") / "llama")
    return folder, hf_logits(folder)


def _assert_streams_back(folder, pieces):
    """Pieces from every rank reassemble to exactly the imported HF tensors."""
    _assert_streams_back_as(safetensors_of(folder), pieces)


def _assert_streams_back_as(tensors, pieces):
    assembled = assemble(piece for rank in pieces for piece in rank)
    assert sorted(assembled) == sorted(tensors)
    for name, tensor in tensors.items():
        assert assembled[name].dtype == tensor.dtype and torch.equal(assembled[name], tensor), name


@pytest.mark.parametrize("grid", ["language:tp=2", "language:pp=2", "language:tp=2,pp=2"])
def test_mimo_language_at_tp2_and_pp2_reproduces_transformers_logits_and_streams_back(llama, grid):
    folder, want = llama
    tp, pp = (2 if f"{dim}=2" in grid else 1 for dim in ("tp", "pp"))
    logits, pieces = mimo_import(1 + tp * pp, str(folder), grid)
    assert len(logits) == tp  # every TP rank of the last stage
    for got in logits:
        assert rel_diff(got[..., :100], want) < TOLERANCE
    layers = [{p.hf_name.split(".")[2] for p in rank if p.hf_name.startswith("model.layers.")}
              for rank in pieces]
    if pp == 2:  # each stage streams only its own layer
        assert all(len(held) == 1 for held in layers) and set.union(*layers) == {"0", "1"}
    if tp == 2:  # each TP rank holding layer 0 streams only its half of the 32 q_proj rows
        q = "model.layers.0.self_attn.q_proj.weight"
        assert [p.tensor.shape[0] for rank in pieces for p in rank if p.hf_name == q] == [16, 16]
    _assert_streams_back(folder, pieces)
    if tp == 2:
        _assert_another_ranks_metadata_is_caught(pieces)


@pytest.mark.parametrize("family, grid", [
    ("qwen2", "language:tp=2"), ("qwen3", "language:tp=2"), ("qwen2", "language:pp=2"),
    ("qwen3", "language:pp=2"), ("qwen3_moe", "language:pp=2"), ("dots1", "language:pp=2"),
    ("qwen3_moe", "language:tp=2"),
])
def test_every_family_at_tp2_and_pp2_reproduces_transformers_logits_and_streams_back(
        family, grid, tmp_path):
    """QKV bias and QK-norm sliced by TP; experts, shared experts, dense-first layers and the
    expert bias split by stage (4 layers: 2 per stage); MoE at TP 2 under sequence parallelism
    (stock's MoE layers need it there), each rank's experts split over TP."""
    folder = save_tiny(family, tmp_path / family, num_hidden_layers=4)
    extra = ("--sequence-parallel",) if family == "qwen3_moe" and "tp" in grid else ()
    logits, pieces = mimo_import(3, str(folder), grid, extra)
    assert len(logits) == (2 if "tp" in grid else 1)
    want = hf_logits(folder)
    for got in logits:
        assert rel_diff(got[..., :100], want) < TOLERANCE
    _assert_streams_back(folder, pieces)


def _assert_another_ranks_metadata_is_caught(pieces):
    """A consumer that places rank 1's q_proj slice with rank 0's offsets gets an error."""
    name = "model.layers.0.self_attn.q_proj.weight"
    [mine] = [p for p in pieces[0] if p.hf_name == name]
    [theirs] = [p for p in pieces[1] if p.hf_name == name]
    assert mine.offsets != theirs.offsets
    wrong = [p if p is not theirs else dataclasses.replace(p, offsets=mine.offsets)
             for rank in pieces for p in rank]
    with pytest.raises(AssembleError, match=f"{name}: pieces at .* overlap"):
        assemble(wrong)
    with pytest.raises(AssembleError, match=f"{name}: pieces cover"):
        assemble(p for p in wrong if p is not mine)


@pytest.mark.parametrize("family", ["qwen3_moe", "dots1"])
def test_moe_at_ep2_reproduces_transformers_logits(family, tmp_path):
    """dots1 adds the router's fp32 expert bias (a buffer), shared experts and a dense layer."""
    folder = save_tiny(family, tmp_path / family)
    logits, pieces = mimo_import(3, str(folder), "language:dp=2,ep=2")
    assert len(logits) == 2  # both expert ranks ran every token through all 4 experts
    want = hf_logits(folder)
    for got in logits:
        assert rel_diff(got[..., :100], want) < TOLERANCE
    experts = [{p.hf_name.split(".experts.")[1].split(".")[0] for p in rank if ".experts." in p.hf_name}
               for rank in pieces]
    assert experts == [{"0", "1"}, {"2", "3"}]  # each EP rank streams only its own experts
    _assert_streams_back(folder, pieces)


def test_untied_by_flag_tied_checkpoint_imports_at_pp2_and_streams_lm_head(tmp_path):
    """A checkpoint without ``lm_head`` (tie_word_embeddings) into a pipelined run with
    --untie-embeddings-and-output-weights: the output layer starts as the embedding and streams
    as ``lm_head`` (what that run exports)."""
    folder = save_tiny("qwen3", tmp_path / "tied", tie_word_embeddings=True)
    original = safetensors_of(folder)
    assert "lm_head.weight" not in original
    logits, pieces = mimo_import(3, str(folder), "language:pp=2",
                                 ("--untie-embeddings-and-output-weights",))
    [got] = logits
    assert rel_diff(got[..., :100], hf_logits(folder)) < TOLERANCE
    original["lm_head.weight"] = original["model.embed_tokens.weight"]
    _assert_streams_back_as(original, pieces)


def test_tied_checkpoint_trains_identically_at_pp1_and_pp2_and_streams_the_embedding_once(
        tmp_path):
    """Kept tied at PP 2, the last stage's output layer is read from the embedding and its
    gradient joins the first stage's: training equals the one-stage run (SGD, fp32), and the
    embedding is streamed once (no ``lm_head``)."""
    folder = save_tiny("qwen3", tmp_path / "tied", tie_word_embeddings=True)
    sgd = ("--optimizer", "sgd", "--lr", "0.05", "--min-lr", "0.005")
    one_stage, one_stage_logits = train_from_hf(2, str(folder), "language:", sgd)
    two_stages, two_stage_logits = train_from_hf(3, str(folder), "language:pp=2", sgd)
    assert rel_diff(two_stage_logits, one_stage_logits) < TOLERANCE
    assert rel_diff(one_stage_logits[..., :100], hf_logits(folder)) > 1e-3  # it trained
    trained = assemble(piece for rank in one_stage for piece in rank)
    assert sorted(trained) == sorted(safetensors_of(folder))
    streamed = assemble(piece for rank in two_stages for piece in rank)
    assert sorted(streamed) == sorted(trained)
    for name, tensor in trained.items():
        assert rel_diff(streamed[name].numpy(), tensor.numpy()) < TOLERANCE, name
