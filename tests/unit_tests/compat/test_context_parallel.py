"""Context-parallel bridges (Gaps 19-21): stock behaviour on disjoint grids, and what each bridge
gives instead. CP groups are stubs (only ``size()`` / ``rank()`` are read) or one-rank gloo
groups; the model-level CP 2 equivalence is tests/unit_tests/test_cp_language.py."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.common.embeddings.rotary_pos_embedding import (
    MultimodalRotaryEmbedding,
)
from megatron.core.models.mimo.partition import utils as partition
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.overrides import TorchFunctionMode

from megatron_plugins.compat import context_parallel, model_build
from megatron_plugins.ops.cp_positions import thd_partitioned_indices

SECTION = [4, 2, 2]  # pairs of a 16-dim head
# Real lengths 5, 1, 3 padded to multiples of 2 x cp = 4 (8, 4, 4), no trailing padding.
PACKED = PackedSeqParams(
    qkv_format="thd", cu_seqlens_q=torch.tensor([0, 5, 6, 9], dtype=torch.int32),
    cu_seqlens_kv=torch.tensor([0, 5, 6, 9], dtype=torch.int32),
    cu_seqlens_q_padded=torch.tensor([0, 8, 12, 16], dtype=torch.int32),
    cu_seqlens_kv_padded=torch.tensor([0, 8, 12, 16], dtype=torch.int32),
    max_seqlen_q=8, max_seqlen_kv=8)


class StubGroup:
    """What stock's CP code reads of a process group."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class HostOnly(TorchFunctionMode):
    """Pinned host copies and ``.cuda()`` stay on the CPU (stock's CP slicing asks for both)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        kwargs.pop("pin_memory", None)
        return func(*args, **kwargs)


def _adapter(cp_group: object) -> partition.PartitionAdapter:
    return partition.PartitionAdapter(partition.PartitionConfig(
        seq_parallel=False, use_cp=True, tp_comm_overlap=False, max_seq_len=16,
        cp_group=cp_group))


def _row(batch: int = 1, length: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Embeddings ``[S, B, 2]``, labels and loss mask ``[B, S]`` naming their positions."""
    positions = torch.arange(length)[None].expand(batch, length).contiguous()
    embeddings = positions.T[..., None].expand(length, batch, 2).float().contiguous()
    return embeddings, positions, positions.clone()


@pytest.mark.skipif(partition._HAVE_TEX, reason="Transformer Engine is installed here")
def test_gap19_canary_stock_thd_split_asserts_without_transformer_engine(one_rank_world):
    """Gap 19: without TE, stock's partition adapter refuses to split a packed row over CP."""
    with pytest.raises(AssertionError, match="Please update Transformer Engine"):
        _adapter(StubGroup(2, 1)).shard(*_row(), packed_seq_params=PACKED)


def test_gap19_bridge_splits_each_document_as_transformer_engine_does(one_rank_world):
    model = SimpleNamespace(partition_adapter=_adapter(StubGroup(2, 1)))
    context_parallel.split_packed_rows_without_te(model)
    embeddings, labels, loss_mask = _row()
    got = model.partition_adapter.shard(embeddings, labels, loss_mask, packed_seq_params=PACKED)
    # Chunks 1 and 2 of 4 of each padded document (TE's kernel formula, by hand).
    expected = [2, 3, 4, 5, 9, 10, 13, 14]
    assert thd_partitioned_indices(PACKED.cu_seqlens_q_padded, 16, 2, 1).tolist() == expected
    assert got[0][:, 0, 0].tolist() == expected and got[0].shape == (8, 1, 2)
    assert got[1].tolist() == [expected] and got[2].tolist() == [expected]
    assert got[3] is PACKED


def test_gap19_bridge_leaves_other_adapters_alone(one_rank_world, monkeypatch):
    empty = SimpleNamespace(partition_adapter=None)
    context_parallel.split_packed_rows_without_te(empty)
    assert empty.partition_adapter is None
    monkeypatch.setattr(partition, "_HAVE_TEX", True)
    stock = SimpleNamespace(partition_adapter=_adapter(StubGroup(2, 0)))
    context_parallel.split_packed_rows_without_te(stock)
    assert type(stock.partition_adapter) is partition.PartitionAdapter


def _tiny_gpt(monkeypatch, pg_collection, position_embedding_type: str) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2,
                               use_cpu_initialization=True, mrope_section=SECTION)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=16, max_sequence_length=16,
                    position_embedding_type=position_embedding_type, pg_collection=pg_collection)


def _groups() -> SimpleNamespace:
    from megatron.core.process_groups_config import ProcessGroupCollection

    group = torch.distributed.new_group([0])
    return ProcessGroupCollection(tp=group, cp=group, pp=group, embd=group, pos_embd=group,
                                  dp=group, dp_cp=group)


