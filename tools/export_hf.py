"""Export a MiMo checkpoint saved by stock ``--save`` (torch_dist, any layout) to HF folders.

    python -m tools.export_hf --checkpoint runs/default/checkpoints --output hf_out

writes ``hf_out/language/`` (config.json + safetensors, the family's HF format), one folder per
encoder whose provider has a HF mapping (with the tower's tensors the encoder does not hold, such
as CLIP's ``post_layernorm``, and its processor files, copied from the folder the run started
from), and
``hf_out/projections.safetensors`` with ``projections.json`` describing them. A run started from
a whole VLM folder (``--hf-model``) is written back as ONE folder of that architecture instead:
``hf_out/config.json`` (the folder's own), the tower, projector and language tensors under the
folder's names, the tower's tensors the encoder does not hold (layers past the feature layer,
``post_layernorm``) and the folder's other files (tokenizer, preprocessor) copied unchanged. Tensors are read
whole from the checkpoint, whatever layout saved it (megatron-core's ``dist_checkpointing.load``
of each tensor's full extent), one module at a time, then split into HF tensors by the same rules
and code the streaming API uses; so the files are byte-identical for any saving layout, and every
tensor keeps its saved dtype.
Shards of ``--max-shard-size`` with ``model.safetensors.index.json`` when the model is bigger.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_plugins.errors import UsageError, report
from megatron_plugins.parallel.layout import LANGUAGE
from megatron_plugins.peft.export import (
    AdapterReader,
    HFAdapter,
    PeftFormatError,
    merge,
    write_peft,
)
from megatron_plugins.peft.flags import PROJECTION
from megatron_plugins.parallel.module_values import module_values
from megatron_plugins.weights.encoder_view import includes_projection, module_tensors
from megatron_plugins.weights.local_view import LocalParam
from megatron_plugins.weights.mapping import Family, Heads, HFWeightsError, linear_geometry
from megatron_plugins.weights.megatron_init import join_sections, split_key
from megatron_plugins.weights.streaming import WeightPiece, assemble, pieces_of
from megatron_plugins.weights.vision_families import untrained_tensors

PROG = "export_hf"
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
              "GIB": 2**30}
PROJECTIONS = "projections"
ADAPTERS = "adapters"
"""Where a LoRA run's adapters go in PEFT's format, inside ``--output`` (one folder per HF model
folder written; the folder itself for a whole VLM)."""
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json")
"""An encoder's source folder's processor files an export carries, so the exported folder loads
with its own image / video processor or feature extractor."""


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or a byte count."""
    match = re.fullmatch(r"\s*([0-9]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in SIZE_UNITS:
        raise HFWeightsError(f"--max-shard-size {text}: expected bytes or a size like 5GB, 500MB")
    return int(match.group(1)) * SIZE_UNITS[match.group(2).upper()]


def iteration_folder(checkpoint: Path, iteration: int | None) -> Path:
    """The complete iteration folder to export: the one given, or the tracker's newest."""
    from megatron_plugins.weights.megatron_folder import (
        TRACKER_FILE,
        FolderFlags,
        is_complete,
        resume_point,
    )

    if is_complete(checkpoint):
        return checkpoint
    if not checkpoint.is_dir():
        raise HFWeightsError(f"--checkpoint {checkpoint}: no such folder")
    fix = ("point --checkpoint at a --save folder holding a complete checkpoint, or at an iter_* "
           "folder")
    flags = FolderFlags("--checkpoint", "--iteration", empty=fix, broken=fix)
    step = resume_point(checkpoint, iteration, auto_resume=False, flags=flags).step
    if step is None:
        step = int((checkpoint / TRACKER_FILE).read_text().strip())
    return checkpoint / f"iter_{step:07d}"


STACKED = (("layers.", "layers."), ("experts.experts.", "experts.local_experts."))
"""(checkpoint key segment, global name segment) of what stock stacks on a leading dim."""


def unstack(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Stock checkpoints stack a block's layers (and an MoE layer's experts) on leading dims;
    yield each with its global name (``decoder.layers.{i}.``, ``experts.local_experts.{e}.``)."""
    for stacked, named in STACKED:
        head, found, rest = name.partition(stacked)
        if found and not rest.split(".")[0].isdigit():
            for index, part in enumerate(tensor.unbind(0)):
                yield from unstack(f"{head}{named}{index}.{rest}", part)
            return
    yield name, tensor


class Checkpoint:
    """A torch_dist iteration folder read one full tensor at a time (no saving layout needed)."""

    def __init__(self, folder: Path) -> None:
        import torch.distributed as dist
        from megatron.core import dist_checkpointing

        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.folder = folder
        self._dc = dist_checkpointing
        self.metadata = dist_checkpointing.load_tensors_metadata(str(folder))
        self.args = dist_checkpointing.load_common_state_dict(str(folder))["args"]
        self.modules: dict[str, dict[str, str]] = {}
        for key in sorted(self.metadata):
            where = split_key(key)
            if where is not None:
                self.modules.setdefault(where[0], {})[where[1]] = key
        if not self.modules:  # a stock GPT checkpoint: the language model's own names
            self.modules["language"] = {key: key for key in self.metadata
                                        if not key.startswith("optimizer.")}

    def tensors(self, module: str) -> Iterator[tuple[str, torch.Tensor]]:
        """(global Megatron name, full tensor) of one module, stacked keys unstacked. One load
        for the whole module: the export holds all of it before writing anyway, and one load
        plans and opens the files once instead of once per tensor. Nothing for a module a LoRA
        run left out whole (frozen, its base referenced)."""
        keys = self.modules.get(module)
        if not keys:
            return
        loaded = self._dc.load({key: self.metadata[key] for key in keys.values()},
                               str(self.folder), validate_access_integrity=False)
        yield from join_sections(item for name, key in keys.items()
                                 for item in unstack(name, loaded[key]))


def hf_pieces(tensors: Iterator[tuple[str, torch.Tensor]], family: Family, heads: Heads | None,
              vocab_size: int | None, where: str) -> Iterator[WeightPiece]:
    """Full Megatron tensors -> HF pieces, by the streaming code at TP 1."""
    for name, tensor in tensors:
        bound = family.bind(name)
        if bound is None:
            raise HFWeightsError(f"{where}: the {family.name} mapping has no rule for {name}")
        yield from pieces_of(LocalParam(name, tensor, bound, 0, 1), tensor, heads, vocab_size)


def write_folder(tensors: Mapping[str, torch.Tensor], folder: Path, max_shard_size: int,
                 config: dict[str, Any] | None, progress: bool) -> list[Path]:
    """safetensors (sharded with an index past ``max_shard_size``) plus config.json."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    folder.mkdir(parents=True, exist_ok=True)
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors, key=_natural):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    written = []
    for file, names in tqdm(list(zip(files, shards)), desc=f"writing {folder.name}",
                            unit="file", disable=not progress):
        save_file({name: tensors[name].contiguous() for name in names}, str(folder / file),
                  metadata={"format": "pt"})
        written.append(folder / file)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                                for t in tensors.values())},
                 "weight_map": {name: file for file, names in zip(files, shards) for name in names}}
        written.append(_write_json(folder / "model.safetensors.index.json", index))
    if config is not None:
        written.append(_write_json(folder / "config.json", config))
    return written


