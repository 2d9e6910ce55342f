"""The advisor against a published operating point: Megatron-Bridge's Qwen3.5-VL 27B tutorial
(tutorials/megatron_mimo/qwen35-vl-non-colocated-sft.md): on H100s, the image encoder moved
off the first stage of language TP4 PP2 DP2 (16 ranks) onto one rank of its own (17 ranks)
gained +23.0% to +44.7% active tokens/s per GPU; on RDR (one 768x768 image per sample) +29.9%,
+44.7%, +23.3% and +30.6% at seq/GBS 2048/32, 2048/64, 4096/32, 4096/64. Its sweep found no
8-GPU layout fitting and TP8 PP2 DP1 and TP4 PP4 DP1 running. The model runs on its default
assumptions (docs/performance.md, "Advisor"), the layouts placed as Bridge places them."""

from __future__ import annotations

import pytest

from megatron_plugins.performance.advisor import advise
from megatron_plugins.performance.assumptions import Assumptions
from megatron_plugins.performance.candidates import HOMOGENEOUS, enumerate_candidates
from megatron_plugins.performance.cost_model import estimate
from megatron_plugins.performance.gpus import hardware
from tests.models.advisor import bridge_layouts, qwen35_27b, space

PUBLISHED = {(2048, 32): 0.299, (2048, 64): 0.447, (4096, 32): 0.233, (4096, 64): 0.306}
"""Bridge's RDR gains in active tokens/s/GPU, by (seq length, global batch)."""

THREE_NODES = hardware(24, 8, "h100-sxm", {})


def _gain(seq_length: int, global_batch: int) -> float:
    work = qwen35_27b(seq_length, global_batch)
    baseline, separate = bridge_layouts()
    before = estimate(baseline, work, THREE_NODES, Assumptions())
    after = estimate(separate, work, THREE_NODES, Assumptions())
    assert before.memory.fits and after.memory.fits
    return after.tokens_per_s_per_gpu / before.tokens_per_s_per_gpu - 1


@pytest.mark.parametrize("point", sorted(PUBLISHED))
def test_the_predicted_gain_of_the_encoder_on_its_own_rank_is_near_the_published(point):
    assert abs(_gain(*point) - PUBLISHED[point]) < 0.15


def test_like_the_published_gains_the_predicted_ones_shrink_with_longer_rows():
    for batch in (32, 64):
        assert _gain(2048, batch) > _gain(4096, batch) > 0


@pytest.mark.parametrize("tp, pp, dp", [(4, 2, 2), (8, 2, 1), (4, 4, 1)])
def test_the_layouts_the_published_sweep_ran_fit_memory(tp, pp, dp):
    baseline, _ = bridge_layouts(tp, pp, dp)
    for seq_length in (2048, 4096):
        estimated = estimate(baseline, qwen35_27b(seq_length, 64), THREE_NODES, Assumptions())
        assert estimated.memory.fits, (tp, pp, dp, seq_length, estimated.memory.ranks)


def test_on_eight_gpus_only_the_widest_splits_fit_and_without_margin():
    work = qwen35_27b(2048, 32)
    gpus = hardware(8, 8, "h100-sxm", {})
    found = [estimate(c, work, gpus, Assumptions())
             for c in enumerate_candidates(space(work, gpus, 24, 16), (1,), 1)
             if c.ranks == 8 and c.kind == HOMOGENEOUS and not c.recompute]
    fitting = {(e.candidate.language.tp, e.candidate.language.pp) for e in found
               if e.memory.fits}
    assert fitting <= {(8, 1), (4, 2)}
    assert all(e.memory.peak > 0.85 * e.memory.capacity for e in found)


def test_the_pick_on_three_nodes_beats_the_best_homogeneous_layout():
    work = qwen35_27b(2048, 32)
    advice = advise(enumerate_candidates(space(work, THREE_NODES, 24, 16), homogeneous_fewest=1),
                    [], work, THREE_NODES, Assumptions())
    best = advice.ranked[0]
    assert 17 <= best.candidate.ranks <= 24 and best.candidate.kind != HOMOGENEOUS
    assert advice.gain(best) > 0
    assert advice.baseline.candidate.ranks == 16
