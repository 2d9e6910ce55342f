"""The PEFT-format adapters folder carries what a LoRA run trained in full, for every whole-VLM
family and usual recipe: the export's writer (``tools.export_hf.write_adapters``) given a merged
folder, its adapters and the tensors trained in full (made here, no training run: a real run per
family is ``tests/functional_tests/test_lora_peft_export.py``'s) writes a folder that
``peft.PeftModel.from_pretrained`` puts on transformers' model of the base folder to give the
merged folder's logits on a sample with images (1e-5, fp32). A tied input embedding trained in
full is saved alone and tied again by PEFT; what PEFT cannot carry is one line and no folder.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.models.hf import rel_diff, safetensors_of
from tests.models.hf_vlm import save_tiny_llava
from tests.models.llava_next import save_tiny_llava_next
from tests.models.peft_vlm import load, logits, model_inputs
from tests.models.qwen3_vlm import save_tiny_qwen3_vl
from tests.models.qwen_vlm import save_tiny_qwen_vl

TOLERANCE = 1e-5
CLIP_PARTS = (("tower", r"vision_tower\."), ("language", r"language_model\."))
FAMILIES: dict[str, tuple[Callable[[Path], Path], tuple[tuple[str, str], ...]]] = {
    "qwen2_5_vl": (save_tiny_qwen_vl, (("projection", r"visual\.merger\.mlp\."),
                                       ("tower", r"visual\."), ("language", ""))),
    "qwen3_vl": (save_tiny_qwen3_vl, (
        ("projection", r"model\.visual\.(merger|deepstack_merger_list)\."),
        ("tower", r"model\.visual\."), ("language", ""))),
    "llava": (save_tiny_llava, (("projection", r"multi_modal_projector\."), *CLIP_PARTS)),
    "llava_tied": (lambda folder: save_tiny_llava(folder, tie_word_embeddings=True),
                   (("projection", r"multi_modal_projector\."), *CLIP_PARTS)),
    "llava_next": (save_tiny_llava_next,
                   (("projection", r"(multi_modal_projector\.|image_newline$)"), *CLIP_PARTS)),
}
"""Each tiny folder and its parts: (part, pattern of its saved tensor names), first match wins
(Qwen2.5-VL's merger norm ``ln_q`` is the tower's, as the encoder holds it)."""
BASE_KEPT = re.compile(r"vision_tower\.(encoder\.layers\.1\.|post_layernorm\.)")
"""The CLIP tower past LLaVA's feature layer: the encoder does not hold it; exports keep the
base's."""
ADAPTED = re.compile(r"\.(blocks|layers)\.\d+\.\w+\.(\w+_proj|qkv|proj|fc[12]|linear_fc[12])"
                     r"\.weight$")
"""The linears LoRA adapts in an adapted part: its blocks' attention and MLP."""
BLOCKS = ["model.visual.blocks.0", "model.visual.blocks.1", "model.visual.blocks.2"]
CLIP_TRAINED = ["model.vision_tower.embeddings", "model.vision_tower.encoder.layers.0",
                "model.vision_tower.pre_layrnorm"]
LANGUAGE = ["model.language_model.embed_tokens", "model.language_model.layers.0",
            "model.language_model.layers.1", "model.language_model.norm"]
CASES = {
    "qwen2_5_vl-tower-adapted-projection-trained": (
        "qwen2_5_vl", ("language", "tower"), ("projection",), ["model.visual.merger.mlp"]),
    "qwen2_5_vl-tower-trained-projection-frozen": (
        "qwen2_5_vl", ("language",), ("tower",),
        [*BLOCKS, "model.visual.merger.ln_q", "model.visual.patch_embed"]),
    "qwen3_vl-tower-and-projection-trained": (
        "qwen3_vl", ("language",), ("tower", "projection"), ["model.visual"]),
    "qwen3_vl-tower-trained-projection-frozen": (
        "qwen3_vl", ("language",), ("tower",),
        [*BLOCKS, "model.visual.patch_embed", "model.visual.pos_embed"]),
    "llava-tower-adapted-projection-trained": (
        "llava", ("language", "tower"), ("projection",), ["model.multi_modal_projector"]),
    "llava-tower-and-projection-trained": (
        "llava", ("language",), ("tower", "projection"),
        ["model.multi_modal_projector", *CLIP_TRAINED]),
    "llava-tied-language-and-projection-trained": (
        "llava_tied", ("tower",), ("language", "projection"),
        [*LANGUAGE, "model.multi_modal_projector"]),
}
"""Test id: family, adapted parts, parts trained in full, the modules saved whole. With the run's
tests (one recipe per family), every recipe on every family."""


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Callable[[str], Path]:
    """Each family's tiny folder, saved once when first asked for."""
    root, saved = tmp_path_factory.mktemp("peft_families"), {}

    def folder(family: str) -> Path:
        if family not in saved:
            saved[family] = FAMILIES[family][0](root / family)
        return saved[family]

    return folder


