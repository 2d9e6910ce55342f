"""ContextParallelAttention at CP 2 (gloo) equals attention over the whole sequence on one rank:
outputs and query / key / value gradients, one sequence per row and packed documents, GQA."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from megatron.core.models.mimo.partition.utils import PartitionAdapter, PartitionConfig
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.ops.cp_attention import ContextParallelAttention
from megatron_plugins.ops.cp_positions import local_positions
from megatron_plugins.ops.packed_attention import PackedAttention
from tests.harness.multiprocess import run_in_processes
from tests.unit_tests.test_packed_attention import FLOAT32_ROUNDING

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


# One short document, then trailing padding: rank 1 holds padding only.
SHORT = PackedSeqParams(
    qkv_format="thd",
    cu_seqlens_q=torch.tensor([0, 2, 2], dtype=torch.int32),
    cu_seqlens_kv=torch.tensor([0, 2, 2], dtype=torch.int32),
    cu_seqlens_q_padded=torch.tensor([0, 8, 16], dtype=torch.int32),
    cu_seqlens_kv_padded=torch.tensor([0, 8, 16], dtype=torch.int32),
    max_seqlen_q=8, max_seqlen_kv=8)
ROWS = {"sbhd": None, "thd": PACKED, "short": SHORT}
CASES = [("sbhd", AttnMaskType.causal), ("thd", AttnMaskType.causal),
         ("thd", AttnMaskType.no_mask), ("short", AttnMaskType.causal)]


def plain(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          documents: list[tuple[int, int]], causal: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v within each (start, length) document, in float64 with an
    explicit mask; tokens outside every document come out zero."""
    query, key, value = (t.double() for t in (query, key, value))
    key = key.repeat_interleave(HEADS // GROUPS, dim=-2)
    value = value.repeat_interleave(HEADS // GROUPS, dim=-2)
    out = torch.zeros_like(query)
    for start, length in documents:
        span = slice(start, start + length)
        scores = torch.einsum("qhd,khd->hqk", query[span], key[span]) / math.sqrt(DIM)
        if causal:
            future = torch.ones(length, length).triu(1).bool()
            scores = scores.masked_fill(future, float("-inf"))
        out[span] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), value[span])
    return out.flatten(-2)


def sequence(layout: str) -> tuple[PackedSeqParams | None, int, list[torch.Tensor]]:
    """Packing parameters, length and (query, key, value, output gradient) of the whole row."""
    packed = ROWS[layout]
    total = int(packed.cu_seqlens_q_padded[-1]) if packed else SEQ
    return packed, total, whole((total,) if packed else (total, BATCH), seed=1)


def _run_rank() -> list[dict[str, object]]:
    """One CP rank, every case of CASES: its rows of the whole sequence through
    ContextParallelAttention, backward of a fixed output gradient; returns its positions,
    output, local gradients and the element count saved for backward."""
    group = dist.group.WORLD
    cp, rank = dist.get_world_size(), dist.get_rank()
    results = []
    for layout, mask in CASES:
        packed, total, (query, key, value, grad) = sequence(layout)
        positions = local_positions(total, cp, rank, packed)
        local = [t[positions].clone().requires_grad_() for t in (query, key, value)]
        attention = ContextParallelAttention(
            config(cp), layer_number=1, attn_mask_type=mask, attention_type="self",
            pg_collection=ProcessGroupCollection(cp=group, tp=group))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t,
                                                      lambda t: t):
            out = attention(*local, attention_mask=None, packed_seq_params=packed)
        out.backward(grad[positions])
        # numpy: tensors would cross as shared memory, gone once the rank exits.
        results.append({"positions": positions.numpy(), "out": out.detach().numpy(),
                        "saved": sum(saved), "local": sum(t.numel() for t in local),
                        **{f"d{name}": t.grad.numpy() for name, t in zip("qkv", local)}})
    # MimoModel's own CP split (stock get_batch_on_this_cp_rank) holds the same rows.
    adapter = PartitionAdapter(PartitionConfig(
        seq_parallel=False, use_cp=True, tp_comm_overlap=False, max_seq_len=SEQ,
        cp_group=group))
    embeddings = torch.arange(SEQ * BATCH, dtype=torch.float32).view(SEQ, BATCH, 1)
    labels = torch.arange(SEQ)[None].expand(BATCH, SEQ).contiguous()
    sharded, labels, _, _ = adapter.shard(embeddings, labels, labels.clone())
    positions = torch.from_numpy(results[0]["positions"])
    results[0]["stock_rows"] = (torch.equal(sharded, embeddings[positions])
                                and torch.equal(labels[0], positions))
    return results


