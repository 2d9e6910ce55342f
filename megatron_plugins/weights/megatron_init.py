"""Start a module from an existing torch_dist checkpoint, resharded on load.

``--language-megatron-checkpoint DIR`` starts the language model from a stock ``pretrain_gpt``
checkpoint (or a MiMo run's language model), ``--encoder-megatron-checkpoint NAME=DIR`` an encoder
network from a previous MiMo run's encoder NAME; DIR is a ``--save`` folder (its tracker's
iteration) or one iteration folder, saved at any TP/PP. Only model tensors are read (no optimizer,
no RNG, no iteration): the module's own sharded state dict, with its keys renamed to the
checkpoint's, goes through megatron-core's ``dist_checkpointing.load`` on the ranks of the
module's grid, which reshards. Before any process group, :func:`check_init_flags` refuses a
missing folder, a folder without a complete torch_dist checkpoint, a module given both HF and
Megatron weights, an unknown encoder and, for the language model, shape flags that differ from
the checkpoint's saved ``args``; once built, :func:`load_megatron_checkpoints` names tensors the
checkpoint lacks or holds with another shape or a narrower dtype before reading any. A run
resumed with stock ``--load`` overwrites all of it: stock loads ``--load`` after the builder.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from megatron_plugins.weights.megatron_folder import DONE_FILE, TRACKER_FILE, is_complete
from megatron_plugins.errors import UsageError
from megatron_plugins.parallel.layout import LANGUAGE
from megatron_plugins.parallel.module_values import ModuleValues, module_values

__all__ = [
    "CheckpointInitError", "SHAPE_FLAGS", "add_checkpoint_init_args", "check_init_flags",
    "check_language_shape", "join_sections", "load_megatron_checkpoints", "module_keys",
    "split_key",
    "tensor_problems"
]

LANGUAGE_FLAG = "--language-megatron-checkpoint"
ENCODER_FLAG = "--encoder-megatron-checkpoint"
EXTRA_STATE = "_extra_state"
"""Transformer Engine's FP8 bookkeeping entries: not weights, absent from local-spec checkpoints."""

SHAPE_FLAGS: tuple[tuple[str, str], ...] = (
    ("num_layers", "--num-layers"),
    ("hidden_size", "--hidden-size"),
    ("ffn_hidden_size", "--ffn-hidden-size"),
    ("num_attention_heads", "--num-attention-heads"),
    ("group_query_attention", "--group-query-attention"),
    ("num_query_groups", "--num-query-groups"),
    ("kv_channels", "--kv-channels"),
    ("padded_vocab_size", "--vocab-size"),
    ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
    ("position_embedding_type", "--position-embedding-type"),
    ("normalization", "--normalization"),
    ("swiglu", "--swiglu"),
    ("add_bias_linear", "--disable-bias-linear"),
    ("add_qkv_bias", "--add-qkv-bias"),
    ("qk_layernorm", "--qk-layernorm"),
    ("num_experts", "--num-experts"),
    ("moe_ffn_hidden_size", "--moe-ffn-hidden-size"),
    ("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size"),
)
"""Stock args that set the language model's tensors: (args attribute, how the user sets it)."""


class CheckpointInitError(UsageError):
    """A module's Megatron-checkpoint init that cannot work; one line names the flag and folder."""


