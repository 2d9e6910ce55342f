"""The HF weights flags: one per module, and the stock shape flags read from ``config.json``.

``--language-hf-weights DIR`` gives the language model's pretrained weights; its ``config.json``
sets the stock shape flags (layers, hidden, heads, ...), so they need not be given, and one that
is given with another value is a one-line error naming both. ``--encoder-hf-weights NAME=DIR``
gives an encoder's; the encoder's provider reads its own shape from that folder and names its
family as ``hf_family`` (a :class:`~megatron_plugins.weights.mapping.Family`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from megatron_plugins.weights.hf_config import find_family, read_config
from megatron_plugins.weights.language_families import FAMILIES
from megatron_plugins.weights.mapping import Family, HFWeightsError

__all__ = [
    "ENCODER_FLAG", "LANGUAGE_FLAG", "add_weights_args", "check_safetensors",
    "encoder_assignments", "encoder_family", "encoder_folders", "fill_layout_flags",
    "implied_language_args"
]

LANGUAGE_FLAG = "--language-hf-weights"
ENCODER_FLAG = "--encoder-hf-weights"


def add_weights_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the per-module "load HF weights from" flags."""
    group = parser.add_argument_group("megatron-plugins HF weights")
    group.add_argument(LANGUAGE_FLAG, metavar="DIR", default=None,
                       help="Load the language model from this HF folder (config.json + "
                            "safetensors) once at start; its config sets the model's shape flags.")
    group.add_argument(ENCODER_FLAG, metavar="NAME=DIR", action="append", default=[],
                       help="Load encoder NAME's network from this HF folder once at start "
                            "(the projection starts from init unless the HF model holds it, as "
                            "Qwen2.5-VL's merger). Repeatable.")
    return parser


USER_MAY_SET = {"untie_embeddings_and_output_weights": True}
"""Implied flags the user may still set, to this value: an untied run from a checkpoint with tied
embeddings starts its output layer as a copy of the embedding."""


def _shown(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def language_args(folder: str) -> tuple[Family, dict[str, Any]]:
    """The family of ``--language-hf-weights``' config.json and the stock args it implies."""
    config = read_config(folder, LANGUAGE_FLAG)
    family = find_family(config, FAMILIES, f"{LANGUAGE_FLAG} {folder}/config.json")
    return family, family.megatron_args(config)


def check_safetensors(folder: str, flag: str) -> None:
    """Before any process group: every safetensors file of ``folder`` is there and readable, so a
    truncated one stops every rank with the same line instead of leaving the others in a
    collective. The launch calls it; the pre-import layout checks do not (it imports torch)."""
    from megatron_plugins.weights.hf_folder import HFCheckpoint

    HFCheckpoint(folder, flag).check_files()


def implied_language_args(args: argparse.Namespace, given: Callable[[str], str | None]
                          ) -> tuple[str | None, dict[str, Any]]:
    """The family name of ``--language-hf-weights`` and the stock shape args (attribute -> value)
    its config.json sets: (None, {}) without the flag. ``given(attr)`` is the flag as the user
    spelled it, or None when it was not given; a given flag that contradicts is an error."""
    folder = args.language_hf_weights
    if folder is None:
        return None, {}
    family, implied = language_args(folder)
    check_safetensors(folder, LANGUAGE_FLAG)
    values = {}
    for attr, value in implied.items():
        if not hasattr(args, attr):
            raise ValueError(f"the {family.name} family sets args.{attr}, which stock lacks")
        spelled = given(attr)
        if spelled is not None and USER_MAY_SET.get(attr, value) == getattr(args, attr):
            continue
        if spelled is not None and getattr(args, attr) != value:
            raise HFWeightsError(
                f"{spelled} {_shown(getattr(args, attr))} contradicts {LANGUAGE_FLAG} "
                f"{folder}/config.json, which gives {_shown(value)}; drop {spelled}")
        values[attr] = value
    return family.name, values


def fill_layout_flags(args: argparse.Namespace) -> None:
    """For the pre-import layout checks: the few stock model flags they read (heads, query
    groups, experts), from ``--language-hf-weights``' config.json where not given."""
    if getattr(args, "language_hf_weights", None) is None:
        return
    for attr, value in language_args(args.language_hf_weights)[1].items():
        if hasattr(args, attr) and getattr(args, attr) in (None, False):
            setattr(args, attr, value)


def encoder_family(plugin: Any) -> Family | None:
    """The HF family an encoder provider maps (its ``hf_family``), if any."""
    return getattr(plugin, "hf_family", None)


def encoder_assignments(values: list[str], plugins: Mapping[str, Any], flag: str,
                        error: type[Exception]) -> Iterator[tuple[str, str, str]]:
    """``(value, NAME, DIR)`` of each ``flag NAME=DIR`` value, NAME one of the run's encoders and
    given once; a bad value raises ``error`` in one line (any per-module "weights from" flag)."""
    seen: set[str] = set()
    for value in values:
        name, sep, folder = value.partition("=")
        if not sep or not folder:
            raise error(f"{flag} {value}: expected NAME=DIR")
        if name not in plugins:
            raise error(f"{flag} {value}: no encoder {name!r}; encoders are "
                        f"{', '.join(plugins) or 'none'}")
        if name in seen:
            raise error(f"{flag} {name}= is given twice")
        seen.add(name)
        yield value, name, folder


def encoder_folders(values: list[str], plugins: Mapping[str, Any]) -> dict[str, str]:
    """``NAME=DIR`` values checked against the run's encoders, their providers and folders."""
    folders: dict[str, str] = {}
    for value, name, folder in encoder_assignments(values, plugins, ENCODER_FLAG, HFWeightsError):
        family = encoder_family(plugins[name])
        if family is None:
            raise HFWeightsError(f"{ENCODER_FLAG} {value}: encoder {name}'s provider "
                                 f"({type(plugins[name]).__name__}) has no HF weight mapping")
        config = read_config(folder, f"{ENCODER_FLAG} {name}=")
        find_family(config, (family,), f"{ENCODER_FLAG} {value}/config.json")
        check_safetensors(folder, f"{ENCODER_FLAG} {name}=")
        folders[name] = folder
    return folders
