"""The peak a run's MFU is measured against: ``--peak-tflops``, or the device's dense bf16 peak
from the known GPUs' table (:data:`.gpus.GPUS`, the advisor's), matched on the name
``torch.cuda.get_device_name()`` reports. The CPU simulation has no peak: MFU is then shown only
with ``--peak-tflops``.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_plugins.performance.gpus import GPUS, gpu_by_device_name

__all__ = ["Peak", "peak_for"]


@dataclass(frozen=True)
class Peak:
    """The peak MFU divides by, or why there is none (``notice``, to show once)."""

    tflops: float | None
    source: str
    notice: str | None = None


def peak_for(device: str, given: float | None) -> Peak:
    """The peak for ``device`` (a CUDA device name, or ``"cpu-simulation"``) unless ``given``
    (``--peak-tflops``, already checked positive) says it."""
    if given is not None:
        return Peak(given, "--peak-tflops")
    spec = gpu_by_device_name(device)
    if spec is not None:
        return Peak(spec.peak_tflops, f"{spec.name} dense bf16 peak")
    return Peak(None, "none", f"no MFU: {device!r} has no known peak (known: {', '.join(GPUS)}); "
                              "give --peak-tflops X, the peak TFLOP/s of one device")