def add_checkpoint_init_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the per-module "start from this Megatron checkpoint" flags."""
    group = parser.add_argument_group("megatron-plugins Megatron checkpoint init")
    group.add_argument(LANGUAGE_FLAG, metavar="DIR", default=None,
                       help="Start the language model from this torch_dist checkpoint (a stock "
                            "pretrain_gpt --save folder or iteration folder, any TP/PP); model "
                            "tensors only. Stock --load, when it resumes, overrides it.")
    group.add_argument(ENCODER_FLAG, metavar="NAME=DIR", action=ModuleValues,
                       help="Start encoder NAME's network from a previous MiMo run's checkpoint "
                            "(its encoder NAME, any TP); the projection starts from init. "
                            "Repeatable.")
    return parser


SECTIONS = re.compile(r"(.*\.(?:in_proj\.(?:weight|lora_b)|conv1d\.(?:weight|bias)))\."
                      r"(query|key|value|z|beta|alpha)$")
"""Gated DeltaNet's ``in_proj`` (and its LoRA ``B``) and ``conv1d`` tensors, which its
``sharded_state_dict`` saves as one key per section (ssm/gated_delta_net/common.py), so the
checkpoint is the same at any TP."""
SECTION_ORDER = ("query", "key", "value", "z", "beta", "alpha")
"""The sections' order inside the module's tensor (``in_proj_split_names``)."""


def join_sections(items: Iterator[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """``items`` with each tensor saved by :data:`SECTIONS` joined back to the module's own
    (its TP 1 layout, which the gdn combines read)."""
    import torch

    sections: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in items:
        found = SECTIONS.match(name)
        if found is None:
            yield name, tensor
        else:
            sections.setdefault(found.group(1), {})[found.group(2)] = tensor
    for name, parts in sections.items():
        yield name, torch.cat([parts[key] for key in SECTION_ORDER if key in parts])


def split_key(key: str) -> tuple[str, str] | None:
    """MiMo checkpoint key -> (module, name inside it); wrappers' ``module.`` segments dropped.
    Modules: ``language``, an encoder's name, ``NAME:projection``; None for anything else
    (optimizer state, a stock GPT checkpoint's keys)."""
    parts = [part for part in key.split(".") if part != "module"]
    if parts[0] == "language_model":
        return LANGUAGE, ".".join(parts[1:])
    if parts[0] == "modality_submodules" and len(parts) > 3:
        name, kind = parts[1], parts[2]
        if kind == "encoders" and parts[3] == name:
            return name, ".".join(parts[4:])
        if kind == "input_projections":
            return f"{name}:projection", ".".join(parts[3:])
    return None


def module_keys(keys: Iterable[str], module: str) -> dict[str, str]:
    """Name inside ``module`` -> checkpoint key. A checkpoint without MiMo keys is a stock GPT
    checkpoint: its keys are the language model's own names."""
    where = {key: split_key(key) for key in keys}
    if module == LANGUAGE and not any(where.values()):
        return {key: key for key in where}
    return {found[1]: key for key, found in where.items() if found and found[0] == module}


def iteration_folder(folder: str, flag: str) -> Path:
    """The complete torch_dist iteration folder DIR names: DIR itself, or its tracker's."""
    path = Path(folder)
    where = f"{flag} {folder}"
    if not path.is_dir():
        raise CheckpointInitError(f"{where}: no such folder")
    if is_complete(path):
        return path
    try:
        tracked = (path / TRACKER_FILE).read_text().strip()
    except OSError:
        raise CheckpointInitError(
            f"{where}: not a torch_dist checkpoint (neither {TRACKER_FILE} nor an iteration "
            f"folder's {DONE_FILE} and .metadata); give a --save folder or one of its "
            "iter_NNNNNNN folders") from None
    chosen = path / (tracked if tracked == "release" else
                     f"iter_{int(tracked):07d}" if tracked.isdigit() else tracked)
    if not is_complete(chosen):
        raise CheckpointInitError(
            f"{where}: {TRACKER_FILE} names {tracked!r}, but {chosen} is not a complete "
            f"torch_dist checkpoint (no {DONE_FILE}: an interrupted save, or another "
            "--ckpt-format)")
    return chosen


def _spelled(attr: str, flag: str, value: object) -> str:
    """How a run with ``args.<attr> == value`` spells it: ``--num-layers 2``, ``--swiglu``,
    ``no --swiglu`` (``--disable-bias-linear`` turns ``add_bias_linear`` off)."""
    if attr == "padded_vocab_size":
        return (f"a vocabulary padded to {value} rows (--vocab-size or the tokenizer, then "
                "--make-vocab-size-divisible-by x TP)")
    if isinstance(value, bool):
        return flag if value != (attr == "add_bias_linear") else f"no {flag}"
    return f"no {flag}" if value is None else f"{flag} {value}"


def check_language_shape(args: argparse.Namespace, saved: argparse.Namespace, where: str) -> None:
    """The run's shape flags must be the checkpoint's; the first that differs names both values."""
    for attr, flag in SHAPE_FLAGS:
        if not hasattr(saved, attr) or getattr(args, attr) == getattr(saved, attr):
            continue
        if attr == "num_query_groups" and not args.group_query_attention:
            continue
        raise CheckpointInitError(
            f"{where}: the checkpoint was saved with {_spelled(attr, flag, getattr(saved, attr))}, "
            f"this run has {_spelled(attr, flag, getattr(args, attr))}; give this run the "
            "checkpoint's")


def _metadata(folder: Path | str) -> dict[str, Any]:
    """A checkpoint's tensors: key -> ShardedTensor without data (global shape, dtype)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_tensors_metadata(str(folder))


def _saved_args(folder: Path) -> argparse.Namespace | None:
    """The ``args`` the saving run wrote into the checkpoint's common state."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(str(folder)).get("args")


def _encoder_folders(values: Mapping[str, str], plugins: Mapping[str, Any],
                     hf_folders: Mapping[str, str]) -> dict[str, str]:
    """``NAME -> DIR`` checked against the run's encoders and the checkpoints' encoders."""
    from megatron_plugins.weights.flags import ENCODER_FLAG as HF_ENCODER_FLAG
    from megatron_plugins.weights.flags import check_encoder_names

    check_encoder_names(values, plugins, ENCODER_FLAG, CheckpointInitError)
    folders: dict[str, str] = {}
    for name, folder in values.items():
        where = f"{ENCODER_FLAG} {name}={folder}"
        if name in hf_folders:
            raise CheckpointInitError(f"{where} and {HF_ENCODER_FLAG} {name}={hf_folders[name]} "
                                      f"both initialize encoder {name}; give one")
        chosen = iteration_folder(folder, f"{ENCODER_FLAG} {name}=")
        metadata = _metadata(chosen)
        if not module_keys(metadata, name):
            modules = sorted({found[0] for found in map(split_key, metadata) if found})
            raise CheckpointInitError(
                f"{where}: {chosen} holds no encoder {name!r} (its modules: "
                f"{', '.join(modules) or 'none, a stock GPT checkpoint'}); give the checkpoint "
                "of a MiMo run that trained an encoder of this name")
        saved = _saved_args(chosen)
        providers = module_values(getattr(saved, "mimo_encoders", None), "--encoder",
                                  CheckpointInitError)
        ours = plugins[name].grid.provider
        if providers.get(name, ours) != ours:
            raise CheckpointInitError(f"{where}: the checkpoint's encoder {name} is "
                                      f"--encoder {name}={providers[name]}, this run's is "
                                      f"{name}={ours}")
        folders[name] = str(chosen)
    return folders


def check_init_flags(args: argparse.Namespace, plugins: Mapping[str, Any],
                     language_pp: int) -> dict[str, Any]:
    """Before any process group, after stock ``validate_args``: check the init flags and return
    their resolved values (``language_megatron_checkpoint``: the iteration folder, when given;
    ``encoder_megatron_checkpoint``: a NAME -> iteration folder dict)."""
    from megatron_plugins.weights.flags import ENCODER_FLAG as HF_ENCODER_FLAG
    from megatron_plugins.weights.flags import LANGUAGE_FLAG as HF_LANGUAGE_FLAG

    encoders = module_values(args.encoder_megatron_checkpoint, ENCODER_FLAG, CheckpointInitError)
    given = [args.language_megatron_checkpoint, *encoders]
    if any(given) and getattr(args, "init_model_with_meta_device", False):
        raise CheckpointInitError(f"{LANGUAGE_FLAG if given[0] else ENCODER_FLAG} cannot load "
                                  "into a model on the meta device; drop "
                                  "--init-model-with-meta-device")
    resolved: dict[str, Any] = {}
    folder = args.language_megatron_checkpoint
    if folder is not None:
        where = f"{LANGUAGE_FLAG} {folder}"
        if args.language_hf_weights is not None:
            raise CheckpointInitError(f"{where} and {HF_LANGUAGE_FLAG} {args.language_hf_weights} "
                                      "both initialize the language model; give one")
        if language_pp > 1 and not args.untie_embeddings_and_output_weights:
            # megatron-core 0.19.2 builds a tied output layer's sharded state dict from the
            # uninitialized global parallel_state (as for --save, see checkpoint_guards.py).
            raise CheckpointInitError(f"{where}: a pipelined language model (pp={language_pp}) "
                                      "with tied embeddings cannot load it on disjoint grids with "
                                      "megatron-core 0.19.2; add "
                                      "--untie-embeddings-and-output-weights")
        chosen = iteration_folder(folder, LANGUAGE_FLAG)
        saved = _saved_args(chosen)
        if saved is None:
            raise CheckpointInitError(f"{where}: {chosen} holds no saved args (not written by "
                                      "stock pretrain_gpt or a MiMo run)")
        check_language_shape(args, saved, where)
        resolved["language_megatron_checkpoint"] = str(chosen)
    resolved["encoder_megatron_checkpoint"] = _encoder_folders(
        encoders, plugins, module_values(args.encoder_hf_weights, HF_ENCODER_FLAG))
    return resolved


def tensor_problems(pieces: Iterable[tuple[str, tuple[int, ...], Any]], keys: Mapping[str, str],
                    metadata: Mapping[str, Any]) -> list[str]:
    """What keeps this rank's tensors ``(name in the module, global shape, dtype)`` from loading:
    names the checkpoint lacks, then shapes and dtypes that differ; [] when all fit."""
    from megatron_plugins.weights.hf_import import WIDENING
    from megatron_plugins.weights.local_view import names_text

    missing, problems = set(), []
    for name, shape, dtype in pieces:
        key = keys.get(name)
        if key is None:
            missing.add(name)
            continue
        saved = metadata[key]
        if tuple(saved.global_shape) != tuple(shape):
            problems.append(f"{key} is {list(saved.global_shape)} in the checkpoint, "
                            f"{list(shape)} in this model")
        elif saved.dtype != dtype and (saved.dtype, dtype) not in WIDENING:
            problems.append(f"{key} is {str(saved.dtype).removeprefix('torch.')} in the "
                            f"checkpoint, {str(dtype).removeprefix('torch.')} in this model "
                            "(train in the checkpoint's precision: --bf16 / --fp16 / neither)")
    if missing:
        return [f"the checkpoint has no tensor {names_text(missing)} of this model (never left "
                "at init: give a checkpoint of this model, or this run the checkpoint's flags)"]
    return sorted(set(problems))


def _pieces(value: Any) -> list[Any]:
    """The ShardedTensors an entry of a sharded state dict loads (a factory builds several)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if isinstance(value, ShardedTensorFactory):
        return list(nested_values(value.build()))
    return [value]


def load_module(module: Any, folder: str, module_name: str, flag: str, pg_collection: Any) -> None:
    """Load ``module`` (this rank's part, not yet wrapped) from the checkpoint's tensors of
    ``module_name``; collective over every rank of the module's grid."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron.core.transformer.utils import sharded_state_dict_default

    from megatron_plugins.compat import model_build

    where = f"{flag} {folder}"
    metadata = _metadata(folder)
    keys = module_keys(metadata, module_name)
    model_build.bind_tp_group(module, pg_collection.tp)  # Gap 3, as the save does
    own = sharded_state_dict_default(module, "", (), {"dp_cp_group": pg_collection.dp_cp},
                                     tp_group=pg_collection.tp)
    sharded = {name: value for name, value in own.items() if not name.endswith(EXTRA_STATE)}
    pieces = [(piece.key, tuple(piece.global_shape), piece.dtype)
              for value in sharded.values() for piece in _pieces(value)]
    group = pg_collection.intra_dist_opt
    gathered: list[list[str] | None] = [None] * group.size()
    dist.all_gather_object(gathered, tensor_problems(pieces, keys, metadata), group=group)
    problems = sorted({line for lines in gathered for line in lines})
    if problems:
        raise CheckpointInitError(f"{where}: {'; '.join(problems)}")
    for value in sharded.values():
        value.key = keys[value.key]
    loaded = dist_checkpointing.load(sharded, folder, strict=StrictHandling.RAISE_UNEXPECTED,
                                     process_group=group)
    with torch.no_grad():
        result = module.load_state_dict({name: loaded[name] for name in sharded}, strict=False)
    left = [name for name in result.missing_keys if not name.endswith(EXTRA_STATE)]
    if left:
        from megatron_plugins.weights.local_view import names_text

        raise CheckpointInitError(f"{where}: {names_text(left)} of this model are not in its "
                                  "sharded state dict and would stay at init")


def load_megatron_checkpoints(model: Any, module_pgs: Mapping[str, Any],
                              language_folder: str | None,
                              encoder_folders: Mapping[str, str]) -> None:
    """Load this rank's module of the (unwrapped) ``MimoModel`` from its checkpoint, if given."""
    for name, pgc in module_pgs.items():
        if name == LANGUAGE and language_folder:
            load_module(model.language_model, language_folder, LANGUAGE, LANGUAGE_FLAG, pgc)
        elif name in encoder_folders:
            load_module(model.modality_submodules[name].encoders[name], encoder_folders[name],
                        name, f"{ENCODER_FLAG} {name}=", pgc)
