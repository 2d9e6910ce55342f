"""HF checkpoints imported into stock GPT models give transformers' own logits (fp32, CPU)."""

from __future__ import annotations

import pytest

from tests.hf_models import hf_logits, rel_diff, save_tiny, stock_gpt_rank
from tests.multiprocess import run_in_processes

TOLERANCE = 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_one_rank_import_reproduces_transformers_logits(family, tmp_path):
    folder = save_tiny(family, tmp_path / family)
    [result] = run_in_processes(stock_gpt_rank, 1, args=(str(folder), 1, 1, []), timeout=120)
    assert result["family"] == family
    assert result["padded_vocab"] == 128  # 100 HF rows padded to Megatron's multiple of 128
    want = hf_logits(folder)
    got = result["logits"]
    assert abs(got[..., 100:]).max() == 0  # padded rows are zero
    assert rel_diff(got[..., :100], want) < TOLERANCE
