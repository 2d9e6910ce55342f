"""Whole-VLM HF folders (``--hf-model DIR``) as data: one :class:`VLMFamily` per architecture.

A whole VLM folder holds three parts in one set of safetensors files: the vision tower, the
projector and the language model. An entry says which encoder provider builds the tower (its
``hf_family`` maps the tower's tensors), under which HF prefixes each part's tensors sit, how the
projector's tensors map onto the encoder's MiMo input projection, which language family maps the
language model and under which names, and where the checkpoint's image placeholder token and
feature selection are read from ``config.json``. :func:`part_families` turns an entry into one
:class:`~megatron_plugins.weights.mapping.Family` per MiMo module, so import and export run the
per-module machinery unchanged. A tower family that maps the projection too (Qwen2.5-VL's, whose
merger MLP is the projection) gives the projector its rules; the entry then lists none. No torch
import: the launch's pre-import checks read it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from megatron_plugins.weights.hf_config import read_config
from megatron_plugins.weights.language_families import FAMILIES as LANGUAGE_FAMILIES
from megatron_plugins.weights.language_families import QWEN3_OMNI_MOE as QWEN3_OMNI_MOE_LANGUAGE
from megatron_plugins.weights.mapping import Family, HFWeightsError, Rule, split_projection
from megatron_plugins.weights.qwen3_5_language import FAMILIES as QWEN3_5_LANGUAGE_FAMILIES

__all__ = ["FAMILIES", "HF_MODEL_FLAG", "LLAVA", "LLAVA_NEXT", "QWEN2_5_OMNI", "QWEN2_5_VL",
           "QWEN3_5_MOE_VL", "QWEN3_OMNI_MOE", "ExtraTower",
           "QWEN3_5_VL", "QWEN3_VL",
           "PartFamilies",
           "VLMFamily",
           "find_vlm",
           "language_family", "part_families", "projector_prefix", "read_vlm"]

HF_MODEL_FLAG = "--hf-model"


@dataclass(frozen=True)
class VLMFamily:
    """One whole-VLM architecture: which encoder and language family its parts are, and where."""

    name: str
    architectures: tuple[str, ...]
    encoder_provider: str
    """The ``--encoder NAME=PROVIDER`` provider building the tower; its ``hf_family`` maps it."""
    encoder_name: str
    """The encoder's default NAME (``--grid NAME:...`` addresses it)."""
    tower_prefixes: tuple[str, ...]
    """Prefixes of the tower's tensors before the tower family's own names (and its
    ``hf_prefixes``), one per naming scheme (a Hub save, a transformers 5 save); the first the
    folder uses wins."""
    projector_prefixes: tuple[str, ...]
    """Prefixes of the projector's tensors, as ``tower_prefixes``. Tensors under one are the
    projector's even inside a tower prefix (Qwen2.5-VL's ``visual.merger.mlp.``)."""
    projector_rules: tuple[Rule, ...]
    """Megatron names inside the encoder's ``input_projections`` (``0.`` is the projection),
    HF names after the projector prefix; empty when the tower family includes the projection
    (:func:`~megatron_plugins.weights.mapping.split_projection`), whose HF names are the
    tower's."""
    projector_input: tuple[str, int]
    """(HF tensor after the projector prefix, dim) whose size is the tower's output width."""
    projector_output: tuple[str, int]
    """(HF tensor after the projector prefix, dim) whose size is the language hidden size."""
    tower_width: Callable[[Mapping[str, Any]], int]
    """config.json -> the width of what the tower hands the projector."""
    language: str
    """The language family's name (:data:`~megatron_plugins.weights.language_families.FAMILIES`)."""
    language_renames: tuple[tuple[tuple[str, str], ...], ...]
    """Naming schemes of the language tensors, the first the folder uses wins: each a tuple of
    (language family HF prefix, this folder's prefix), ``model.`` -> ``language_model.model.``."""
    image_token_id: Callable[[Mapping[str, Any]], int]
    """config.json -> the token id HF replaces by image features."""
    tower_layers: Callable[[Mapping[str, Any]], int]
    """config.json -> how many tower layers feed the projector (the rest are carried untrained);
    an :class:`HFWeightsError` naming the config field for a selection it cannot express."""
    drops_class_token: Callable[[Mapping[str, Any]], bool]
    """config.json -> whether the class token is dropped before the projector (errors as
    ``tower_layers``)."""
    projector_activation: Callable[[Mapping[str, Any]], str]
    """config.json -> the projector's HF activation name."""
    text_model_types: tuple[str, ...] = ()
    """``text_config.model_type`` values the language family computes exactly (empty: any);
    a LLaVA over another decoder would otherwise be read with Llama's rules."""
    projection_extras: tuple[Rule, ...] = ()
    """Projection parameters saved outside the projector prefix, HF names in full (LLaVA-NeXT's
    trained ``image_newline``, which the projection appends after each row of tiles)."""
    top_level_text_fields: tuple[str, ...] = ()
    """Language fields transformers reads from the top level of config.json, over
    ``text_config``'s (Qwen3-VL's ``tie_word_embeddings``)."""
    carried: tuple[str, ...] = ()
    """Regexes of HF tensors of no MiMo module (Qwen3.5's multi-token-prediction layers,
    ``mtp.*``): not imported, and copied unchanged on export."""
    carried_what: str = "e.g. multi-token-prediction layers"
    """What :attr:`carried` holds, for the one notice at start."""
    sub_config: str = ""
    """The config.json field holding the parts' configs when they are nested (Qwen2.5-Omni's
    ``thinker_config``); empty: the top level."""
    item_wrapping: Callable[[Mapping[str, Any]], tuple[int, int] | None] = (
        lambda config: _ids(config, "vision_start_token_id", "vision_end_token_id"))
    """config.json -> the ids around each image's run (Qwen's ``<|vision_start|>`` /
    ``<|vision_end|>``), None where it has none."""
    extra_towers: tuple["ExtraTower", ...] = ()
    """Encoders beside the vision tower (Qwen2.5-Omni's audio tower), each its own module."""
    audio_in_video: Callable[[Mapping[str, Any]], int | None] | None = None
    """config.json -> the temporal positions per chunk by which a video's sound is interleaved
    with its frames (``--use-audio-in-video``), None where merged by time (Qwen3-Omni); None:
    the family does not interleave."""

    def root(self, config: Mapping[str, Any]) -> Mapping[str, Any]:
        """The config holding the parts' configs (:attr:`sub_config`'s, else the top level)."""
        return (config.get(self.sub_config) if self.sub_config else None) or config

    @property
    def towers(self) -> tuple["ExtraTower", ...]:
        """Every encoder of the folder, the vision tower first."""
        return (ExtraTower(self.encoder_provider, self.encoder_name, self.tower_prefixes,
                           self.image_token_id, self.item_wrapping), *self.extra_towers)

    def text_config(self, config: Mapping[str, Any]) -> Mapping[str, Any]:
        """The language model's config inside the VLM's (an older save keeps its fields at the
        top level)."""
        root = self.root(config)
        text = root.get("text_config") or root
        return {**text, **{key: root[key] for key in self.top_level_text_fields
                           if key in root}}

    def vision_config(self, config: Mapping[str, Any]) -> Mapping[str, Any]:
        """The tower's config inside the VLM's."""
        return self.root(config).get("vision_config") or {}