def _natural(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"([0-9]+)", name)]


def _write_json(path: Path, content: Any) -> Path:
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    return path


def _language_family(args: Any, name: str | None) -> Family:
    from megatron_plugins.weights.language_families import FAMILIES

    chosen = name or getattr(args, "language_hf_family", None)
    names = ", ".join(family.name for family in FAMILIES)
    if chosen is None:
        raise HFWeightsError(f"the checkpoint was not started from HF weights: give "
                             f"--language-family ({names})")
    for family in FAMILIES:
        if family.name == chosen:
            return family
    raise HFWeightsError(f"--language-family {chosen}: not one of {names}")


def _encoder_families(args: Any) -> dict[str, Family | None]:
    from megatron_plugins.encoders import resolve
    from megatron_plugins.weights.flags import encoder_family

    providers = module_values(getattr(args, "mimo_encoders", None), "--encoder")
    return {name: encoder_family(resolve(provider, name)) for name, provider in providers.items()}


def _heads(args: Any) -> Heads:
    return Heads(args.num_attention_heads,
                 args.num_query_groups if args.group_query_attention else args.num_attention_heads,
                 args.kv_channels or args.hidden_size // args.num_attention_heads,
                 linear_geometry(args))


def _encoder_heads(config: Mapping[str, Any]) -> Heads:
    """HF encoders use plain multi-head attention; Whisper and Qwen2.5-VL name their shape
    fields differently."""
    heads = (config.get("num_attention_heads") or config.get("encoder_attention_heads")
             or config["num_heads"])
    hidden = config.get("hidden_size", config.get("d_model"))
    return Heads(heads, heads, hidden // heads)


def export(checkpoint: str | Path, output: str | Path, *, iteration: int | None = None,
           max_shard_size: int = 5 * 10**9, language_family: str | None = None,
           progress: bool = True, adapter_output: str | Path | None = None) -> list[Path]:
    """Write the HF folders of a MiMo checkpoint (a LoRA run's with its adapters merged, and
    the adapters in PEFT's format under ``adapter_output``, default ``output/adapters``);
    returns the files written. The one-rank world reading the checkpoint needs is removed
    afterwards when this call made it, so a caller's process is left as it was."""
    made_world = not torch.distributed.is_initialized()
    try:
        return _export(Checkpoint(iteration_folder(Path(checkpoint), iteration)), Path(output),
                       max_shard_size, language_family, progress, adapter_output)
    finally:
        if made_world and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _export(ckpt: Checkpoint, out: Path, max_shard_size: int, language_family: str | None,
            progress: bool, adapter_output: str | Path | None) -> list[Path]:
    args = ckpt.args
    adapters_out = Path(adapter_output) if adapter_output else out / ADAPTERS
    reader = AdapterReader(ckpt, Checkpoint)
    if getattr(args, "hf_model", None):
        return export_whole(reader, out, adapters_out, max_shard_size, progress)
    written = []
    if LANGUAGE in ckpt.modules:
        family = _language_family(args, language_family)
        vocab = args.vocab_size or args.padded_vocab_size
        pieces = hf_pieces(reader.tensors(LANGUAGE), family, _heads(args), vocab,
                           str(ckpt.folder))
        held = assemble(pieces)
        tensors = reader.fill(held, [LANGUAGE], family)
        adapters = reader.hf_adapters(LANGUAGE, family, _heads(args))
        merge(tensors, adapters)
        config = family.hf_config(args, vocab)
        written += write_folder(tensors, out / LANGUAGE, max_shard_size, config, progress)
        written += write_adapters(adapters_out / LANGUAGE, adapters, args.language_hf_weights,
                                  config, tensors, held)
    for name, family in _encoder_families(args).items():
        if family is None:
            print(f"{PROG}: notice: encoder {name}'s provider has no HF mapping; its network is "
                  "not exported", file=sys.stderr)
        elif name in ckpt.modules:
            config = family.hf_config(args, None)
            heads = _encoder_heads(config)
            pieces = hf_pieces(module_tensors(reader.tensors, name, family), family, heads, None,
                               str(ckpt.folder))
            held = assemble(pieces)
            tensors = reader.fill({**held, **untrained_tensors(family, args)},
                                  [name, name + PROJECTION], family)
            adapters = reader.encoder_adapters(name, family, heads)
            merge(tensors, adapters)
            written += write_folder(tensors, out / name, max_shard_size, config, progress)
            written += _processor_files(args, name, out / name)
            written += write_adapters(adapters_out / name, adapters,
                                      dict(args.encoder_hf_weights or {}).get(name), config,
                                      tensors, held)
    # A projection its encoder's family maps (Qwen2.5-VL's merger) is in that encoder's folder.
    exported = {f"{name}:projection" for name, family in _encoder_families(args).items()
                if family is not None and includes_projection(family)}
    projections, adapters = {}, []
    for module in ckpt.modules:
        if module.endswith(":projection") and module not in exported:
            encoder = module.partition(":")[0]
            projections.update({f"{encoder}.{name}": tensor
                                for name, tensor in reader.tensors(module)})
            adapters += [HFAdapter(f"{encoder}.{a.weight.removesuffix('.weight')}", a.a, a.b,
                                   a.spec) for a in reader.adapters[module]]
    merge(projections, adapters)
    if projections:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in projections.items()},
                  str(out / f"{PROJECTIONS}.safetensors"), metadata={"format": "pt"})
        written.append(out / f"{PROJECTIONS}.safetensors")
        written.append(_write_json(out / f"{PROJECTIONS}.json", {
            "module": "megatron.core.models.vision.multimodal_projector.MultimodalProjector "
                      "(projector_type mlp: linear_fc1 -> GELU -> linear_fc2, biases)",
            "tensors": {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                        for name, t in sorted(projections.items())},
        }))
    return written


