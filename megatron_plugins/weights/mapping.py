"""The HF <-> Megatron weight mapping as data: one :class:`Family` table per architecture.

A :class:`Rule` says how one Megatron parameter is made from HF tensors. Names are *global*: the
name the parameter has in the module at TP 1 / PP 1 / EP 1 (``{layer}`` is the global layer index,
``{expert}`` the global expert index), so one table serves every layout. A combine kind says how
the HF tensors are laid out inside the Megatron tensor and how a TP rank's slice of it is made from
slices of the HF tensors (and back), so a rank only ever reads and writes its own rows.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from megatron_plugins.errors import UsageError

__all__ = ["PROJECTION", "TOWER", "Bound", "Family", "HFWeightsError", "Heads", "Rule",
           "includes_projection", "linear_geometry", "norm_rules", "split_projection"]

TOWER = "encoder."
"""Prefix of the encoder network's parameters in a family that includes the projection."""
PROJECTION = "projection."
"""Prefix of the input projection's parameters in such a family."""

COMBINES = ("copy", "qkv", "gate_up", "fused_qkv", "gated_qkv", "gdn_in", "gdn_conv")
"""copy: one HF tensor (optionally sliced on ``tp_dim``); qkv: q, k, v -> Megatron's fused layout,
per query group [that group's q heads, k, v]; gate_up: SwiGLU ``linear_fc1`` = [gate; up];
fused_qkv: as qkv, from one HF tensor laid out [q; k; v] (Qwen2.5-VL's vision ``attn.qkv``);
gated_qkv: as qkv with an output gate, HF's q_proj holding [q; gate] per head, Megatron's group
[q heads, gate heads, k, v]; gdn_in: Gated DeltaNet's ``in_proj`` = [q; k; v; z; beta; alpha]
from HF's in_proj_qkv ([q; k; v]), in_proj_z, in_proj_b, in_proj_a, each section split over TP;
gdn_conv: its ``conv1d`` channels [q; k; v], each section split over TP."""

PLACEHOLDERS = ("layer", "expert")


class HFWeightsError(UsageError):
    """HF weights that cannot be used as given; the message names the file, tensor or flag."""


