"""The HF weights flags: one per module, and the stock shape flags read from ``config.json``.

``--language-hf-weights DIR`` gives the language model's pretrained weights; its ``config.json``
sets the stock shape flags (layers, hidden, heads, ...), so they need not be given, and one that
is given with another value is a one-line error naming both. ``--encoder-hf-weights NAME=DIR``
gives an encoder's; the encoder's provider reads its own shape from that folder and names its
family as ``hf_family`` (a :class:`~megatron_plugins.weights.mapping.Family`). ``--hf-model DIR``
gives a whole VLM (:mod:`~megatron_plugins.weights.vlm_families`): :func:`expand_hf_model` writes
the encoder it implies into the parsed flags, its ``text_config`` sets the shape flags, and
:func:`check_hf_model` checks that its parts meet.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

from megatron_plugins.parallel.module_values import ModuleValues, module_values
from megatron_plugins.weights.hf_config import find_family, read_config
from megatron_plugins.weights.language_families import FAMILIES
from megatron_plugins.weights.mapping import Family, HFWeightsError
from megatron_plugins.weights.vlm_families import (
    HF_MODEL_FLAG,
    ExtraTower,
    language_family,
    part_families,
    projector_prefix,
    read_vlm,
)

__all__ = [
    "ENCODER_FLAG", "HF_MODEL_FLAG", "LANGUAGE_FLAG", "add_weights_args",
    "checkpoint_audio_in_video", "check_hf_model",
    "checkpoint_image_token", "checkpoint_item_wrapping", "check_encoder_names",
    "check_safetensors", "encoder_family", "encoder_folders",
    "expand_hf_model", "fill_layout_flags", "hf_model_encoder", "hf_model_towers",
    "implied_language_args",
    "language_origin"
]

LANGUAGE_FLAG = "--language-hf-weights"
ENCODER_FLAG = "--encoder-hf-weights"


def add_weights_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the per-module "load HF weights from" flags."""
    group = parser.add_argument_group("megatron-plugins HF weights")
    group.add_argument(LANGUAGE_FLAG, metavar="DIR", default=None,
                       help="Load the language model from this HF folder (config.json + "
                            "safetensors) once at start; its config sets the model's shape flags.")
    group.add_argument(ENCODER_FLAG, metavar="NAME=DIR", action=ModuleValues,
                       help="Load encoder NAME's network from this HF folder once at start "
                            "(the projection starts from init unless the HF model holds it, as "
                            "Qwen2.5-VL's merger). Repeatable.")
    group.add_argument(HF_MODEL_FLAG, metavar="DIR", default=None,
                       help="Load a whole HF VLM folder (LLaVA, LLaVA-NeXT, Qwen2.5-VL, Qwen3-VL, "
                            "Qwen3.5-VL, Qwen2.5-Omni, Qwen3-Omni-MoE): its vision tower (and "
                            "an Omni's audio tower) as the encoder it implies (named by the "
                            "architecture, e.g. image=clip; --grid NAME:... places it), its "
                            "projector as that encoder's projection, "
                            "its language model on the language grid; its config sets the shape "
                            "flags and the image token.")
    group.add_argument("--mrope-interleaved", action="store_true",
                       help="With --position-embedding-type mrope: rotate frequency pair j by "
                            "the temporal, height or width position in turn (Qwen3-VL; set by "
                            "its config.json) instead of one block of --mrope-section pairs per "
                            "axis.")
    return parser


def expand_hf_model(flags: argparse.Namespace) -> None:
    """Write what ``--hf-model DIR`` implies into the parsed flags, once: for each of its towers
    encoder ``NAME=PROVIDER`` into ``mimo_encoders`` (unless a given one names the provider) and
    ``NAME=DIR`` into ``encoder_hf_weights`` (the provider reads the tower's shape there). A given
    flag that contradicts the folder is one line naming both."""
    folder = getattr(flags, "hf_model", None)
    if folder is None:
        return
    vlm, _ = read_vlm(folder)
    origin = f"{HF_MODEL_FLAG} {folder} ({vlm.architectures[0]})"
    language = getattr(flags, "language_hf_weights", None)
    if language is not None:
        raise HFWeightsError(f"{LANGUAGE_FLAG} {language} contradicts {origin}, which holds the "
                             f"language model; drop {LANGUAGE_FLAG}")
    encoders = module_values(getattr(flags, "mimo_encoders", None), "--encoder")
    weights = module_values(getattr(flags, "encoder_hf_weights", None), ENCODER_FLAG)
    implied = {}
    for tower in vlm.towers:
        provider = tower.encoder_provider
        named = [name for name, given in encoders.items() if given == provider]
        if encoders and len(named) != 1:
            given = " ".join(f"{name}={p}" for name, p in encoders.items())
            built = (f"tower is built by provider {provider}" if len(vlm.towers) == 1 else
                     "towers are built by providers "
                     + ", ".join(t.encoder_provider for t in vlm.towers))
            raise HFWeightsError(f"--encoder {given} contradicts {origin}, whose {built}; give "
                                 f"exactly one --encoder NAME={provider} or drop --encoder")
        name = named[0] if named else tower.encoder_name
        if weights.get(name, folder) != folder:
            raise HFWeightsError(f"{ENCODER_FLAG} {name}={weights[name]} contradicts {origin}, "
                                 f"which holds encoder {name}'s tower; drop {ENCODER_FLAG} "
                                 f"{name}=")
        implied[name] = provider
    flags.mimo_encoders = encoders or implied
    flags.encoder_hf_weights = {**weights, **{name: folder for name in implied}}


