"""A LoRA checkpoint's adapters out: merged into the HF weights, or in the PEFT library's format.

The export tool (``tools/export_hf.py``) reads every module of a checkpoint as full Megatron
tensors. :func:`split_adapters` takes the adapters (``lora_a`` / ``lora_b`` of an adapted linear)
out of a module's tensors; :func:`hf_adapters` names them as HF does: the adapted linear's weight
binds to the same family rule as a full fine-tune's, ``B`` (``[out, rank]``) splits into the HF
tensors exactly as the weight's rows do (fused QKV into q / k / v, SwiGLU ``linear_fc1`` into
gate / up) and ``A`` is every one of them's ``lora_A``, so ``B_hf A`` is each HF tensor's share of
the update. :func:`merge` adds ``scale * B_hf A`` to the HF weights (the folder a full fine-tune
exports) and :func:`write_peft` writes ``adapter_config.json`` + ``adapter_model.safetensors`` under
the HF module names, which ``peft.PeftModel.from_pretrained`` loads onto transformers' model, with
what the run trained in full beside the adapters as PEFT's ``modules_to_save``
(:func:`modules_to_save`), or nothing and one line why where PEFT cannot carry it.
:func:`check_reference` checks a frozen base's folder is the one the run trained on before its
tensors fill what the checkpoint left out.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_plugins.peft.checkpoint import BASE_ATTR, describe_reference, reference_fingerprint
from megatron_plugins.parallel.layout import LANGUAGE
from megatron_plugins.peft.flags import PROJECTION, LoraSpec, lora_specs
from megatron_plugins.peft.layers import ADAPTERS, merged
from megatron_plugins.weights.encoder_view import module_tensors
from megatron_plugins.weights.local_view import LocalParam
from megatron_plugins.weights.mapping import Family, Heads, HFWeightsError
from megatron_plugins.weights.streaming import assemble, pieces_of

__all__ = ["Adapter", "AdapterReader", "HFAdapter", "PeftFormatError", "check_reference",
           "hf_adapters", "merge", "run_specs", "split_adapters", "write_peft"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class Adapter:
    """One adapted linear: the global name of its weight and its adapters, full (TP 1)."""

    weight: str
    a: torch.Tensor
    b: torch.Tensor
    spec: LoraSpec


@dataclass(frozen=True)
class HFAdapter:
    """The adapter of one HF linear (module name, no ``.weight``)."""

    module: str
    a: torch.Tensor
    b: torch.Tensor
    spec: LoraSpec


def run_specs(args: Any) -> dict[str, LoraSpec]:
    """The saving run's LoRA specs by part (its ``--lora`` values)."""
    return lora_specs(getattr(args, "lora", None) or [], None)


def split_adapters(tensors: Iterable[tuple[str, torch.Tensor]], spec: LoraSpec | None
                   ) -> tuple[list[tuple[str, torch.Tensor]], list[Adapter]]:
    """A module's (global name, tensor) pairs without its adapters, and the adapters."""
    rest, found = [], {}
    for name, tensor in tensors:
        layer, _, leaf = name.rpartition(".")
        if leaf in ADAPTERS:
            found.setdefault(layer, {})[leaf] = tensor
        else:
            rest.append((name, tensor))
    if found and spec is None:
        raise HFWeightsError(f"the checkpoint holds adapters ({next(iter(found))}) but its args "
                             "have no --lora for that part")
    return rest, [Adapter(f"{layer}.weight", pair["lora_a"], pair["lora_b"], spec)
                  for layer, pair in sorted(found.items())]


def hf_adapters(adapters: Iterable[Adapter], family: Family, heads: Heads | None,
                where: str) -> list[HFAdapter]:
    """Each adapter split onto the HF linears its weight maps to."""
    found = []
    for adapter in adapters:
        bound = family.bind(adapter.weight)
        if bound is None:
            raise HFWeightsError(f"{where}: the {family.name} mapping has no rule for "
                                 f"{adapter.weight}")
        pieces = pieces_of(LocalParam(adapter.weight, adapter.b, bound, 0, 1), adapter.b, heads,
                           None)
        for name, b in assemble(pieces).items():
            found.append(HFAdapter(name.removesuffix(".weight"), adapter.a, b, adapter.spec))
    return found


