"""Copy a HF checkpoint into this rank's part of a built module, reading only this rank's slices.

Runs once after stock builds the model and before DDP wraps it. Every parameter of the module
must be covered by a family rule whose HF tensors exist, and every HF tensor must be used by some
rank of the module (checked over the module's model-parallel groups before anything is read);
shapes and dtypes are checked per tensor. Each failure is one line naming the tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_plugins.weights.hf_config import find_family
from megatron_plugins.weights.hf_folder import HFCheckpoint
from megatron_plugins.weights.local_view import LocalParam, heads_of, local_params, names_text
from megatron_plugins.weights.mapping import Family, Heads, HFWeightsError
from megatron_plugins.weights.slicing import combine, source_slices

__all__ = ["WIDENING", "load_hf_weights"]

WIDENING = {(torch.bfloat16, torch.float32), (torch.float16, torch.float32)}
"""(HF dtype, parameter dtype) pairs copied exactly although they differ."""


def _union(used: set[str], pg_collection: object, experts: bool) -> set[str]:
    """HF names used by every rank holding a part of one model replica."""
    groups = [getattr(pg_collection, "mp", None)]
    if experts:
        groups.append(getattr(pg_collection, "tp_ep_pp", None))
    everything = set(used)
    for group in groups:
        if group is None or group.size() == 1:
            continue
        gathered: list[set[str] | None] = [None] * group.size()
        dist.all_gather_object(gathered, used, group=group)
        for names in gathered:
            everything |= names
    return everything


def check_names(params: Sequence[LocalParam], checkpoint: HFCheckpoint, pg_collection: object,
                family: Family, where: str) -> None:
    """Missing HF tensors (named with the parameter needing them) and unused ones are errors."""
    available = checkpoint.names()
    missing = {name: p.bound.megatron for p in params
               for name in p.bound.rule.present_hf(p.bound.hf) if name not in available}
    if missing:
        first = sorted(missing)[0]
        raise HFWeightsError(f"{where}: missing HF tensors {names_text(missing)} (e.g. "
                             f"{first} for Megatron {missing[first]})")
    used = {name for p in params for name in p.bound.hf}
    experts = any(p.bound.rule.is_expert for p in params)
    unused = {name for name in available - _union(used, pg_collection, experts)
              if not family.is_unused(name)}
    if unused:
        raise HFWeightsError(f"{where}: HF tensors {names_text(unused)} are not used by the "
                             f"{family.name} mapping of this model (a different model, or stock "
                             "flags that contradict config.json)")


def _mismatch(p: LocalParam, checkpoint: HFCheckpoint, got: object, where: str) -> HFWeightsError:
    shapes = ", ".join(f"{name} {list(checkpoint.shape(name))}" for name in p.bound.hf)
    return HFWeightsError(
        f"{where}: {shapes} do not fit Megatron {p.bound.megatron} (shape {list(p.param.shape)} "
        f"at TP rank {p.tp_rank} of {p.tp_size}, the HF tensors give {got}): the stock shape "
        "flags disagree with config.json")


def read_local(p: LocalParam, checkpoint: HFCheckpoint, heads: Heads | None, where: str
               ) -> torch.Tensor:
    """This rank's tensor for one parameter, from slices of the HF tensors."""
    rule = p.bound.rule
    parts = []
    slices = source_slices(p.bound, tuple(p.param.shape), p.tp_rank, heads)
    for index, (name, dim, start, length) in enumerate(slices):
        if index in rule.absent_zero:
            shape = list(p.param.shape)
            shape[dim] = length
            parts.append(torch.zeros(shape, dtype=p.param.dtype))
            continue
        if length < 0:
            parts.append(checkpoint.read(name, 0, 0, -1))
            continue
        shape = checkpoint.shape(name)
        if dim >= len(shape):
            raise _mismatch(p, checkpoint, f"no dim {dim}", where)
        rows = shape[dim]
        if rule.pad_vocab and p.param.shape[dim] * p.tp_size < rows:
            raise HFWeightsError(
                f"{where}: {name} has {rows} vocabulary rows, the Megatron model "
                f"{p.param.shape[dim] * p.tp_size} (padded); give --vocab-size {rows} or a "
                "tokenizer with that many tokens")
        stop = min(start + length, rows) if rule.pad_vocab else start + length
        if stop > rows:
            raise _mismatch(p, checkpoint, f"only {rows} rows on dim {dim}", where)
        part = checkpoint.read(name, dim, start, max(stop - start, 0))
        if part.shape[dim] < length:
            pad = list(part.shape)
            pad[dim] = length - part.shape[dim]
            part = torch.cat([part, part.new_zeros(pad)], dim=dim)
        parts.append(part)
    try:
        tensor = combine(p.bound, parts, heads)
    except RuntimeError as error:
        raise _mismatch(p, checkpoint, f"no valid layout ({error})", where) from None
    if tuple(tensor.shape) != tuple(p.param.shape):
        raise _mismatch(p, checkpoint, list(tensor.shape), where)
    return tensor


def check_dtypes(p: LocalParam, checkpoint: HFCheckpoint, where: str) -> None:
    """Same dtype, or an exact widening to fp32; anything else would change the weights."""
    want = p.param.dtype
    for name in p.bound.rule.present_hf(p.bound.hf):
        have = checkpoint.dtype(name)
        if have == want or (have, want) in WIDENING:
            continue
        raise HFWeightsError(
            f"{where}: {name} is {str(have).removeprefix('torch.')} but Megatron "
            f"{p.bound.megatron} is {str(want).removeprefix('torch.')}; copying would change the "
            "weights: train in the checkpoint's precision (--bf16 / --fp16 / neither) or "
            "convert it")


def import_hf_weights(module: torch.nn.Module, family: Family, pg_collection: object,
                      checkpoint: HFCheckpoint) -> int:
    """Copy the checkpoint into ``module`` (this rank's part); returns how many parameters."""
    where = f"{checkpoint.flag} {checkpoint.folder}"
    if any(param.is_meta for param in module.parameters()):
        raise HFWeightsError(f"{where}: the model is on the meta device; drop "
                             "--init-model-with-meta-device to load HF weights")
    family = family.for_names(checkpoint.names())
    params = local_params(module, family, pg_collection, where)
    check_names(params, checkpoint, pg_collection, family, where)
    for p in params:
        check_dtypes(p, checkpoint, where)
    heads = heads_of(module)
    with torch.no_grad():
        for p in params:
            p.param.copy_(read_local(p, checkpoint, heads, where))
    return len(params)


def load_hf_weights(module: torch.nn.Module, folder: str, flag: str, pg_collection: object,
                    families: Sequence[Family]) -> Family:
    """Open ``folder``, pick its family from ``config.json`` and import it into ``module``."""
    checkpoint = HFCheckpoint(folder, flag)
    family = find_family(checkpoint.config, families, f"{flag} {folder}/config.json")
    import_hf_weights(module, family, pg_collection, checkpoint)
    return family
