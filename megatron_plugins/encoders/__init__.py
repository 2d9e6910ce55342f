"""Encoder plugins: how one modality plugs into the MiMo model, and how a provider is resolved.

An encoder is a subclass of :class:`~megatron_plugins.encoders.base.EncoderPlugin`. Built-ins are
named (``vit``, ``audio``); anything else is an import path ``package.module:ClassName`` given as
``--encoder NAME=package.module:ClassName``, so a user's encoder lives in the user's own file.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Mapping

from megatron_plugins.encoders.base import EncoderPlugin, EncoderPluginError, encoder_config

BUILTIN = {
    "vit": "megatron_plugins.encoders.vit:ViTEncoder",
    "audio": "megatron_plugins.encoders.audio:AudioFrameEncoder",
}
"""Built-in provider names and the classes they stand for."""

__all__ = ["BUILTIN", "EncoderPlugin", "EncoderPluginError", "add_encoder_args",
           "encoder_config", "resolve"]


def resolve(provider: str, encoder: str) -> type[EncoderPlugin]:
    """The plugin class behind ``--encoder ENCODER=PROVIDER``; errors name the flag."""
    path = BUILTIN.get(provider, provider)
    module_name, sep, attr = path.partition(":")
    flag = f"--encoder {encoder}={provider}"
    if not sep:
        raise EncoderPluginError(
            f"{flag}: unknown built-in encoder {provider!r}; use one of "
            f"{', '.join(sorted(BUILTIN))} or an import path package.module:ClassName"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise EncoderPluginError(f"{flag}: cannot import {module_name!r} ({error})") from None
    plugin = module
    for part in attr.split("."):
        plugin = getattr(plugin, part, None)
        if plugin is None:
            raise EncoderPluginError(f"{flag}: {module_name!r} has no attribute {attr!r}")
    if not (isinstance(plugin, type) and issubclass(plugin, EncoderPlugin)):
        raise EncoderPluginError(
            f"{flag}: {path} is not a subclass of megatron_plugins.encoders.EncoderPlugin"
        )
    return plugin


def add_encoder_args(parser: argparse.ArgumentParser,
                     providers: Mapping[str, str]) -> argparse.ArgumentParser:
    """Register the flags of every plugin class named in ``providers`` (encoder -> provider).

    Each class registers its flags once, however many encoders use it.
    """
    seen: set[type[EncoderPlugin]] = set()
    for encoder, provider in providers.items():
        plugin = resolve(provider, encoder)
        if plugin not in seen:
            seen.add(plugin)
            plugin.add_arguments(parser)
    return parser