def write_adapters(folder: Path, adapters: list[HFAdapter], base: str | None,
                   config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                   trained: Iterable[str]) -> list[Path]:
    """A LoRA run's adapters in PEFT's format with the tensors it ``trained`` in full beside
    them (:func:`~megatron_plugins.peft.export.write_peft`): those the checkpoint held beside the
    adapters, since a LoRA run leaves out the frozen base it references. Where PEFT's format
    cannot carry them, no folder and one line saying why: the merged folder holds the model."""
    try:
        return write_peft(folder, adapters, base, config, tensors, trained)
    except PeftFormatError as error:
        print(f"{PROG}: notice: no PEFT-format adapters written to {folder}: {error}; the "
              "merged folder holds the trained model", file=sys.stderr)
        return []


def _processor_files(args: Any, name: str, folder: Path) -> list[Path]:
    """Copy :data:`PROCESSOR_FILES` from encoder ``name``'s ``--encoder-hf-weights`` folder."""
    folders = module_values(getattr(args, "encoder_hf_weights", None), "--encoder-hf-weights")
    if name not in folders:
        return []
    source = Path(folders[name])
    return [Path(shutil.copyfile(source / file, folder / file)) for file in PROCESSOR_FILES
            if (source / file).is_file()]


HEADS_FIELDS = ("num_attention_heads", "num_heads", "encoder_attention_heads")
WIDTH_FIELDS = ("hidden_size", "d_model")
"""A tower config's attention heads and width, as vision and Whisper-style audio configs name
them in config.json."""

