"""HuggingFace weights in and out of MiMo and stock GPT models, at any layout.

``mapping`` holds the data format (:class:`Rule`, :class:`Family`), ``language_families`` the
language tables, ``hf_import`` the per-rank import, ``streaming`` the per-rank export pieces that
``tools/export_hf.py`` writes, ``flags`` the per-module flags. :func:`load_pretrained` is what the
MiMo builder calls once the model is built, before DDP wraps it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_plugins.weights.mapping import Family, HFWeightsError, Rule

__all__ = ["Family", "HFWeightsError", "Rule", "load_pretrained"]


def load_pretrained(model: Any, module_pgs: Mapping[str, Any], language_folder: str | None,
                    encoder_folders: Mapping[str, str], plugins: Mapping[str, Any]) -> None:
    """Load each HF folder into this rank's module of the (unwrapped) ``MimoModel``."""
    from megatron_plugins.layout import LANGUAGE
    from megatron_plugins.weights.encoder_view import encoder_module
    from megatron_plugins.weights.flags import ENCODER_FLAG, LANGUAGE_FLAG, encoder_family
    from megatron_plugins.weights.hf_import import load_hf_weights
    from megatron_plugins.weights.language_families import FAMILIES

    for name, pgc in module_pgs.items():
        if name == LANGUAGE and language_folder:
            load_hf_weights(model.language_model, language_folder, LANGUAGE_FLAG, pgc, FAMILIES)
        elif name in encoder_folders:
            family = encoder_family(plugins[name])
            module = encoder_module(model.modality_submodules[name], name, family)
            load_hf_weights(module, encoder_folders[name], f"{ENCODER_FLAG} {name}=", pgc,
                            (family,))
