"""--balance-encoder-work: the assignment of a fan-in group's samples to encoder replicas, the
language's reordering of what it receives, and the mock streams that follow them."""

from __future__ import annotations

import random

import torch

from megatron_plugins.data.addressing import AlignmentGuard, RankSlice, _first_difference
from megatron_plugins.data.balance import (
    assign_samples, balanced_encoders, received_order, sample_work
)
from megatron_plugins.data.streams import ITEM_TOKENS, POSITIONS, MicrobatchStream, RECEIVED_ORDER
from megatron_plugins.parallel.layout import LANGUAGE
from tests.unit_tests.test_data import _layout, _source


def _skewed_group(rng: random.Random, samples: int) -> list[tuple[int, ...]]:
    """0..3 images per sample of a native-resolution mix: thumbnails to large photos."""
    sizes = [64, 196, 256, 400, 576, 1024]
    weights = [10, 15, 25, 25, 15, 10]
    return [tuple(rng.choices(sizes, weights)[0] for _ in range(rng.randint(0, 3)))
            for _ in range(samples)]


def _max_over_mean(group: list[tuple[int, ...]], assigned: list[list[int]]) -> float:
    loads = [sum(sample_work(group[i]) for i in samples) for samples in assigned]
    return max(loads) / (sum(loads) / len(loads))


def test_work_counts_attention_and_linear_cost_of_each_item():
    assert sample_work(()) == 0
    assert sample_work((4, 10)) == 4 * 4 + 4 + 10 * 10 + 10


def test_every_sample_is_assigned_once_in_position_order_and_work_is_balanced():
    rng = random.Random(0)
    before, after = [], []
    for _ in range(200):
        group = _skewed_group(rng, 16)
        assigned = assign_samples(group, 4)
        assert sorted(i for samples in assigned for i in samples) == list(range(16))
        assert all(samples == sorted(samples) for samples in assigned)
        after.append(_max_over_mean(group, assigned))
        before.append(_max_over_mean(group, [list(range(r * 4, r * 4 + 4)) for r in range(4)]))
        # Largest-first is within 4/3 of the best split, itself no better than the largest
        # sample or an even share.
        works = [sample_work(counts) for counts in group]
        best = max(max(works), sum(works) / 4) / (sum(works) / 4)
        assert after[-1] <= 4 / 3 * best + 1e-9
    mean_before, mean_after = sum(before) / len(before), sum(after) / len(after)
    assert mean_after < 1.2 < 1.5 < mean_before, (mean_before, mean_after)


def test_assignment_is_deterministic_and_breaks_ties_by_replica_then_position():
    group = [(10,), (), (30,), (10,), (20,)]
    assert assign_samples(group, 2) == assign_samples(list(group), 2) == [[2], [0, 1, 3, 4]]
    # Equal work: round robin, lowest position onto lowest replica.
    assert assign_samples([(8,)] * 4, 2) == [[0, 2], [1, 3]]
    # More replicas than samples: the last replicas get none.
    assert assign_samples([(8,), (4,)], 3) == [[0], [1], []]


def test_received_rows_reordered_are_the_samples_in_order_and_gradients_return_as_received():
    rng = random.Random(1)
    group = _skewed_group(rng, 8)
    rows = [sum(counts) for counts in group]
    per_sample = [torch.full((n, 2), float(i)) for i, n in enumerate(rows)]
    received = torch.cat([per_sample[i] for samples in assign_samples(group, 4) for i in samples])
    received.requires_grad_(True)
    order = torch.tensor(received_order(group, 4), dtype=torch.long)
    in_order = received.index_select(0, order)
    assert torch.equal(in_order, torch.cat(per_sample))
    in_order.backward(torch.cat(per_sample) + 1)  # each row's gradient names its sample
    assert torch.equal(received.grad, received.detach() + 1)