def merge(tensors: dict[str, torch.Tensor], adapters: Iterable[HFAdapter]) -> None:
    """``W + scale * B A`` for every adapted HF weight of ``tensors``, in place, each weight
    kept in its dtype (:func:`~megatron_plugins.peft.layers.merged`)."""
    for adapter in adapters:
        name = f"{adapter.module}.weight"
        tensors[name] = merged(tensors[name], adapter.a, adapter.b, adapter.spec.scale)


class PeftFormatError(HFWeightsError):
    """Adapters PEFT's format cannot carry with what the run trained in full beside them; the
    export then writes no PEFT folder and says why in one line (the merged folder holds the
    trained model)."""


def hf_model(config: Mapping[str, Any]) -> torch.nn.Module | None:
    """transformers' model of an HF folder's ``config`` (its ``config.json``) on the meta device,
    whose names PEFT finds modules and tensors by; None when the config names no class of
    transformers."""
    import transformers

    settings = dict(config)
    architecture = getattr(transformers, (settings.get("architectures") or [""])[0], None)
    if architecture is None:
        return None
    with torch.device("meta"):
        return architecture(transformers.AutoConfig.for_model(**settings))


def runtime_names(model: torch.nn.Module | None, names: Iterable[str]) -> dict[str, str]:
    """The name each tensor of an HF folder (as its safetensors name it) has in transformers'
    ``model`` of it: transformers renames a saved layout on load (Qwen2.5-VL's ``model.layers``
    is ``model.language_model.layers``), and PEFT finds adapters and saved modules by the
    model's names. Names it does not rename (or no ``model``) stay."""
    if model is None:
        return {name: name for name in names}
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    meta = model.state_dict()
    renamed = {}
    for name in names:
        found, _ = rename_source_key(name, renamings, converters, model.base_model_prefix, meta)
        renamed[name] = found if found in meta else name
    return renamed


def _ancestors(name: str) -> list[str]:
    """The names of the modules holding module or tensor ``name`` (the model's, "", first)."""
    parts = name.split(".")
    return [".".join(parts[:depth]) for depth in range(len(parts))]


def _module_tensors(model: torch.nn.Module) -> dict[str, set[str]]:
    """Every module's state tensors (its own and its submodules'), full names, by module: what
    PEFT saves and loads of a module it saves whole."""
    held: dict[str, set[str]] = {name: set() for name, _ in model.named_modules()}
    for key in model.state_dict():
        for module in _ancestors(key):
            if module in held:
                held[module].add(key)
    return held


