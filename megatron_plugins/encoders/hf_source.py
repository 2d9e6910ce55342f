"""The HF folder a pretrained encoder provider is built from (``--encoder-hf-weights NAME=DIR``):
finding it among the flag's values, reading its JSON files and its transformers config, with
errors that start by naming the flag."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_plugins.encoders.base import EncoderPluginError
from megatron_plugins.parallel.module_values import module_values
from megatron_plugins.weights.flags import ENCODER_FLAG

__all__ = ["HFSource"]


@dataclass(frozen=True)
class HFSource:
    """One encoder's HF folder; ``where`` (the flag and value) starts every error about it."""

    folder: Path
    where: str

    @classmethod
    def of(cls, name: str, provider: str, args: argparse.Namespace, what: str) -> "HFSource":
        """Encoder ``name``'s folder; ``what`` describes the folder the provider needs, for the
        error when there is none."""
        folders = module_values(getattr(args, "encoder_hf_weights", None), ENCODER_FLAG,
                                EncoderPluginError)
        if name not in folders:
            raise EncoderPluginError(f"--encoder {name}={provider} needs {ENCODER_FLAG} "
                                     f"{name}=DIR, {what} (its config.json shapes the encoder)")
        folder = Path(folders[name])
        return cls(folder, f"{ENCODER_FLAG} {name}={folder}")

    def read_json(self, filename: str) -> dict[str, Any] | None:
        """The folder's JSON file ``filename``, None when it has none."""
        path = self.folder / filename
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise EncoderPluginError(f"{self.where}: {filename} is unreadable JSON "
                                     f"({error})") from None

    def hf_config(self, model_type: str, fields: dict[str, Any]) -> Any:
        """transformers' config of ``model_type`` from ``fields`` (its defaults fill the rest)."""
        from huggingface_hub.errors import StrictDataclassError
        from transformers import AutoConfig

        try:
            return AutoConfig.for_model(model_type, **fields)
        except (TypeError, ValueError, StrictDataclassError) as error:
            reason = " ".join(str(error).split())
            raise EncoderPluginError(f"{self.where}: config.json rejected by transformers: "
                                     f"{reason}") from None
