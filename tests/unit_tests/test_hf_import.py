"""HF checkpoints imported into stock GPT models give transformers' own logits (fp32, CPU)."""

from __future__ import annotations

import pytest

from tests.hf_models import hf_logits, mimo_logits, rel_diff, save_tiny, stock_gpt_rank
from tests.multiprocess import run_in_processes

TOLERANCE = 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_one_rank_import_reproduces_transformers_logits(family, tmp_path):
    folder = save_tiny(family, tmp_path / family)
    [result] = run_in_processes(stock_gpt_rank, 1, args=(str(folder), 1, 1, []), timeout=120)
    assert result["family"] == family
    assert result["padded_vocab"] == 128  # 100 HF rows padded to Megatron's multiple of 128
    want = hf_logits(folder)
    got = result["logits"]
    assert abs(got[..., 100:]).max() == 0  # padded rows are zero
    assert rel_diff(got[..., :100], want) < TOLERANCE


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = save_tiny("llama", tmp_path_factory.mktemp("hf") / "llama")
    return folder, hf_logits(folder)


@pytest.mark.parametrize("grid", ["language:tp=2", "language:pp=2"])
def test_mimo_language_at_tp2_and_pp2_reproduces_transformers_logits(llama, grid):
    folder, want = llama
    logits = mimo_logits(3, str(folder), grid)
    assert len(logits) == (2 if "tp" in grid else 1)  # every TP rank of the last stage
    for got in logits:
        assert rel_diff(got[..., :100], want) < TOLERANCE


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    folder = save_tiny("qwen3_moe", tmp_path_factory.mktemp("hf") / "qwen3_moe")
    return folder, hf_logits(folder)


def test_qwen3_moe_at_ep2_reproduces_transformers_logits(qwen3_moe):
    folder, want = qwen3_moe
    logits = mimo_logits(3, str(folder), "language:dp=2,ep=2")
    assert len(logits) == 2  # both expert ranks ran every token through all 4 experts
    for got in logits:
        assert rel_diff(got[..., :100], want) < TOLERANCE