def trained_beside_lora(folder: Path, family: str, adapted: tuple[str, ...],
                        trained: tuple[str, ...], out: Path) -> tuple[dict, set, list]:
    """A run's export made by hand: the ``trained`` parts' tensors moved, adapters on the
    ``adapted`` parts' linears; the merged folder written to ``out``. Returns the merged tensors,
    the names trained in full and the adapters."""
    from safetensors.torch import save_file

    from megatron_plugins.peft.export import HFAdapter, merge
    from megatron_plugins.peft.flags import LoraSpec

    generator = torch.Generator().manual_seed(0)
    tensors, moved, adapters = safetensors_of(folder), set(), []
    for name, tensor in sorted(tensors.items()):
        part = next(part for part, pattern in FAMILIES[family][1] if re.match(pattern, name))
        if BASE_KEPT.match(name):
            continue
        if part in trained:
            tensors[name] = tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
            moved.add(name)
        if part in adapted and ADAPTED.search(name):
            a = 0.1 * torch.randn(4, tensor.shape[1], generator=generator)
            b = 0.1 * torch.randn(tensor.shape[0], 4, generator=generator)
            spec = LoraSpec(part, 4, 8.0, 0.0, ())
            adapters.append(HFAdapter(name.removesuffix(".weight"), a, b, spec))
    merge(tensors, adapters)
    shutil.copytree(folder, out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return tensors, moved, adapters


def write(folder: Path, family: str, adapted: tuple[str, ...], trained: tuple[str, ...],
          out: Path) -> list[Path]:
    """The export's adapters writer on :func:`trained_beside_lora`'s export (``out/adapters``)."""
    from tools.export_hf import write_adapters

    tensors, moved, adapters = trained_beside_lora(folder, family, adapted, trained, out)
    config = json.loads((folder / "config.json").read_text())
    return write_adapters(out / "adapters", adapters, str(folder), config, tensors, moved)


@pytest.mark.parametrize("case", CASES)
def test_the_adapters_folder_gives_the_merged_folders_logits(case, folders, tmp_path):
    family, adapted, trained, saved_whole = CASES[case]
    folder, out = folders(family), tmp_path / "out"
    assert write(folder, family, adapted, trained, out)
    config = json.loads((out / "adapters" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == saved_whole
    assert config.get("ensure_weight_tying", False) == (family == "llava_tied")
    inputs = model_inputs(folder)
    difference = rel_diff(logits(load(folder, out / "adapters"), inputs), logits(load(out), inputs))
    assert difference < TOLERANCE


@pytest.mark.parametrize("family, adapted, trained, why", [
    ("llava_next", ("language",), ("projection",),
     "the run trained model.image_newline in full, and PEFT saves such tensors as whole modules "
     "(modules_to_save), but its module model also holds the adapted linear "
     "model.language_model.layers.0.mlp.down_proj"),
    ("qwen2_5_vl", ("language",), ("language",),
     "the adapted linear model.language_model.layers.0.mlp.down_proj's "
     "model.language_model.layers.0.mlp.down_proj.weight is not the base folder's (its frozen "
     "weights came from init or a Megatron checkpoint), and PEFT adds adapters to the base "
     "folder's weights"),
], ids=["a-bare-parameter-beside-adapters", "adapters-on-weights-not-the-base-folders"])
def test_what_peft_cannot_carry_is_one_line_and_no_folder(family, adapted, trained, why, folders,
                                                          tmp_path, capsys):
    folder, out = folders(family), tmp_path / "out"
    capsys.readouterr()
    assert write(folder, family, adapted, trained, out) == []
    assert not (out / "adapters").exists()
    assert capsys.readouterr().err == (
        f"export_hf: notice: no PEFT-format adapters written to {out / 'adapters'}: {why}; the "
        "merged folder holds the trained model\n")


def test_expert_adapters_have_no_peft_layout_and_are_one_line(tmp_path, capsys):
    """An MoE expert's adapter (LoRA on the experts) has no linear of transformers' model to sit
    on, which fuses each layer's experts into one tensor: one line, no folder; the merged
    folder carries it."""
    from megatron_plugins.peft.export import HFAdapter
    from megatron_plugins.peft.flags import LoraSpec
    from tests.models.qwen3_5_whole import save_whole
    from tools.export_hf import write_adapters

    folder, out = save_whole(tmp_path / "moe", moe=True), tmp_path / "adapters"
    tensors = safetensors_of(folder)
    name = next(n for n in sorted(tensors) if n.endswith(".mlp.experts.1.up_proj.weight"))
    rows, columns = tensors[name].shape
    adapter = HFAdapter(name.removesuffix(".weight"), torch.ones(4, columns),
                        torch.ones(rows, 4), LoraSpec("language", 4, 8.0, 0.0, ()))
    config = json.loads((folder / "config.json").read_text())
    capsys.readouterr()
    assert write_adapters(out, [adapter], str(folder), config, tensors, set()) == []
    assert not out.exists()
    assert re.fullmatch(
        f"export_hf: notice: no PEFT-format adapters written to {re.escape(str(out))}: the "
        f"folder's {re.escape(name.removesuffix('.weight'))} is no linear layer of transformers' "
        r"model \(it holds it in \S+\.mlp\.experts\.gate_up_proj: MoE experts are fused "
        r"there\), and PEFT's LoRA adapts linear layers; the merged folder holds the trained "
        r"model\n", capsys.readouterr().err)