WHOLE_WEIGHTS = re.compile(r"(model|pytorch_model).*\.(safetensors|bin)(\.index\.json)?$")
"""The source folder's weight files, which the export writes anew."""


def export_whole(reader: AdapterReader, out: Path, adapters_out: Path, max_shard_size: int,
                 progress: bool) -> list[Path]:
    """One HF folder of the ``--hf-model`` architecture the run started from: every module's
    tensors under the folder's own names, its untrained tensors and other files copied (and a
    LoRA run's adapters merged, and in PEFT's format in ``adapters_out``)."""
    from megatron_plugins.weights.flags import hf_model_towers
    from megatron_plugins.weights.hf_folder import HFCheckpoint
    from megatron_plugins.weights.vlm_families import HF_MODEL_FLAG, part_families, read_vlm

    ckpt = reader.ckpt
    args = ckpt.args
    source = Path(args.hf_model)
    vlm, config = read_vlm(str(source))
    checkpoint = HFCheckpoint(source, HF_MODEL_FLAG)
    where = str(ckpt.folder)
    vocab = args.vocab_size or args.padded_vocab_size
    families = _encoder_families(args)
    pieces, adapters, untrained, modules = [], [], set(), [LANGUAGE]
    for name, tower in hf_model_towers(args).items():
        if families.get(name) is None:
            raise HFWeightsError(f"{ckpt.folder}: the run's --hf-model encoder {name} has no HF "
                                 "weight mapping")
        parts = part_families(vlm, config, families[name], checkpoint.names())
        sub = vlm.root(config).get(tower.config_key) or {}
        heads = next(sub[k] for k in HEADS_FIELDS if k in sub)  # plain multi-head
        tower_heads = Heads(heads, heads, next(sub[k] for k in WIDTH_FIELDS if k in sub) // heads)
        pieces += [*hf_pieces(reader.tensors(name), parts.tower, tower_heads, None, where),
                   *hf_pieces(reader.tensors(f"{name}:projection"), parts.projector, None, None,
                              where)]
        adapters += [*reader.hf_adapters(name, parts.tower, tower_heads),
                     *reader.hf_adapters(f"{name}:projection", parts.projector, None)]
        untrained.update(parts.tower.untrained, parts.language.untrained)
        modules += [name, name + PROJECTION]
    pieces += hf_pieces(reader.tensors(LANGUAGE), parts.language, _heads(args), vocab, where)
    adapters += reader.hf_adapters(LANGUAGE, parts.language, _heads(args))
    held = assemble(pieces)
    copied_tensors = {hf: checkpoint.read(hf, 0, 0, -1) for hf in sorted(checkpoint.names())
                      if any(re.match(pattern, hf) for pattern in untrained)}
    tensors = reader.fill({**held, **copied_tensors}, modules, None)
    merge(tensors, adapters)
    out.mkdir(parents=True, exist_ok=True)
    copied = []
    for file in sorted(source.iterdir()):
        if file.is_file() and file.name != "config.json" and not WHOLE_WEIGHTS.match(file.name):
            copied.append(Path(shutil.copyfile(file, out / file.name)))
    return [*copied, *write_folder(tensors, out, max_shard_size, config, progress),
            *write_adapters(adapters_out, adapters, str(source), config, tensors, held)]


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: export, or one error line and exit code 2."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True,
                        help="the --save folder (its newest complete iteration) or an iter_* folder")
    parser.add_argument("--output", required=True, help="folder for the HF folders")
    parser.add_argument("--iteration", type=int, default=None, help="export this iteration")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="largest safetensors file (default 5GB); more files get an index")
    parser.add_argument("--language-family", default=None,
                        help="HF family of the language model when the run did not start from "
                             "--language-hf-weights")
    parser.add_argument("--adapter-output", default=None,
                        help="a LoRA run's adapters in the PEFT library's format go here "
                             f"(default: OUTPUT/{ADAPTERS}); the HF folders get them merged")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        export(args.checkpoint, args.output, iteration=args.iteration,
               max_shard_size=parse_size(args.max_shard_size),
               language_family=args.language_family, progress=not args.no_progress,
               adapter_output=args.adapter_output)
    except UsageError as error:
        return report(PROG, error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
