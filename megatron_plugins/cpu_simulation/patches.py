"""The torch patches of the CPU simulation (gloo instead of NCCL, CPU as the GPU).

Every process sees exactly one "CUDA device" and that device is the CPU: ``torch.cuda`` device,
stream, event, memory and RNG calls get CPU stand-ins, tensors asked for on ``cuda`` land on the
CPU, NCCL process groups become gloo groups, and the two spots of ``megatron.training`` that need a
real GPU (the CUDA assertion in ``initialize_megatron`` and the JIT warm-up) are bypassed. Nothing
in Megatron's files is edited. Importing this module patches nothing; call :func:`activate` before
Megatron is imported. ``torch.cuda.is_available()`` stays False on purpose: optimizers consult
``torch.accelerator`` through it and must keep running their CPU kernels.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
import time
import types
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from megatron_plugins.cpu_simulation import quiet_gpu_library_warnings

__all__ = ["activate", "active"]

_active = False
_device_mode: TorchFunctionMode | None = None


def active() -> bool:
    """Whether :func:`activate` ran in this process."""
    return _active


def activate() -> None:
    """Switch this process to the CPU simulation. Idempotent; prints one banner per process."""
    global _active
    # Stock validate_args requires this for TP > 1; it only matters for real CUDA streams. Set on
    # every call: a process forked from an active one may have been given another environment.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if _active:
        return
    quiet_gpu_library_warnings()
    _patch_torch_cuda()
    _patch_process_groups()
    _enter_device_mode()
    _patch_megatron()
    _active = True
    rank = os.environ.get("RANK", "0")
    print(
        f"[megatron-plugins] rank {rank}: CPU simulation active (CPU stands in for one CUDA "
        "device per process, NCCL groups run on gloo). Not for production training.",
        file=sys.stderr,
        flush=True,
    )


# --------------------------------------------------------------------------------------------
# torch.cuda stand-ins


class _SimStream:
    """A CUDA stream on the CPU: every operation is already complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = torch.device("cpu")

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_SimEvent":
        event = event or _SimEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> "_SimStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _SimEvent:
    """A CUDA event on the CPU: records wall-clock time so elapsed_time() stays meaningful."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._time: float | None = None

    def record(self, stream: Any = None) -> None:
        self._time = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_SimEvent") -> float:
        return ((end._time or 0.0) - (self._time or 0.0)) * 1000.0


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _returning(value: Any) -> Any:
    """A fresh function returning ``value``: torch's compiler rejects one object under two names."""
    return lambda *args, **kwargs: value


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    generator = torch.default_generator
    total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    properties = types.SimpleNamespace(
        name="CPU (megatron-plugins CUDA simulation)",
        total_memory=total_memory,
        major=8,
        minor=0,
        multi_processor_count=os.cpu_count() or 1,
    )
    replacements: dict[str, Any] = {
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": _returning(None),
        "is_initialized": _returning(True),
        "_lazy_init": _returning(None),
        "_lazy_call": lambda callable_, **kwargs: callable_(),
        "synchronize": _returning(None),
        "empty_cache": _returning(None),
        "ipc_collect": _returning(None),
        "reset_peak_memory_stats": _returning(None),
        "reset_max_memory_allocated": _returning(None),
        "memory_allocated": _returning(0),
        "max_memory_allocated": _returning(0),
        "memory_reserved": _returning(0),
        "max_memory_reserved": _returning(0),
        "memory_stats": lambda *a, **k: {},
        "mem_get_info": lambda *a, **k: (total_memory, total_memory),
        "get_device_properties": lambda *a, **k: properties,
        "get_device_name": lambda *a, **k: properties.name,
        "get_device_capability": lambda *a, **k: (properties.major, properties.minor),
        "Stream": _SimStream,
        "Event": _SimEvent,
        "current_stream": lambda *a, **k: _SimStream(),
        "default_stream": lambda *a, **k: _SimStream(),
        "stream": lambda *a, **k: contextlib.nullcontext(),
        "device": lambda *a, **k: contextlib.nullcontext(),
        # The one "CUDA" generator is the CPU default generator: tensors that Megatron asks for on
        # cuda are drawn on the CPU, so its RNG tracker must fork the generator those draws use.
        "default_generators": (generator,),
        "manual_seed": lambda seed: generator.manual_seed(seed),
        "manual_seed_all": lambda seed: generator.manual_seed(seed),
        "seed": lambda: generator.seed(),
        "seed_all": lambda: generator.seed(),
        "initial_seed": lambda: generator.initial_seed(),
        "get_rng_state": lambda device="cuda": generator.get_state(),
        "set_rng_state": lambda new_state, device="cuda": generator.set_state(new_state),
        "get_rng_state_all": lambda: [generator.get_state()],
        "set_rng_state_all": lambda states: generator.set_state(states[0]),
    }
    for name, value in replacements.items():
        setattr(cuda, name, value)
    for name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all", "seed",
                 "initial_seed", "get_rng_state_all", "set_rng_state_all", "seed_all"):
        setattr(cuda.random, name, replacements[name])
    # Tensor.record_stream takes a real torch.cuda.Stream; on the CPU there is nothing to record.
    torch.Tensor.record_stream = _noop