def _ids(config: Mapping[str, Any], *fields: str) -> tuple[int, int] | None:
    """Two token ids of config.json, None where it lacks one."""
    ids = tuple(config.get(field) for field in fields)
    return None if None in ids else (int(ids[0]), int(ids[1]))


@dataclass(frozen=True)
class ExtraTower:
    """One encoder of a whole folder: its provider, default name, where its tensors sit and
    which ids mark its items. An extra tower's provider family maps its projection too
    (:func:`~megatron_plugins.weights.mapping.split_projection`), under the tower prefix."""

    encoder_provider: str
    encoder_name: str
    prefixes: tuple[str, ...]
    """Prefixes of its tensors, one per naming scheme; the first the folder uses wins."""
    token_id: Callable[[Mapping[str, Any]], int]
    """config.json -> the token id HF replaces by this encoder's features."""
    wrapping: Callable[[Mapping[str, Any]], tuple[int, int] | None]
    """config.json -> the ids around each item's run, None where there are none."""
    family: str = ""
    """Its provider's ``hf_family`` name (which tower a family handed in maps)."""
    config_key: str = "vision_config"
    """The field of the parts' config holding its config."""


def _llava_layers(config: Mapping[str, Any]) -> int:
    """HF's ``hidden_states[vision_feature_layer]``: index 0 is the embeddings, k is after k
    layers, negative counts from the end of ``num_hidden_layers + 1`` entries."""
    layer = config.get("vision_feature_layer", -2)
    total = (config.get("vision_config") or {}).get("num_hidden_layers", 24)
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise HFWeightsError(f"config.json vision_feature_layer {layer!r} is not supported; give "
                             "one layer index (an int)")
    if not -(total + 1) <= layer <= total or layer % (total + 1) == 0:
        raise HFWeightsError(f"config.json vision_feature_layer {layer} does not select a layer "
                             f"output of the {total}-layer tower")
    return layer % (total + 1)