def hf_model_encoder(args: argparse.Namespace) -> str | None:
    """The encoder ``--hf-model``'s vision tower is (after :func:`expand_hf_model`), or None."""
    return next(iter(hf_model_towers(args)), None)


def hf_model_towers(args: argparse.Namespace) -> dict[str, ExtraTower]:
    """``{encoder: tower}``: the encoders ``--hf-model``'s towers are (after
    :func:`expand_hf_model`), the vision tower first; empty without the flag. An encoder is
    matched to its tower by provider (``--encoder``), else by the tower's default name."""
    folder = getattr(args, "hf_model", None)
    if folder is None:
        return {}
    weights = module_values(getattr(args, "encoder_hf_weights", None), ENCODER_FLAG)
    providers = module_values(getattr(args, "mimo_encoders", None), "--encoder")
    names = [name for name, path in weights.items() if path == folder]
    towers = read_vlm(folder)[0].towers
    found = {}
    for tower in towers:
        name = next((n for n in names if providers.get(n) == tower.encoder_provider), None)
        if name is None and tower.encoder_name in names:
            name = tower.encoder_name
        if name is None and len(towers) == len(names) == 1:
            name = names[0]
        if name is not None:
            found[name] = tower
    return found


def checkpoint_image_token(args: argparse.Namespace) -> dict[str, int]:
    """``{encoder: id}``: the token ``--hf-model``'s checkpoint puts where each tower's features
    go (Qwen2.5-VL's ``<|image_pad|>``, LLaVA's ``<image>``, Qwen2.5-Omni's ``<|AUDIO|>``),
    which real data must use for that encoder's positions; empty without the flag."""
    towers = hf_model_towers(args)
    if not towers:
        return {}
    _, config = read_vlm(args.hf_model)
    return {name: tower.token_id(config) for name, tower in towers.items()}


def checkpoint_audio_in_video(args: argparse.Namespace
                              ) -> tuple[str, str, int | None] | None:
    """(video encoder, audio encoder, temporal positions per chunk, None where merged by time)
    where ``--hf-model``'s family interleaves a video's sound track with its frames
    (Qwen2.5-Omni, Qwen3-Omni); else None."""
    towers = hf_model_towers(args)
    if not towers:
        return None
    vlm, config = read_vlm(args.hf_model)
    audio = [name for name, tower in towers.items() if tower.config_key == "audio_config"]
    if vlm.audio_in_video is None or not audio:
        return None
    return next(iter(towers)), audio[0], vlm.audio_in_video(config)


