"""Encoder plugins: how one modality plugs into the MiMo model, and how a provider is resolved.

An encoder is a subclass of :class:`~megatron_plugins.encoders.base.EncoderPlugin`. Built-ins are
named (``vit``, ``audio``, ``clip``, ``siglip``, ``whisper``, ``qwen2_5_vl``, ``qwen3_vl``,
``siglip2``, ``llava_next``, ``qwen2_5_omni_vision``, ``qwen2_5_omni_audio``,
``qwen3_omni_vision``, ``qwen3_omni_audio``); anything else is an import path
``package.module:ClassName`` given as
``--encoder NAME=package.module:ClassName``, so a user's encoder lives in the user's own file.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pickle
from collections.abc import Iterable

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.encoders.base import (
    EncoderPlugin,
    EncoderPluginError,
    MediaPreprocessor,
    encoder_config,
    is_replicated,
)
from megatron_plugins.parallel.layout import ModulePlacement

BUILTIN = {
    "vit": "megatron_plugins.encoders.vit:ViTEncoder",
    "audio": "megatron_plugins.encoders.audio:AudioFrameEncoder",
    "clip": "megatron_plugins.encoders.hf_vision:CLIPVisionEncoder",
    "siglip": "megatron_plugins.encoders.hf_vision:SiglipVisionEncoder",
    "whisper": "megatron_plugins.encoders.whisper:WhisperEncoder",
    "qwen2_5_vl": "megatron_plugins.encoders.qwen2_5_vision:Qwen2_5VisionEncoder",
    "qwen3_vl": "megatron_plugins.encoders.qwen3_vision:Qwen3VisionEncoder",
    "qwen3_5_vl": "megatron_plugins.encoders.qwen3_5_vision:Qwen3_5VisionEncoder",
    "siglip2": "megatron_plugins.encoders.siglip2:Siglip2VisionEncoder",
    "llava_next": "megatron_plugins.encoders.llava_next:LlavaNextEncoder",
    "qwen2_5_omni_vision": "megatron_plugins.encoders.qwen2_5_vision:Qwen2_5OmniVisionEncoder",
    "qwen2_5_omni_audio": "megatron_plugins.encoders.qwen2_5_omni_audio:Qwen2_5OmniAudioEncoder",
    "qwen3_omni_vision": "megatron_plugins.encoders.qwen3_vision:Qwen3OmniVisionEncoder",
    "qwen3_omni_audio": "megatron_plugins.encoders.qwen3_omni_audio:Qwen3OmniAudioEncoder",
}
"""Built-in provider names and the classes they stand for."""

__all__ = ["BUILTIN", "EncoderPlugin", "EncoderPluginError", "MediaPreprocessor",
           "add_encoder_args", "check_hooks", "encoder_config", "instantiate", "resolve"]


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
    if inspect.isabstract(plugin):
        raise EncoderPluginError(
            f"{flag}: {path} is abstract; implement "
            f"{', '.join(sorted(plugin.__abstractmethods__))}"
        )
    return plugin


def _hook_error(flag: str, plugin: type, hook: str, error: Exception) -> EncoderPluginError:
    message = str(error).splitlines()[0] if str(error) else ""
    return EncoderPluginError(f"{flag}: {plugin.__name__}.{hook} raised "
                              f"{type(error).__name__}: {message}")


def instantiate(provider: str, encoder: str, args: argparse.Namespace, grid: ModulePlacement,
                plugin_class: type[EncoderPlugin] | None = None) -> EncoderPlugin:
    """The plugin for ``--encoder ENCODER=PROVIDER`` (``plugin_class``: the class :func:`resolve`
    gave, when the caller resolved it already); an ``__init__`` or a shape property that raises is
    one line naming it."""
    plugin_class = plugin_class or resolve(provider, encoder)
    hook = "__init__"
    try:
        plugin = plugin_class(encoder, args, grid)
        for hook in ("num_attention_heads", "tokens_per_item"):
            getattr(plugin, hook)
    except EncoderPluginError:
        raise
    except Exception as error:  # noqa: BLE001 - a user's plugin may raise anything
        raise _hook_error(f"--encoder {encoder}={provider}", plugin_class, hook, error) from None
    return plugin


def check_hooks(plugin: EncoderPlugin, language: TransformerConfig) -> str | None:
    """Run the build-time hooks once before any process group, so one that raises is one line
    naming the plugin, not a traceback minutes in. Returns a notice if the encoder is replicated
    over its tp ranks instead of sharded."""
    flag = f"--encoder {plugin.name}={plugin.grid.provider}"
    hook = "transformer_config"
    try:
        config = plugin.transformer_config(language)
        hook = "encoder_spec"
        spec = plugin.encoder_spec(config, None)
        hook = "preprocessor"
        preprocessor = plugin.preprocessor()
    except EncoderPluginError:
        raise
    except Exception as error:  # noqa: BLE001 - a user's plugin may raise anything
        raise _hook_error(flag, type(plugin), hook, error) from None
    _check_preprocessor(flag, type(plugin), preprocessor)
    if not is_replicated(spec, plugin.grid.tp):
        return None
    return (f"{flag}: {spec.module.__name__} is a plain torch.nn.Module (no sharded_state_dict), "
            f"so each of its {plugin.grid.tp} tp ranks trains a full replica; make it a "
            "MegatronModule with tensor-parallel layers to shard it")


def _check_preprocessor(flag: str, plugin: type, preprocessor: object) -> None:
    """What the loader workers rely on: a MediaPreprocessor of a known media kind that pickles."""
    # Imported here: the data package imports the encoders, not the other way round.
    from megatron_plugins.media.codec import MEDIA_KINDS

    where = f"{flag}: {plugin.__name__}.preprocessor()"
    if not isinstance(preprocessor, MediaPreprocessor):
        raise EncoderPluginError(f"{where} returned {type(preprocessor).__name__}, not a "
                                 "megatron_plugins.encoders.MediaPreprocessor")
    media = getattr(preprocessor, "media", None)
    if media not in MEDIA_KINDS:
        raise EncoderPluginError(f"{where}: media {media!r} is not one of "
                                 f"{', '.join(MEDIA_KINDS)}; set the class attribute media")
    try:
        pickle.dumps(preprocessor)
    except Exception as error:  # noqa: BLE001 - pickling raises several types
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise EncoderPluginError(f"{where} cannot be pickled for the loader workers ({message}); "
                                 "keep plain attributes (numbers, strings, tuples)") from None


def add_encoder_args(parser: argparse.ArgumentParser,
                     classes: Iterable[type[EncoderPlugin]]) -> argparse.ArgumentParser:
    """Register the flags of every plugin class in ``classes`` (resolved by :func:`resolve`), once
    per class however many encoders use it."""
    for plugin in dict.fromkeys(classes):
        plugin.add_arguments(parser)
    return parser
