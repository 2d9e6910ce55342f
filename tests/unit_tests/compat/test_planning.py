"""Planning bridge (Gap 34): without Transformer Engine stock's config checks refuse a plain GPU
command line (RoPE fusion on by default); while planning they see a current Transformer Engine,
and afterwards this machine's own answers are back. ``mimo-plan`` on such a command line:
tests/unit_tests/test_plan.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_plugins import compat
from megatron_plugins.compat import MegatronCompatError, installed, planning

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                                reason="Transformer Engine is installed here")


def _config(**flags):
    """A stock TransformerConfig of one small layer with ``flags``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **flags)


GPU_FLAGS = {
    "rope fusion": dict(apply_rope_fusion=True),
    "moe permute fusion": dict(num_moe_experts=4, moe_permute_fusion=True),
    "fp8 moe": dict(num_moe_experts=4, fp8="hybrid", bf16=True, params_dtype=torch.bfloat16),
}
"""Flags a GPU command line gives that stock checks against this machine's Transformer Engine."""


def test_gap34_canary_stock_config_checks_ask_this_machine_for_transformer_engine():
    """Gap 34: without Transformer Engine the fused kernels stock probes for are None, its
    version reads 0.0.0, and the config refuses each of these GPU flags."""
    from megatron.core import utils
    from megatron.core.models.common.embeddings import rope_utils

    assert rope_utils.fused_apply_rotary_pos_emb is None
    assert not utils.is_te_min_version("1.4")
    for flags in GPU_FLAGS.values():
        with pytest.raises(ValueError, match="(not available|transformer-engine>=)"):
            _config(**flags)


def test_gap34_bridge_builds_the_gpu_config_and_restores_this_machine(monkeypatch):
    from megatron.core import utils
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.setattr(compat, "_recorded", set())
    with planning.transformer_engine_assumed():
        for flags in GPU_FLAGS.values():
            _config(**flags)
        assert utils.is_te_min_version(planning.PLANNED_TE_VERSION)
        with pytest.raises(MegatronCompatError, match="called while planning"):
            moe_utils.fused_permute()
    assert installed() == ("34",)
    assert moe_utils.fused_permute is None and not utils.is_te_min_version("1.4")
    with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
        _config(**GPU_FLAGS["rope fusion"])


def test_gap34_bridge_leaves_an_installed_transformer_engine_alone(monkeypatch):
    from megatron.core import utils
    from megatron.core.models.common.embeddings import rope_utils
    from packaging.version import Version

    kernel = object()
    monkeypatch.setattr(compat, "_recorded", set())
    monkeypatch.setattr(utils, "_te_version", Version("2.3.0"))
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", kernel)
    with planning.transformer_engine_assumed():
        assert rope_utils.fused_apply_rotary_pos_emb is kernel
        assert not utils.is_te_min_version(planning.PLANNED_TE_VERSION)
    assert installed() == ()
