"""The GPUs the advisor knows: dense bf16 peak, memory, memory bandwidth and links.

Figures are the vendors' nominal ones (sources by entry); what a run reaches of them is an
assumption of the cost model (:mod:`.assumptions`), printed and overridable. Bandwidths are per
GPU and per direction, in GB/s (1e9 bytes per second); memory is what the device reports, in GiB.
A run's own figures (``--peak-tflops``, ``--gpu-memory-gib``, ``--intra-node-gbps``,
``--inter-node-gbps``) replace the table's, or stand in for a GPU it lacks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from megatron_plugins.errors import FlagError

__all__ = ["FIGURES", "GPUS", "GpuSpec", "Hardware", "gpu_by_device_name", "gpu_by_name",
           "hardware"]


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model: ``peak_tflops`` dense bf16 (no sparsity), ``memory_gib`` as the device
    reports it, ``memory_gbps`` HBM bandwidth, ``intra_node_gbps`` to another GPU of its node
    (NVLink, else PCIe), ``inter_node_gbps`` to another node (its network adapter's share)."""

    name: str
    peak_tflops: float
    memory_gib: float
    memory_gbps: float
    intra_node_gbps: float
    inter_node_gbps: float
    device_names: str = ""
    """Regular expression matching ``torch.cuda.get_device_name()`` of this model."""


GPUS: dict[str, GpuSpec] = {spec.name: spec for spec in (
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS with sparsity (989 dense),
    # 80 GB HBM3 at 3.35 TB/s (torch reports 79.18 GiB on "NVIDIA H100 80GB HBM3"), NVLink
    # 900 GB/s (450 per direction); DGX H100: one 400 Gb/s ConnectX-7 per GPU (50 GB/s).
    GpuSpec("h100-sxm", 989.0, 79.2, 3350.0, 450.0, 50.0, r"H100 80GB HBM3|H100 SXM"),
    # Same datasheet (PCIe): BF16 1,513 with sparsity (756 dense), 80 GB HBM2e at 2.0 TB/s,
    # PCIe Gen5 x16 (64 GB/s per direction); a 200 Gb/s adapter per GPU (25 GB/s).
    GpuSpec("h100-pcie", 756.0, 79.2, 2000.0, 64.0, 25.0, r"H100 PCIe"),
    # Same datasheet (NVL): BF16 1,671 with sparsity (835 dense), 94 GB HBM3 at 3.9 TB/s, NVLink
    # bridge 600 GB/s (300 per direction).
    GpuSpec("h100-nvl", 835.0, 93.0, 3900.0, 300.0, 25.0, r"H100 NVL"),
    # NVIDIA H200 datasheet (SXM): BF16 1,979 with sparsity (989 dense), 141 GB HBM3e at
    # 4.8 TB/s, NVLink 900 GB/s; DGX H200: 400 Gb/s ConnectX-7 per GPU.
    GpuSpec("h200", 989.0, 139.8, 4800.0, 450.0, 50.0, r"(?<!G)H200(?! NVL)"),
    # Same datasheet (NVL): BF16 1,671 with sparsity (835 dense), NVLink bridge 900 GB/s.
    GpuSpec("h200-nvl", 835.0, 139.8, 4800.0, 450.0, 25.0, r"H200 NVL"),
    # NVIDIA GH200 Grace Hopper Superchip datasheet: the H100's 989 dense BF16, 96 GB HBM3 at
    # 4 TB/s (the 144 GB HBM3e model: give --gpu-memory-gib), NVLink 900 GB/s between superchips.
    GpuSpec("gh200", 989.0, 94.5, 4000.0, 450.0, 50.0, r"GH200"),
    # NVIDIA A100 datasheet (SXM4 80GB): BF16 312 dense, 2,039 GB/s HBM2e, NVLink 600 GB/s
    # (300 per direction); DGX A100: one 200 Gb/s HDR adapter per GPU (25 GB/s).
    GpuSpec("a100-80gb", 312.0, 79.2, 2039.0, 300.0, 25.0, r"A100.*80GB"),
    # Same datasheet (SXM4 40GB): 1,555 GB/s HBM2.
    GpuSpec("a100-40gb", 312.0, 39.4, 1555.0, 300.0, 25.0, r"A100.*40GB"),
    # NVIDIA DGX B200 datasheet: 72 PFLOPS FP8 training for 8 GPUs (4.5 dense FP8, 2.25 dense
    # BF16 per GPU), 1,440 GB HBM3e (180 GB per GPU) at 8 TB/s, NVLink 5 1.8 TB/s (900 per
    # direction), 400 Gb/s ConnectX-7 per GPU.
    GpuSpec("b200", 2250.0, 178.4, 8000.0, 900.0, 50.0, r"(?<!G)B200"),
    # NVIDIA GB200 NVL72 datasheet: BF16 360 PFLOPS with sparsity for 72 GPUs (2.5 dense per
    # GPU), 186 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s across the rack (give --gpus-per-node 72
    # for one NVLink domain), 400 Gb/s ConnectX-7 per GPU beyond it.
    GpuSpec("gb200", 2500.0, 184.0, 8000.0, 900.0, 50.0, r"GB200"),
    # NVIDIA L40S datasheet: BF16 362 dense (733 with sparsity), 48 GB GDDR6 at 864 GB/s,
    # PCIe Gen4 x16 (32 GB/s per direction), no NVLink; a 200 Gb/s adapter per GPU assumed.
    GpuSpec("l40s", 362.0, 44.4, 864.0, 32.0, 25.0, r"L40S"),
)}
"""Known GPUs by the name ``--gpu`` takes."""

ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb"}


