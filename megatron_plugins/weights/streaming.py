"""HF-named weight pieces from a live model, on every rank, with explicit per-rank metadata.

:func:`iter_hf_weights` is the inverse of the import: each rank yields the slices of HF tensors it
holds, each saying which global slice of which HF tensor it is (``global_shape``, ``offsets``).
A layer carrying adapters (LoRA) yields its weight with them merged, as the export
writes it. Across all ranks of a module every HF tensor is yielded exactly once: a DP replica other than the
first yields nothing, a tensor replicated over TP comes from TP rank 0 only. :func:`assemble`
joins pieces from any ranks into full tensors and refuses pieces that overlap, leave gaps or
disagree on the tensor's shape, so a consumer never has to assume one rank's layout is another's.
The export tool (``tools/export_hf.py``) writes what these pieces assemble to. A model started
from a whole VLM folder (``--hf-model``) streams its modules under that folder's names
(:func:`iter_whole_weights`), as the export writes them back into one folder.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from math import prod

import torch

from megatron_plugins.weights.local_view import LocalParam, heads_of, local_params, owner_of, unwrap
from megatron_plugins.weights.mapping import Family, Heads, HFWeightsError
from megatron_plugins.weights.slicing import split

__all__ = ["AssembleError", "WeightPiece", "assemble", "iter_hf_weights", "iter_whole_weights",
           "pieces_of"]


@dataclass(frozen=True)
class WeightPiece:
    """``tensor`` is ``full[offsets[0]:offsets[0]+shape[0], ...]`` of HF tensor ``hf_name``."""

    hf_name: str
    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


class AssembleError(ValueError):
    """Pieces that do not tile their HF tensor exactly; the message names the tensor."""


def _owner(pg_collection: object, expert: bool) -> bool:
    """The first data-parallel replica (of the experts, for expert parameters) yields; of a
    dense parameter, its first context-parallel rank too (Megatron's dp group leaves CP out,
    the expert dp group holds it)."""
    groups = ("expt_dp",) if expert else ("dp", "cp")
    return all(getattr(pg_collection, name, None) is None
               or getattr(pg_collection, name).rank() == 0 for name in groups)


def pieces_of(p: LocalParam, tensor: torch.Tensor, heads: Heads | None,
              vocab_size: int | None) -> Iterator[WeightPiece]:
    """The HF pieces of one parameter's local tensor (padded vocabulary rows dropped)."""
    rule = p.bound.rule
    if rule.tp_dim is None and p.tp_rank != 0:
        return
    for index, piece in enumerate(split(p.bound, tensor, p.tp_rank, heads)):
        if index in rule.absent_zero:
            _check_zero(p, piece.hf_name, piece.tensor)
            continue
        shape = list(piece.tensor.shape)
        data = piece.tensor
        if rule.tp_dim is not None:
            shape[piece.dim] = piece.total or shape[piece.dim] * p.tp_size
            if rule.pad_vocab and vocab_size is not None:
                shape[piece.dim] = vocab_size
                keep = max(0, min(data.shape[piece.dim], vocab_size - piece.start))
                if keep == 0:
                    continue
                data = data.narrow(piece.dim, 0, keep)
        offsets = [0] * len(shape)
        if rule.tp_dim is not None:
            offsets[piece.dim] = piece.start
        yield WeightPiece(piece.hf_name, data, tuple(shape), tuple(offsets))


def _check_zero(p: LocalParam, hf_name: str, part: torch.Tensor) -> None:
    """A part the HF model has no tensor for is dropped only while it is zero, as imported."""
    if torch.count_nonzero(part):
        raise HFWeightsError(
            f"{p.bound.megatron}: its {hf_name} part is nonzero (max |x| "
            f"{part.abs().max().item():.3g}) but the HF model has no {hf_name}, so the export "
            "would change the model; keep that part zero (it has no effect on the output)")


def _tied_copy(module: torch.nn.Module) -> torch.Tensor | None:
    """The last stage of a pipelined model with tied embeddings holds the embedding again as its
    output layer; the first stage streams it, as the HF embedding."""
    if getattr(module, "share_embeddings_and_output_weights", False) and not getattr(
            module, "pre_process", True):
        return module.shared_embedding_or_output_weight()
    return None


