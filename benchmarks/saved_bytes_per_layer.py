"""Bytes one transformer layer keeps for its backward, measured: reference vs fast attention.

    python benchmarks/saved_bytes_per_layer.py [--json PATH] [--list LAYER] [--threads N]

What is counted: every tensor autograd saves for the backward while the layer's forward runs
(``torch.autograd.graph.saved_tensors_hooks``, entered by a forward pre-hook on the layer and left
by its forward hook), each storage once (deduplicated by ``untyped_storage().data_ptr()``, summed
as the storage's ``nbytes``: a view saved twice, or a tensor two ops save, counts once), the
model's parameters excluded (weights are not activations). That is the layer's input as its first
norm keeps it, the norms' outputs and statistics, Q / K / V, what the attention kernel keeps, the
MLP's intermediates, the rotary tables the layer builds and any mask it keeps (the reference's
causal mask, Megatron's cached ``get_default_causal_mask``: ``s^2`` bytes, one storage every layer
of a model shares). Not counted: what is saved
outside the layer (embedding, loss, patch embedding), gradients, and transient buffers the forward
frees (the reference's score buffer before the softmax, for one). Only forwards run: autograd
saves there.

Each layer is built by the project's own builders on one CPU-simulation rank, fp32 (what the
simulation runs), micro-batch 1, dropout 0 unless the row says otherwise, and run by its model's
own forward:

- ``language``: the launch's language model (``language_config_from_args`` on stock flags, then
  ``StockLanguageModel``, which gives the local spec its core attention) with one decoder layer:
  hidden 256, 8 query heads in 2 groups (GQA), head dim 32, SwiGLU MLP 704, RMSNorm, RoPE, no
  biases; a causal row of ``s`` tokens as the data gives it (``data.streams.collate_text``: no
  dense mask, the causal mask type).
- ``language, dropout 0.1``: the same with stock's default attention and hidden dropout (0.1).
- ``vit``: the built-in ``vit`` encoder (``ViTEncoder``: Megatron's ``CLIPViTModel`` on
  ``encoder_layer_spec``): hidden 256, 8 heads, GELU MLP 1024, LayerNorm, biases; one square image
  of ``s`` 16-pixel patches, bidirectional.
- ``qwen2.5-vl window``: the ``qwen2_5_vl`` tower (``Qwen2_5ViT``) shaped by the Qwen2.5-VL-7B
  recipe's ``config.json`` (hidden 1280, 16 heads of 80, SwiGLU 3420, RMSNorm, biases, 2D RoPE),
  its first layer, a window layer: one square image of ``s`` patches attending in 112-pixel
  windows (64 patches each).

``reference`` is ``--reference-attention`` (Megatron's local ``DotProductAttention`` for the
language model and the ViT, ``PackedAttention`` for the Qwen tower's windows), ``fast`` the
default (``FastAttention``, torch's SDPA). Lengths are square numbers (square images). The fast
rows are measured at s = 1024, 4096, 16384; the rows whose reference keeps whole ``s x s`` score
matrices at 1024, 2304, 4096 (at 16384 one fp32 ``heads x s x s`` matrix of the 8-head layers is
8 GiB, and the reference forward holds several at once), their 16384 figure extrapolated from the
fit and marked so. Fits: ``bytes = a s + b s^2`` by least squares over the three measured lengths
(``a`` bytes per token, ``b`` per token^2), with the largest relative residual.

Beside each fast row, what the layout advisor's activation model
(``performance.workload.TransformerShape.activation_elements``, modelled on fused kernels: no
score matrix) predicts for the same layer's shape at 4 bytes an element. ``--list LAYER`` prints
each storage the fast (and then the reference) layer saves at s = 256: bytes per token, shape,
dtype and the line that saved it.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import platform
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FAST_LENGTHS = (1024, 4096, 16384)
REFERENCE_LENGTHS = (1024, 2304, 4096)
REPORTED_LENGTHS = (1024, 4096, 16384)
ELEMENT_BYTES = 4
"""fp32, as the CPU simulation runs."""

LANGUAGE_FLAGS = [
    "--num-layers", "1", "--hidden-size", "256", "--ffn-hidden-size", "704",
    "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2",
    "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--vocab-size", "1024",
    "--micro-batch-size", "1", "--global-batch-size", "1",
]
"""The language model's shape (stock flags, after ``tests.models.hf.BASE_FLAGS``' CPU-simulation
numerics: local implementation, fp32, dropout 0, no fusions)."""
STOCK_DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
VIT_FLAGS = ["--vit-num-layers", "1", "--vit-hidden-size", "256",
             "--vit-num-attention-heads", "8", "--vit-patch-size", "16"]
QWEN_CONFIG = REPO / "examples/mimo/recipes/qwen2_5_vl/qwen2_5_vl_7b_config"
QWEN_PATCH_VALUES = 3 * 2 * 14 * 14
"""Values per Qwen2.5-VL patch (channels x temporal patch x patch x patch)."""


# --- measuring --------------------------------------------------------------------------------

def saved_bytes(model: Any, layer: Any, forward: Callable[[], Any],
                listing: list[tuple[int, tuple[int, ...], str, str]] | None = None) -> int:
    """Bytes of the unique non-parameter storages autograd saves inside ``layer`` (a submodule
    of ``model``) while ``forward()`` runs ``model``'s forward; ``listing`` collects each
    storage's (bytes, shape, dtype, the line that saved it)."""
    import torch

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}
    inside: list[Any] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in parameters and pointer not in storages:
            storages[pointer] = storage.nbytes()
            if listing is not None:
                listing.append((storage.nbytes(), tuple(tensor.shape), str(tensor.dtype),
                                _caller()))
        return tensor

    def enter(module: Any, args: Any) -> None:
        context = torch.autograd.graph.saved_tensors_hooks(pack, lambda kept: kept)
        context.__enter__()
        inside.append(context)

    def leave(module: Any, args: Any, output: Any) -> None:
        inside.pop().__exit__(None, None, None)

    handles = [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
    try:
        output = forward()
    finally:
        for handle in handles:
            handle.remove()
    del output
    return sum(storages.values())


def _caller() -> str:
    """The innermost frame outside torch and this file: where a saved tensor was made."""
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and frame.filename != __file__ \
                and "cpu_simulation" not in frame.filename:
            where = frame.filename.rsplit("site-packages/", 1)[-1].replace(f"{REPO}/", "")
            return f"{where}:{frame.lineno} {frame.name}"
    return "?"


def _groups(tp: int = 1) -> Any:
    """This rank's model-parallel groups (``tp`` ranks of tensor parallelism), under the CPU
    simulation."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    return ProcessGroupCollection.use_mpu_process_groups()


def _language_model(reference: bool, longest: int, extra: list[str] = ()) -> tuple[Any, Any, Any]:
    """(model, transformer config, stock args): the launch's language model of
    :data:`LANGUAGE_FLAGS` (and ``extra``), ``--reference-attention`` as ``reference`` says."""
    from megatron.training.global_vars import set_global_variables, unset_global_variables

    from megatron_plugins.model.language import StockLanguageModel, language_config_from_args
    from tests.models.hf import BASE_FLAGS, stock_args

    unset_global_variables()
    args = stock_args([*BASE_FLAGS, *LANGUAGE_FLAGS, *extra, "--seq-length", str(longest),
                       "--max-position-embeddings", str(longest)])
    args.padded_vocab_size = args.vocab_size
    args.reference_attention = reference  # the MiMo flag
    set_global_variables(args, build_tokenizer=False)
    config = language_config_from_args(args)
    model = StockLanguageModel(config.transformer, config,
                               _groups(config.transformer.tensor_model_parallel_size),
                               args.seq_length)
    return model.train(), config.transformer, args


def _language(reference: bool, lengths: list[int], listing: list | None = None,
              extra: list[str] = ()) -> tuple[dict[int, int], Any]:
    import torch

    from megatron_plugins.data.streams import collate_text

    model, config, args = _language_model(reference, max(lengths), extra)
    layer = model.decoder.layers[0]
    points = {}
    for tokens in lengths:
        ids = torch.randint(0, args.vocab_size, (tokens,),
                            generator=torch.Generator().manual_seed(tokens))
        batch = collate_text([{"tokens": ids}], [{}])  # what the data gives: no dense mask
        positions = torch.arange(tokens)[None]
        points[tokens] = saved_bytes(model, layer, lambda: model(
            batch["tokens"], positions, attention_mask=batch.get("attention_mask"),
            labels=batch["tokens"]), listing)
    return points, config


def _language_dropout(reference: bool, lengths: list[int],
                      listing: list | None = None) -> tuple[dict[int, int], Any]:
    return _language(reference, lengths, listing, STOCK_DROPOUT)


def _encoder_config(plugin: Any, language: Any, hidden: int) -> Any:
    """``plugin``'s config from the language config (its numerics and attention choice), one
    layer; ``hidden``: the language hidden size the plugin's projection checks."""
    from megatron_plugins.ops import REFERENCE_ATTENTION

    language = copy.copy(language)
    language.hidden_size = hidden
    one_layer = dataclasses.replace(plugin.transformer_config(language), num_layers=1)
    # Not a field: dataclasses.replace leaves it behind.
    setattr(one_layer, REFERENCE_ATTENTION, getattr(language, REFERENCE_ATTENTION))
    return one_layer


def _side(tokens: int) -> int:
    side = math.isqrt(tokens)
    if side * side != tokens:
        raise ValueError(f"{tokens} tokens are no square image; give square numbers")
    return side


def _vit(reference: bool, lengths: list[int],
         listing: list | None = None) -> tuple[dict[int, int], Any]:
    import torch
    from megatron.core.transformer.spec_utils import build_module

    from megatron_plugins.encoders.vit import ViTEncoder
    from tests.harness.flops_cases import flag_plugin

    _, language, _ = _language_model(reference, 16)
    points = {}
    for tokens in lengths:
        pixels = _side(tokens) * 16
        plugin = flag_plugin(ViTEncoder, "vit", [*VIT_FLAGS, "--vit-img-size", str(pixels)])
        config = _encoder_config(plugin, language, language.hidden_size)
        encoder = build_module(plugin.encoder_spec(config, _groups())).train()
        images = torch.randn(1, 3, pixels, pixels,
                             generator=torch.Generator().manual_seed(tokens))
        points[tokens] = saved_bytes(encoder, encoder.decoder.layers[0],
                                     lambda: encoder(images), listing)
    return points, config


def _qwen_window(reference: bool, lengths: list[int],
                 listing: list | None = None) -> tuple[dict[int, int], Any]:
    import torch
    from megatron.core.transformer.spec_utils import build_module

    from tests.models.hf_vision import plugin as hf_plugin

    _, language, _ = _language_model(reference, 16)
    plugin = hf_plugin("qwen2_5_vl", QWEN_CONFIG)
    config = _encoder_config(plugin, language, plugin.hf_config.out_hidden_size)
    tower = build_module(plugin.encoder_spec(config, _groups())).train()
    if 0 in tower.full_layers:
        raise ValueError("the tower's first layer is no window layer")
    points = {}
    for tokens in lengths:
        side = _side(tokens)
        pixels = torch.randn(tokens, QWEN_PATCH_VALUES,
                             generator=torch.Generator().manual_seed(tokens))
        grid = torch.tensor([[1, side, side]])
        points[tokens] = saved_bytes(tower, tower.decoder.layers[0],
                                     lambda: tower(pixels, grid), listing)
    return points, config


LAYERS: dict[str, Callable[..., tuple[dict[int, int], Any]]] = {
    "language": _language,
    "language, dropout 0.1": _language_dropout,
    "vit": _vit,
    "qwen2.5-vl window": _qwen_window,
}
"""Each layer's measurement: ``(reference, lengths, listing)`` -> (bytes by length, config)."""
QUADRATIC = ("language", "language, dropout 0.1", "vit")
"""Layers one of whose two attentions keeps whole-sequence score matrices: both rows measured at
:data:`REFERENCE_LENGTHS` (the fast one too where it is quadratic on CPU: SDPA with dropout runs
its math kernel there); the window layer's reference keeps a ``window x window`` matrix per
window, linear in s, and is measured at every length."""


@dataclasses.dataclass(frozen=True)
class Measured:
    """One layer and attention: saved bytes by length, and the layer's advisor shape."""

    points: dict[int, int]
    shape: Any
    """``performance.workload.TransformerShape`` of the layer's config (torch-free)."""


def measure(cases: list[tuple[str, bool, list[int]]]) -> list[Measured]:
    """On one CPU-simulation rank: for each (layer of :data:`LAYERS`, reference, lengths), the
    bytes the layer saves at each length. Vision lengths must be square numbers."""
    from megatron_plugins.performance.workload import TransformerShape

    _groups()
    results = []
    for layer, reference, lengths in cases:
        points, config = LAYERS[layer](reference, list(lengths))
        results.append(Measured(points, TransformerShape.of(config)))
    return results


TP_FLAGS = {"tp2": ["--tensor-model-parallel-size", "2"],
            "tp2 + SP": ["--tensor-model-parallel-size", "2", "--sequence-parallel"]}
"""The language layer's tensor-parallel settings :func:`run_measure_tp` compares."""


def measure_tp(lengths: list[int]) -> dict[str, dict[int, int]]:
    """On one of two CPU-simulation ranks: the fast language layer's saved bytes per length at
    each of :data:`TP_FLAGS` (this rank's share)."""
    found = {}
    for name, flags in TP_FLAGS.items():
        found[name], _ = _language(False, lengths, extra=flags)
    return found


def run_measure_tp(lengths: list[int], timeout: float = 1800) -> list[dict[str, dict[int, int]]]:
    """:func:`measure_tp` on two fresh simulated ranks; each rank's figures."""
    from tests.harness.multiprocess import run_in_processes

    return run_in_processes(measure_tp, 2, args=(lengths,), timeout=timeout, simulated=True)


def listing(layer: str, tokens: int = 256) -> dict[str, list]:
    """On one CPU-simulation rank: every storage ``layer`` saves at ``tokens``, fast and
    reference."""
    _groups()
    found = {}
    for reference in (False, True):
        found["reference" if reference else "fast"] = lines = []
        LAYERS[layer](reference, [tokens], lines)
    return found


def run_measure(cases: list[tuple[str, bool, list[int]]], timeout: float = 3600,
                threads: int | None = None) -> list[Measured]:
    """:func:`measure` on a fresh simulated rank (the CPU simulation patches its whole process,
    so it cannot run in a test's or a caller's own)."""
    from tests.harness.multiprocess import run_in_processes

    env = None if threads is None else {"OMP_NUM_THREADS": str(threads)}
    [result] = run_in_processes(measure, 1, args=(cases,), timeout=timeout, simulated=True,
                                env=env)
    return result


# --- fitting and reporting --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Fit:
    """``bytes = per_token * s + per_token2 * s^2``, fitted by least squares."""

    per_token: float
    per_token2: float
    residual: float
    """Largest |measured - fitted| / measured over the points."""

    def __call__(self, tokens: int) -> float:
        return self.per_token * tokens + self.per_token2 * tokens ** 2


def fit(points: dict[int, int]) -> Fit:
    """Least squares of ``a s + b s^2`` through ``points`` (length -> bytes)."""
    import numpy as np

    s = np.array(sorted(points), dtype=np.float64)
    y = np.array([points[n] for n in sorted(points)], dtype=np.float64)
    (a, b), *_ = np.linalg.lstsq(np.stack([s, s * s], axis=1), y, rcond=None)
    residual = float(np.max(np.abs(a * s + b * s * s - y) / y))
    return Fit(float(a), float(b), residual)


def second_difference(points: dict[int, int]) -> float:
    """``f(s0) - 2 f(s1) + f(s2)`` over three equally spaced lengths, relative to ``f(s2)``:
    zero for bytes linear in s, ``2 b step^2 / f(s2)`` with a ``b s^2`` term."""
    s0, s1, s2 = sorted(points)
    if s1 - s0 != s2 - s1:
        raise ValueError(f"lengths {s0}, {s1}, {s2} are not equally spaced")
    return (points[s0] - 2 * points[s1] + points[s2]) / points[s2]


def advisor_bytes(shape: Any, tokens: float) -> float:
    """What the advisor's memory model holds for one layer of ``shape`` over ``tokens``
    (``performance.memory``: ``activation_elements`` x the element size), fp32."""
    return shape.activation_elements(tokens) * ELEMENT_BYTES


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2 ** 20:,.1f}"