def test_only_encoders_with_more_replicas_than_the_language_are_balanced():
    assert balanced_encoders(_layout(4, 2)) == {"vision": 2}
    assert balanced_encoders(_layout(2, 2)) == {} == balanced_encoders(_layout(1, 2))
    assert RankSlice.of(_layout(1, 2), "vision", 0, 2, balance=True).balance_replicas == 1
    assert RankSlice.of(_layout(4, 2), LANGUAGE, 0, 2, balance=True).balance_replicas == 1


def test_balanced_mock_replicas_embed_their_groups_samples_by_work_and_the_guard_agrees():
    layout = _layout(4, 2)
    source = _source(layout)
    vision = [RankSlice.of(layout, "vision", r, 2, balance=True) for r in range(4)]
    others = [*(RankSlice.of(layout, LANGUAGE, r, 2) for r in range(2)),
              RankSlice.of(layout, "audio", 0, 2, balance=True)]  # audio dp 1: not balanced
    opened = {(m.module, m.dp_rank): source.open("train", m, 8) for m in vision + others}
    guards = {rank: AlignmentGuard(layout, rank[0], this, True, balance=True)
              for rank, this in zip(opened, vision + others)}
    streams = {rank: MicrobatchStream(stream, this, guards[rank], writes_state=False,
                                      balanced=balanced_encoders(layout)
                                      if rank[0] == LANGUAGE else None)
               for (rank, stream), this in zip(opened.items(), vision + others)}
    moved = False
    for _ in range(4):
        batches = {rank: next(stream) for rank, stream in streams.items()}
        for j in range(2):  # language replica j: vision replicas 2j, 2j+1 fill it
            counts = batches[(LANGUAGE, j)][ITEM_TOKENS]["vision"]
            sent = [batches[("vision", r)][ITEM_TOKENS]["vision"] for r in (2 * j, 2 * j + 1)]
            assigned = assign_samples(counts, 2)
            assert sent == [[counts[i] for i in samples] for samples in assigned]
            moved |= assigned != [[0], [1]]
            order = batches[(LANGUAGE, j)][RECEIVED_ORDER]["vision"]
            assert order.tolist() == received_order(counts, 2)
        assert all(POSITIONS not in batch for batch in batches.values())
    assert moved, "no microbatch was rebalanced: the test samples are too uniform"
    total = sum(guard.contribution() for guard in guards.values())
    assert not total.any()


def test_a_balanced_replica_sending_another_assignment_than_the_language_reads_fails_the_guard():
    """Both vision replicas of language replica 0 embed its two samples, but swapped against the
    assignment the language's received order reads: same keys and item counts per language
    replica, other rows. The guard fires and says so."""
    layout = _layout(4, 2)
    counts = {"vision": [(8,), (4,)]}  # (audio's entries, unbalanced, left out)
    assert assign_samples(counts["vision"], 2) == [[0], [1]]

    def guard_sums(vision_positions: list[int]) -> tuple[torch.Tensor, list]:
        language = AlignmentGuard(layout, LANGUAGE, RankSlice.of(layout, LANGUAGE, 0, 2), True,
                                  balance=True)
        language.record(["train/0", "train/1"], [0, 1], counts)
        guards = [language]
        for replica, position in enumerate(vision_positions):
            vision = AlignmentGuard(layout, "vision",
                                    RankSlice.of(layout, "vision", replica, 2, balance=True),
                                    True, balance=True)
            vision.record([f"train/{position}"], [position],
                          {"vision": [counts["vision"][position]]})
            guards.append(vision)
        total = sum(guard.contribution() for guard in guards)
        return total, [(rank, *guard.witness_records()) for rank, guard in enumerate(guards)]

    total, _ = guard_sums([0, 1])
    assert not total.any()
    total, witnesses = guard_sums([1, 0])
    assert total[0] != 0 and not total[1:].any()  # (vision, language replica 0)
    message = _first_difference(witnesses, total, ["vision", "audio"], 2)
    assert message == (
        "data misalignment at microbatch 0 of this step: encoder 'vision' dp rank 0 (global "
        "rank 1) embedded sample 'train/1' and sent it as row block 0 of fan-in replica 0, but "
        "language global rank 0 reads it from block 0 of replica 1 (--balance-encoder-work "
        "assigned the samples differently on the two sides)")
