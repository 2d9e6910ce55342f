"""A HF folder's ``config.json`` and the family that accepts it (no torch import: the launch's
pre-import checks read it)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_plugins.weights.mapping import Family, HFWeightsError

__all__ = ["find_family", "read_config"]


def read_config(folder: str | Path, flag: str) -> dict[str, Any]:
    """``config.json`` of ``folder``; a missing or unreadable one names the flag that gave it."""
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise HFWeightsError(f"{flag} {folder}: no such folder")
    if not path.is_file():
        raise HFWeightsError(f"{flag} {folder}: no config.json there (a HF model folder has "
                             "config.json and model.safetensors or an index)")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise HFWeightsError(f"{flag} {path}: unreadable ({error})") from None


def find_family(config: dict[str, Any], families: Sequence[Family], where: str) -> Family:
    """The family accepting this config's ``architectures`` (or ``model_type``)."""
    architectures = config.get("architectures") or []
    for family in families:
        if set(architectures) & set(family.architectures):
            return family
    for family in families:
        if not architectures and config.get("model_type") == family.model_type:
            return family
    supported = ", ".join(a for family in families for a in family.architectures)
    found = ", ".join(architectures) or config.get("model_type") or "none"
    raise HFWeightsError(f"{where}: architecture {found} is not supported; supported: {supported}")