def checkpoint_item_wrapping(args: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """``{encoder: (start, end)}``: the ids ``--hf-model``'s checkpoint puts around each item's
    run (Qwen's ``<|vision_start|>`` / ``<|vision_end|>``, Omni's audio bos / eos), for the
    towers whose ids its vocabulary holds."""
    towers = hf_model_towers(args)
    if not towers:
        return {}
    vlm, config = read_vlm(args.hf_model)
    vocab = vlm.text_config(config).get("vocab_size")
    found = {}
    for name, tower in towers.items():
        ids = tower.wrapping(config)
        if ids is not None and vocab is not None and all(0 <= i < int(vocab) for i in ids):
            found[name] = ids
    return found


USER_MAY_SET = {"untie_embeddings_and_output_weights": True}
"""Implied flags the user may still set, to this value: an untied run from a checkpoint with tied
embeddings starts its output layer as a copy of the embedding."""


def _shown(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) or value is None else str(value)


def language_origin(args: argparse.Namespace) -> str:
    """The config.json the language model's shape comes from, for messages."""
    if getattr(args, "hf_model", None) and not args.language_hf_weights:
        return f"{HF_MODEL_FLAG} {args.hf_model}/config.json text_config"
    return f"{LANGUAGE_FLAG} {args.language_hf_weights}/config.json"


def language_args(args: argparse.Namespace) -> tuple[Family, dict[str, Any]] | None:
    """The language family of ``--language-hf-weights`` (or ``--hf-model``'s text_config) and
    the stock args it implies; None without either flag."""
    folder = args.language_hf_weights
    if folder is not None:
        config = read_config(folder, LANGUAGE_FLAG)
        family = find_family(config, FAMILIES, f"{LANGUAGE_FLAG} {folder}/config.json")
        return family, family.megatron_args(config)
    if getattr(args, "hf_model", None) is None:
        return None
    vlm, config = read_vlm(args.hf_model)
    text = vlm.text_config(config)
    kind = text.get("model_type")
    if vlm.text_model_types and kind not in vlm.text_model_types:
        raise HFWeightsError(
            f"{HF_MODEL_FLAG} {args.hf_model}/config.json text_config.model_type {kind!r} is not "
            f"mapped for {vlm.name}; supported: {', '.join(vlm.text_model_types)}")
    family = language_family(vlm)
    return family, family.megatron_args(text)


def check_safetensors(folder: str, flag: str) -> None:
    """Before any process group: every safetensors file of ``folder`` is there and readable, so a
    truncated one stops every rank with the same line instead of leaving the others in a
    collective. The launch calls it; the pre-import layout checks do not (it imports torch)."""
    from megatron_plugins.weights.hf_folder import HFCheckpoint

    HFCheckpoint(folder, flag).check_files()


def implied_language_args(args: argparse.Namespace, given: Callable[[str], str | None],
                          planning: bool = False) -> tuple[str | None, dict[str, Any]]:
    """The family name of ``--language-hf-weights`` and the stock shape args (attribute -> value)
    its config.json sets: (None, {}) without the flag. ``given(attr)`` is the flag as the user
    spelled it, or None when it was not given; a given flag that contradicts is an error.
    ``planning`` (``mimo-plan``): a folder holding only its config.json passes."""
    from megatron_plugins.weights.hf_folder import holds_weights

    found = language_args(args)
    if found is None:
        return None, {}
    family, implied = found
    folder, flag = ((args.language_hf_weights, LANGUAGE_FLAG)
                    if args.language_hf_weights is not None else (args.hf_model, HF_MODEL_FLAG))
    if not planning or holds_weights(folder):
        check_safetensors(folder, flag)
    values = {}
    for attr, value in implied.items():
        if not hasattr(args, attr):
            raise ValueError(f"the {family.name} family sets args.{attr}, which stock lacks")
        spelled = given(attr)
        if spelled is not None and USER_MAY_SET.get(attr, value) == getattr(args, attr):
            continue
        if spelled is not None and getattr(args, attr) != value:
            raise HFWeightsError(
                f"{spelled} {_shown(getattr(args, attr))} contradicts {language_origin(args)}, "
                f"which gives {_shown(value)}; drop {spelled}")
        values[attr] = value
    return family.name, values


def fill_layout_flags(args: argparse.Namespace) -> None:
    """For the pre-import layout checks: the few stock model flags they read (heads, query
    groups, experts), from ``--language-hf-weights``' (or ``--hf-model``'s) config.json where
    not given."""
    found = language_args(args)
    if found is None:
        return
    for attr, value in found[1].items():
        if hasattr(args, attr) and getattr(args, attr) in (None, False):
            setattr(args, attr, value)


def encoder_family(plugin: Any) -> Family | None:
    """The HF family an encoder provider maps (its ``hf_family``), if any."""
    return getattr(plugin, "hf_family", None)


def check_encoder_names(values: Mapping[str, str], plugins: Mapping[str, Any], flag: str,
                        error: type[Exception]) -> None:
    """Each ``NAME`` of a per-module "weights from" flag's ``NAME -> DIR`` is one of the run's
    encoders; else ``error`` in one line."""
    for name, folder in values.items():
        if name not in plugins:
            raise error(f"{flag} {name}={folder}: no encoder {name!r}; encoders are "
                        f"{', '.join(plugins) or 'none'}")


def encoder_folders(values: Mapping[str, str], plugins: Mapping[str, Any],
                    whole: str | None = None) -> dict[str, str]:
    """``--encoder-hf-weights``' ``NAME -> DIR`` checked against the run's encoders, their
    providers and folders; the ``--hf-model`` folder ``whole`` is checked by
    :func:`check_hf_model` instead."""
    check_encoder_names(values, plugins, ENCODER_FLAG, HFWeightsError)
    folders: dict[str, str] = {}
    for name, folder in values.items():
        value = f"{name}={folder}"
        family = encoder_family(plugins[name])
        if family is None:
            raise HFWeightsError(f"{ENCODER_FLAG} {value}: encoder {name}'s provider "
                                 f"({type(plugins[name]).__name__}) has no HF weight mapping")
        if folder == whole:
            folders[name] = folder
            continue
        config = read_config(folder, f"{ENCODER_FLAG} {name}=")
        find_family(config, (family,), f"{ENCODER_FLAG} {value}/config.json")
        check_safetensors(folder, f"{ENCODER_FLAG} {name}=")
        folders[name] = folder
    return folders


def check_hf_model(args: argparse.Namespace, plugins: Mapping[str, Any],
                   planning: bool = False) -> None:
    """Before any process group: ``--hf-model``'s projector meets its tower and its language
    model (input = the tower's output width, output = the language hidden size). ``planning``
    (``mimo-plan``, which loads nothing): a folder holding only its config.json passes, its
    shapes read from config.json alone."""
    from megatron_plugins.weights.hf_folder import HFCheckpoint, holds_weights

    name = hf_model_encoder(args)
    if name is None:
        return
    folder = args.hf_model
    vlm, config = read_vlm(folder)
    if encoder_family(plugins[name]) is None:
        raise HFWeightsError(f"{HF_MODEL_FLAG} {folder}: encoder {name}'s provider has no HF "
                             "weight mapping")
    if planning and not holds_weights(folder):
        return
    checkpoint = HFCheckpoint(folder, HF_MODEL_FLAG)
    prefix = projector_prefix(vlm, checkpoint.names())
    sizes = (("input", vlm.projector_input, vlm.tower_width(config),
              "the width the tower (vision_config) hands it"),
             ("output", vlm.projector_output, vlm.text_config(config).get("hidden_size"),
              "the language model's hidden size (text_config)"))
    for side, (tensor, dim), want, what in sizes:
        hf_name = prefix + tensor
        if hf_name not in checkpoint.names():
            raise HFWeightsError(f"{HF_MODEL_FLAG} {folder}: no projector tensor {hf_name}")
        have = checkpoint.shape(hf_name)[dim]
        if have != want:
            raise HFWeightsError(f"{HF_MODEL_FLAG} {folder}: projector {hf_name} {side} size "
                                 f"{have} does not meet {what}, {want}; the tower and language "
                                 "model are not this projector's pair")
    _check_every_tensor_handled(args, plugins, vlm, config, checkpoint.names())
    carried = sorted(n for n in checkpoint.names() if any(re.match(p, n) for p in vlm.carried))
    if carried and os.environ.get("RANK", "0") == "0":
        print(f"pretrain_mimo.py: notice: {HF_MODEL_FLAG} {folder}: {len(carried)} tensors of no "
              f"module here ({carried[0].split('.')[0]}.*, {vlm.carried_what}) are "
              "not trained; tools/export_hf writes them back unchanged", file=sys.stderr,
              flush=True)


def _check_every_tensor_handled(args: argparse.Namespace, plugins: Mapping[str, Any], vlm: Any,
                                config: Mapping[str, Any], names: set[str]) -> None:
    """Every tensor of ``--hf-model`` is a module's here or carried: one that no part maps and
    none carries is a part of the model this import does not handle, which training would leave
    out and the export would drop, so it is one line naming it."""
    parts = []
    for name in hf_model_towers(args):
        found = part_families(vlm, config, encoder_family(plugins[name]), names)
        parts += [found.tower, found.projector, found.language]

    def left_out(hf_name: str, part: Family) -> bool:
        return (any(re.match(p, hf_name) for p in part.unused)
                and not any(re.match(p, hf_name) for p in part.untrained))

    candidates = [n for n in names if all(left_out(n, part) for part in parts)]
    # A rule may map a tensor outside its part's prefix (LLaVA-NeXT's image_newline).
    mapped = [re.compile(re.escape(n).replace(r"\{layer\}", r"\d+")) for part in parts
              for rule in part.rules for n in rule.hf] if candidates else []
    unhandled = sorted(n for n in candidates if not any(m.fullmatch(n) for m in mapped))
    if unhandled:
        raise HFWeightsError(
            f"{HF_MODEL_FLAG} {args.hf_model}: {len(unhandled)} tensors belong to no part this "
            f"{vlm.name} import handles (e.g. {unhandled[0]}); training would leave them out and "
            "tools/export_hf would drop them: give a folder of the supported architecture "
            f"({', '.join(vlm.architectures)}) as transformers saves it")
