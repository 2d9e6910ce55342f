"""--pack-sequences: a microbatch's samples in one row, each with its own positions and segment."""

from __future__ import annotations

import pytest
import torch

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.ops.cp_positions import local_positions, thd_partitioned_indices
from megatron_plugins.data.packing import PackingError, pack_row
from megatron_plugins.ops.packed_attention import PackedAttention
from megatron_plugins.data.streams import (
    LENGTH, POSITIONS, MicrobatchStream, Packing, collate_text
)
from megatron_plugins.data.addressing import RankSlice

SEQ = 12
IMAGE = 99


def _sample(tokens: list[int], loss: list[float], seq: int = SEQ) -> dict[str, torch.Tensor]:
    length = len(tokens)
    pad = seq - length
    return {"tokens": torch.tensor(tokens + [0] * pad),
            "labels": torch.tensor(tokens[1:] + [0] * (pad + 1)),
            "loss_mask": torch.tensor(loss + [0.0] * pad),
            "position_ids": torch.arange(seq), LENGTH: torch.tensor(length)}


def _batch(*samples: dict[str, torch.Tensor]) -> tuple[dict, list[int]]:
    batch = collate_text(list(samples), [{"vision": ()} for _ in samples])
    return batch, batch.pop(LENGTH).tolist()


def test_samples_keep_their_positions_loss_and_segments() -> None:
    batch, lengths = _batch(_sample([1, IMAGE, IMAGE, 2, 3], [0, 0, 1, 1, 0]),
                            _sample([4, 5, 6], [1, 1, 0]))
    row = pack_row(batch, lengths, ["a", "b"], {IMAGE})
    assert row.fields["tokens"].tolist() == [[1, IMAGE, IMAGE, 2, 3, 4, 5, 6, 0, 0, 0, 0]]
    assert row.fields["labels"][0, :8].tolist() == [IMAGE, IMAGE, 2, 3, 0, 5, 6, 0]
    assert row.fields["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]]
    assert row.fields["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0]]
    kwargs = row.packing_kwargs()
    assert kwargs["cu_seqlens_q"].tolist() == [0, 5, 8, 12]
    assert kwargs["cu_seqlens_q"].dtype == torch.int32
    assert kwargs["max_seqlen_q"] == 5 and row.cut == ()


def test_a_full_row_has_no_padding_segment() -> None:
    batch, lengths = _batch(_sample([1] * 7, [1.0] * 6 + [0]), _sample([2] * 5, [1.0] * 5))
    row = pack_row(batch, lengths, ["a", "b"], {IMAGE})
    assert row.packing_kwargs()["cu_seqlens_kv"].tolist() == [0, 7, 12]


def test_later_text_is_cut_first_never_a_placeholder_run() -> None:
    first = _sample([1, IMAGE, IMAGE, 2, 3, 4, 5], [0, 0, 1, 1, 1, 1, 0])
    second = _sample([6, IMAGE, IMAGE, IMAGE, 7, 8, 9], [0, 0, 0, 1, 1, 1, 0])
    batch, lengths = _batch(first, second)
    row = pack_row(batch, lengths, ["a", "b"], {IMAGE})
    # 14 positions for 12: "b" loses 2 of its 3 text tokens after its run.
    assert row.kept == (7, 5) and row.cut == ("b",)
    assert row.fields["tokens"].tolist() == [[1, IMAGE, IMAGE, 2, 3, 4, 5, 6, IMAGE, IMAGE,
                                              IMAGE, 7]]
    # The cut sample's last kept position predicts a token no longer in the row: out of the loss.
    assert row.fields["loss_mask"][0, 7:].tolist() == [0, 0, 0, 1, 0]


def test_cutting_goes_back_to_earlier_samples_and_drops_text_only_ones() -> None:
    first = _sample([1, 2, IMAGE, 3, 4, 5, 6, 7], [1.0] * 7 + [0])
    second = _sample([8, 9, 10, 11, IMAGE, 12], [1.0] * 3 + [0.0] * 3)
    batch, lengths = _batch(first, second)
    row = pack_row(batch, lengths, ["a", "b"], {IMAGE})
    assert row.kept == (7, 5) and row.cut == ("a", "b")
    text_only = _sample([8, 9, 10, 11, 12, 13], [1.0] * 5 + [0])
    batch, lengths = _batch(_sample([1] * 4 + [IMAGE] * 8, [0.0] * 12), text_only)
    row = pack_row(batch, lengths, ["a", "b"], {IMAGE})
    assert row.kept == (12, 0) and row.cut == ("b",)
    assert row.packing_kwargs()["cu_seqlens_q"].tolist() == [0, 12]


def test_placeholder_runs_that_cannot_fit_name_the_samples_and_flags() -> None:
    batch, lengths = _batch(_sample([1] + [IMAGE] * 7, [0.0] * 8),
                            _sample([2] + [IMAGE] * 6, [0.0] * 7))
    with pytest.raises(PackingError, match=r"'a', 'b'.*15 positions.*--seq-length 12.*"
                                           r"--micro-batch-size"):
        pack_row(batch, lengths, ["a", "b"], {IMAGE})


def test_the_stream_packs_language_batches_into_one_row_without_a_mask() -> None:
    batch = collate_text([_sample([1, 2, 3], [1, 1, 0]), _sample([4, 5], [1, 0])],
                         [{"vision": ()}, {"vision": ()}])
    stream = MicrobatchStream(iter([(["a", "b"], {**batch, POSITIONS: [0, 1]})]),
                              RankSlice("language", 0, 2, 2, 2),
                              None, writes_state=False, packing=Packing({IMAGE}))
    packed = next(stream)
    assert packed["tokens"].shape == (1, SEQ) and "attention_mask" not in packed
    assert LENGTH not in packed
    assert packed["packing_kwargs"]["cu_seqlens_q"].tolist() == [0, 3, 5, 12]


def test_without_context_parallelism_rows_and_segments_are_unchanged() -> None:
    """multiple=1 (cp=1) is what packing always gave: the trailing padding a segment of its own
    and no padded boundaries (the packed checkpoint-resume goldens depend on it)."""
    batch, lengths = _batch(_sample([1, IMAGE, IMAGE, 2, 3], [0, 0, 1, 1, 0]),
                            _sample([4, 5, 6], [1, 1, 0]))
    default = pack_row(batch, lengths, ["a", "b"], {IMAGE})
    explicit = pack_row(batch, lengths, ["a", "b"], {IMAGE}, multiple=1)
    for name, field in default.fields.items():
        assert torch.equal(field, explicit.fields[name]) and field.dtype == batch[name].dtype
    kwargs = explicit.packing_kwargs()
    assert sorted(kwargs) == ["cu_seqlens_kv", "cu_seqlens_q", "max_seqlen_kv", "max_seqlen_q"]
    assert kwargs["cu_seqlens_kv"].tolist() == [0, 5, 8, 12] and kwargs["max_seqlen_kv"] == 5
    assert explicit.segment_lengths == explicit.padded_lengths == [5, 3, 4]


# Language cp=2: every kept sample padded to a multiple of 2 x cp = 4.
CP2 = 4


def _cp2_row(seq: int = 16):
    batch, lengths = _batch(_sample([1, IMAGE, IMAGE, 2, 3], [0, 0, 1, 1, 0], seq),
                            _sample([4, 5, 6], [1, 1, 0], seq))
    return pack_row(batch, lengths, ["a", "b"], {IMAGE}, multiple=CP2)


def test_context_parallel_packing_pads_each_sample_out_of_the_loss() -> None:
    row = _cp2_row()
    assert row.fields["tokens"].tolist() == [[1, IMAGE, IMAGE, 2, 3, 0, 0, 0, 4, 5, 6, 0,
                                              0, 0, 0, 0]]
    assert row.fields["labels"].tolist() == [[IMAGE, IMAGE, 2, 3, 0, 0, 0, 0, 5, 6, 0, 0,
                                              0, 0, 0, 0]]
    assert row.fields["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0,
                                                 0, 0, 0, 0]]
    # A sample's padding goes on from its last position (as its own unpacked padding does);
    # the trailing padding restarts at 0, as without CP.
    assert row.fields["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3,
                                                    0, 1, 2, 3]]
    assert row.kept == (5, 3) and row.cut == ()
    assert row.padded_lengths == [8, 4, 4] and row.segment_lengths == [5, 3, 0]


