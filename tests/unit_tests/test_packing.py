"""--pack-sequences: a microbatch's samples in one row, each with its own positions and segment."""

from __future__ import annotations

import pytest
import torch

from megatron_plugins.data.packing import PackingError, pack_row
from megatron_plugins.data.streams import (
    LENGTH, POSITIONS, MicrobatchStream, Packing, collate_text
)
from megatron_plugins.data.addressing import RankSlice

SEQ = 12
IMAGE = 99


def _sample(tokens: list[int], loss: list[float]) -> dict[str, torch.Tensor]:
    length = len(tokens)
    pad = SEQ - length
    return {"tokens": torch.tensor(tokens + [0] * pad),
            "labels": torch.tensor(tokens[1:] + [0] * (pad + 1)),
            "loss_mask": torch.tensor(loss + [0.0] * pad),
            "position_ids": torch.arange(SEQ), LENGTH: torch.tensor(length)}


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
