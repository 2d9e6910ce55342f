"""Activation memory of a language rank, measured on the entry point's own path.

Each rank runs what ``examples/mimo/pretrain_mimo.py`` runs (parse, stock ``pretrain()``) on the
CPU simulation. On language ranks, saved-tensor hooks around the MimoModel forward count the
bytes of the unique storages autograd keeps for backward (parameters excluded), split by where
they were saved: the layers' core attention, the rest of the language model, and MimoModel
around it (text embeddings, combining encoder rows, the CP split). The process's peak RSS over
the training steps is read from ``/proc/self/status`` (VmHWM, reset before the first forward).

    PYTHONPATH=. .venv/bin/python -m tests.harness.activation_memory --seq-length 4096 --cp 1 2 | grep '^|'

:class:`HeldActivations` measures a whole training step instead (colocated layouts keep encoder
activations across the step's microbatches): the saved-for-backward bytes held at once, by
whether an encoder or the rest of the model saved them, and their peak.
"""

from __future__ import annotations

import argparse
import resource
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.harness.multiprocess import run_in_processes
from tests.models.tiny import TINY_TRANSFORMER

REGIONS = ("attention", "language", "mimo")
"""Where a saved tensor was saved: inside a core attention, elsewhere in the language model, or
in MimoModel's own forward around the language model."""


def _status_kib(field_name: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise KeyError(field_name)


@dataclass
class SavedActivations:
    """Saved-for-backward bytes of each MimoModel forward on this rank, by region."""

    parameter_storages: set[int]
    forwards: list[dict[str, int]] = field(default_factory=list)
    rss_before_kib: int | None = None
    _storages: dict[int, tuple[str, int]] = field(default_factory=dict)
    _regions: list[str] = field(default_factory=list)
    _context: Any = None

    @classmethod
    def install(cls, mimo: torch.nn.Module) -> "SavedActivations":
        """Hook ``mimo`` (the language rank's MimoModel) and its language model's modules."""
        meter = cls({p.untyped_storage().data_ptr() for p in mimo.parameters()})
        mimo.register_forward_pre_hook(lambda module, args: meter._start())
        mimo.register_forward_hook(lambda module, args, output: meter._stop())
        from megatron.core.models.gpt.gpt_model import GPTModel

        for name, module in mimo.named_modules():
            region = ("attention" if name.endswith("core_attention") else
                      "language" if isinstance(module, GPTModel) else None)
            if region is not None:
                module.register_forward_pre_hook(
                    lambda module, args, region=region: meter._regions.append(region))
                module.register_forward_hook(lambda module, args, output: meter._leave())
        return meter

    def _start(self) -> None:
        if self.rss_before_kib is None:
            self.rss_before_kib = _status_kib("VmRSS")
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")  # restart the peak-RSS (VmHWM) count here
        self._storages.clear()
        self._regions[:] = ["mimo"]
        self._context = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda kept: kept)
        self._context.__enter__()

    def _leave(self) -> None:
        self._regions.pop()  # returns None: a forward hook's return value replaces the output

    def _stop(self) -> None:
        self._context.__exit__(None, None, None)
        totals = dict.fromkeys(REGIONS, 0)
        for region, nbytes in self._storages.values():
            totals[region] += nbytes
        self.forwards.append(totals)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self.parameter_storages and pointer not in self._storages:
            self._storages[pointer] = (self._regions[-1], storage.nbytes())
        return tensor


class _Held:
    """One saved tensor as autograd keeps it; tells the meter when the graph lets it go."""

    __slots__ = ("tensor", "_release")

    def __init__(self, tensor: torch.Tensor, release: Any) -> None:
        self.tensor = tensor
        self._release = release

    def __del__(self) -> None:
        self._release()