def test_context_parallel_boundaries_are_real_and_padded_ending_at_the_row() -> None:
    kwargs = _cp2_row().packing_kwargs()
    # Real lengths per segment; the trailing padding has none, so its real entry repeats.
    assert kwargs["cu_seqlens_q"].tolist() == kwargs["cu_seqlens_kv"].tolist() == [0, 5, 8, 8]
    assert kwargs["cu_seqlens_q_padded"].tolist() == [0, 8, 12, 16]
    assert kwargs["cu_seqlens_kv_padded"].tolist() == [0, 8, 12, 16]
    assert all(kwargs[key].dtype == torch.int32 for key in kwargs if key.startswith("cu_"))
    assert kwargs["max_seqlen_q"] == kwargs["max_seqlen_kv"] == 8  # the longest padded segment
    full = _cp2_row(seq=12).packing_kwargs()  # samples fill the row: no trailing segment
    assert full["cu_seqlens_q"].tolist() == [0, 5, 8]
    assert full["cu_seqlens_q_padded"].tolist() == [0, 8, 12]


@pytest.mark.parametrize("seq", [12, 16])
def test_context_parallel_split_accepts_the_packed_row(seq) -> None:
    """Each CP rank gets chunks r and 3-r of every padded sample; together the ranks hold the
    row once, and no chunk of a sample's real tokens lands in another sample."""
    row = _cp2_row(seq)
    params = PackedSeqParams(qkv_format="thd", **row.packing_kwargs())
    held = [local_positions(seq, 2, rank, params) for rank in range(2)]
    for rank in range(2):
        assert torch.equal(held[rank], thd_partitioned_indices(
            params.cu_seqlens_q_padded, seq, 2, rank).long())
    assert sorted(torch.cat(held).tolist()) == list(range(seq))
    assert held[0].tolist()[:4] == [0, 1, 6, 7] and held[1].tolist()[:4] == [2, 3, 4, 5]


