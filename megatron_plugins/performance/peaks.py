"""The peak a run's MFU is measured against: ``--peak-tflops``, or the device's dense bf16 peak
from a table of known GPUs, matched on the name ``torch.cuda.get_device_name()`` reports.

Figures are NVIDIA's datasheet dense (not 2:4 sparse) BF16 Tensor Core peaks per GPU: H100 SXM
and H200 989 TFLOP/s, H100 / H200 NVL 835, H100 PCIe 756, GH200 989, A100 312, B200 2250,
GB200 2500, L40S 362. The CPU simulation has no peak: MFU is then shown only with
``--peak-tflops``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KNOWN_PEAKS", "Peak", "peak_for"]

KNOWN_PEAKS: tuple[tuple[tuple[str, ...], str, float], ...] = (
    (("GH200",), "GH200", 989.0),
    (("GB200",), "GB200", 2500.0),
    (("H100", "PCIE"), "H100 PCIe", 756.0),
    (("H100", "NVL"), "H100 NVL", 835.0),
    (("H100",), "H100 SXM", 989.0),
    (("H200", "NVL"), "H200 NVL", 835.0),
    (("H200",), "H200", 989.0),
    (("A100",), "A100", 312.0),
    (("B200",), "B200", 2250.0),
    (("L40S",), "L40S", 362.0),
)
"""(every word a device name must contain, upper case; the GPU; dense bf16 TFLOP/s), first match
wins (GH200 before H200, the PCIe and NVL H100 before the SXM one)."""


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
    name = device.upper()
    for words, gpu, tflops in KNOWN_PEAKS:
        if all(word in name for word in words):
            return Peak(tflops, f"{gpu} dense bf16 peak")
    known = ", ".join(gpu for _, gpu, _ in KNOWN_PEAKS)
    return Peak(None, "none", f"no MFU: {device!r} has no known peak (known: {known}); give "
                              "--peak-tflops X, the peak TFLOP/s of one device")
