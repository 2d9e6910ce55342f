"""cp_positions: the positions a CP rank holds are exactly stock Megatron's (and TE's) split."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.utils import get_batch_on_this_cp_rank

from megatron_plugins.ops.cp_positions import (
    local_positions,
    thd_partitioned_indices,
    zigzag_indices,
)


def described(seq_length: int, cp: int, rank: int) -> list[int]:
    """The split in words: 2 x cp equal chunks, rank r keeps chunk r and chunk 2cp-1-r."""
    chunk = seq_length // (2 * cp)
    chunks = [list(range(c * chunk, (c + 1) * chunk)) for c in range(2 * cp)]
    return chunks[rank] + chunks[2 * cp - 1 - rank]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_is_stocks_per_sequence_split(cp, monkeypatch):
    seq_length = 2 * cp * 3
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: cp)
    for rank in range(cp):
        monkeypatch.setattr(dist, "get_rank", lambda group=None, rank=rank: rank)
        row = torch.arange(seq_length)[None, :]
        stock = get_batch_on_this_cp_rank({"tokens": row.clone(), "cu_seqlens": None},
                                          is_hybrid_cp=False, cp_group=object())
        mine = zigzag_indices(seq_length, cp, rank)
        assert mine.tolist() == stock["tokens"][0].tolist() == described(seq_length, cp, rank)
        assert torch.equal(local_positions(seq_length, cp, rank), mine)
    held = torch.cat([zigzag_indices(seq_length, cp, r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(seq_length))


def test_thd_split_keeps_each_document_on_its_two_chunks():
    # Documents padded to multiples of 4 (cp 2): [0, 8), [8, 12), [12, 24), trailing pad [24, 28).
    bounds = torch.tensor([0, 8, 12, 24, 28], dtype=torch.int32)
    rank0 = thd_partitioned_indices(bounds, 28, 2, 0)
    rank1 = thd_partitioned_indices(bounds, 28, 2, 1)
    assert rank0.dtype == torch.int32
    assert rank0.tolist() == [0, 1, 6, 7, 8, 11, 12, 13, 14, 21, 22, 23, 24, 27]
    assert rank1.tolist() == [2, 3, 4, 5, 9, 10, 15, 16, 17, 18, 19, 20, 25, 26]
    for cp in (1, 2, 4):
        bounds = torch.tensor([0, 8, 16, 40], dtype=torch.int32)
        for rank in range(cp):
            expected = [start + p for start, end in zip([0, 8, 16], [8, 16, 40])
                        for p in described(end - start, cp, rank)]
            assert thd_partitioned_indices(bounds, 40, cp, rank).tolist() == expected


def test_local_positions_of_a_packed_row_use_the_padded_boundaries():
    params = PackedSeqParams(qkv_format="thd",
                             cu_seqlens_q=torch.tensor([0, 5, 6], dtype=torch.int32),
                             cu_seqlens_q_padded=torch.tensor([0, 8, 12], dtype=torch.int32))
    assert local_positions(12, 2, 1, params).tolist() == [2, 3, 4, 5, 9, 10]
    unpadded = PackedSeqParams(qkv_format="thd",
                               cu_seqlens_q=torch.tensor([0, 4, 12], dtype=torch.int32))
    assert local_positions(12, 2, 0, unpadded).tolist() == [0, 3, 4, 5, 10, 11]


@pytest.mark.parametrize("bounds, seq_length, match", [
    ([0, 6, 12], 12, "multiples of 2 x context parallel size \\(4\\)"),
    ([0, 8], 12, "end at 8, not at the packed row's 12 tokens"),
])
def test_bad_thd_boundaries_are_refused_in_one_line(bounds, seq_length, match):
    with pytest.raises(ValueError, match=match):
        thd_partitioned_indices(torch.tensor(bounds), seq_length, 2, 0)


def test_a_row_that_does_not_split_into_2cp_chunks_is_refused():
    with pytest.raises(ValueError, match="not a multiple of 2 x context parallel size \\(4\\)"):
        zigzag_indices(10, 2, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TE's index kernel runs on a GPU")
def test_thd_split_equals_transformer_engines_kernel():
    tex = pytest.importorskip("transformer_engine_torch")
    generator = torch.Generator().manual_seed(0)
    for cp in (1, 2, 4):
        lengths = torch.randint(1, 6, (7,), generator=generator) * 2 * cp
        bounds = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).int()
        total = int(bounds[-1])
        for rank in range(cp):
            theirs = tex.thd_get_partitioned_indices(bounds.cuda(), total, cp, rank)
            assert thd_partitioned_indices(bounds, total, cp, rank).tolist() == theirs.tolist()
