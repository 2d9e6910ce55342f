"""Gated DeltaNet bridge (Gap 30): stock refuses to build the layer without
flash-linear-attention; the bridge binds the reference kernels once, and nothing where the package
is installed. The layer's numbers on those kernels: tests/unit_tests/test_gated_delta_rule.py."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from megatron_plugins.compat import gated_delta_net, installed
from megatron_plugins.ops import gated_delta_rule
from tests.harness import gated_delta_net as layers

KERNELS = ("causal_conv1d", "l2norm", "chunk_gated_delta_rule")
ONE_RANK = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
"""What the layer's config reads of its process groups before it checks for the kernels."""


@pytest.fixture
def stock_kernels(monkeypatch):
    """megatron's gated_delta_net modules as imported; whatever a test bridges is undone."""
    from megatron.core.ssm import gated_delta_net as package
    from megatron.core.ssm.gated_delta_net import common, gdn

    layers.undo_bridge_after_test(monkeypatch)
    return package, common, gdn


@pytest.mark.skipif(importlib.util.find_spec("fla") is not None,
                    reason="flash-linear-attention is installed here")
def test_gap30_canary_stock_gated_delta_net_refuses_to_build_without_flash_linear_attention(
        stock_kernels):
    """Gap 30: without flash-linear-attention the kernels are None and the layer refuses."""
    _, common, gdn = stock_kernels
    assert not common.HAVE_FLA
    assert common.chunk_gated_delta_rule is None and gdn.causal_conv1d is None
    with pytest.raises(ImportError, match="FLA is not installed"):
        layers.megatron_layer(ONE_RANK)


@pytest.mark.skipif(importlib.util.find_spec("fla") is not None,
                    reason="flash-linear-attention is installed here")
def test_gap30_bridge_binds_the_reference_kernels_once(stock_kernels):
    package, common, gdn = stock_kernels
    gated_delta_net.use_reference_gdn_kernels()
    assert common.HAVE_FLA and package.HAVE_FLA
    for module in stock_kernels:
        for name in KERNELS:
            if hasattr(module, name):
                assert getattr(module, name) is getattr(gated_delta_rule, name), (module, name)
    assert not hasattr(gdn, "l2norm")  # gdn.py reads it through common's methods
    assert installed() == ("30",)
    gated_delta_net.use_reference_gdn_kernels()
    assert installed() == ("30",)


def test_gap30_bridge_leaves_flash_linear_attention_in_place(stock_kernels, monkeypatch):
    package, common, gdn = stock_kernels
    triton_kernels = {name: object() for name in KERNELS}
    for module in stock_kernels:
        for name, kernel in triton_kernels.items():
            if hasattr(module, name):
                monkeypatch.setattr(module, name, kernel)
    monkeypatch.setattr(common, "HAVE_FLA", True)
    gated_delta_net.use_reference_gdn_kernels()
    assert common.chunk_gated_delta_rule is triton_kernels["chunk_gated_delta_rule"]
    assert gdn.causal_conv1d is triton_kernels["causal_conv1d"]
    assert installed() == ()