@pytest.fixture(scope="module")
def cp2_ranks() -> list[list[dict[str, object]]]:
    """Every case on 2 gloo ranks, in one launch forked from the simulated ranks' server, which
    has Megatron imported (CI time)."""
    return run_in_processes(_run_rank, 2, timeout=120, simulated=True)


@pytest.mark.multirank
def test_each_rank_holds_mimo_models_rows(cp2_ranks):
    assert all(rank[0]["stock_rows"] for rank in cp2_ranks)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{l}-{m.name}" for l, m in CASES])
@pytest.mark.multirank
def test_cp2_equals_attention_over_the_whole_sequence(cp2_ranks, case):
    layout, mask = CASES[case]
    ranks = [{key: torch.from_numpy(value) if isinstance(value, np.ndarray) else value
              for key, value in per_rank[case].items()} for per_rank in cp2_ranks]
    packed, total, (query, key, value, grad) = sequence(layout)
    leaves = [t.clone().requires_grad_() for t in (query, key, value)]
    reference = PackedAttention(config(1), layer_number=1, attn_mask_type=mask,
                                attention_type="self")
    expected = reference(*leaves, attention_mask=None, packed_seq_params=packed)
    expected.backward(grad)
    causal = mask == AttnMaskType.causal
    # The float32 reference against float64 (its rounding, relative to the largest output).
    if packed:
        documents = list(zip(packed.cu_seqlens_q_padded[:-1].tolist(),
                             torch.diff(packed.cu_seqlens_q).tolist()))
        exact = plain(query, key, value, documents, causal)
        assert (exact - expected).abs().max() < FLOAT32_ROUNDING * exact.abs().max()
    else:
        by_row = torch.stack([plain(query[:, b], key[:, b], value[:, b], [(0, SEQ)], causal)
                              for b in range(BATCH)], dim=1)
        assert (by_row - expected).abs().max() < FLOAT32_ROUNDING * by_row.abs().max()

    out = torch.zeros_like(expected)
    grads = [torch.zeros_like(t) for t in leaves]
    for result in ranks:
        out[result["positions"]] = result["out"]
        for i, name in enumerate(("dq", "dk", "dv")):
            grads[i][result["positions"]] = result[name]
        # Only local tensors are kept for backward (keys / values are re-gathered there).
        assert result["saved"] == result["local"]
    assert sorted(torch.cat([r["positions"] for r in ranks]).tolist()) == list(range(total))
    # fp32; differences are summation order only (gradients: the all-reduce of two partials).
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    for mine, leaf in zip(grads, leaves):
        torch.testing.assert_close(mine, leaf.grad, rtol=1e-6, atol=1e-6)
    if packed:
        padding = torch.tensor([p for p in range(total) if not any(
            s <= p < s + n for s, n in documents)])
        assert padding.numel() == total - int(packed.cu_seqlens_q[-1])
        assert out[padding].abs().max() == 0 and grads[0][padding].abs().max() == 0


def test_dropout_and_a_missing_cp_group_are_refused_in_one_line():
    with pytest.raises(ValueError, match="--attention-dropout 0"):
        ContextParallelAttention(config(2), 1, AttnMaskType.causal, "self", attention_dropout=0.1,
                                 pg_collection=ProcessGroupCollection(cp=object(), tp=None))
    with pytest.raises(ValueError, match="needs pg_collection.cp"):
        ContextParallelAttention(config(2), 1, AttnMaskType.causal, "self")