def test_packed_attention_reads_real_tokens_at_padded_starts() -> None:
    """The reference packed attention takes segment starts from the padded boundaries and
    lengths from the real ones: each sample attends as if alone, padding comes out zero."""
    heads, dim = 2, 4
    config = TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
                               attention_dropout=0.0, use_cpu_initialization=True)
    attention = PackedAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                attention_type="self")
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(16, heads, dim, generator=generator) for _ in range(3))
    packed = attention(q, k, v, None, packed_seq_params=PackedSeqParams(
        qkv_format="thd", **_cp2_row().packing_kwargs()))
    for start, length in ((0, 5), (8, 3)):
        alone = slice(start, start + length)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, length]),
                                 cu_seqlens_kv=torch.tensor([0, length]),
                                 max_seqlen_q=length, max_seqlen_kv=length)
        assert torch.allclose(packed[alone], attention(q[alone], k[alone], v[alone], None,
                                                       packed_seq_params=params))
    assert not packed[[5, 6, 7, 11, 12, 13, 14, 15]].any()


def test_context_parallel_cut_counts_padded_positions() -> None:
    # 7 and 9 positions pad to 8 + 12 = 20 > 16: "b" is cut to 8 (its padded size), not to 9.
    first = _sample([1, IMAGE, IMAGE, 2, 3, 4, 5], [0, 0, 1, 1, 1, 1, 0], 16)
    second = _sample([6, IMAGE, IMAGE, IMAGE, 7, 8, 9, 10, 11], [0, 0, 0, 1, 1, 1, 1, 1, 0], 16)
    batch, lengths = _batch(first, second)
    row = pack_row(batch, lengths, ["a", "b"], {IMAGE}, multiple=CP2)
    assert row.kept == (7, 8) and row.cut == ("b",) and row.padded_lengths == [8, 8]
    assert row.fields["tokens"][0, 7:].tolist() == [0, 6, IMAGE, IMAGE, IMAGE, 7, 8, 9, 10]
    assert row.fields["loss_mask"][0, 7:].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 0]
    assert row.packing_kwargs()["cu_seqlens_q_padded"].tolist() == [0, 8, 16]
    # Text-only later samples are cut to what their padded share leaves, or dropped whole.
    batch, lengths = _batch(_sample([1] * 9 + [IMAGE] * 3, [0.0] * 12, 16),
                            _sample([2, 3, 4, 5, 6], [1.0] * 4 + [0], 16))
    row = pack_row(batch, lengths, ["a", "b"], {IMAGE}, multiple=CP2)
    assert row.kept == (12, 4) and row.cut == ("b",)
    batch, lengths = _batch(_sample([1] * 13 + [IMAGE] * 3, [0.0] * 16, 16),
                            _sample([2, 3, 4], [1.0, 1.0, 0], 16))
    row = pack_row(batch, lengths, ["a", "b"], {IMAGE}, multiple=CP2)
    assert row.kept == (16, 0) and row.packing_kwargs()["cu_seqlens_q"].tolist() == [0, 16]


def test_placeholder_runs_that_fit_only_without_cp_padding_say_so() -> None:
    # 5 + 6 = 11 placeholder positions fit 12, but padded to 4 each they need 8 + 8 = 16.
    batch, lengths = _batch(_sample([1] + [IMAGE] * 4, [0.0] * 5),
                            _sample([2] + [IMAGE] * 5, [0.0] * 6))
    assert pack_row(batch, lengths, ["a", "b"], {IMAGE}).kept == (5, 6)
    with pytest.raises(PackingError, match=r"'a', 'b'.*need 11 positions \(16 once each sample "
                                           r"is padded to a multiple of 4, 2 x the language cp, "
                                           r"for context parallelism\).*--seq-length 12"):
        pack_row(batch, lengths, ["a", "b"], {IMAGE}, multiple=CP2)


def test_the_stream_pads_to_its_packing_multiple() -> None:
    batch = collate_text([_sample([1, 2, 3], [1, 1, 0]), _sample([4, 5], [1, 0])],
                         [{"vision": ()}, {"vision": ()}])
    stream = MicrobatchStream(iter([(["a", "b"], {**batch, POSITIONS: [0, 1]})]),
                              RankSlice("language", 0, 2, 2, 2), None, writes_state=False,
                              packing=Packing({IMAGE}, multiple=CP2))
    kwargs = next(stream)["packing_kwargs"]
    assert kwargs["cu_seqlens_q"].tolist() == [0, 3, 5, 5]
    assert kwargs["cu_seqlens_q_padded"].tolist() == [0, 4, 8, 12]
