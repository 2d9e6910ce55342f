"""LoRA adapters inside Megatron's tensor-parallel linear layers, sharded as their base layer.

An adapted layer computes ``W x + (alpha / rank) B A x`` with ``W`` frozen. The adapters live in
the layer itself (``lora_a`` ``[rank, in]``, ``lora_b`` ``[out, rank]``), whose class becomes a
subclass adding them to the forward and the checkpoint, so every other name, the HF mappings and
Megatron checkpoints of the base stay as they were. Under tensor parallelism the adapter is split
the way its base is:

* column parallel (``linear_qkv``, ``linear_fc1``, Gated DeltaNet's ``in_proj``; output split
  over TP): ``A`` is whole on every TP rank, ``B`` holds this rank's output rows. ``A x`` is one
  full-rank activation; its gradient is summed over TP (every rank's ``B`` rows contribute), so
  each rank computes the same ``A`` gradient and the copies stay equal without a reduction. Under
  sequence parallelism the sequence-split input is gathered first (the gradient coming back is
  already whole: split). A rank's rows of a fused output are that rank's share of each section
  (gate and up; q, k, v, z, beta, alpha), as the weight's are, and ``B`` is checkpointed by
  section as the weight is, so the checkpoint holds it in its TP 1 layout.
* row parallel (``linear_proj``, ``linear_fc2``, ``out_proj``; input split over TP): ``A`` holds
  this rank's input columns, ``A x`` is summed over TP, ``B`` is whole on every TP rank and sees
  the same input and output gradient everywhere. Under sequence parallelism the output is split
  over the sequence as the base's is.

An MoE expert's linears (each routed expert's ``linear_fc1`` / ``linear_fc2``, at expert TP 1:
the dispatcher hands them whole tokens) are adapted as unsharded layers; their adapters are
reduced over the expert data-parallel group as the expert weights are (``allreduce = False``),
never averaged with another expert's on a rank holding different experts.

``A`` starts uniform in ``+-1/sqrt(in)`` (PEFT's default), drawn from a generator seeded by the
run's seed and the layer's global name (an expert's global index), whole, then sliced: the same
adapters at any layout, and no other random stream moves. ``B`` starts at zero, so an adapted
model starts as its base.
Dropout on the adapter's input uses the default generator where the input is whole (equal on TP
ranks, as the equal ``A`` copies need) and the model-parallel stream where it is split.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from megatron.core.ssm.gated_delta_net import GatedDeltaNet
from megatron.core.ssm.utils import _split_tensor_factory
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megatron_plugins.parallel.layout import LANGUAGE
from megatron_plugins.peft.flags import PROJECTION, LoraSpec
from megatron_plugins.weights.local_view import global_names

__all__ = ["ADAPTERS", "adapt", "merged", "module_parts"]

ADAPTERS = ("lora_a", "lora_b")
"""The adapter parameters' names inside an adapted layer."""


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``weight + scale * b @ a`` summed in fp64, in ``weight``'s dtype: the one merge the
    streaming API and the export both use."""
    return (weight.double() + (b.double() @ a.double()) * scale).to(weight.dtype)


class _Adapted:
    """What an adapted layer adds to its base class (mixed in before it)."""

    adapter_parameters = ADAPTERS
    """Not weights of the HF model: the weights code merges them (:meth:`merged_weight`)."""

    lora_a: torch.nn.Parameter
    lora_b: torch.nn.Parameter
    lora_scale: float
    lora_dropout: float
    lora_gated: bool
    """A gated MLP's ``linear_fc1``: its output rows are [gate; up] per TP rank, and ``lora_b``'s
    checkpoint is resharded as the weight's (stock's SwiGLU factory)."""
    lora_sections: tuple[tuple[int, ...], tuple[str, ...]] | None
    """Gated DeltaNet's ``in_proj``: its output rows are [q; k; v; z; beta; alpha] per TP rank
    (sizes, names), and ``lora_b`` is saved one key per section as the weight is, so the
    checkpoint holds it in its TP 1 layout at any TP."""

    def forward(self, input_: torch.Tensor, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        return output + self.lora_delta(input_).to(output.dtype), bias

    def _dropout(self, x: torch.Tensor, split: bool) -> torch.Tensor:
        if not (self.lora_dropout and self.training):
            return x
        if split:
            with get_cuda_rng_tracker().fork():
                return F.dropout(x, self.lora_dropout)
        return F.dropout(x, self.lora_dropout)

    def lora_delta(self, input_: torch.Tensor) -> torch.Tensor:
        """``scale * B A x`` in this rank's part of the base layer's output."""
        if isinstance(self, ColumnParallelLinear):
            x = input_
            if self.sequence_parallel:
                x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False,
                                                         group=self.tp_group)
            hidden = F.linear(self._dropout(x, split=False), self.lora_a)
            hidden = copy_to_tensor_model_parallel_region(hidden, group=self.tp_group)
            return F.linear(hidden, self.lora_b) * self.lora_scale
        hidden = F.linear(self._dropout(input_, split=self.tp_group.size() > 1), self.lora_a)
        hidden = reduce_from_tensor_model_parallel_region(hidden, group=self.tp_group)
        output = F.linear(hidden, self.lora_b) * self.lora_scale
        if self.sequence_parallel:
            output = scatter_to_sequence_parallel_region(output, group=self.tp_group)
        return output

    def merged_weight(self) -> torch.Tensor:
        """This rank's slice of ``W + scale * B A``, in the weight's dtype (the sum in fp64)."""
        with torch.no_grad():
            return merged(self.weight, self.lora_a, self.lora_b, self.lora_scale)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """The base layer's, with its TP-sharded adapter saved as sharded as the weight."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        name, dim = ("lora_b", 0) if isinstance(self, ColumnParallelLinear) else ("lora_a", 1)
        [(key, sharded)] = make_sharded_tensors_for_checkpoint(
            {name: getattr(self, name)}, prefix, {name: dim}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"]).items()
        if self.lora_gated:
            sharded = apply_swiglu_sharded_factory(
                sharded, sharded_offsets, metadata.get("singleton_local_shards", False),
                tp_group=self.tp_group, dp_group=metadata["dp_cp_group"])
        if self.lora_sections is not None:
            sizes, names = self.lora_sections
            sharded = _split_tensor_factory(sharded, list(sizes), list(names), 0)
        state[key] = sharded
        return state


@functools.cache
def _adapted_class(base: type) -> type:
    return type(f"LoRA{base.__name__}", (_Adapted, base), {"__module__": __name__})


def _supported(layer: torch.nn.Module, where: str) -> None:
    problem = None
    if not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
        problem = (f"{type(layer).__name__} is not Megatron's ColumnParallelLinear or "
                   "RowParallelLinear (Transformer Engine's fused layers are not supported: use "
                   "--transformer-impl local)")
    elif getattr(layer, "is_expert", False) and layer.tp_group.size() > 1:
        problem = "it is an MoE expert's layer split over expert TP, which LoRA does not adapt"
    elif isinstance(layer, ColumnParallelLinear) and layer.gather_output:
        problem = "it gathers its output over TP"
    elif isinstance(layer, RowParallelLinear) and not layer.input_is_parallel:
        problem = "it splits its input over TP itself"
    if problem:
        raise ValueError(f"LoRA cannot adapt {where}: {problem}")


def _initial_a(rank: int, in_features: int, seed: int, name: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed((seed % 2**31) * 2**32 + zlib.crc32(name.encode()))
    bound = in_features ** -0.5
    return (torch.rand(rank, in_features, generator=generator, dtype=torch.float64) * 2 - 1) * bound


def _adapt_layer(layer: torch.nn.Module, spec: LoraSpec, seed: int, name: str, gated: bool,
                 sections: tuple[tuple[int, ...], tuple[str, ...]] | None) -> None:
    weight = layer.weight
    column = isinstance(layer, ColumnParallelLinear)
    tp, tp_rank = layer.tp_group.size(), layer.tp_group.rank()
    out_local, in_local = weight.shape
    in_features = in_local if column else in_local * tp
    a = _initial_a(spec.rank, in_features, seed, name)
    if not column:
        a = a.chunk(tp, dim=1)[tp_rank]
    layer.__class__ = _adapted_class(type(layer))
    layer.lora_a = torch.nn.Parameter(a.to(weight.dtype).to(weight.device).contiguous())
    layer.lora_b = torch.nn.Parameter(torch.zeros(out_local, spec.rank, dtype=weight.dtype,
                                                  device=weight.device))
    sharded = layer.lora_b if column else layer.lora_a
    for parameter in (layer.lora_a, layer.lora_b):
        parallel = parameter is sharded and tp > 1
        set_tensor_model_parallel_attributes(parameter, parallel, (0 if column else 1)
                                             if parallel else -1, 1)
        if hasattr(weight, "allreduce"):  # reduced where its weight is (an expert's: expert DP)
            parameter.allreduce = weight.allreduce
    layer.lora_scale = spec.scale
    layer.lora_dropout = spec.dropout
    layer.lora_gated = gated
    layer.lora_sections = sections


def _in_proj_sections(mixer: torch.nn.Module) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """A Gated DeltaNet's ``in_proj`` sections on this TP rank (sizes, names), as its
    ``sharded_state_dict`` splits the weight."""
    if not isinstance(mixer, GatedDeltaNet):
        raise ValueError(f"LoRA adapts in_proj of Gated DeltaNet layers only, not of "
                         f"{type(mixer).__name__}")
    return tuple(mixer.in_proj_split_sections), tuple(mixer.in_proj_split_names)


def _targets(module: torch.nn.Module, targets: tuple[str, ...]
             ) -> Iterator[tuple[str, torch.nn.Module, torch.nn.Module]]:
    for path, layer in module.named_modules():
        parent_path, _, leaf = path.rpartition(".")
        if leaf in targets:
            yield path, layer, module.get_submodule(parent_path)


def adapt(module: torch.nn.Module, spec: LoraSpec, seed: int) -> int:
    """Add ``spec``'s adapters to every target linear of ``module`` (one part, not yet wrapped)
    and freeze the part's own parameters; returns how many layers were adapted. ``seed`` is the
    run's: adapters start the same at any layout."""
    module.requires_grad_(False)
    names = global_names(module)
    adapted = 0
    for path, layer, parent in list(_targets(module, spec.targets)):
        where = f"{spec.part}'s {path}"
        _supported(layer, where)
        gated = path.endswith("linear_fc1") and bool(
            getattr(getattr(parent, "config", None), "gated_linear_unit", False))
        sections = _in_proj_sections(parent) if path.endswith(".in_proj") else None
        _adapt_layer(layer, spec, seed, f"{spec.part}/{names[path + '.weight']}", gated,
                     sections)
        adapted += 1
    if not adapted:
        raise ValueError(f"LoRA found no {', '.join(spec.targets)} layer in {spec.part}")
    return adapted


def module_parts(model: torch.nn.Module, name: str) -> dict[str, torch.nn.Module]:
    """The parts of module ``name`` of a ``MimoModel`` (wrapped or not): the language model, or an
    encoder's network and its projection."""
    from megatron_plugins.weights.local_view import unwrap

    if name == LANGUAGE:
        return {LANGUAGE: unwrap(model.language_model)}
    submodules = unwrap(model.modality_submodules[name])
    return {name: submodules.encoders[name], name + PROJECTION: submodules.input_projections}