def gpu_by_name(name: str) -> GpuSpec:
    """The spec ``--gpu NAME`` names (case-insensitive); an unknown name lists the known."""
    key = name.lower()
    key = ALIASES.get(key, key)
    if key not in GPUS:
        raise FlagError(f"--gpu {name}: unknown GPU; known: {', '.join(GPUS)} (or give its "
                        "figures: --peak-tflops, --gpu-memory-gib, --intra-node-gbps, "
                        "--inter-node-gbps)")
    return GPUS[key]


def gpu_by_device_name(device_name: str) -> GpuSpec | None:
    """The spec of a device as ``torch.cuda.get_device_name()`` names it, or None."""
    return next((spec for spec in GPUS.values()
                 if re.search(spec.device_names, device_name, re.IGNORECASE)), None)


@dataclass(frozen=True)
class Hardware:
    """The machines a layout runs on: ``gpus`` in all, ``gpus_per_node`` to a node, each a
    :class:`GpuSpec`."""

    gpu: GpuSpec
    gpus: int
    gpus_per_node: int

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    @property
    def fewest_gpus(self) -> int:
        """The fewest ranks a candidate may use: every node of the allocation, the last at least
        in part (all of them on one node)."""
        return self.gpus - self.gpus_per_node + 1 if self.gpus > self.gpus_per_node else self.gpus


FIGURES = (("peak_tflops", "--peak-tflops"), ("memory_gib", "--gpu-memory-gib"),
           ("intra_node_gbps", "--intra-node-gbps"), ("inter_node_gbps", "--inter-node-gbps"))
"""The figures a command line may give instead of (or over) a known GPU's."""


def hardware(gpus: int, gpus_per_node: int, name: str | None,
             figures: dict[str, float | None]) -> Hardware:
    """Check ``--gpus``/``--gpus-per-node`` and build the hardware from ``--gpu`` and the given
    ``figures`` (by :class:`GpuSpec` field); each mistake is one line naming the flag."""
    if gpus < 1:
        raise FlagError(f"--gpus {gpus}: give the number of GPUs to plan for (>= 1)")
    if gpus_per_node < 1:
        raise FlagError(f"--gpus-per-node {gpus_per_node}: give the GPUs of one node (>= 1)")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        lower = gpus // gpus_per_node * gpus_per_node
        raise FlagError(f"--gpus {gpus} is more than one node of --gpus-per-node "
                        f"{gpus_per_node} but not whole nodes; give {lower} or "
                        f"{lower + gpus_per_node} (a layout may leave GPUs of the last node idle)")
    for field, flag in FIGURES:
        value = figures.get(field)
        if value is not None and value <= 0:
            raise FlagError(f"{flag} {value:g} must be positive")
    given = {field: value for field, value in figures.items() if value is not None}
    if name is not None:
        spec = replace(gpu_by_name(name), **given)
    else:
        missing = [flag for field, flag in FIGURES if field not in given]
        if missing:
            raise FlagError(f"--gpu is not given: name a known GPU ({', '.join(GPUS)}) or give "
                            f"its figures ({', '.join(missing)} missing)")
        spec = GpuSpec("custom", memory_gbps=2000.0, **given)
    return Hardware(spec, gpus, gpus_per_node)
