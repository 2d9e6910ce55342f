"""The advisor on Qwen3.5-VL (Gated DeltaNet layers): its parameter count is the built model's,
its layouts are ones the launch accepts (no context parallelism, TP dividing the linear heads),
its activations count what a Gated DeltaNet layer keeps; it plans from a config-only folder,
which a launch still refuses."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from megatron_plugins.performance.candidates import enumerate_candidates
from megatron_plugins.performance.gpus import hardware
from megatron_plugins.performance.workload import TransformerShape
from tests.models.advisor import language_config, qwen35_27b, space
from tests.models.hf import built_then
from tests.harness.multiprocess import REPO_ROOT
from tests.models.hf_vlm import bad_input, vlm_flags
from tests.models.qwen3_5_whole import save_whole

H100 = hardware(8, 8, "h100-sxm", {})
GRIDS = ("image:dp=1", "language:tp=2")
"""The tiny model's layout: its language model split over TP (expert TP 1: every TP rank holds
the routed experts whole)."""
VOCAB = ["--make-vocab-size-divisible-by", "1"]
"""The vocabulary unpadded at any TP (the advisor pads it as for its probe's TP 1)."""


def _language_params(session: Any, mimo: Any) -> dict[str, int]:
    """This rank's language-model parameters the advisor models (layer norms left out): those
    split over TP, and those every TP rank holds whole (replicated ones, the routed experts)."""
    model = mimo.language_model
    if model is None:
        return {}
    counts = {"split": 0, "whole": 0}
    for name, param in model.named_parameters():
        if "layernorm" not in name:
            split = getattr(param, "tensor_model_parallel", False) and ".experts." not in name
            counts["split" if split else "whole"] += param.numel()
    return counts


@pytest.mark.multirank
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_the_advisor_counts_a_qwen3_5_language_model_as_built(moe, tmp_path):
    from megatron_plugins.launch.advise import advisor_flags, plan_inputs
    from tests.harness.multiprocess import run_in_processes

    argv = [*vlm_flags(save_whole(tmp_path / "folder", moe=moe), GRIDS), *VOCAB]
    own, rest = advisor_flags(["--gpus", "3", "--advise-item-tokens", "image=4", *argv])
    language = plan_inputs(own, rest).workload.language
    assert language.shape.linear_layers == 2 and language.shape.linear is not None
    ranks = [rank for rank in run_in_processes(built_then, 3, args=(argv, _language_params),
                                               timeout=240, simulated=True) if "split" in rank]
    assert len(ranks) == 2 and ranks[0]["whole"] == ranks[1]["whole"]
    assert language.params == sum(rank["split"] for rank in ranks) + ranks[0]["whole"]


def test_a_launch_still_needs_the_weights_a_plan_does_without(monkeypatch):
    config_only = REPO_ROOT / "examples/mimo/recipes/qwen3_5_vl/qwen3_5_vl_27b_config"
    assert bad_input(vlm_flags(config_only, ("image:dp=1", "language:dp=1")), monkeypatch) == (
        f"--hf-model {config_only}: neither model.safetensors nor "
        "model.safetensors.index.json is there")


def test_the_advisors_layouts_for_gated_delta_net_split_no_sequence_and_no_linear_head():
    workload = qwen35_27b(4096, 32)
    plain = list(enumerate_candidates(space(workload, H100, 24, 16)))
    linear = list(enumerate_candidates(replace(space(workload, H100, 24, 16),
                                               linear_heads=(16, 12))))
    assert any(candidate.language.cp > 1 for candidate in plain)
    assert linear and all(candidate.language.cp == 1 for candidate in linear)
    assert {candidate.language.tp for candidate in linear} == {1, 2, 4}
    assert {candidate.language.tp for candidate in plain} == {1, 2, 4, 8}


def test_a_gated_delta_net_layer_keeps_its_rule_inputs_not_attentions():
    gdn = dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=[1, 0],
               linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=4)
    attention = TransformerShape.of(language_config(num_layers=2, hidden_size=32,
                                                    num_attention_heads=4, ffn_hidden_size=64))
    hybrid = TransformerShape.of(language_config(num_layers=2, hidden_size=32,
                                                 num_attention_heads=4, ffn_hidden_size=64, **gdn))
    assert (hybrid.linear_layers, attention.linear_layers) == (1, 0)
    values, channels = 4 * 16, 2 * 2 * 8 + 4 * 16
    in_proj = channels + values + 2 * 4
    assert hybrid.params - attention.params == (
        32 * in_proj + channels * 4 + 2 * 4 + 16 + values * 32 - attention.attention_params)
    # Per token, a Gated DeltaNet layer's mixer: its norm, in_proj's and the convolution's
    # outputs, q, k (at the value heads), v, g, beta and the 64-wide chunk matrix per value head,
    # the rule's and the gated norm's outputs; the layers averaged.
    mixer = 2 * 32 + in_proj + channels + 4 * (2 * 8 + 16 + 2 + 64) + 2 * values
    query = 32
    assert hybrid.activation_elements(1) - attention.activation_elements(1) == pytest.approx(
        (mixer - (2 * 32 + 2 * query + 2 * query)) / 2)