@dataclass
class HeldActivations:
    """Saved-for-backward bytes a rank holds at once over training, and their peak.

    Unique storages (parameters excluded) count from the first save until autograd frees the
    last graph node keeping them; each is attributed to ``encoder`` when first saved inside an
    encoder's forward, else to ``model``. ``encoder_forwards``: the bytes each encoder forward
    saved (one microbatch's)."""

    parameter_storages: set[int]
    held: dict[str, int] = field(default_factory=lambda: {"encoder": 0, "model": 0})
    peak: dict[str, int] = field(default_factory=lambda: {"encoder": 0, "model": 0, "total": 0})
    encoder_forwards: list[int] = field(default_factory=list)
    _storages: dict[int, list] = field(default_factory=dict)
    _grad_modes: list[bool] = field(default_factory=list)
    """Per encoder forward entered, whether grad was on: without it some kernels (dropout)
    still pack, for a graph that is never kept (pack hooks run with grad off, so they cannot
    tell)."""
    _context: Any = None

    @classmethod
    def install(cls, mimo: torch.nn.Module) -> "HeldActivations":
        """Count from now on, for the MimoModel ``mimo`` of this rank (its encoders hooked)."""
        meter = cls({p.untyped_storage().data_ptr() for p in mimo.parameters()})
        for encoder in mimo.modality_submodules.values():
            # MimoModel calls an encoder's DDP wrapper by ``.forward``: hook the wrapped module
            # too (the colocated step calls the wrapper; nested entries count once).
            for module in {encoder, getattr(encoder, "module", encoder)}:
                module.register_forward_pre_hook(lambda module, args: meter._enter_encoder())
                module.register_forward_hook(
                    lambda module, args, output: meter._leave_encoder())
        meter._context = torch.autograd.graph.saved_tensors_hooks(meter._pack,
                                                                  lambda held: held.tensor)
        meter._context.__enter__()
        return meter

    def stop(self) -> None:
        """Stop counting (the run is over)."""
        self._context.__exit__(None, None, None)

    def _enter_encoder(self) -> None:
        if not self._grad_modes:
            self.encoder_forwards.append(0)
        self._grad_modes.append(torch.is_grad_enabled())

    def _leave_encoder(self) -> None:
        self._grad_modes.pop()

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer in self.parameter_storages or self._grad_modes[-1:] == [False]:
            return _Held(tensor, lambda: None)
        entry = self._storages.get(pointer)
        if entry is None:
            region = "encoder" if self._grad_modes else "model"
            entry = self._storages[pointer] = [region, storage.nbytes(), 0]
            self.held[region] += entry[1]
            if self._grad_modes:
                self.encoder_forwards[-1] += entry[1]
            self._note_peak()
        entry[2] += 1
        return _Held(tensor, lambda: self._release(pointer))

    def _release(self, pointer: int) -> None:
        entry = self._storages[pointer]
        entry[2] -= 1
        if entry[2] == 0:
            del self._storages[pointer]
            self.held[entry[0]] -= entry[1]

    def _note_peak(self) -> None:
        for region, held in self.held.items():
            self.peak[region] = max(self.peak[region], held)
        self.peak["total"] = max(self.peak["total"], sum(self.held.values()))

    def report(self) -> dict[str, Any]:
        """Peak bytes (encoder, model, total), each encoder forward's bytes, and the process's
        peak RSS (``ru_maxrss``, KiB)."""
        return {"peak": dict(self.peak), "encoder_forwards": list(self.encoder_forwards),
                "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def activation_rank(argv: list[str]) -> dict[str, Any]:
    """One rank of a MiMo run; language ranks return their saved bytes per region (the largest
    forward), RSS before the first forward and peak RSS after it, and the run's seconds."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    from megatron_plugins.launch.pretrain import parse_mimo_args, train

    result: dict[str, Any] = {}
    meters: list[SavedActivations] = []

    def observe(session: Any) -> None:
        [module] = session.topology.active_modules
        pgc = session.topology.module_pgs[module]
        result.update(module=module, cp_rank=pgc.cp.rank())
        if module == "language":
            session.config.model.post_wrap_hooks.append(
                lambda chunks: meters.append(SavedActivations.install(chunks[0])) or chunks)

    started = time.monotonic()
    train(parse_mimo_args(argv), observe)
    result["seconds"] = time.monotonic() - started
    if meters:
        [meter] = meters
        result["saved"] = max(meter.forwards, key=lambda totals: sum(totals.values()))
        result["rss_before_kib"] = meter.rss_before_kib
        result["peak_rss_kib"] = _status_kib("VmHWM")
    return result


def measure(seq_length: int, cp: int, *, iterations: int = 1, timeout: float = 300.0
            ) -> list[dict[str, Any]]:
    """Train the tiny model (one vision encoder rank, language ``cp`` ranks, micro-batch 1) on
    ``seq_length`` tokens; returns the language ranks' results in CP rank order."""
    argv = [*TINY_TRANSFORMER, "--seq-length", str(seq_length),
            "--max-position-embeddings", str(seq_length), "--micro-batch-size", "1",
            "--global-batch-size", "1", "--train-iters", str(iterations), "--eval-iters", "0",
            "--encoder", "vision=vit", "--grid", "vision:", "--grid", f"language:cp={cp}"]
    results = run_in_processes(activation_rank, 1 + cp, timeout=timeout, simulated=True,
                               args=(argv,))
    return sorted((r for r in results if r["module"] == "language"), key=lambda r: r["cp_rank"])


def main() -> None:
    """Print one Markdown table row per language rank of each (seq length, cp) asked."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, nargs="+", required=True)
    parser.add_argument("--cp", type=int, nargs="+", required=True)
    args = parser.parse_args()
    print("| seq | cp | cp rank | saved MiB (attention / language / mimo) | "
          "RSS before MiB | peak RSS MiB | run s |")
    print("|---|---|---|---|---|---|---|")
    mib = 1 << 20
    for seq_length in args.seq_length:
        for cp in args.cp:
            for r in measure(seq_length, cp):
                saved = r["saved"]
                parts = " / ".join(f"{saved[region] / mib:.1f}" for region in REGIONS)
                print(f"| {seq_length} | {cp} | {r['cp_rank']} | "
                      f"{sum(saved.values()) / mib:.1f} ({parts}) | "
                      f"{r['rss_before_kib'] / 1024:.0f} | {r['peak_rss_kib'] / 1024:.0f} | "
                      f"{r['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
