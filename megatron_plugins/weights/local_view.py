"""This rank's parameters (and mapped buffers) of a module, under global names, with their rules.

Import and streaming both start here: every parameter (but the adapters a layer carries, which
streaming merges into its weight) of the rank's module gets the name it would
have at TP 1 / PP 1 / EP 1 (a layer's global index from its ``layer_number``, an expert's from the
MoE layer's ``local_expert_indices``), the family rule covering it, and the TP rank and size of the
group it is sharded over (expert TP for experts). Persistent buffers a family rule covers (an MoE
router's fp32 ``expert_bias``) are weights too and come along; other buffers (Megatron's
``local_tokens_per_expert`` counters) are not HF weights and are left out.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_plugins.weights.mapping import Bound, Family, Heads, HFWeightsError

__all__ = [
    "LocalParam", "global_names", "heads_of", "local_params", "names_text", "owner_of", "unwrap"
]


@dataclass(frozen=True)
class LocalParam:
    """One parameter (or mapped buffer) of this rank: its local name, the tensor, its rule and TP
    coordinates."""

    name: str
    param: torch.Tensor
    bound: Bound
    tp_rank: int
    tp_size: int


def _renames(module: torch.nn.Module) -> dict[str, str]:
    """Local module path -> its last path segment under global numbering."""
    renames: dict[str, str] = {}
    for path, sub in module.named_modules():
        parent, _, index = path.rpartition(".")
        if index.isdigit() and parent.rpartition(".")[2] == "layers" and hasattr(sub, "layer_number"):
            renames[path] = str(sub.layer_number - 1)
        for local, expert in enumerate(getattr(sub, "local_expert_indices", ()) or ()):
            renames[f"{path}.experts.local_experts.{local}"] = str(expert)
    return renames


def _global_name(name: str, renames: dict[str, str]) -> str:
    local, parts = "", []
    for part in name.split("."):
        local = f"{local}.{part}" if local else part
        parts.append(renames.get(local, part))
    return ".".join(parts)


def global_names(module: torch.nn.Module) -> dict[str, str]:
    """Every parameter's local name -> its global name."""
    renames = _renames(module)
    return {name: _global_name(name, renames) for name, _ in module.named_parameters()}


def persistent_buffers(module: torch.nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(local name, global name, tensor) of every buffer the module's state dict holds."""
    renames = _renames(module)
    for name, buffer in module.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf not in module.get_submodule(owner)._non_persistent_buffers_set:
            yield name, _global_name(name, renames), buffer


def _group_coords(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return group.rank(), group.size()


def local_params(module: torch.nn.Module, family: Family, pg_collection: object,
                 where: str) -> list[LocalParam]:
    """This rank's parameters with their rules, and the persistent buffers a rule covers; a
    parameter no rule covers is an error naming it."""
    tp = _group_coords(getattr(pg_collection, "tp", None))
    expert_tp = _group_coords(getattr(pg_collection, "expt_tp", None))
    params = dict(module.named_parameters())
    candidates = [(name, global_name, params[name], True)
                  for name, global_name in global_names(module).items()
                  if not _is_adapter(module, name)]
    candidates += [(*buffer, False) for buffer in persistent_buffers(module)]
    found, uncovered = [], []
    for name, global_name, tensor, required in candidates:
        bound = family.bind(global_name)
        if bound is None:
            if required:
                uncovered.append(global_name)
            continue
        rank, size = expert_tp if bound.rule.is_expert else tp
        if size > 1 and getattr(tensor, "tensor_model_parallel", False):
            if tensor.partition_dim != bound.rule.tp_dim:
                raise ValueError(f"{family.name} rule for {global_name} shards dim "
                                 f"{bound.rule.tp_dim}, Megatron shards dim {tensor.partition_dim}")
        found.append(LocalParam(name, tensor, bound, rank, size))
    if uncovered:
        raise HFWeightsError(f"{where}: the {family.name} mapping has no rule for Megatron "
                             f"parameters {names_text(uncovered)}; the model does not match the "
                             "family (check the stock flags that shape it)")
    return found


def owner_of(module: torch.nn.Module, name: str) -> torch.nn.Module:
    """The submodule of ``module`` that holds parameter ``name``."""
    return module.get_submodule(name.rpartition(".")[0])


def _is_adapter(module: torch.nn.Module, name: str) -> bool:
    """An adapter of a layer that carries adapters (``adapter_parameters``, e.g. LoRA's): not
    a weight of the model's own, it is merged into the layer's weight (``merged_weight()``)."""
    return name.rpartition(".")[2] in getattr(owner_of(module, name), "adapter_parameters", ())


def heads_of(module: torch.nn.Module) -> Heads | None:
    """The attention geometry for qkv rules, from the module's TransformerConfig."""
    config = getattr(module, "config", None)
    return Heads.of(config) if config is not None and config.num_attention_heads else None


def names_text(names: set[str] | list[str], limit: int = 6) -> str:
    """A bounded, sorted list of names for a one-line message."""
    shown = ", ".join(sorted(names)[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP / precision wrappers (each keeps it as ``.module``)."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module
