"""LoRA'd language models and encoders (rank-2 adapters, the base frozen) on a real microbatch,
forward and backward under ``FlopCounterMode``, next to what :mod:`megatron_plugins.flops` says
(:class:`~megatron_plugins.flops.count.Adapters`): one CPU-simulation rank, as
:mod:`tests.harness.flops_cases` runs the other families.
"""

from __future__ import annotations

from pathlib import Path

from megatron_plugins.peft.flags import ATTENTION, GATED_DELTA_NET, MLP
from tests.harness.flops_cases import (
    BEFORE,
    MOE,
    PACK,
    QWEN3_5,
    SHARED,
    Row,
    _adapt,
    _audio,
    _encoder_row,
    _groups,
    _images,
    _language,
    _language_row,
    flag_plugin,
)

LORA_LANGUAGE_CASES = [
    ("LoRA", "attention + MLP, nothing trains before", ["--swiglu"], ATTENTION + MLP),
    ("LoRA", "attention only, GQA", ["--group-query-attention", "--num-query-groups", "2"],
     ATTENTION),
    ("LoRA", "linear_proj + linear_fc2: the gradient starts mid-layer", [PACK],
     ("linear_proj", "linear_fc2")),
    ("LoRA", "linear_fc1 only, a trained encoder before", [BEFORE], ("linear_fc1",)),
    ("LoRA", "attention, MoE + shared expert, 1 MTP layer", [*MOE, *SHARED, "--mtp-num-layers",
                                                             "1"], ATTENTION),
    ("LoRA", "MoE routed and shared experts' MLPs: the gradient starts at the experts",
     [*MOE, *SHARED], MLP),
    ("LoRA", "attention + MoE experts' MLPs", MOE, ATTENTION + MLP),
    ("LoRA", "hybrid -*: the gradient starts in layer 1", ["--hybrid-layer-pattern=-*"],
     ("linear_qkv",)),
    ("LoRA", "Qwen3.5 MLP: the gradient starts past the Gated DeltaNet mixer", QWEN3_5, MLP),
    ("LoRA", "Qwen3.5 attention, packed: the Gated DeltaNet layer runs forward only",
     [*QWEN3_5, PACK], ATTENTION),
    ("LoRA", "Qwen3.5 Gated DeltaNet in_proj + out_proj: the gradient starts at in_proj",
     QWEN3_5, GATED_DELTA_NET),
    ("LoRA", "Qwen3.5 out_proj + linear_fc2: the gradient starts past the mixing", QWEN3_5,
     ("out_proj", "linear_fc2")),
]
"""(family, case, flags, targets) of each LoRA'd language row."""


def _parameters_row(case: str, flags: list[str], targets: tuple[str, ...]) -> Row:
    """The advisor's count of the adapters' parameters
    (:meth:`~megatron_plugins.performance.workload.TransformerShape.adapter_params`, routed
    experts' included) against the adapted model's."""
    from megatron_plugins.performance.workload import TransformerShape

    model, config, _ = _language(flags)
    adapters = _adapt(model, "language", targets)
    held = sum(p.numel() for name, p in model.named_parameters() if ".lora_" in name)
    return Row("LoRA parameters", case, sum(TransformerShape.of(config).adapter_params(adapters)),
               held)


def lora_rows(folder: str) -> list[Row]:
    """LoRA'd language models (:data:`LORA_LANGUAGE_CASES`) and encoders, parts frozen,
    adapted or trained, HF folders saved under ``folder``."""
    from megatron_plugins.encoders.vit import ViTEncoder
    from tests.models.hf_whisper import plugin as whisper_plugin
    from tests.models.hf_whisper import save_tiny as save_whisper

    _groups()
    rows = [_language_row(family, case, flags, targets)
            for family, case, flags, targets in LORA_LANGUAGE_CASES]
    rows += [_parameters_row(case, flags, targets)  # the advisor's shape: no MTP, no pattern
             for _, case, flags, targets in LORA_LANGUAGE_CASES
             if not any(flag.startswith(("--mtp", "--hybrid")) for flag in flags)]
    native = flag_plugin(ViTEncoder, "vit", ["--vit-native-resolution", "--vit-num-layers", "2"])
    images = _images((20, 30), (16, 16), (37, 11))
    for freeze, lora in (((), ("encoder",)), ((), ("encoder", "projection")),
                         (("encoder",), ("projection",)), ((), ("projection",))):
        case = " + ".join([*(f"{part} LoRA" for part in lora),
                           *(f"{part} frozen" for part in freeze)])
        rows.append(_encoder_row("LoRA vit", case, native, images, 24, freeze, lora))
    whisper = whisper_plugin(save_whisper(Path(folder) / "whisper"))
    rows.append(_encoder_row("LoRA whisper", "encoder LoRA after its two convolutions", whisper,
                             [_audio(0.4)], 24, lora=("encoder",)))
    return rows