def _llava_drops_class(config: Mapping[str, Any]) -> bool:
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise HFWeightsError(f"config.json vision_feature_select_strategy {strategy!r} is not one "
                             "of default, full")
    return strategy == "default"


LLAVA = VLMFamily(
    name="llava",
    architectures=("LlavaForConditionalGeneration",),
    encoder_provider="clip",
    # Its placeholder <image> is LLaVA's own image token, so a LLaVA tokenizer gives HF's id.
    encoder_name="image",
    tower_prefixes=("vision_tower.",),
    projector_prefixes=("multi_modal_projector.",),
    projector_rules=(
        Rule("0.encoder.linear_fc1.weight", ("linear_1.weight",), tp_dim=0),
        Rule("0.encoder.linear_fc1.bias", ("linear_1.bias",), tp_dim=0),
        Rule("0.encoder.linear_fc2.weight", ("linear_2.weight",), tp_dim=1),
        Rule("0.encoder.linear_fc2.bias", ("linear_2.bias",)),
    ),
    projector_input=("linear_1.weight", 1),
    projector_output=("linear_2.weight", 0),
    tower_width=lambda config: (config.get("vision_config") or {}).get("hidden_size", 0),
    language="llama",
    language_renames=((("model.", "language_model.model."),
                       ("lm_head.", "language_model.lm_head.")),),
    image_token_id=lambda config: int(config.get("image_token_index", 32000)),
    tower_layers=_llava_layers,
    drops_class_token=_llava_drops_class,
    projector_activation=lambda config: config.get("projector_hidden_act", "gelu"),
    text_model_types=("llama", "mistral"),
)


def _merged_width(config: Mapping[str, Any]) -> int:
    """A Qwen tower's merged width: its hidden size times the spatial merge's square."""
    vision = config.get("vision_config") or {}
    return vision.get("hidden_size", 0) * vision.get("spatial_merge_size", 2) ** 2