def _embeddings(model: torch.nn.Module) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """The input embedding and output layer of transformers' model, or of its first submodel
    that says (a whole Omni model leaves them to its thinker)."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            try:
                return module.get_input_embeddings(), module.get_output_embeddings()
            except NotImplementedError:
                continue
    return None, None


def _tied_embedding(model: torch.nn.Module) -> tuple[str, str] | None:
    """The module names of the input embedding and of the output layer sharing its weight."""
    inputs, outputs = _embeddings(model)
    if inputs is None or outputs is None or outputs.weight is not inputs.weight:
        return None
    names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    return names[id(inputs)], names[id(outputs)]


def modules_to_save(model: torch.nn.Module, trained: set[str], targets: set[str]
                    ) -> tuple[list[str], dict[str, str]]:
    """PEFT's ``modules_to_save`` for the tensors a run trained in full (``trained``, the model's
    names) beside adapters on ``targets``: the largest modules all of whose tensors trained that
    hold no adapted linear and are called, not indexed (a ``ModuleList`` is not). A tied input
    embedding stands alone, and PEFT ties the output layer to its copy, loading the output's
    weight too: the dict names those tensors (output's name: input's). A trained tensor no
    such module holds cannot travel: :class:`PeftFormatError` says which."""
    held = _module_tensors(model)
    blocked = {""} | {name for name, module in model.named_modules()
                      if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict))}
    blocked |= {name for target in targets for name in (*_ancestors(target), target)}
    tied = _tied_embedding(model)
    if tied is not None:
        blocked |= set(_ancestors(tied[0]))
    whole = {name for name, keys in held.items()
             if name not in blocked and keys and keys <= trained}
    chosen = sorted(name for name in whole if not whole.intersection(_ancestors(name)))
    missing = sorted(trained.difference(*(held[name] for name in chosen)))
    if missing:
        raise PeftFormatError(_uncovered(missing[0], held, trained, targets))
    if tied is None or tied[0] not in chosen:
        return chosen, {}
    embedding, output = tied
    return chosen, {f"{output}{key[len(embedding):]}": key for key in sorted(held[embedding])}


def _uncovered(name: str, held: Mapping[str, set[str]], trained: set[str],
               targets: set[str]) -> str:
    """Why the trained tensor ``name`` cannot travel in a module PEFT saves whole."""
    owner = next((module for module in reversed(_ancestors(name)) if name in held[module]), None)
    if owner is None:
        return f"the run trained {name} in full, which transformers' model does not hold"
    if owner in targets:
        return (f"the adapted linear {owner}'s {name} is not the base folder's (its frozen "
                "weights came from init or a Megatron checkpoint), and PEFT adds adapters to the "
                "base folder's weights")
    adapted = sorted(target for target in targets if owner in _ancestors(target))
    other = (f"the adapted linear {adapted[0]}" if adapted else
             f"{min(held[owner] - trained)}, which the run did not train")
    return (f"the run trained {name} in full, and PEFT saves such tensors as whole modules "
            f"(modules_to_save), but its module {owner or '(the model)'} also holds {other}")


def _check_linears(model: torch.nn.Module | None, adapters: Iterable[HFAdapter],
                   names: Mapping[str, str]) -> None:
    """Every adapter sits on a linear layer of transformers' model, as PEFT's LoRA needs (an
    MoE expert's is not one: transformers fuses each layer's experts into one tensor)."""
    if model is None:
        return
    linears = {name for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear)}
    for adapter in adapters:
        weight = names[f"{adapter.module}.weight"]
        if weight.removesuffix(".weight") not in linears:
            raise PeftFormatError(
                f"the folder's {adapter.module} is no linear layer of transformers' model (it "
                f"holds it in {weight}: MoE experts are fused there), and PEFT's LoRA adapts "
                "linear layers")


def write_peft(folder: Path, adapters: list[HFAdapter], base: str | None,
               config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
               trained: Iterable[str]) -> list[Path]:
    """``adapter_config.json`` and ``adapter_model.safetensors`` of ``adapters`` in ``folder``,
    under the names of transformers' model of ``config`` (:func:`runtime_names`), with the
    ``tensors`` (HF names) the run ``trained`` in full beside them, as PEFT's
    ``modules_to_save`` (:func:`modules_to_save`), so ``PeftModel.from_pretrained`` on the base
    folder gives the merged folder's model. The config's rank and alpha are the first part's;
    modules of other parts get theirs through ``rank_pattern`` / ``alpha_pattern`` (their full
    names). Nothing is written when PEFT cannot carry it (:class:`PeftFormatError`)."""
    from safetensors.torch import save_file

    if not adapters:
        return []
    trained = sorted(trained)
    model = hf_model(config)
    if trained and model is None:
        raise PeftFormatError(f"the run trained {trained[0]} in full, and the folder's config "
                              "names no transformers class whose modules PEFT could save it by")
    names = runtime_names(model, [*(f"{a.module}.weight" for a in adapters), *trained])
    _check_linears(model, adapters, names)
    adapters = [HFAdapter(names[f"{a.module}.weight"].removesuffix(".weight"), a.a, a.b, a.spec)
                for a in adapters]
    saved = {names[name]: tensors[name] for name in trained}
    modules, tied = (modules_to_save(model, set(saved), {a.module for a in adapters})
                     if saved else ([], {}))
    first = adapters[0].spec
    config = {
        "peft_type": "LORA", "task_type": None, "base_model_name_or_path": base,
        "r": first.rank, "lora_alpha": first.alpha, "lora_dropout": first.dropout,
        "target_modules": sorted({a.module for a in adapters}), "bias": "none",
        "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": modules or None, **({"ensure_weight_tying": True} if tied else {}),
        "rank_pattern": {a.module: a.spec.rank for a in adapters if a.spec.rank != first.rank},
        "alpha_pattern": {a.module: a.spec.alpha for a in adapters
                          if a.spec.alpha != first.alpha},
    }
    saved.update({output: saved[embedding].clone() for output, embedding in tied.items()})
    weights = {f"{PEFT_PREFIX}{name}": tensor.contiguous() for name, tensor in saved.items()}
    for adapter in adapters:
        weights[f"{PEFT_PREFIX}{adapter.module}.lora_A.weight"] = adapter.a.clone()
        weights[f"{PEFT_PREFIX}{adapter.module}.lora_B.weight"] = adapter.b.contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return [folder / ADAPTER_WEIGHTS, folder / ADAPTER_CONFIG]


def check_reference(args: Any, part: str) -> dict[str, str] | None:
    """The frozen base a LoRA checkpoint left out for ``part`` (flag, path, fingerprint), checked
    to be unchanged; None when the checkpoint holds the part whole."""
    reference = (getattr(args, BASE_ATTR, None) or {}).get(part)
    if reference is None:
        return None
    now = reference_fingerprint(reference["flag"], reference["path"])
    if now != reference["fingerprint"]:
        raise HFWeightsError(
            f"the checkpoint left {part}'s frozen weights out, to be read from "
            f"{describe_reference(reference)}, which "
            f"{'no longer exists' if now is None else f'has changed (fingerprint {now})'}; give "
            "the export that folder unchanged")
    return reference


class AdapterReader:
    """A checkpoint's modules for the export, without their adapters (set aside by module);
    the frozen base a LoRA run left out is read back from its reference: a Megatron checkpoint's
    tensors join a module's (:meth:`tensors`), an HF folder's join the HF tensors (:meth:`fill`).

    ``ckpt`` has ``args``, ``folder`` and ``tensors(module)`` (global name, full tensor);
    ``open_checkpoint(folder)`` opens a reference Megatron checkpoint the same way.
    """

    def __init__(self, ckpt: Any, open_checkpoint: Callable[[Path], Any]) -> None:
        self.ckpt = ckpt
        self.open_checkpoint = open_checkpoint
        self.specs = run_specs(ckpt.args)
        self.adapters: dict[str, list[Adapter]] = {}

    def tensors(self, module: str) -> Iterator[tuple[str, torch.Tensor]]:
        """One module's weights (``language``, ``NAME``, ``NAME:projection``), adapters aside."""
        part = module.replace(":projection", PROJECTION)
        rest, self.adapters[module] = split_adapters(self.ckpt.tensors(module),
                                                     self.specs.get(part))
        reference = check_reference(self.ckpt.args, part)
        if reference is not None and "megatron-checkpoint" in reference["flag"]:
            have = {name for name, _ in rest}
            base = self.open_checkpoint(Path(reference["path"]))
            rest += [(name, tensor) for name, tensor in base.tensors(module) if name not in have]
        return iter(rest)

    def hf_adapters(self, module: str, family: Family, heads: Heads | None) -> list[HFAdapter]:
        """The adapters of ``module`` (read first) under ``family``'s HF names."""
        return hf_adapters(self.adapters.get(module, []), family, heads, str(self.ckpt.folder))

    def encoder_adapters(self, name: str, family: Family, heads: Heads | None
                         ) -> list[HFAdapter]:
        """Encoder ``name``'s adapters (its projection's too where ``family`` maps it) under
        the names :func:`module_tensors` gives its tensors."""
        renamed = module_tensors(lambda module: ((a.weight, a) for a in self.adapters.get(
            module, [])), name, family)
        adapters = [Adapter(weight, a.a, a.b, a.spec) for weight, a in renamed]
        return hf_adapters(adapters, family, heads, str(self.ckpt.folder))

    def fill(self, tensors: dict[str, torch.Tensor], parts: Sequence[str],
             family: Family | None) -> dict[str, torch.Tensor]:
        """``tensors`` plus the HF tensors of the frozen base the checkpoint left out of
        ``parts``, read from their HF folder under the names ``tensors`` use (``family``'s
        own, without its prefixes; a whole VLM folder's as they are with None)."""
        from megatron_plugins.weights.hf_folder import HFCheckpoint

        folders = {ref["path"] for part in parts
                   if (ref := check_reference(self.ckpt.args, part)) is not None
                   and "megatron-checkpoint" not in ref["flag"]}
        filled = dict(tensors)
        prefixes = [p for p in (family.hf_prefixes if family is not None else ()) if p]
        for folder in sorted(folders):
            source = HFCheckpoint(folder, "the base folder")
            for name in sorted(source.names()):
                own = next((name[len(p):] for p in prefixes if name.startswith(p)), name)
                if own not in filled and not (family is not None and family.is_unused(name)):
                    filled[own] = source.read(name, 0, 0, -1)
        return filled
