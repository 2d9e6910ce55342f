"""Calibrating the cost model from a measured run: ``--profile FILE`` (what ``--mimo-profile``
writes, docs/performance.md) replaces each module's assumed efficiency with the one that makes
the model predict the compute time the run measured on its own layout.

The run's per-module FLOPs and compute seconds per step give the rate a rank reached; the model's
busy time of that module on that layout (:func:`.cost_model.module_busy`) is solved for the
efficiency that matches it, scaled by the ratio of this command's FLOPs to the run's when the two
describe batches of different sizes. Everything else (links, latencies) stays as assumed.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_plugins.errors import FlagError
from megatron_plugins.parallel.layout import LayoutError, ModulePlacement, ParallelLayout
from megatron_plugins.performance.assumptions import Assumptions
from megatron_plugins.performance.candidates import Candidate, layout_candidate
from megatron_plugins.performance.cost_model import module_busy
from megatron_plugins.performance.gpus import Hardware
from megatron_plugins.performance.memory import microbatches
from megatron_plugins.performance.workload import Workload

__all__ = ["Profile", "ProfileError", "calibrate", "module_flops", "read_profile"]

VERSION = 1
MODULE_FIELDS = ("flops_per_step", "compute_s_per_step")


class ProfileError(FlagError):
    """A ``--profile`` file the advisor cannot read; the message names the file and field."""


@dataclass(frozen=True)
class Profile:
    """What the advisor reads of a run's profile."""

    path: str
    device: str
    layout: ParallelLayout
    command: list[str]
    modules: dict[str, dict[str, Any]]

    def candidate(self) -> Candidate:
        """The run's layout with its micro-batch size and recomputation, from its command."""
        parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        parser.add_argument("--micro-batch-size", type=int, default=1)
        parser.add_argument("--recompute-granularity", default=None)
        parser.add_argument("--colocated-encoder-recompute", action="store_true")
        args, _ = parser.parse_known_args(self.command)
        return layout_candidate(self.layout, args.micro_batch_size,
                                args.recompute_granularity == "full",
                                args.colocated_encoder_recompute)


def _layout(records: Any, where: str) -> ParallelLayout:
    """The layout a profile's ``layout`` field records (``checkpoint_guards.layout_record``)."""
    try:
        offset, modules = 0, []
        for record in records:
            host = record.get("on")
            sizes = {key: int(record.get(key, 1)) for key in ("tp", "pp", "cp", "dp", "ep", "etp")}
            placement = ModulePlacement(name=record["name"], provider=record.get("provider"),
                                        host=host, rank_offset=0 if host else offset, **sizes)
            if host is None:
                offset += placement.size
            modules.append(placement)
        hosts = {m.name: m.rank_offset for m in modules if m.host is None}
        modules = [m if m.host is None else ModulePlacement(
            name=m.name, provider=m.provider, host=m.host, rank_offset=hosts.get(m.host, 0),
            tp=m.tp, pp=m.pp, cp=m.cp, dp=m.dp, ep=m.ep, etp=m.etp) for m in modules]
        return ParallelLayout(tuple(modules))
    except (LayoutError, KeyError, TypeError, ValueError, AttributeError) as error:
        raise ProfileError(f"{where}: field 'layout' is not a layout record ({error}); give a "
                           "file written by --mimo-profile") from None


def read_profile(path: str) -> Profile:
    """Read and check a profile file; every problem is one line naming the file and field."""
    where = f"--profile {path}"
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise ProfileError(f"{where}: cannot read it ({error.strerror})") from None
    except json.JSONDecodeError as error:
        raise ProfileError(f"{where}: not JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise ProfileError(f"{where}: expected a --mimo-profile file of version {VERSION}")
    modules = data.get("modules")
    if not isinstance(modules, dict) or not modules:
        raise ProfileError(f"{where}: field 'modules' is missing or empty")
    for name, module in modules.items():
        for field in MODULE_FIELDS:
            value = module.get(field) if isinstance(module, dict) else None
            if not isinstance(value, (int, float)) or not value > 0:
                raise ProfileError(f"{where}: modules.{name}.{field} must be a positive number "
                                   f"(is {value!r})")
    command = data.get("command")
    if not isinstance(command, list):
        raise ProfileError(f"{where}: field 'command' must be the launch's argv (a list)")
    return Profile(path, str(data.get("device")), _layout(data.get("layout"), where),
                   [str(token) for token in command], modules)


def module_flops(candidate: Candidate, workload: Workload, module: str) -> float:
    """Model FLOPs per step of ``module`` (all its ranks) on ``candidate``."""
    if module == "language":
        m = microbatches(candidate, workload)
        return (workload.language.microbatch_flops(candidate.micro, False).model * m
                * candidate.language.dp)
    return workload.encoder(module).flops.model * workload.global_batch


def _solve(busy: Any, target: float) -> float | None:
    """The efficiency at which ``busy(efficiency)`` (falling) equals ``target``, by bisection
    on a log scale; None when even a very high efficiency is slower (the launch-time floor)."""
    low, high = 1e-6, 1e3
    if busy(high) > target:
        return None
    for _ in range(100):
        middle = math.sqrt(low * high)
        if busy(middle) > target:
            low = middle
        else:
            high = middle
    return high


def calibrate(profile: Profile, workload: Workload, hardware: Hardware,
              assumptions: Assumptions) -> Assumptions:
    """``assumptions`` with every module the profile measured calibrated to it."""
    candidate = profile.candidate()
    names = {m.name for m in profile.layout.modules}
    mine = {"language"} | {work.name for work in workload.encoders}
    if names != mine:
        raise ProfileError(f"--profile {profile.path}: its run has modules "
                           f"{', '.join(sorted(names))}, this command "
                           f"{', '.join(sorted(mine))}; calibrate with a run of the same model")
    measured = {}
    for name, module in profile.modules.items():
        if name not in mine:
            continue
        scale = module_flops(candidate, workload, name) / module["flops_per_step"]
        target = module["compute_s_per_step"] * scale

        def busy(efficiency: float, name: str = name) -> float:
            return module_busy(candidate, workload, hardware, assumptions, name, efficiency)

        solved = _solve(busy, target)
        if solved is None:
            raise ProfileError(
                f"--profile {profile.path}: module {name} computed in "
                f"{module['compute_s_per_step']:.4g} s per step, less than the host launch time "
                "the model assumes for its layers; lower --advise-layer-overhead-ms")
        measured[name] = solved
    return assumptions.calibrated(measured, f"measured by {profile.path} on {profile.device}")
