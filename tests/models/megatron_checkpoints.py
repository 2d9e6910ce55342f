"""torch_dist checkpoints for the Megatron-checkpoint init tests: written by hand (a few tensors
and saved ``args``, in one spawned process) and read back whole, whatever layout saved them."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.harness.multiprocess import run_in_processes


def _write_rank(jobs: list[tuple[str, dict[str, torch.Tensor], dict[str, Any]]]) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_plugins.cpu_simulation import patches

    patches.activate()  # the save synchronizes a CUDA device
    for folder, tensors, args in jobs:
        Path(folder).mkdir(parents=True, exist_ok=True)
        state: dict[str, Any] = {name: ShardedTensor.from_rank_offsets(name, tensor)
                                 for name, tensor in tensors.items()}
        state["args"] = argparse.Namespace(**args)
        dist_checkpointing.save(state, folder)


def write_checkpoints(jobs: list[tuple[Path, dict[str, torch.Tensor], dict[str, Any]]]) -> None:
    """Iteration folders each holding ``tensors`` under their keys and ``args`` as stock saves
    them, ``(folder, tensors, args)`` per job, written in one spawned process."""
    run_in_processes(_write_rank, 1, args=([(str(f), t, a) for f, t, a in jobs],), timeout=90,
                     simulated=True)


def read_rank(jobs: list[tuple[str, str]]) -> list[dict[str, np.ndarray]]:
    """Every model tensor of ``module`` in each ``(checkpoint folder, module)``, whole (stacked
    layers as saved), by name inside the module; the export tool's reader, in one process.
    Arrays, not tensors: a tensor's shared memory would not outlive this process."""
    from megatron.core import dist_checkpointing

    from megatron_plugins.weights.megatron_init import module_keys
    from tools.export_hf import Checkpoint, iteration_folder

    found = []
    for folder, module in jobs:
        checkpoint = Checkpoint(iteration_folder(Path(folder), None))
        keys = {name: key for name, key in module_keys(checkpoint.metadata, module).items()
                if not key.startswith("optimizer.")}
        found.append({name: dist_checkpointing.load({key: checkpoint.metadata[key]},
                                                     str(checkpoint.folder),
                                                     validate_access_integrity=False)[key]
                      .numpy() for name, key in keys.items()})
    return found


def read_modules(jobs: list[tuple[str, str]]) -> list[dict[str, np.ndarray]]:
    """:func:`read_rank` in a process forked from the simulated ranks' server (it starts a
    one-rank process group; the server has Megatron imported)."""
    [found] = run_in_processes(read_rank, 1, args=(jobs,), timeout=120, simulated=True)
    return found
