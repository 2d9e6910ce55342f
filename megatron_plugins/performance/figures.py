"""The throughput figures of one log interval, from every rank's row of the interval meter.

Definitions (docs/performance.md, "Throughput in the log"):

- the interval's seconds: the longest total of training-step time over the ranks (evaluation and
  logging between steps excluded);
- tokens/s: the language model's real tokens (padding excluded) per second; active tokens/s/GPU:
  that over the ranks that computed anything;
- TFLOP/s/GPU: model FLOPs (forward and backward of the batches the run consumed, recomputation
  excluded) per second, per module over its ranks and in total over the world; MFU: the total
  over the GPU's dense bf16 peak;
- busy share of a grid: its ranks' mean share of their step spent in its own forward and
  backward; wait share: the same for waiting on another grid or pipeline stage;
- replica imbalance of an encoder with several data-parallel replicas: the largest replica's
  compute seconds (and tokens) over the replicas' mean.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from megatron_plugins.parallel.layout import LANGUAGE, ParallelLayout
from megatron_plugins.performance.meter import Columns

__all__ = ["Figures", "interval_figures"]


@dataclass(frozen=True)
class Figures:
    """One log interval's throughput (see the module docstring); per-module dicts follow the
    layout's order. ``flops`` holds the modules that count their FLOPs only."""

    iterations: int
    seconds: float
    tokens_per_second: float
    active_tokens_per_second_per_gpu: float
    flops: dict[str, float]
    tflops_per_gpu: dict[str, float]
    total_tflops_per_gpu: float
    mfu: float | None
    busy: dict[str, float]
    wait: dict[str, float]
    imbalance: dict[str, tuple[float | None, float | None]]
    """Per encoder with several replicas: (compute, tokens) max over mean."""

    @property
    def total_flops(self) -> float:
        return sum(self.flops.values())

    def log_fields(self) -> str:
        """What goes on stock's log line, in its ``name: value |`` style."""
        tflops = ", ".join([*(f"{name} {value:.3g}" for name, value in self.tflops_per_gpu.items()),
                            f"total {self.total_tflops_per_gpu:.3g}"])
        fields = [f"tokens/s: {self.tokens_per_second:.1f}",
                  f"active tokens/s/GPU: {self.active_tokens_per_second_per_gpu:.1f}",
                  f"model FLOPs: {self.total_flops:.6E}",
                  f"TFLOP/s/GPU: {tflops}"]
        if self.mfu is not None:
            fields.append(f"MFU: {self.mfu:.1%}")
        fields.append("busy: " + ", ".join(f"{n} {v:.1%}" for n, v in self.busy.items()))
        fields.append("waiting: " + ", ".join(f"{n} {v:.1%}" for n, v in self.wait.items()))
        for name, (compute, tokens) in self.imbalance.items():
            fields.append(f"{name} replica imbalance: compute {_ratio(compute)}, tokens "
                          f"{_ratio(tokens)}")
        return "".join(f" {field} |" for field in fields)

    def scalars(self) -> dict[str, float]:
        """TensorBoard / W&B scalars, by tag."""
        values = {"mimo/tokens-per-second": self.tokens_per_second,
                  "mimo/active-tokens-per-second-per-gpu": self.active_tokens_per_second_per_gpu,
                  "mimo/model-flops": self.total_flops,
                  "mimo/tflops-per-gpu": self.total_tflops_per_gpu}
        if self.mfu is not None:
            values["mimo/mfu"] = self.mfu
        for name, value in self.flops.items():
            values[f"mimo/model-flops/{name}"] = value
        for name, value in self.tflops_per_gpu.items():
            values[f"mimo/tflops-per-gpu/{name}"] = value
        for name, value in self.busy.items():
            values[f"mimo/busy-share/{name}"] = value
        for name, value in self.wait.items():
            values[f"mimo/wait-share/{name}"] = value
        for name, (compute, tokens) in self.imbalance.items():
            for what, value in (("compute", compute), ("tokens", tokens)):
                if value is not None:
                    values[f"mimo/replica-imbalance-{what}/{name}"] = value
        return values


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _max_over_mean(values: Sequence[float]) -> float | None:
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else None


def interval_figures(rows: Sequence[Sequence[float]], columns: Columns, layout: ParallelLayout,
                     counted: Collection[str], peak_tflops: float | None) -> Figures:
    """The figures of the interval whose ``[world, columns]`` rows the meter gathered;
    ``counted``: the modules that count their FLOPs; ``peak_tflops``: per GPU (None: no MFU)."""
    world = len(rows)
    seconds = max(row[columns.step_seconds] for row in rows)
    iterations = int(max(row[columns.steps] for row in rows))

    def total(module: str, what: str) -> float:
        return sum(row[columns.of(module, what)] for row in rows)

    def share(module: str, what: str) -> float:
        ranks = [rank for rank in layout.module(module).ranks if rows[rank][columns.step_seconds]]
        return sum(rows[rank][columns.of(module, what)] / rows[rank][columns.step_seconds]
                   for rank in ranks) / len(ranks) if ranks else 0.0

    names = [module.name for module in layout.modules]
    active = sum(any(row[columns.of(name, "compute")] > 0 for name in names) for row in rows)
    per_second = 1.0 / seconds if seconds > 0 else 0.0
    tokens_per_second = total(LANGUAGE, "tokens") * per_second
    flops = {name: total(name, "flops") for name in names if name in counted}
    tflops = {name: value * per_second / len(layout.module(name).ranks) / 1e12
              for name, value in flops.items()}
    total_tflops = sum(flops.values()) * per_second / world / 1e12
    imbalance = {}
    for module in layout.encoders:
        if module.dp < 2:
            continue
        replicas: dict[int, list[int]] = {}
        for rank in module.ranks:
            replicas.setdefault(module.coordinates(rank)["dp"], []).append(rank)
        compute = [sum(rows[r][columns.of(module.name, "compute")] for r in ranks) / len(ranks)
                   for ranks in replicas.values()]
        tokens = [sum(rows[r][columns.of(module.name, "tokens")] for r in ranks)
                  for ranks in replicas.values()]
        imbalance[module.name] = (_max_over_mean(compute), _max_over_mean(tokens))
    return Figures(
        iterations=iterations, seconds=seconds, tokens_per_second=tokens_per_second,
        active_tokens_per_second_per_gpu=tokens_per_second / active if active else 0.0,
        flops=flops, tflops_per_gpu=tflops, total_tflops_per_gpu=total_tflops,
        mfu=total_tflops / peak_tflops if peak_tflops else None,
        busy={name: share(name, "compute") for name in names},
        wait={name: share(name, "wait") for name in names},
        imbalance=imbalance)