def report(measured: dict[tuple[str, bool], Measured]) -> tuple[str, dict[str, Any]]:
    """The markdown tables (bytes, fits, advisor) and a JSON-able record of every figure."""
    rows = ["| layer | attention | " + " | ".join(f"s = {n:,} (MiB)" for n in REPORTED_LENGTHS)
            + " | measured at s = |",
            "| --- | --- | " + " | ".join("---:" for _ in REPORTED_LENGTHS) + " | --- |"]
    fits = ["| layer | attention | a: bytes per token | b: bytes per token^2 | "
            "b s^2 share at s = 16,384 | largest residual |",
            "| --- | --- | ---: | ---: | ---: | ---: |"]
    advisor = ["| layer | measured a (fast), bytes per token | advisor, bytes per token | "
               "advisor / measured | advisor at s = 16,384 vs measured (fast) |",
               "| --- | ---: | ---: | ---: | ---: |"]
    record: dict[str, Any] = {}
    for layer in LAYERS:
        for reference in (True, False):
            if (layer, reference) not in measured:
                continue
            result = measured[layer, reference]
            points, line = result.points, fit(result.points)
            name = "reference" if reference else "fast"
            cells = [_mib(points[n]) if n in points else f"{_mib(line(n))} (extrapolated)"
                     for n in REPORTED_LENGTHS]
            rows.append(f"| {layer} | {name} | " + " | ".join(cells) + " | "
                        + ", ".join(f"{n:,}" for n in sorted(points)) + " |")
            share = line.per_token2 * 16384 ** 2 / line(16384)
            fits.append(f"| {layer} | {name} | {line.per_token:,.1f} | {line.per_token2:.4g} | "
                        f"{share:.2%} | {line.residual:.1e} |")
            predicted = advisor_bytes(result.shape, 1)
            record[f"{layer} {name}"] = {
                "measured": {str(k): v for k, v in sorted(points.items())},
                "per_token": line.per_token, "per_token2": line.per_token2,
                "residual": line.residual, "advisor_per_token": predicted}
            if not reference:
                advisor.append(
                    f"| {layer} | {line.per_token:,.0f} | {predicted:,.0f} | "
                    f"{predicted / line.per_token:.2f} | {_mib(advisor_bytes(result.shape, 16384))}"
                    f" vs {_mib(points.get(16384, line(16384)))} MiB |")
    return "\n\n".join("\n".join(table) for table in (rows, fits, advisor)), record


