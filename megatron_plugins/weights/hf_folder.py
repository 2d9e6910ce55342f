"""A HF checkpoint folder on local disk: ``config.json`` and memory-mapped safetensors.

Tensors are opened with ``safe_open`` and read with ``get_slice``, so a rank reads only the rows
it asks for; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from megatron_plugins.weights.hf_config import read_config
from megatron_plugins.weights.mapping import HFWeightsError

__all__ = ["HFCheckpoint", "holds_weights"]

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def holds_weights(folder: str | Path) -> bool:
    """Whether ``folder`` has safetensors weights (a single file or an index), not only its
    config.json (a recipe's config-only folder, which ``mimo-plan`` can plan with)."""
    return (Path(folder) / SINGLE).is_file() or (Path(folder) / INDEX).is_file()


class HFCheckpoint:
    """The safetensors files of one HF folder (single file or sharded with an index)."""

    def __init__(self, folder: str | Path, flag: str) -> None:
        self.folder = Path(folder)
        self.flag = flag
        self.config = read_config(folder, flag)
        index = self.folder / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise HFWeightsError(f"{flag} {index}: not a JSON index with a weight_map "
                                     f"({error}); copy the folder again") from None
        elif (self.folder / SINGLE).is_file():
            weight_map = None
        else:
            raise HFWeightsError(f"{flag} {folder}: neither {SINGLE} nor {INDEX} is there")
        self._handles: dict[str, Any] = {}
        if weight_map is None:
            names = self._open(SINGLE).keys()
            weight_map = {name: SINGLE for name in names}
        for file in sorted(set(weight_map.values())):
            if not (self.folder / file).is_file():
                raise HFWeightsError(f"{flag} {folder}: {file}, listed in {INDEX}, is missing")
        self.weight_map: dict[str, str] = dict(weight_map)

    def _open(self, file: str) -> Any:
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(self.folder / file), framework="pt")
            except Exception as error:  # noqa: BLE001 - safetensors raises several kinds
                raise HFWeightsError(f"{self.flag} {self.folder / file}: not a readable "
                                     f"safetensors file ({error}); copy the folder again") from None
        return self._handles[file]

    def check_files(self) -> None:
        """Open every safetensors file now, so a truncated or corrupt one is one line before any
        process group: safetensors checks the header length, that the JSON header parses, and
        that the tensors' data offsets cover the file exactly."""
        for file in sorted(set(self.weight_map.values())):
            self._open(file)

    def names(self) -> set[str]:
        return set(self.weight_map)

    def _slice(self, name: str) -> Any:
        return self._open(self.weight_map[name]).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype | str:
        """The stored dtype (the safetensors code when torch has no such dtype)."""
        code = self._slice(name).get_dtype()
        return SAFETENSORS_DTYPES.get(code, code)

    def read(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows ``[start, start + length)`` on ``dim`` (``length`` -1: the whole tensor)."""
        view = self._slice(name)
        if length < 0:
            return view[:]
        index = [slice(None)] * dim + [slice(start, start + length)]
        return view[tuple(index)]