def test_gap20_canary_gpt_mrope_falls_back_to_parallel_state_cp_group(one_rank_world,
                                                                     monkeypatch):
    """Gap 20: built on explicit groups (parallel_state uninitialized), GPT's standard RoPE takes
    the model's CP group, its multimodal RoPE none."""
    assert not parallel_state.model_parallel_is_initialized()
    groups = _groups()
    assert _tiny_gpt(monkeypatch, groups, "rope").rotary_pos_emb.cp_group is groups.cp
    assert _tiny_gpt(monkeypatch, groups, "mrope").rotary_pos_emb.cp_group is None


def test_gap20_bridge_gives_multimodal_rope_the_models_group(one_rank_world, monkeypatch):
    groups = _groups()
    model = _tiny_gpt(monkeypatch, groups, "mrope")
    context_parallel.bind_mrope_cp_group(model, groups.cp)
    assert model.rotary_pos_emb.cp_group is groups.cp
    model_build.interleave_mrope(model)  # Gap 17 keeps the state
    assert model.rotary_pos_emb.cp_group is groups.cp
    rope = _tiny_gpt(monkeypatch, groups, "rope")
    context_parallel.bind_mrope_cp_group(rope, StubGroup(2, 0))
    assert rope.rotary_pos_emb.cp_group is groups.cp


def _positions(length: int = 16) -> torch.Tensor:
    """``[3, 1, S]`` ids: documents restart (as packing gives them), h and w differ from t."""
    t = torch.cat([torch.arange(8), torch.arange(4), torch.arange(4)])[:length]
    return torch.stack([t, t * 2 % 5, t * 3 % 7])[:, None]


class RopeUser(torch.nn.Module):
    """Calls its multimodal RoPE from ``forward(position_ids, packed_seq_params)`` as GPT does."""

    def __init__(self, interleaved: bool = False) -> None:
        super().__init__()
        self.rotary_pos_emb = MultimodalRotaryEmbedding(16, 1.0)
        if interleaved:
            model_build.interleave_mrope(self)

    def forward(self, position_ids: torch.Tensor, packed_seq_params: PackedSeqParams | None = None
                ) -> torch.Tensor:
        return self.rotary_pos_emb(position_ids, SECTION)


def test_gap21_canary_stock_mrope_splits_every_row_it_has_a_cp_group_for(monkeypatch):
    """Gap 21: stock multimodal RoPE cannot be told a row is packed and zigzag-splits whatever
    it gets once it has a CP group of two."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    assert list(inspect.signature(MultimodalRotaryEmbedding.forward).parameters) == [
        "self", "position_ids", "mrope_section", "cp_group"]
    rotary = MultimodalRotaryEmbedding(16, 1.0, cp_group=StubGroup(2, 0))
    with HostOnly():
        freqs = rotary(_positions(), SECTION)
    whole = MultimodalRotaryEmbedding(16, 1.0)(_positions(), SECTION)
    assert freqs.shape == (8, 1, 1, 16)
    assert torch.equal(freqs, whole[[0, 1, 2, 3, 12, 13, 14, 15]])


def _rotate(query: torch.Tensor, freqs: torch.Tensor, group: StubGroup) -> torch.Tensor:
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2,
                               apply_rope_fusion=False)
    return rope_utils.apply_rotary_pos_emb(query, freqs, config,
                                           cu_seqlens=PACKED.cu_seqlens_q_padded, cp_group=group)


@pytest.mark.parametrize("interleaved", [False, True], ids=["contiguous", "interleaved"])
def test_gap21_bridge_rotates_each_cp_ranks_documents_at_their_global_positions(monkeypatch,
                                                                              interleaved):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    query = torch.randn(16, 2, 16, generator=torch.Generator().manual_seed(0))
    model = RopeUser(interleaved)
    whole = model(_positions(), PACKED)  # no CP group: the whole row
    expected = _rotate(query, whole, StubGroup(1, 0))
    context_parallel.whole_packed_mrope_rows(model)
    for rank in (0, 1):
        group = StubGroup(2, rank)
        context_parallel.bind_mrope_cp_group(model, group)
        local = thd_partitioned_indices(PACKED.cu_seqlens_q_padded, 16, 2, rank).long()
        with HostOnly():
            freqs = model(_positions(), PACKED)
            stock = model(_positions())  # one sequence per row: still zigzag-split
        assert torch.equal(freqs, whole)
        assert stock.shape == (8, 1, 1, 16)
        torch.testing.assert_close(_rotate(query[local], freqs, group), expected[local],
                                   rtol=0, atol=1e-6)
        # What stock's split frequencies would rotate by: not the documents' positions.
        wrong = _rotate(query[local], stock, group)
        assert (wrong - expected[local]).abs().max() > 1e-2