QWEN2_5_VL = VLMFamily(
    name="qwen2_5_vl",
    architectures=("Qwen2_5_VLForConditionalGeneration",),
    # The provider's family maps the merger's MLP as the projection (it includes it).
    encoder_provider="qwen2_5_vl",
    encoder_name="image",
    tower_prefixes=("visual.",),
    projector_prefixes=("visual.merger.mlp.",),
    projector_rules=(),
    projector_input=("0.weight", 1),
    projector_output=("2.weight", 0),
    tower_width=_merged_width,
    language="qwen2_5_vl",
    language_renames=((("model.", "model."), ("lm_head.", "lm_head.")),),
    image_token_id=lambda config: int(config.get("image_token_id", 151655)),
    # The merger reads the last block's output, merged by ln_q: the whole tower, no class token.
    tower_layers=lambda config: int((config.get("vision_config") or {}).get("depth", 32)),
    drops_class_token=lambda config: False,
    projector_activation=lambda config: "gelu",
)


def _anyres_drops_class(config: Mapping[str, Any]) -> bool:
    """LLaVA-NeXT's tiles are laid out as a square grid of patches, so its packing needs the
    class token dropped; transformers cannot run ``full`` either."""
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy != "default":
        raise HFWeightsError(f"config.json vision_feature_select_strategy {strategy!r} is not "
                             "supported for LLaVA-NeXT (its anyres packing needs the class token "
                             "dropped); use default")
    return True


LLAVA_NEXT = dataclasses.replace(
    LLAVA, name="llava_next", architectures=("LlavaNextForConditionalGeneration",),
    # The CLIP tower with anyres tiling; its projection appends the trained image_newline.
    encoder_provider="llava_next", drops_class_token=_anyres_drops_class,
    projection_extras=(Rule("0.image_newline", ("image_newline",)),),
)


QWEN3_VL = VLMFamily(
    name="qwen3_vl",
    architectures=("Qwen3VLForConditionalGeneration",),
    # The provider's family maps the merger and the DeepStack mergers as the projection.
    encoder_provider="qwen3_vl",
    encoder_name="image",
    tower_prefixes=("model.visual.",),
    projector_prefixes=("model.visual.merger.", "model.visual.deepstack_merger_list."),
    projector_rules=(),
    projector_input=("linear_fc1.weight", 1),
    projector_output=("linear_fc2.weight", 0),
    tower_width=_merged_width,
    language="qwen3_vl",
    language_renames=((("model.language_model.", "model.language_model."),
                       ("lm_head.", "lm_head.")),),
    image_token_id=lambda config: int(config.get("image_token_id", 151655)),
    # The merger reads the last block's output: the whole tower, no class token.
    tower_layers=lambda config: int((config.get("vision_config") or {}).get("depth", 27)),
    drops_class_token=lambda config: False,
    projector_activation=lambda config: "gelu",
    top_level_text_fields=("tie_word_embeddings",),
)

QWEN3_5_VL = dataclasses.replace(
    QWEN3_VL, name="qwen3_5_vl", architectures=("Qwen3_5ForConditionalGeneration",),
    # Qwen3-VL's tower without DeepStack: its merger alone is the projection.
    encoder_provider="qwen3_5_vl", projector_prefixes=("model.visual.merger.",),
    language="qwen3_5", image_token_id=lambda config: int(config.get("image_token_id", 248056)),
    carried=(r"mtp\.",),
)

QWEN3_5_MOE_VL = dataclasses.replace(
    QWEN3_5_VL, name="qwen3_5_moe_vl", architectures=("Qwen3_5MoeForConditionalGeneration",),
    language="qwen3_5_moe",
)