@dataclass(frozen=True)
class Rule:
    """One Megatron parameter (global name template) made from HF tensors (name templates)."""

    megatron: str
    hf: tuple[str, ...]
    combine: str = "copy"
    tp_dim: int | None = None
    """The dim Megatron shards this parameter on over TP (expert TP for ``{expert}`` rules)."""
    pad_vocab: bool = False
    """Megatron pads the vocabulary: rows past the HF rows are zeros on import, dropped on export."""
    leading_ones: int = 0
    """copy only: the Megatron tensor has this many extra leading size-1 dims (CLIP's class token
    is ``[1, 1, H]`` in Megatron, ``[H]`` in HF)."""
    absent_zero: tuple[int, ...] = ()
    """Positions in ``hf`` of tensors the HF model does not have, whose part of the Megatron
    tensor is zeros (Whisper's key bias: Megatron's fused qkv bias has a k part, HF's k_proj no
    bias): imported as zeros, left out on export, which refuses them if they are no longer zero."""

    def __post_init__(self) -> None:
        if self.combine not in COMBINES:
            raise ValueError(f"Rule {self.megatron}: combine {self.combine!r} is not one of "
                             f"{', '.join(COMBINES)}")
        arity = {"copy": 1, "qkv": 3, "gate_up": 2, "fused_qkv": 1, "gated_qkv": 3, "gdn_in": 4,
                 "gdn_conv": 1}[self.combine]
        if len(self.hf) != arity:
            raise ValueError(f"Rule {self.megatron}: {self.combine} takes {arity} HF tensors")
        if any(not 0 <= i < arity for i in self.absent_zero) or (
                self.absent_zero and self.tp_dim is None):
            raise ValueError(f"Rule {self.megatron}: absent_zero needs tp_dim and positions in hf")

    def present_hf(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """``names`` (this rule's HF names, bound) without the absent ones."""
        return tuple(name for i, name in enumerate(names) if i not in self.absent_zero)

    @property
    def is_expert(self) -> bool:
        """Expert parameters are sharded over the expert-TP group and owned by one EP rank."""
        return "{expert}" in self.megatron

    def pattern(self) -> re.Pattern[str]:
        """A regex matching concrete global Megatron names, capturing the placeholders."""
        text = re.escape(self.megatron)
        for key in PLACEHOLDERS:
            text = text.replace(re.escape("{" + key + "}"), f"(?P<{key}>[0-9]+)")
        return re.compile(text + "$")


def norm_rules(megatron: str, hf: str, te: bool = False) -> tuple[Rule, ...]:
    """A LayerNorm's weight and bias rules; ``te``: the Transformer Engine spec's, fused into the
    following linear (``layer_norm_weight`` / ``layer_norm_bias``)."""
    prefix = "layer_norm_" if te else ""
    return tuple(Rule(f"{megatron}.{prefix}{p}", (f"{hf}.{p}",)) for p in ("weight", "bias"))


@dataclass(frozen=True)
class Bound:
    """A rule with its placeholders filled: concrete Megatron and HF names."""

    rule: Rule
    megatron: str
    hf: tuple[str, ...]


@dataclass(frozen=True)
class Family:
    """A HF architecture: what ``config.json`` it accepts, its rules, and its config <-> flags."""

    name: str
    architectures: tuple[str, ...]
    model_type: str
    rules: tuple[Rule, ...]
    megatron_args: Callable[[Mapping[str, Any]], dict[str, Any]]
    """HF ``config.json`` -> stock Megatron argparse attributes (``args.<attr>``) it implies."""
    hf_config: Callable[[Any, int], dict[str, Any]]
    """(stock args, unpadded vocabulary size) -> the ``config.json`` this family writes."""
    unused: tuple[str, ...] = ()
    """Regexes of HF tensor names of another model in the same files (a full CLIP model's text
    tower), deliberately not imported."""
    untrained: tuple[str, ...] = ()
    """Regexes of HF tensor names of this model outside the Megatron module (CLIP's
    ``post_layernorm``, SigLIP's pooling head): not imported, and copied unchanged on export from
    the folder the run started from."""
    tied: tuple[tuple[str, str], ...] = ()
    """(HF name, HF name it equals) for tensors a checkpoint with ``tie_word_embeddings`` omits:
    a Megatron output layer (last pipeline stage, or an untied run) is read from the embedding."""
    hf_prefixes: tuple[str, ...] = ("",)
    """Prefixes the HF names may carry, first match wins (a CLIP vision tower is saved as
    ``embeddings.*`` by ``CLIPVisionModel`` in transformers 5, as ``vision_model.embeddings.*`` by
    ``CLIPModel`` and older versions)."""

    def is_unused(self, hf_name: str) -> bool:
        """Whether a HF tensor is one the family leaves out on purpose."""
        return any(re.match(pattern, hf_name) for pattern in (*self.unused, *self.untrained))

    def for_names(self, hf_names: set[str]) -> "Family":
        """This family with its rules' HF names as the checkpoint has them: under the first
        prefix where the first rule's tensors exist, and a tied tensor the checkpoint omits read
        from the one it equals."""
        first = self.rules[0].hf
        prefix = next((p for p in self.hf_prefixes if all(p + n in hf_names for n in first)), "")
        tied = {prefix + name: prefix + source for name, source in self.tied
                if prefix + name not in hf_names}
        rules = tuple(dataclasses.replace(rule, hf=tuple(tied.get(prefix + n, prefix + n)
                                                         for n in rule.hf))
                      for rule in self.rules)
        return dataclasses.replace(self, rules=rules, hf_prefixes=("",))

    def bind(self, megatron_name: str) -> Bound | None:
        """The rule covering a concrete global Megatron name, with HF names filled in."""
        for rule in self.rules:
            match = rule.pattern().match(megatron_name)
            if match:
                values = match.groupdict()
                return Bound(rule, megatron_name, tuple(name.format(**values) for name in rule.hf))
        return None

    def expand(self, num_layers: int, num_experts: int, present: Callable[[str], bool]
               ) -> Iterator[Bound]:
        """Every rule instance of a model of this size; a rule whose HF tensors are absent
        (``present`` False for all of them) is left out, e.g. no output layer when tied."""
        for rule in self.rules:
            layers = range(num_layers) if "{layer}" in rule.megatron else [None]
            experts = range(num_experts) if rule.is_expert else [None]
            for layer in layers:
                for expert in experts:
                    values = {"layer": layer, "expert": expert}
                    hf = tuple(name.format(**values) for name in rule.hf)
                    if any(present(name) for name in hf):
                        yield Bound(rule, rule.megatron.format(**values), hf)


@dataclass(frozen=True)
class Heads:
    """Attention geometry the qkv combine needs (from the module's TransformerConfig)."""

    heads: int
    groups: int
    head_dim: int
    linear: tuple[int, int, int] | None = None
    """Gated DeltaNet's (q and k width, v width, value heads), for the gdn combines."""

    @classmethod
    def of(cls, config: Any) -> "Heads":
        heads = config.num_attention_heads
        return cls(heads, config.num_query_groups or heads, config.kv_channels,
                   linear_geometry(config))


def linear_geometry(config: Any) -> tuple[int, int, int] | None:
    """:attr:`Heads.linear` of a TransformerConfig or stock args (None without Gated DeltaNet)."""
    if getattr(config, "experimental_attention_variant", None) != "gated_delta_net":
        return None
    return (config.linear_num_key_heads * config.linear_key_head_dim,
            config.linear_num_value_heads * config.linear_value_head_dim,
            config.linear_num_value_heads)


def includes_projection(family: Family) -> bool:
    """Whether ``family`` maps the input projection too (its rules name :data:`PROJECTION`)."""
    return any(rule.megatron.startswith(PROJECTION) for rule in family.rules)


def split_projection(family: Family) -> tuple[Family, tuple[Rule, ...]]:
    """A family that includes the projection (Qwen2.5-VL's tower + merger) as its network's own
    family (names inside the encoder network) and its projection's rules (names inside the
    modality's ``input_projections``, ``0.`` being the projection; HF names as the family's);
    any other family and no rules."""
    if not includes_projection(family):
        return family, ()
    network = tuple(dataclasses.replace(rule, megatron=rule.megatron[len(TOWER):])
                    for rule in family.rules if rule.megatron.startswith(TOWER))
    projection = tuple(dataclasses.replace(rule, megatron="0." + rule.megatron[len(PROJECTION):])
                       for rule in family.rules if rule.megatron.startswith(PROJECTION))
    return dataclasses.replace(family, rules=network), projection
