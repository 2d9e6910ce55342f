"""Language context parallelism splits the activations each language rank keeps for backward.

A user turns on ``--grid language:cp=2`` to fit longer sequences: on a 1024-token row each CP
rank must keep well under the cp=1 rank's saved-for-backward bytes, in total, in the layers'
attention and in the rest of the language model. The last check is the sharp one (attention
dominates the total): a CP split that leaves every rank the whole row keeps it at 1.0 x cp=1.
"""

from __future__ import annotations

import pytest

from tests.harness.activation_memory import measure

pytestmark = pytest.mark.multirank

SEQ_LENGTH = 1024
MOST = 0.6
"""Upper bound of a CP rank's bytes over the cp=1 rank's; an even split is 0.5 or less."""


def test_language_cp2_ranks_each_keep_about_half_the_activations_of_cp1() -> None:
    [whole] = measure(SEQ_LENGTH, cp=1)
    halves = measure(SEQ_LENGTH, cp=2)
    assert [r["cp_rank"] for r in halves] == [0, 1]
    reference = whole["saved"]
    for rank in halves:
        saved = rank["saved"]
        assert sum(saved.values()) <= MOST * sum(reference.values()), (saved, reference)
        assert saved["language"] <= MOST * reference["language"], (saved, reference)
        assert saved["attention"] <= MOST * reference["attention"], (saved, reference)
