"""Audio-encoder families: the HF Whisper encoder <-> :class:`~megatron_plugins.encoders.whisper.
WhisperNetwork`, and the Qwen2.5-Omni and Qwen3-Omni audio towers with their projections.

Megatron names are relative to the encoder network, local spec first; the Transformer Engine spec
fuses the pre-attention / pre-MLP LayerNorms into ``linear_qkv`` / ``linear_fc1``, named here too.
HF names are those of a transformers 5 ``WhisperEncoder`` save; a ``WhisperModel`` has them under
``encoder.``, a ``WhisperForConditionalGeneration`` under ``model.encoder.``, and the decoder in
those folders is another model's (``unused``). HF's key projection has no bias; Megatron's fused
qkv bias has a key part, held at zero (``absent_zero``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from megatron_plugins.parallel.module_values import module_values
from megatron_plugins.weights.mapping import (
    PROJECTION,
    TOWER,
    Family,
    HFWeightsError,
    Rule,
    norm_rules,
)

__all__ = ["QWEN2_5_OMNI_AUDIO", "QWEN2_5_OMNI_AUDIO_MODEL_TYPE", "QWEN3_OMNI_AUDIO",
           "QWEN3_OMNI_AUDIO_MODEL_TYPE", "WHISPER_ENCODER", "WHISPER_MODEL_TYPE",
           "whisper_source_config"]

WHISPER_MODEL_TYPE = "whisper"

LAYER = "decoder.layers.{layer}."
HF_LAYER = "layers.{layer}."


def _qkv(part: str) -> tuple[str, str, str]:
    return tuple(f"{HF_LAYER}self_attn.{x}_proj.{part}" for x in "qkv")


LAYER_RULES = (
    *norm_rules(f"{LAYER}input_layernorm", f"{HF_LAYER}self_attn_layer_norm"),
    *norm_rules(f"{LAYER}self_attention.linear_qkv", f"{HF_LAYER}self_attn_layer_norm", te=True),
    Rule(f"{LAYER}self_attention.linear_qkv.weight", _qkv("weight"), "qkv", tp_dim=0),
    Rule(f"{LAYER}self_attention.linear_qkv.bias", _qkv("bias"), "qkv", tp_dim=0,
         absent_zero=(1,)),
    Rule(f"{LAYER}self_attention.linear_proj.weight", (f"{HF_LAYER}self_attn.out_proj.weight",),
         tp_dim=1),
    Rule(f"{LAYER}self_attention.linear_proj.bias", (f"{HF_LAYER}self_attn.out_proj.bias",)),
    *norm_rules(f"{LAYER}pre_mlp_layernorm", f"{HF_LAYER}final_layer_norm"),
    *norm_rules(f"{LAYER}mlp.linear_fc1", f"{HF_LAYER}final_layer_norm", te=True),
    Rule(f"{LAYER}mlp.linear_fc1.weight", (f"{HF_LAYER}fc1.weight",), tp_dim=0),
    Rule(f"{LAYER}mlp.linear_fc1.bias", (f"{HF_LAYER}fc1.bias",), tp_dim=0),
    Rule(f"{LAYER}mlp.linear_fc2.weight", (f"{HF_LAYER}fc2.weight",), tp_dim=1),
    Rule(f"{LAYER}mlp.linear_fc2.bias", (f"{HF_LAYER}fc2.bias",)),
)
"""A Whisper-style encoder layer (Whisper's, Qwen2.5-Omni's audio tower's): pre-LN, no key
bias."""

CONVOLUTIONS = tuple(Rule(f"conv{n}.{p}", (f"conv{n}.{p}",)) for n in (1, 2)
                     for p in ("weight", "bias"))

RULES = (
    *CONVOLUTIONS,
    Rule("embed_positions", ("embed_positions.weight",)),
    *LAYER_RULES,
    *norm_rules("decoder.final_layernorm", "layer_norm"),
)

OTHER_MODEL = (r"(model\.)?decoder\.", r"proj_out\.", r"projector\.", r"classifier\.",
               r"layer_weights$")
"""Tensors of a full Whisper model that are not the encoder: the text decoder and its output
layer, an audio classifier's head."""


def whisper_source_config(args: Any) -> tuple[Path, dict[str, Any]]:
    """The one ``--encoder-hf-weights`` Whisper folder and its config.json: what an export of the
    encoder takes its config from."""
    found = []
    folders = module_values(getattr(args, "encoder_hf_weights", None), "--encoder-hf-weights")
    for folder in map(Path, folders.values()):
        config = json.loads((folder / "config.json").read_text())
        if config.get("model_type") == WHISPER_MODEL_TYPE:
            found.append((folder, config))
    if len(found) != 1:
        raise HFWeightsError(f"--encoder-hf-weights: {len(found)} {WHISPER_MODEL_TYPE} folders "
                             "given; exporting its config.json needs exactly one")
    return found[0]


def _no_stock_flags(config: Mapping[str, Any]) -> dict[str, Any]:
    """The encoder is shaped by its provider from ``config.json``, not by stock flags."""
    return {}


def _encoder_config(args: Any, vocab_size: int | None) -> dict[str, Any]:
    """The run's Whisper config.json as an encoder-only save's (``WhisperEncoder``): the export
    writes the tensors without prefix, as that class saves them."""
    config = dict(whisper_source_config(args)[1])
    config["architectures"] = ["WhisperEncoder"]
    return config


WHISPER_ENCODER = Family(
    name="whisper_encoder",
    architectures=("WhisperEncoder", "WhisperModel", "WhisperForConditionalGeneration",
                   "WhisperForAudioClassification"),
    model_type=WHISPER_MODEL_TYPE,
    rules=RULES,
    megatron_args=_no_stock_flags,
    hf_config=_encoder_config,
    unused=OTHER_MODEL,
    hf_prefixes=("", "model.encoder.", "encoder."),
)


def _with_projection(tower: Iterable[Rule], projection: Iterable[Rule]) -> tuple[Rule, ...]:
    """A family's rules when it includes the projection: the tower's under :data:`TOWER`, the
    projection's under :data:`PROJECTION`."""
    return (*(dataclasses.replace(rule, megatron=TOWER + rule.megatron) for rule in tower),
            *(dataclasses.replace(rule, megatron=PROJECTION + rule.megatron)
              for rule in projection))


QWEN2_5_OMNI_AUDIO_MODEL_TYPE = "qwen2_5_omni_audio_encoder"


def _inside_whole_folder(model: str) -> Callable[[Any, int | None], dict[str, Any]]:
    """``hf_config`` of an Omni audio tower: it lives inside its ``model``'s whole folder, which
    is exported as one (``--hf-model``, ``tools/export_hf``), so it has no folder of its own."""
    def refuse(args: Any, vocab_size: int | None) -> dict[str, Any]:
        raise HFWeightsError(f"the {model} audio tower is exported inside its whole folder "
                             "(--hf-model); it has no folder of its own")
    return refuse


QWEN2_5_OMNI_AUDIO = Family(
    name="qwen2_5_omni_audio",
    architectures=("Qwen2_5OmniAudioEncoder",),
    model_type=QWEN2_5_OMNI_AUDIO_MODEL_TYPE,
    # ln_post and proj map the pooled tower output to the language width: the projection.
    rules=_with_projection((*CONVOLUTIONS, *LAYER_RULES),
                           (*norm_rules("ln_post", "ln_post"),
                            *(Rule(f"proj.{p}", (f"proj.{p}",)) for p in ("weight", "bias")))),
    megatron_args=_no_stock_flags,
    hf_config=_inside_whole_folder("Qwen2.5-Omni"),
    # The audio bos / eos embeddings are read by no forward of the thinker (no gradient in HF).
    untrained=(r"audio_bos_eos_token\.",),
)
"""Qwen2.5-Omni's audio tower (``Qwen2_5OmniAudioEncoder``): Whisper's layers, its two
convolutions and, as the projection, ``ln_post`` + ``proj``; its sinusoidal positions are a
buffer HF does not save."""


QWEN3_OMNI_AUDIO_MODEL_TYPE = "qwen3_omni_moe_audio_encoder"


QWEN3_OMNI_AUDIO = Family(
    name="qwen3_omni_audio",
    architectures=("Qwen3OmniMoeForConditionalGeneration",
                   "Qwen3OmniMoeThinkerForConditionalGeneration"),
    model_type=QWEN3_OMNI_AUDIO_MODEL_TYPE,
    rules=_with_projection(
        (*(Rule(f"conv2d{n}.{p}", (f"conv2d{n}.{p}",)) for n in (1, 2, 3)
           for p in ("weight", "bias")),
         Rule("conv_out.weight", ("conv_out.weight",)),
         # Unlike Whisper's, AuT's key projection has a bias.
         *(dataclasses.replace(rule, absent_zero=()) for rule in LAYER_RULES)),
        # ln_post, proj1 and proj2 map the tower output to the language width: the projection.
        (*norm_rules("ln_post", "ln_post"),
         *(Rule(f"proj{n}.{p}", (f"proj{n}.{p}",)) for n in (1, 2) for p in ("weight", "bias")))),
    megatron_args=_no_stock_flags,
    hf_config=_inside_whole_folder("Qwen3-Omni"),
    # The rest of the folder: the thinker's language model and vision tower, the talker, code2wav.
    unused=(r"(?!(thinker\.)?audio_tower\.)",),
    hf_prefixes=("thinker.audio_tower.", "audio_tower."),
)
"""Qwen3-Omni's audio tower (``Qwen3OmniMoeAudioEncoder``, AuT) as a whole Qwen3-Omni-MoE folder
(``thinker.audio_tower.``) or a thinker-only save (``audio_tower.``) names it: three Conv2d and
``conv_out``, Whisper's layers with a key bias and, as the projection, ``ln_post`` + ``proj1`` +
``proj2``; its sinusoidal positions are a buffer HF does not save."""