def cases() -> list[tuple[str, bool, list[int]]]:
    """Every layer, fast and reference, at the lengths the module docstring gives."""
    found = []
    for layer in LAYERS:
        for reference in (False, True):
            quadratic = layer in QUADRATIC and (reference or "dropout" in layer)
            found.append((layer, reference, list(REFERENCE_LENGTHS if quadratic
                                                 else FAST_LENGTHS)))
    return found


def _cpu() -> str:
    """The CPU's model name."""
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="also write every figure to this file")
    parser.add_argument("--list", choices=list(LAYERS), metavar="LAYER",
                        help="only list what LAYER saves at s = 256, fast and reference")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads of the measuring rank (default: 1)")
    parser.add_argument("--tp", action="store_true",
                        help="only the fast language layer at tp 2, with and without "
                             "--sequence-parallel, on two ranks")
    options = parser.parse_args()
    # By module name, so that the simulated rank imports this file as a module, not __main__.
    from benchmarks import saved_bytes_per_layer as this
    from tests.harness.multiprocess import run_in_processes

    if options.list:
        env = None if options.threads is None else {"OMP_NUM_THREADS": str(options.threads)}
        [found] = run_in_processes(this.listing, 1, args=(options.list,), timeout=900,
                                   simulated=True, env=env)
        for attention, lines in found.items():
            print(f"{options.list}, {attention}: {sum(n for n, *_ in lines) / 256:,.1f} "
                  "bytes per token")
            for nbytes, shape, dtype, where in lines:
                print(f"  {nbytes / 256:10,.1f}  {str(shape):22} {dtype:14} {where}")
        return
    if options.tp:
        lengths = list(FAST_LENGTHS)
        ranks = this.run_measure_tp(lengths)
        print("| language layer, fast, rank 0 of 2 | "
              + " | ".join(f"s = {n:,} (MiB)" for n in lengths) + " | bytes per token |")
        print("| --- |" + " ---: |" * (len(lengths) + 1))
        for name, points in ranks[0].items():
            print(f"| {name} | " + " | ".join(f"{points[n] / 2 ** 20:,.1f}" for n in lengths)
                  + f" | {fit(points).per_token:,.1f} |")
        print("ranks agree:", ranks[0] == ranks[1])
        return
    todo = this.cases()
    results = this.run_measure(todo, threads=options.threads)
    measured = {(layer, reference): result
                for (layer, reference, _), result in zip(todo, results)}
    table, record = report(measured)
    import torch

    print(f"host: {_cpu()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch "
          f"{torch.__version__}; fp32, micro-batch 1, one CPU-simulation rank")
    print(table)
    if options.json:
        Path(options.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
