"""The advisor's assumptions: every figure its cost model takes that the hardware table and the
run's flags do not give, each printed with the flag that overrides it.

Compute: a module's FLOPs run at ``efficiency`` of the GPU's peak, and each of a layer's kernels
(five per forward: four matrix products and attention; ten per backward) costs ``kernel_us``
more, so narrow TP shards and small batches run slower. The host needs ``layer_overhead_ms`` per
layer to launch a forward (twice that for a backward); a pass takes the longer of its launch and
its GPU time. Measured on an H100 (benchmarks/advisor_assumptions.py, docs/performance.md):
bf16 products of transformer-layer shapes fit ``FLOPs / (0.82 x peak) + 15 us`` each within a
few percent, and plain PyTorch launches a layer's forward in 0.49 ms, its backward in 0.88 ms.
Communication: collectives reach ``link_efficiency`` of a link's nominal bandwidth and pay
``latency_us`` per ring step; gradient reduction hides ``grad_overlap`` of itself behind the
backward (with ``--overlap-grad-reduce``), context-parallel exchanges
``cp_overlap`` behind attention. Memory: tensors may use ``usable_memory`` of the GPU after
``reserved_gib`` for the CUDA context and communication buffers.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from megatron_plugins.errors import FlagError

__all__ = ["Assumptions", "add_assumption_args", "assumptions_from_args", "named_numbers"]


@dataclass(frozen=True)
class Assumptions:
    """What the cost model assumes; :meth:`lines` prints each with its flag."""

    efficiency: dict[str, float] = field(default_factory=dict)
    """Per module (``language`` or an encoder's name): the share of peak its FLOPs run at;
    modules not named take ``default_efficiency``."""
    default_efficiency: float = 0.65
    kernel_us: float = 15.0
    layer_overhead_ms: float = 0.5
    link_efficiency: float = 0.7
    latency_us: float = 10.0
    grad_overlap: float = 0.8
    cp_overlap: float = 0.5
    usable_memory: float = 0.9
    reserved_gib: float = 2.0
    optimizer_bytes_moved: float = 30.0
    """Bytes the optimizer step reads and writes per local parameter (memory-bound)."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where a module's efficiency came from when not the default (e.g. the profile)."""

    def module_efficiency(self, module: str) -> float:
        return self.efficiency.get(module, self.default_efficiency)

    def calibrated(self, efficiency: dict[str, float], source: str) -> Assumptions:
        """These assumptions with ``efficiency`` measured (by module) from ``source``."""
        return replace(self, efficiency={**self.efficiency, **efficiency},
                       sources={**self.sources, **{name: source for name in efficiency}})

    def lines(self, modules: list[str]) -> list[str]:
        """One line per assumption, naming the flag that overrides it."""
        found = []
        for module in modules:
            source = self.sources.get(module, "given" if module in self.efficiency else "default")
            found.append(f"{module} FLOPs run at {self.module_efficiency(module):.1%} of "
                         f"peak ({source}; --advise-efficiency {module}=F)")
        found += [
            f"each kernel of a layer costs {self.kernel_us:g} us more (5 per forward, 10 per "
            "backward; --advise-kernel-us)",
            f"the host launches a layer's forward in {self.layer_overhead_ms:g} ms, a backward "
            "in twice that; a pass takes the longer of launch and GPU time "
            "(--advise-layer-overhead-ms)",
            f"collectives reach {self.link_efficiency:.0%} of a link's nominal bandwidth "
            f"(--advise-link-efficiency), {self.latency_us:g} us per ring step "
            "(--advise-latency-us)",
            f"with --overlap-grad-reduce, {self.grad_overlap:.0%} of gradient reduction hides "
            "behind the backward (--advise-grad-overlap); without it, none",
            f"{self.cp_overlap:.0%} of context-parallel exchanges hide behind attention "
            "(--advise-cp-overlap)",
            f"tensors use {self.usable_memory:.0%} of GPU memory after {self.reserved_gib:g} GiB "
            "for the CUDA context and buffers (--advise-usable-memory, --advise-reserved-gib)",
            f"the optimizer step moves {self.optimizer_bytes_moved:g} bytes per local parameter "
            "through GPU memory (--advise-optimizer-bytes)",
            "sequence parallelism with TP > 1 on the language model; 1F1B pipeline schedule; "
            "layers split evenly over pipeline stages; an encoder's TP shards its activations",
        ]
        return found


_FLAGS = (
    ("--advise-kernel-us", "kernel_us", "Fixed GPU time per kernel of a layer."),
    ("--advise-layer-overhead-ms", "layer_overhead_ms", "Host time to launch a layer forward."),
    ("--advise-link-efficiency", "link_efficiency", "Fraction of nominal link bandwidth."),
    ("--advise-latency-us", "latency_us", "Latency per ring step of a collective."),
    ("--advise-grad-overlap", "grad_overlap", "Share of DP reduction hidden (with overlap)."),
    ("--advise-cp-overlap", "cp_overlap", "Share of CP exchanges hidden behind attention."),
    ("--advise-usable-memory", "usable_memory", "Share of GPU memory tensors may use."),
    ("--advise-reserved-gib", "reserved_gib", "GiB held by the CUDA context and buffers."),
    ("--advise-optimizer-bytes", "optimizer_bytes_moved", "Bytes moved per parameter by the "
                                                          "optimizer step."),
)
_FRACTIONS = {"link_efficiency", "grad_overlap", "cp_overlap", "usable_memory"}


def add_assumption_args(parser: argparse.ArgumentParser) -> None:
    """Register the flags that override :class:`Assumptions`."""
    group = parser.add_argument_group("mimo-plan --advise: cost model assumptions")
    group.add_argument("--advise-efficiency", action="append", default=[], metavar="MODULE=F",
                       help="Share of the peak a module's FLOPs run at (language or an "
                            "encoder's name). Repeatable.")
    for flag, attr, text in _FLAGS:
        group.add_argument(flag, dest=f"advise_{attr}", type=float, default=None, help=text)


def named_numbers(values: Sequence[str], flag: str, form: str,
                  valid: Callable[[float], bool]) -> dict[str, float]:
    """``NAME=NUMBER`` values of a repeatable flag by name; a malformed one, or a number
    ``valid`` refuses, is one line naming the flag and the ``form`` expected."""
    found = {}
    for text in values:
        name, sep, number = text.partition("=")
        try:
            value = float(number)
        except ValueError:
            value = float("nan")
        if not sep or not name or not valid(value):
            raise FlagError(f"{flag} {text}: give {form}")
        found[name] = value
    return found


def assumptions_from_args(args: Any) -> Assumptions:
    """The assumptions the parsed flags give; a value out of range is one line naming its flag."""
    values: dict[str, Any] = {}
    for flag, attr, _ in _FLAGS:
        value = getattr(args, f"advise_{attr}", None)
        if value is None:
            continue
        low_ok = value >= 0 if attr in ("layer_overhead_ms", "latency_us", "reserved_gib",
                                        "kernel_us", "grad_overlap", "cp_overlap") else value > 0
        if not low_ok or (attr in _FRACTIONS and value > 1):
            bound = "between 0 and 1" if attr in _FRACTIONS else "positive"
            raise FlagError(f"{flag} {value:g} must be {bound}")
        values[attr] = value
    efficiency = named_numbers(getattr(args, "advise_efficiency", None) or [],
                               "--advise-efficiency", "MODULE=F with F in (0, 1], e.g. "
                               "language=0.6", lambda value: 0 < value <= 1)
    return Assumptions(efficiency=efficiency, **values)
