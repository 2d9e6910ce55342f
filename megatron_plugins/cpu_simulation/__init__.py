"""Opt-in CPU simulation of Megatron's stock training loop: what needs no torch.

The flag, the CPU-capable values of the GPU-only flags and the GPU-library warning filters are
read before torch is imported (the pre-import checks, the launch's defaults). The torch patches
live in :mod:`megatron_plugins.cpu_simulation.patches`; an entry point calls its ``activate()``
before Megatron is imported, when :data:`FLAG` is on the command line.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

__all__ = [
    "CPU_SIMULATION_VALUES", "FLAG", "add_cli_flag", "is_active", "quiet_gpu_library_warnings"
]

FLAG = "--cpu-simulation"

CPU_SIMULATION_VALUES = (
    ("transformer_impl", "local", "--transformer-impl local", "Transformer Engine needs a GPU"),
    ("gradient_accumulation_fusion", False, "--no-gradient-accumulation-fusion",
     "a fused CUDA kernel"),
    ("masked_softmax_fusion", False, "--no-masked-softmax-fusion", "a fused CUDA kernel"),
    ("apply_rope_fusion", False, "--no-rope-fusion", "a fused CUDA kernel"),
    ("no_persist_layer_norm", True, "--no-persist-layer-norm",
     "the persistent layer norm needs Apex on a GPU"),
    ("distributed_backend", "gloo", "--distributed-backend gloo", "NCCL needs GPUs"),
    ("moe_grouped_gemm", False, "drop the flag", "it needs Transformer Engine on a GPU"),
    ("moe_permute_fusion", False, "drop the flag",
     "it needs Transformer Engine on a GPU"),
    ("moe_router_fusion", False, "drop the flag", "it needs Transformer Engine on a GPU"),
)
"""(args attribute, CPU-capable value, the flag that sets it, why the stock value cannot run)."""

GPU_LIBRARY_WARNINGS = (
    r"(Transformer Engine and Apex are|Apex is) not installed",
    r"Only transformer-engine>=.* supports MoE experts",
    r"MimoModelConfig is experimental",
)
"""Import-time warnings of Megatron about GPU libraries, which the CPU simulation never has."""


def is_active() -> bool:
    """Whether this process runs under the CPU simulation (its patches were activated)."""
    patches = sys.modules.get(f"{__name__}.patches")
    return patches is not None and patches.active()


def quiet_gpu_library_warnings() -> None:
    """Hide warnings nobody can act on on the CPU simulation (~20 lines per rank), so that errors
    are what users see. Called by ``patches.activate()``, or before it by code that imports
    Megatron."""
    for message in GPU_LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def add_cli_flag(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register ``--cpu-simulation`` so stock parsers accept (and document) the flag.

    The flag itself is acted on before Megatron is imported: the MiMo launch's pre-import checks
    read it (``megatron_plugins.launch.preflight``), other entry points scan ``sys.argv`` for it.
    """
    group = parser.add_argument_group("megatron-plugins CPU simulation")
    group.add_argument(
        FLAG,
        action="store_true",
        help="Run the stock loop on CPU over gloo (testing and debugging; no GPU needed).",
    )
    return parser
