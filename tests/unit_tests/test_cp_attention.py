"""ContextParallelAttention at CP 2 (gloo) equals causal attention over the whole sequence on one
rank: outputs and query / key / value gradients, one sequence per row and packed documents."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from megatron.core.models.mimo.partition.utils import PartitionAdapter, PartitionConfig
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.cp_attention import ContextParallelAttention
from megatron_plugins.cp_positions import local_positions
from megatron_plugins.encoders.packed_attention import PackedAttention
from tests.multiprocess import run_in_processes

HEADS, GROUPS, DIM = 4, 2, 8
SEQ, BATCH = 16, 2
# Real document lengths 5, 1, 9, 3 padded to multiples of 2 x cp (8, 4, 12, 4), then a trailing
# padding segment: 32 tokens.
PACKED = PackedSeqParams(
    qkv_format="thd",
    cu_seqlens_q=torch.tensor([0, 5, 6, 15, 18, 18], dtype=torch.int32),
    cu_seqlens_kv=torch.tensor([0, 5, 6, 15, 18, 18], dtype=torch.int32),
    cu_seqlens_q_padded=torch.tensor([0, 8, 12, 24, 28, 32], dtype=torch.int32),
    cu_seqlens_kv_padded=torch.tensor([0, 8, 12, 24, 28, 32], dtype=torch.int32),
    max_seqlen_q=12, max_seqlen_kv=12)


def config(cp: int, **overrides: object) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                             num_query_groups=GROUPS, attention_dropout=0.0,
                             context_parallel_size=cp, use_cpu_initialization=True, **overrides)


def whole(shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    """Query, key, value and output gradient of the whole sequence, equal on every rank."""
    generator = torch.Generator().manual_seed(seed)
    heads = (HEADS, GROUPS, GROUPS, HEADS * DIM)
    return [torch.randn(*shape, h, *(() if h == HEADS * DIM else (DIM,)), generator=generator)
            for h in heads]


def plain(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          documents: list[tuple[int, int]]) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(d)) v within each (start, length) document, in float64 with
    an explicit mask; tokens outside every document come out zero."""
    query, key, value = (t.double() for t in (query, key, value))
    key = key.repeat_interleave(HEADS // GROUPS, dim=-2)
    value = value.repeat_interleave(HEADS // GROUPS, dim=-2)
    out = torch.zeros_like(query)
    for start, length in documents:
        span = slice(start, start + length)
        scores = torch.einsum("qhd,khd->hqk", query[span], key[span]) / math.sqrt(DIM)
        scores = scores.masked_fill(torch.ones(length, length).triu(1).bool(), float("-inf"))
        out[span] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), value[span])
    return out.flatten(-2)


def _run_rank(case: str) -> dict[str, object]:
    """One CP rank: its rows of the whole sequence through ContextParallelAttention, backward
    of a fixed output gradient; returns its positions, output and local gradients."""
    group = dist.group.WORLD
    cp, rank = dist.get_world_size(), dist.get_rank()
    packed = PACKED if case == "thd" else None
    total = int(PACKED.cu_seqlens_q_padded[-1]) if packed else SEQ
    query, key, value, grad = whole((total,) if packed else (total, BATCH), seed=1)
    positions = local_positions(total, cp, rank, packed)
    local = [t[positions].clone().requires_grad_() for t in (query, key, value)]
    attention = ContextParallelAttention(
        config(cp), layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
        pg_collection=ProcessGroupCollection(cp=group, tp=group))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t,
                                                  lambda t: t):
        out = attention(*local, attention_mask=None, packed_seq_params=packed)
    out.backward(grad[positions])
    result = {"positions": positions, "out": out.detach(), "saved": sum(saved),
              "local": sum(t.numel() for t in local),
              **{f"d{name}": t.grad for name, t in zip("qkv", local)}}
    if case == "sbhd":
        # MimoModel's own CP split (stock get_batch_on_this_cp_rank) holds the same rows.
        adapter = PartitionAdapter(PartitionConfig(
            seq_parallel=False, use_cp=True, tp_comm_overlap=False, max_seq_len=SEQ,
            cp_group=group))
        embeddings = torch.arange(SEQ * BATCH, dtype=torch.float32).view(SEQ, BATCH, 1)
        labels = torch.arange(SEQ)[None].expand(BATCH, SEQ).contiguous()
        sharded, labels, _, _ = adapter.shard(embeddings, labels, labels.clone())
        result["stock_rows"] = (torch.equal(sharded, embeddings[positions])
                                and torch.equal(labels[0], positions))
    return result


@pytest.mark.parametrize("case", ["sbhd", "thd"])
def test_cp2_equals_causal_attention_over_the_whole_sequence(case):
    ranks = run_in_processes(_run_rank, 2, args=(case,), timeout=120)
    packed = PACKED if case == "thd" else None
    total = int(PACKED.cu_seqlens_q_padded[-1]) if packed else SEQ
    query, key, value, grad = whole((total,) if packed else (total, BATCH), seed=1)
    leaves = [t.clone().requires_grad_() for t in (query, key, value)]
    reference = PackedAttention(config(1), layer_number=1, attn_mask_type=AttnMaskType.causal,
                                attention_type="self")
    expected = reference(*leaves, attention_mask=None, packed_seq_params=packed)
    expected.backward(grad)
    if packed:
        documents = list(zip(PACKED.cu_seqlens_q_padded[:-1].tolist(),
                             torch.diff(PACKED.cu_seqlens_q).tolist()))
        assert (plain(query, key, value, documents) - expected).abs().max() < 1e-6
    else:
        by_row = torch.stack([plain(query[:, b], key[:, b], value[:, b], [(0, SEQ)])
                              for b in range(BATCH)], dim=1)
        assert (by_row - expected).abs().max() < 1e-6

    out = torch.zeros_like(expected)
    grads = [torch.zeros_like(t) for t in leaves]
    for result in ranks:
        out[result["positions"]] = result["out"]
        for i, name in enumerate(("dq", "dk", "dv")):
            grads[i][result["positions"]] = result[name]
        # Only local tensors are kept for backward (keys / values are re-gathered there).
        assert result["saved"] == result["local"]
        if case == "sbhd":
            assert result["stock_rows"]
    assert sorted(torch.cat([r["positions"] for r in ranks]).tolist()) == list(range(total))
    # fp32; differences are summation order only (gradients: the all-reduce of two partials).
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    for mine, leaf in zip(grads, leaves):
        torch.testing.assert_close(mine, leaf.grad, rtol=1e-6, atol=1e-6)
    if packed:
        padding = torch.tensor([p for p in range(total) if not any(
            s <= p < s + n for s, n in zip(PACKED.cu_seqlens_q_padded[:-1].tolist(),
                                           torch.diff(PACKED.cu_seqlens_q).tolist()))])
        assert padding.numel() == total - 18
        assert out[padding].abs().max() == 0 and grads[0][padding].abs().max() == 0


def test_dropout_and_a_missing_cp_group_are_refused_in_one_line():
    with pytest.raises(ValueError, match="--attention-dropout 0"):
        ContextParallelAttention(config(2), 1, AttnMaskType.causal, "self", attention_dropout=0.1,
                                 pg_collection=ProcessGroupCollection(cp=object(), tp=None))
    with pytest.raises(ValueError, match="needs pg_collection.cp"):
        ContextParallelAttention(config(2), 1, AttnMaskType.causal, "self")