# --------------------------------------------------------------------------------------------
# Device arguments -> CPU


def _is_accelerator_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _to_cpu_device(device: Any) -> Any:
    return torch.device("cpu") if _is_accelerator_device(device) else device


class _CpuDeviceMode(TorchFunctionMode):
    """Maps every device argument naming CUDA to the CPU; CPU tensors report CUDA types."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_accelerator_device(args[1]):
            args = (args[0], torch.device("cpu"), *args[2:])
        if func is dist.all_to_all_single:
            # MoE dispatch moves split sizes to host memory only for CUDA tensors (as numpy);
            # CPU tensors stay tensors, which c10d does not accept as split sizes.
            for key in ("output_split_sizes", "input_split_sizes"):
                if isinstance(kwargs.get(key), torch.Tensor):
                    kwargs[key] = kwargs[key].tolist()
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(result, str):
            # Megatron asserts main grads are "torch.cuda.FloatTensor".
            return result.replace("torch.", "torch.cuda.", 1)
        return result


def _enter_device_mode() -> None:
    global _device_mode
    _device_mode = _CpuDeviceMode()
    _device_mode.__enter__()


# --------------------------------------------------------------------------------------------
# Process groups: NCCL -> gloo


def _gloo_backend(backend: Any) -> Any:
    if backend is None:
        return None
    text = str(backend).lower()
    return "gloo" if "nccl" in text or "cuda" in text else backend


def _on_gloo(original: Any) -> Any:
    """Wrap a c10d group constructor so NCCL requests become gloo and NCCL-only options drop."""
    signature = inspect.signature(original)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        call = signature.bind_partial(*args, **kwargs).arguments
        call["backend"] = _gloo_backend(call.get("backend")) or "gloo"
        call.pop("pg_options", None)
        call.pop("device_id", None)
        return original(**call)

    return wrapper


def _patch_process_groups() -> None:
    c10d = dist.distributed_c10d
    init_process_group = _on_gloo(c10d.init_process_group)
    new_group = _on_gloo(c10d.new_group)
    for module in (dist, c10d):
        module.init_process_group = init_process_group
        module.new_group = new_group


# --------------------------------------------------------------------------------------------
# Megatron


class _DropForkWarning(logging.Filter):
    """The CUDA and CPU generators are one generator here, so this stock warning is always noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _patch_megatron() -> None:
    torch._dynamo.config.disable = True
    import megatron.training.initialize as initialize
    import megatron.training.training as training

    stock_initialize = training.initialize_megatron

    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return stock_initialize(*args, **kwargs)

    training.initialize_megatron = initialize_megatron
    # The warm-up builds CUDA tensors and compiled fusions; its results are never used on CPU.
    initialize._warmup_jit_function = _noop
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_DropForkWarning())