def iter_hf_weights(module: torch.nn.Module, family: Family, pg_collection: object,
                    vocab_size: int | None = None) -> Iterator[WeightPiece]:
    """This rank's pieces of the HF checkpoint ``family`` describes, read from ``module``.

    ``module`` is this rank's part of the model (wrappers are looked through); ``vocab_size`` is
    the unpadded vocabulary, so Megatron's padding rows are dropped (None keeps them).
    """
    module = unwrap(module)
    heads = heads_of(module)
    tied_copy = _tied_copy(module)
    for p in local_params(module, family, pg_collection, f"{family.name} streaming"):
        if p.param is not tied_copy and _owner(pg_collection, p.bound.rule.is_expert):
            yield from pieces_of(p, _weight(module, p), heads, vocab_size)


def _weight(module: torch.nn.Module, p: LocalParam) -> torch.Tensor:
    """A parameter as the HF model holds it: a layer carrying adapters gives its weight with
    them merged (this rank's slice)."""
    owner = owner_of(module, p.name)
    if p.name.endswith(".weight") and hasattr(owner, "merged_weight"):
        return owner.merged_weight()
    return p.param.detach()


def iter_whole_weights(mimo: torch.nn.Module, module: str, pg_collection: object, folder: str,
                       tower: Family, vocab_size: int | None = None) -> Iterator[WeightPiece]:
    """This rank's pieces of the whole VLM folder ``folder`` (``--hf-model``) the (unwrapped)
    ``MimoModel`` was started from: the language model's, or the tower's and projector's of the
    encoder ``module`` (``tower`` is its provider's ``hf_family``), under the folder's names."""
    from megatron_plugins.parallel.layout import LANGUAGE
    from megatron_plugins.weights.hf_folder import HFCheckpoint
    from megatron_plugins.weights.vlm_families import HF_MODEL_FLAG, part_families, read_vlm

    vlm, config = read_vlm(folder)
    parts = part_families(vlm, config, tower, HFCheckpoint(folder, HF_MODEL_FLAG).names())
    if module == LANGUAGE:
        yield from iter_hf_weights(mimo.language_model, parts.language, pg_collection, vocab_size)
        return
    submodule = unwrap(mimo.modality_submodules[module])
    yield from iter_hf_weights(submodule.encoders[module], parts.tower, pg_collection)
    yield from iter_hf_weights(submodule.input_projections, parts.projector, pg_collection)


def _overlap(a: WeightPiece, b: WeightPiece) -> bool:
    return all(x0 < y0 + ys and y0 < x0 + xs for x0, xs, y0, ys
               in zip(a.offsets, a.tensor.shape, b.offsets, b.tensor.shape))


def assemble(pieces: Iterable[WeightPiece]) -> dict[str, torch.Tensor]:
    """Full HF tensors (CPU, contiguous) from pieces gathered from any ranks, checked to tile each
    tensor exactly. A tensor whose one piece is already whole, contiguous and on the CPU is
    returned as that piece, not copied (export writes it as is); copy it before changing it."""
    by_name: dict[str, list[WeightPiece]] = defaultdict(list)
    for piece in pieces:
        by_name[piece.hf_name].append(piece)
    full = {}
    for name, group in sorted(by_name.items()):
        shape = group[0].global_shape
        dtype = group[0].tensor.dtype
        for piece in group:
            if piece.global_shape != shape or piece.tensor.dtype != dtype:
                raise AssembleError(f"{name}: pieces disagree on the tensor ({shape} {dtype} vs "
                                    f"{piece.global_shape} {piece.tensor.dtype})")
            ends = [o + s for o, s in zip(piece.offsets, piece.tensor.shape)]
            if len(ends) != len(shape) or any(o < 0 for o in piece.offsets) or any(
                    e > s for e, s in zip(ends, shape)):
                raise AssembleError(f"{name}: piece at {piece.offsets} of shape "
                                    f"{list(piece.tensor.shape)} lies outside {list(shape)}")
        for i, a in enumerate(group):
            for b in group[i + 1:]:
                if _overlap(a, b):
                    raise AssembleError(f"{name}: pieces at {a.offsets} and {b.offsets} overlap")
        covered = sum(prod(piece.tensor.shape) for piece in group)
        if covered != prod(shape):
            raise AssembleError(f"{name}: pieces cover {covered} of {prod(shape)} elements")
        if len(group) == 1 and tuple(group[0].tensor.shape) == shape:
            # One piece is the whole tensor: no second copy (a view is only made contiguous).
            full[name] = group[0].tensor.cpu().contiguous()
            continue
        tensor = torch.empty(shape, dtype=dtype)
        for piece in group:
            index = tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.tensor.shape))
            tensor[index] = piece.tensor
        full[name] = tensor
    return full
