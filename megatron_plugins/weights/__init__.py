"""HuggingFace weights in and out of MiMo and stock GPT models, at any layout.

``mapping`` holds the data format (:class:`Rule`, :class:`Family`), ``language_families`` the
language tables, ``hf_import`` the per-rank import, ``streaming`` the per-rank export pieces that
``tools/export_hf.py`` writes, ``flags`` the per-module flags, ``vlm_families`` the whole-VLM
tables (``--hf-model``). :func:`load_pretrained` is what the MiMo builder calls once the model is
built, before DDP wraps it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_plugins.weights.mapping import Family, HFWeightsError, Rule

__all__ = ["Family", "HFWeightsError", "Rule", "load_pretrained"]


def load_pretrained(model: Any, module_pgs: Mapping[str, Any], language_folder: str | None,
                    encoder_folders: Mapping[str, str], plugins: Mapping[str, Any],
                    hf_model: str | None = None) -> None:
    """Load each HF folder into this rank's module of the (unwrapped) ``MimoModel``; a whole
    VLM folder (``hf_model``) into the encoders holding its towers, their projections and the
    language model, each rank reading only its slices."""
    from megatron_plugins.parallel.layout import LANGUAGE
    from megatron_plugins.weights.encoder_view import encoder_module
    from megatron_plugins.weights.flags import ENCODER_FLAG, LANGUAGE_FLAG, encoder_family
    from megatron_plugins.weights.hf_import import load_hf_weights
    from megatron_plugins.weights.language_families import FAMILIES

    whole = [name for name, folder in encoder_folders.items() if hf_model and folder == hf_model]
    for name, pgc in module_pgs.items():
        if whole and name in (LANGUAGE, *whole):
            tower = plugins[name if name in whole else whole[0]]
            _load_whole(model, name, pgc, hf_model, encoder_family(tower))
        elif name == LANGUAGE and language_folder:
            load_hf_weights(model.language_model, language_folder, LANGUAGE_FLAG, pgc, FAMILIES)
        elif name in encoder_folders:
            family = encoder_family(plugins[name])
            module = encoder_module(model.modality_submodules[name], name, family)
            load_hf_weights(module, encoder_folders[name], f"{ENCODER_FLAG} {name}=", pgc,
                            (family,))


def _load_whole(model: Any, name: str, pgc: Any, folder: str, tower: Family) -> None:
    """This rank's module of a whole VLM folder: the language model, or the tower and the
    projector of the encoder holding it."""
    from megatron_plugins.parallel.layout import LANGUAGE
    from megatron_plugins.weights.hf_folder import HFCheckpoint
    from megatron_plugins.weights.hf_import import load_hf_weights
    from megatron_plugins.weights.vlm_families import HF_MODEL_FLAG, find_vlm, part_families

    checkpoint = HFCheckpoint(folder, HF_MODEL_FLAG)
    vlm = find_vlm(checkpoint.config, f"{HF_MODEL_FLAG} {folder}/config.json")
    parts = part_families(vlm, checkpoint.config, tower, checkpoint.names())
    if name == LANGUAGE:
        load_hf_weights(model.language_model, folder, HF_MODEL_FLAG, pgc, (parts.language,))
        return
    submodule = model.modality_submodules[name]
    load_hf_weights(submodule.encoders[name], folder, HF_MODEL_FLAG, pgc, (parts.tower,))
    load_hf_weights(submodule.input_projections, folder, HF_MODEL_FLAG, pgc, (parts.projector,))