def _thinker(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """A Qwen2.5-Omni folder's thinker config (a thinker-only save's is the top level)."""
    return config.get("thinker_config") or config


def _omni_vision_wrapping(config: Mapping[str, Any]) -> tuple[int, int] | None:
    """``<|vision_bos|>`` / ``<|vision_eos|>`` (Qwen3-Omni's ``<|vision_start|>`` /
    ``<|vision_end|>``): the thinker config's class lacks them, so a folder's thinker config
    may hold them, else the talker's (a whole folder); the released ids otherwise."""
    return _ids({"vision_start_token_id": 151652, "vision_end_token_id": 151653,
                 **(config.get("talker_config") or {}), **_thinker(config)},
                "vision_start_token_id", "vision_end_token_id")


def _omni_audio(provider: str, token: tuple[str, int], wrapping: tuple[int, int]) -> ExtraTower:
    """An Omni thinker's audio tower under ``thinker.audio_tower.`` (a thinker-only save's
    ``audio_tower.``), built by ``provider``, whose family has its name: its token id is the
    thinker config's ``token`` field, its start / end ids the config's ``audio_start_token_id``
    / ``audio_end_token_id``, the released ids (``token``'s, ``wrapping``) where it lacks
    them."""
    field, released = token
    return ExtraTower(
        encoder_provider=provider, encoder_name="audio",
        prefixes=("thinker.audio_tower.", "audio_tower."),
        token_id=lambda config: int(_thinker(config).get(field, released)),
        wrapping=lambda config: _ids({"audio_start_token_id": wrapping[0],
                                      "audio_end_token_id": wrapping[1], **_thinker(config)},
                                     "audio_start_token_id", "audio_end_token_id"),
        family=provider, config_key="audio_config")


QWEN2_5_OMNI = dataclasses.replace(
    QWEN2_5_VL, name="qwen2_5_omni", encoder_provider="qwen2_5_omni_vision",
    architectures=("Qwen2_5OmniForConditionalGeneration",
                   "Qwen2_5OmniThinkerForConditionalGeneration"),
    # A whole folder's names, then a thinker-only save's (transformers 5 writes them bare).
    tower_prefixes=("thinker.visual.", "visual."),
    projector_prefixes=("thinker.visual.merger.mlp.", "visual.merger.mlp."),
    tower_width=lambda config: _merged_width(_thinker(config)),
    language_renames=((("model.", "thinker.model."), ("lm_head.", "thinker.lm_head.")),
                      (("model.", "model."), ("lm_head.", "lm_head."))),
    image_token_id=lambda config: int(_thinker(config).get("image_token_index", 151655)),
    tower_layers=lambda config: int((_thinker(config).get("vision_config") or {}).get(
        "depth", 32)),
    top_level_text_fields=("tie_word_embeddings",),
    sub_config="thinker_config",
    item_wrapping=_omni_vision_wrapping,
    carried=(r"talker\.", r"token2wav\."),
    carried_what="the talker and token2wav",
    audio_in_video=lambda config: int(_thinker(config).get("position_id_per_seconds", 25)
                                      * _thinker(config).get("seconds_per_chunk", 2)),
    extra_towers=(_omni_audio("qwen2_5_omni_audio", ("audio_token_index", 151646),
                              (151647, 151648)),),
)

QWEN3_OMNI_MOE = dataclasses.replace(
    QWEN2_5_OMNI, name="qwen3_omni_moe", encoder_provider="qwen3_omni_vision",
    architectures=("Qwen3OmniMoeForConditionalGeneration",
                   "Qwen3OmniMoeThinkerForConditionalGeneration"),
    # The provider's family maps the merger and the DeepStack mergers (merger_list) as the
    # projection; a whole folder's names, then a thinker-only save's.
    projector_prefixes=("thinker.visual.merger.", "visual.merger.",
                        "thinker.visual.merger_list.", "visual.merger_list."),
    projector_input=("mlp.0.weight", 1),
    projector_output=("mlp.2.weight", 0),
    language="qwen3_omni_moe",
    image_token_id=lambda config: int(_thinker(config).get("image_token_id", 151655)),
    tower_layers=lambda config: int((_thinker(config).get("vision_config") or {}).get(
        "depth", 27)),
    carried=(r"talker\.", r"code2wav\."),
    carried_what="the talker and code2wav",
    audio_in_video=lambda config: None,  # merged by time, no chunks
    extra_towers=(_omni_audio("qwen3_omni_audio", ("audio_token_id", 151675), (151669, 151670)),),
)
"""A whole Qwen3-Omni-MoE folder (or its thinker alone): Qwen3-VL-MoE's vision tower with
DeepStack, the AuT audio tower, the thinker's Qwen3-MoE language model with interleaved
multimodal RoPE; the talker and code2wav carried. The released ids are the fallbacks: the
thinker config's class defaults differ from them."""

FAMILIES = (LLAVA, QWEN2_5_VL, LLAVA_NEXT, QWEN3_VL, QWEN3_5_VL, QWEN3_5_MOE_VL, QWEN2_5_OMNI,
            QWEN3_OMNI_MOE)
"""Supported whole-VLM architectures."""


def find_vlm(config: Mapping[str, Any], where: str) -> VLMFamily:
    """The entry whose architectures the config names; otherwise one line listing them."""
    architectures = config.get("architectures") or []
    for family in FAMILIES:
        if set(architectures) & set(family.architectures):
            return family
    supported = ", ".join(a for family in FAMILIES for a in family.architectures)
    found = ", ".join(architectures) or config.get("model_type") or "none"
    raise HFWeightsError(f"{where}: architecture {found} is not a supported whole VLM; "
                         f"supported: {supported}")


def read_vlm(folder: str) -> tuple[VLMFamily, dict[str, Any]]:
    """The entry and config.json of a ``--hf-model`` folder."""
    config = read_config(folder, HF_MODEL_FLAG)
    return find_vlm(config, f"{HF_MODEL_FLAG} {folder}/config.json"), config


def language_family(vlm: VLMFamily) -> Family:
    """The language family the entry names, as HF names it on its own."""
    return next(family for family in (*LANGUAGE_FAMILIES, *QWEN3_5_LANGUAGE_FAMILIES,
                                      QWEN3_OMNI_MOE_LANGUAGE)
                if family.name == vlm.language)


def _renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    return next((new + name[len(old):] for old, new in renames if name.startswith(old)), name)


def _outside(*prefixes: str) -> str:
    """A regex matching HF names under none of ``prefixes`` (another part's tensors)."""
    return "(?!" + "|".join(re.escape(p) for p in prefixes) + ")"


def _under(*prefixes: str) -> str:
    """A regex matching HF names under one of ``prefixes``."""
    return "(?:" + "|".join(re.escape(p) for p in prefixes) + ")"


def _first(prefixes: tuple[str, ...], names: set[str], first: tuple[str, ...]) -> str:
    """The first prefix under which the folder holds the tensors ``first`` (else the first)."""
    return next((p for p in prefixes if all(p + n in names for n in first)), prefixes[0])


def projector_prefix(vlm: VLMFamily, names: set[str]) -> str:
    """The projector prefix the folder holding ``names`` uses."""
    return _first(vlm.projector_prefixes, names, (vlm.projector_input[0],))


@dataclass(frozen=True)
class PartFamilies:
    """One family per MiMo module of a whole VLM: the tower (the encoder network), the projector
    (the encoder's ``input_projections``) and the language model, each with HF names as the
    folder has them and the other parts' tensors marked unused."""

    tower: Family
    projector: Family
    language: Family


def part_families(vlm: VLMFamily, config: Mapping[str, Any], tower: Family,
                  names: set[str]) -> PartFamilies:
    """The three modules' families for a folder holding the HF tensors ``names``; ``tower`` is
    the encoder provider's ``hf_family``, whose projection rules (if it includes the
    projection) are the projector's. Each part's names are under the first naming scheme the
    folder uses, so import, streaming and export name every tensor as the folder does. Tower
    layers past the feature layer are carried untrained (export copies them unchanged)."""
    extra = next((t for t in vlm.extra_towers if t.family == tower.name), None)
    if extra is not None:
        return _extra_part_families(vlm, extra, tower, names)
    tower, projection = split_projection(tower)
    kept = vlm.tower_layers(config)
    layers = vlm.vision_config(config).get("num_hidden_layers", kept)
    prefixes = tuple(t + p for t in vlm.tower_prefixes for p in tower.hf_prefixes)
    prefix = _first(prefixes, names, tower.rules[0].hf)
    dropped = tuple(rf"{re.escape(p)}{re.escape(name.format(layer=layer))}$"
                    for rule in tower.rules if "{layer}" in rule.megatron for name in rule.hf
                    for layer in range(kept, layers) for p in prefixes)
    others = tuple(re.escape(t) + pattern for t in vlm.tower_prefixes
                   for pattern in tower.untrained)
    tower_part = dataclasses.replace(
        tower, name=f"{vlm.name}_tower", architectures=vlm.architectures, hf_prefixes=("",),
        rules=tuple(dataclasses.replace(rule, hf=tuple(prefix + n for n in rule.hf))
                    for rule in tower.rules),
        tied=tuple((prefix + a, prefix + b) for a, b in tower.tied),
        unused=(_outside(*vlm.tower_prefixes), _under(*vlm.projector_prefixes)),
        untrained=(*others, *dropped))
    projected = prefix if projection else projector_prefix(vlm, names)
    projector = Family(
        name=f"{vlm.name}_projector", architectures=vlm.architectures, model_type=vlm.name,
        rules=(*(dataclasses.replace(rule, hf=tuple(projected + n for n in rule.hf))
                 for rule in projection or vlm.projector_rules), *vlm.projection_extras),
        megatron_args=lambda _: {}, hf_config=lambda args, vocab: dict(config),
        unused=(_outside(*vlm.projector_prefixes),))
    return PartFamilies(tower_part, projector, _language_part(vlm, names))


def _language_part(vlm: VLMFamily, names: set[str]) -> Family:
    """The language model's family under the first naming scheme the folder uses; the carried
    tensors (no module's) are its untrained ones, copied on export."""
    text = language_family(vlm)
    renames = next((scheme for scheme in vlm.language_renames
                    if all(_renamed(n, scheme) in names for n in text.rules[0].hf)),
                   vlm.language_renames[0])
    return dataclasses.replace(
        text, architectures=vlm.architectures,
        rules=tuple(dataclasses.replace(rule, hf=tuple(_renamed(n, renames) for n in rule.hf))
                    for rule in text.rules),
        tied=tuple((_renamed(a, renames), _renamed(b, renames)) for a, b in text.tied),
        unused=(_outside(*(new for _, new in renames)),), untrained=vlm.carried,
        hf_prefixes=("",))


def _exactly(names: set[str]) -> str:
    """A regex matching exactly the HF names ``names``."""
    return "(?:" + "|".join(re.escape(n) + "$" for n in sorted(names)) + ")"


def _extra_part_families(vlm: VLMFamily, extra: ExtraTower, tower: Family,
                         names: set[str]) -> PartFamilies:
    """An extra tower's families: its network's and its projection's (both under the tower
    prefix the folder uses, the projection's tensors named exactly), and the language model's."""
    network, projection = split_projection(tower)
    prefix = _first(extra.prefixes, names, network.rules[0].hf)
    projected = {prefix + n for rule in projection for n in rule.hf}
    tower_part = dataclasses.replace(
        network, name=f"{vlm.name}_{extra.encoder_name}", architectures=vlm.architectures,
        hf_prefixes=("",),
        rules=tuple(dataclasses.replace(rule, hf=tuple(prefix + n for n in rule.hf))
                    for rule in network.rules),
        unused=(_outside(prefix), _exactly(projected)),
        untrained=tuple(re.escape(prefix) + pattern for pattern in network.untrained))
    projector = dataclasses.replace(
        tower_part, name=f"{vlm.name}_{extra.encoder_name}_projector",
        rules=tuple(dataclasses.replace(rule, hf=tuple(prefix + n for n in rule.hf))
                    for rule in projection),
        unused=(f"(?!{_exactly(projected)})",), untrained=())
    return PartFamilies(tower_part, projector, _language_part(vlm, names))
