"""LoRA beside parts trained in full, exported in PEFT's format: ``PeftModel.from_pretrained``
of the adapters folder on transformers' model of the original folder gives the merged folder's
logits on a sample with images (1e-5, fp32), because what the run trained in full travels with the
adapters as PEFT's ``modules_to_save``.

One whole-VLM family per usual recipe, one step at one rank per module (LoRA's layout invariance
is tested elsewhere): Qwen3-VL with the language model and the tower adapted, its merger and
DeepStack mergers trained (the projection); Qwen2.5-VL with the language model adapted, its tower
and merger trained (saved as one module); LLaVA with the language model adapted and the CLIP tower
trained, its projector frozen (the tower's layers past the feature layer stay the base's). The
other family / recipe pairs are ``tests/unit_tests/test_peft_modules_to_save.py``'s.

Qwen3.5 with every language linear adapted, Gated DeltaNet's fused ``in_proj`` and ``out_proj``
among them, trained at language TP 2 (the LoRA layout test's runs): the adapters carry them under
transformers' names and load onto transformers' model with the trained model's logits.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.models.hf import rel_diff, safetensors_of
from tests.models.hf_vlm import check_export, save_tiny_llava, vlm_train
from tests.models.peft_vlm import load, logits, model_inputs
from tests.models.qwen3_5_whole import lora_runs
from tests.models.qwen3_vlm import save_tiny_qwen3_vl
from tests.models.qwen_vlm import save_tiny_qwen_vl

pytestmark = pytest.mark.multirank

TOLERANCE = 1e-5
GRIDS = ("image:dp=1", "language:dp=1")
LANGUAGE_LORA = ("--lora", "language:rank=4,alpha=8")
CASES: dict[str, tuple[Callable[[Path], Path], tuple[str, ...], list[str]]] = {
    "qwen3_vl-tower-adapted-projection-trained": (
        save_tiny_qwen3_vl,
        (*LANGUAGE_LORA, "--lora", "image:rank=2,alpha=4", "--module-lr", "image=5e-3"),
        ["model.visual.deepstack_merger_list.0", "model.visual.deepstack_merger_list.1",
         "model.visual.merger"]),
    "qwen2_5_vl-tower-and-projection-trained": (save_tiny_qwen_vl, LANGUAGE_LORA,
                                                ["model.visual"]),
    "llava-tower-trained-projection-frozen": (
        save_tiny_llava, (*LANGUAGE_LORA, "--freeze-projection", "image"),
        ["model.vision_tower.embeddings", "model.vision_tower.encoder.layers.0",
         "model.vision_tower.pre_layrnorm"]),
}
"""Test id: the tiny folder, the run's flags, the modules the adapters folder saves whole."""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_the_peft_adapters_carry_what_the_run_trained_in_full(case, tmp_path):
    from tools.export_hf import export

    save, flags, saved_whole = CASES[case]
    folder = save(tmp_path / "hf")
    vlm_train(2, folder, GRIDS, (*flags, "--train-iters", "1", "--eval-iters", "0", "--save",
                                 str(tmp_path / "lora"), "--save-interval", "1"))
    out = tmp_path / "out"
    export(tmp_path / "lora", out, progress=False)
    config = json.loads((out / "adapters" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == saved_whole
    base = load(folder)
    before = base.state_dict()
    for module in saved_whole:  # each trained: its saved tensors moved
        prefix = f"base_model.model.{module}."
        assert any(not torch.equal(tensor, before[name.removeprefix("base_model.model.")])
                   for name, tensor in safetensors_of(out / "adapters").items()
                   if name.startswith(prefix)), module
    inputs = model_inputs(folder)
    merged = logits(load(out), inputs)
    assert rel_diff(logits(base, inputs), merged) > 1e-3  # the run moved the model
    difference = rel_diff(logits(load(folder, out / "adapters"), inputs), merged)
    print(f"\n{case}: PEFT adapters vs merged export, max relative logits difference "
          f"{difference:.2e}")
    assert difference < TOLERANCE


@pytest.mark.timeout(900)
def test_gated_delta_net_adapters_trained_at_tp2_load_in_peft_with_the_trained_logits():
    """The language TP 2 run's export: its adapters name transformers' Gated DeltaNet linears
    (``in_proj_qkv`` / ``_z`` / ``_b`` / ``_a`` split from Megatron's fused ``in_proj``,
    ``out_proj``), the merged folder is the trained model as its ranks streamed it (each merging
    its own shards, not read from the checkpoint), and PEFT's adapters on the original folder give
    that folder's logits."""
    root, pieces = lora_runs()
    folder, out = root / "hf", root / "out_language-tp2"
    config = json.loads((out / "adapters" / "adapter_config.json").read_text())
    layer = "model.language_model.layers.0.linear_attn."
    assert {f"{layer}{linear}" for linear in ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                              "in_proj_a", "out_proj")} <= set(
        config["target_modules"])
    assert config["modules_to_save"] is None
    check_export(out, folder, pieces, ("model.visual.",))
    inputs = model_inputs(folder)
    merged = logits(load(out), inputs)
    assert rel_diff(logits(load(folder), inputs), merged) > 1e-3  # the run moved the model
    difference = rel_diff(logits(load(folder, out / "adapters"), inputs), merged)
    print(f"\nqwen3_5 Gated DeltaNet LoRA at language TP 2: PEFT adapters vs merged export, max "
          f"relative logits difference {difference:.2e}")
    assert difference < TOLERANCE
