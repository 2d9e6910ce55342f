"""What one layer keeps for its backward, measured by ``benchmarks/saved_bytes_per_layer.py`` at
small lengths: with the default fast attention the bytes grow linearly in the sequence length s,
with ``--reference-attention`` they carry an ``s^2`` term (at least one fp32 ``heads x s x s``
probability matrix), and the fast path keeps fewer bytes at every s. The language layer, the
built-in ViT's and a Qwen2.5-VL window layer (whose reference matrices are per window: linear in
s, and still more than the fast path's). If the local path silently fell back to the reference
attention, the fast rows would carry the ``s^2`` term and fail.

The layers are built and run on one CPU-simulation rank (the simulation patches its whole
process, so it cannot run in the test's own): a multirank test of one forked rank.
"""

from __future__ import annotations

import pytest

from benchmarks.saved_bytes_per_layer import (
    ELEMENT_BYTES,
    TP_FLAGS,
    fit,
    run_measure,
    run_measure_tp,
    second_difference,
)

LANGUAGE_LENGTHS = (256, 512, 768)
IMAGE_LENGTHS = (196, 676, 1156)
"""14^2, 26^2, 34^2 patches: square images of even sides (Qwen's 2 x 2 merge), equally spaced."""
LINEAR = 1e-6
"""Largest second difference of linear bytes, relative to the total: what is saved is exactly
proportional to s (measured: 0); a ``s^2`` term of one fp32 matrix per head is 2-4% here."""
WINDOWED = 1e-2
"""The same for the window layer's reference: its edge windows' matrices are not proportional to
s (measured: 3e-4)."""
LAYERS = ("language", "vit", "qwen2.5-vl window")
WHOLE_SEQUENCE = ("language", "vit")
"""Layers whose reference attention keeps ``s x s`` matrices (the window layer's: per window)."""


@pytest.mark.multirank
def test_the_fast_attention_keeps_bytes_linear_in_s_and_fewer_than_the_reference() -> None:
    cases = [(layer, reference,
              list(LANGUAGE_LENGTHS if layer == "language" else IMAGE_LENGTHS))
             for layer in LAYERS for reference in (False, True)]
    results = dict(zip([(layer, reference) for layer, reference, _ in cases],
                       run_measure(cases, timeout=600)))
    for layer in LAYERS:
        fast, reference = results[layer, False], results[layer, True]
        assert abs(second_difference(fast.points)) <= LINEAR, (layer, fast.points)
        heads = reference.shape.heads
        if layer in WHOLE_SEQUENCE:
            assert second_difference(reference.points) > 1000 * LINEAR, (layer, reference.points)
            # The s^2 coefficient, exactly: f(s0) - 2 f(s1) + f(s2) = 2 b step^2.
            s0, s1, s2 = sorted(reference.points)
            per_token2 = (reference.points[s0] - 2 * reference.points[s1]
                          + reference.points[s2]) / (2 * (s1 - s0) ** 2)
            assert per_token2 >= ELEMENT_BYTES * heads, (layer, reference.points)
        else:  # one window x window matrix per window; the images' edge windows are smaller
            assert abs(second_difference(reference.points)) <= WINDOWED, \
                (layer, reference.points)
        for tokens, kept in fast.points.items():
            assert kept < reference.points[tokens], (layer, tokens, fast.points,
                                                     reference.points)
        assert abs(fit(fast.points).per_token2) * max(fast.points) < LINEAR * \
            fit(fast.points).per_token, (layer, fast.points)


@pytest.mark.multirank
def test_sequence_parallelism_halves_what_the_norms_and_linear_inputs_keep_per_tp_rank() -> None:
    """The fast language layer at tp 2, on two ranks: with ``--sequence-parallel`` each rank's
    norms keep their input, statistics and output, and the column-parallel linears their input,
    for its half of the sequence: per token, half of tp 2's ``2 x (3 H + 1)`` elements kept
    whole (6,152 -> 3,076 bytes), less the other half of the ``s x H`` embedding output, which the
    first layer's input still views (stock's scatter slices it without a copy). Attention and MLP
    inner activations are split by heads either way. Both ranks keep the same bytes."""
    rank0, rank1 = run_measure_tp([256, 512], timeout=600)
    assert rank0 == rank1
    hidden = 256  # LANGUAGE_FLAGS' --hidden-size
    whole, split = (fit(rank0[name]).per_token for name in TP_FLAGS)
    for points in rank0.values():
        assert points[512] == 2 * points[256], points  # linear in s
    halved = 2 * (3 * hidden + 1) * ELEMENT_BYTES / 2
    assert whole - split == pytest.approx(halved - hidden * ELEMENT_BYTES / 2), (whole, split)
