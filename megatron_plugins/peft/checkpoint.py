"""Checkpoints of a LoRA run: adapters and trained parts saved, the frozen base referenced.

In a run with ``--lora``, a frozen part whose weights came from a folder (an HF folder or a
Megatron checkpoint: its *reference*) is left out of every save: the checkpoint holds the
adapters and the trained parts' weights, optimizer state and RNG, and records each reference
(flag, path and a fingerprint of the folder) in the run's saved ``args``
(:data:`BASE_ATTR`). A resumed run builds the base from the same flags again; before any process
group, :func:`check_resume` refuses in one line a reference whose folder changed, ``--lora``
settings that differ from the checkpoint's, and per-part optimizer settings that differ unless
stock ``--override-opt_param-scheduler`` asks for the new ones. A frozen part without a
reference (started from init) is saved as before.
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_plugins.errors import UsageError
from megatron_plugins.parallel.layout import LANGUAGE, ParallelLayout
from megatron_plugins.peft.flags import PROJECTION, describe, encoder_of, lora_specs

__all__ = [
    "BASE_ATTR", "SETTINGS_ATTR", "PeftCheckpointError", "base_references", "check_resume",
    "describe_reference", "fingerprint", "frozen_parts", "omit_frozen_base",
    "reference_fingerprint", "saved_args"
]

BASE_ATTR = "peft_base"
"""The saved ``args`` attribute: part -> {"flag", "path", "fingerprint"} of its reference."""
SETTINGS_ATTR = "peft_part_settings"
"""The saved ``args`` attribute: every part's scheduler values (``peft.optimizer``)."""
_SAMPLE = 1 << 20
_HF_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json")


class PeftCheckpointError(UsageError):
    """A resumed LoRA run that would not continue the checkpoint's; one line says why."""


def fingerprint(folder: str | Path, patterns: tuple[str, ...] = ("*",)) -> str:
    """A digest of a folder's files matching ``patterns``: names, sizes, files up to 1 MiB
    whole, the first and last MiB of larger ones (a changed shape, dtype, file or config
    changes it; reading whole multi-GB weights on every resume would not pay)."""
    digest = hashlib.sha256()
    files = sorted({path for pattern in patterns for path in Path(folder).glob(pattern)
                    if path.is_file()})
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}\n".encode())
        with path.open("rb") as handle:
            digest.update(handle.read(_SAMPLE))
            if size > 2 * _SAMPLE:
                handle.seek(size - _SAMPLE)
            digest.update(handle.read())
    return digest.hexdigest()[:16]


def _reference(args: argparse.Namespace, part: str, whole: str | None,
               plugins: Mapping[str, Any]) -> tuple[str, str] | None:
    """(flag, folder) a part's weights come from, or None (it starts from init)."""
    encoder = encoder_of(part)
    if whole is not None and part in (LANGUAGE, whole, whole + PROJECTION):
        return "--hf-model", args.hf_model
    if part == LANGUAGE:
        if args.language_hf_weights:
            return "--language-hf-weights", args.language_hf_weights
        if args.language_megatron_checkpoint:
            return "--language-megatron-checkpoint", str(args.language_megatron_checkpoint)
        return None
    hf = dict(args.encoder_hf_weights or {}).get(encoder)
    if hf is not None and (not part.endswith(PROJECTION) or _family_has_projection(
            plugins.get(encoder))):
        return f"--encoder-hf-weights {encoder}=", hf
    megatron = dict(args.encoder_megatron_checkpoint or {}).get(encoder)
    if megatron is not None and not part.endswith(PROJECTION):
        return f"--encoder-megatron-checkpoint {encoder}=", str(megatron)
    return None


def _family_has_projection(plugin: Any) -> bool:
    from megatron_plugins.weights.mapping import includes_projection

    family = getattr(plugin, "hf_family", None)
    return family is not None and includes_projection(family)


def frozen_parts(args: argparse.Namespace, layout: ParallelLayout) -> set[str]:
    """Parts whose own weights do not train: adapted, or frozen by the freeze flags."""
    frozen = set(lora_specs(args.lora, layout))
    if args.freeze_language_model:
        frozen.add(LANGUAGE)
    for module in layout.encoders:
        if module.name in args.freeze_encoder:
            frozen |= {module.name, module.name + PROJECTION}
        elif module.name in args.freeze_projection:
            frozen.add(module.name + PROJECTION)
    return frozen


def base_references(args: argparse.Namespace, layout: ParallelLayout,
                    plugins: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """The references of a LoRA run's frozen parts, by part (empty without ``--lora``)."""
    from megatron_plugins.weights.flags import hf_model_encoder

    if not args.lora:
        return {}
    whole = hf_model_encoder(args)
    references = {}
    for part in sorted(frozen_parts(args, layout)):
        found = _reference(args, part, whole, plugins)
        if found is not None:
            flag, folder = found
            references[part] = {"flag": flag, "path": folder,
                                "fingerprint": reference_fingerprint(flag, folder)}
    return references


def reference_fingerprint(flag: str, folder: str) -> str | None:
    """The :func:`fingerprint` of a reference folder (an HF folder's config and weights, a
    Megatron checkpoint's every file), None when it is not a folder."""
    if not Path(folder).is_dir():
        return None
    return fingerprint(folder, ("*",) if "megatron-checkpoint" in flag else _HF_FILES)


def describe_reference(reference: Mapping[str, str] | None) -> str:
    """A reference as a flag would give it, with its fingerprint."""
    if reference is None:
        return "none"
    flag = reference["flag"]
    return (f"{flag}{'' if flag.endswith('=') else ' '}{reference['path']} (fingerprint "
            f"{reference['fingerprint']})")


def omit_frozen_base(model: Any, parts: Mapping[str, Any]) -> None:
    """Leave the frozen parameters of ``parts`` (part -> this rank's module of it) out of the
    ``MimoModel``'s saves and loads: a load then restores everything else and only that."""
    frozen = {id(p) for module in parts.values() for p in module.parameters()
              if not p.requires_grad}
    if not frozen:
        return
    names = {name for name, p in model.named_parameters() if id(p) in frozen}
    sharded = model.sharded_state_dict
    load = model.load_state_dict

    def sharded_state_dict(*args: Any, **kwargs: Any) -> dict:
        return {key: value for key, value in sharded(*args, **kwargs).items()
                if id(getattr(value, "data", None)) not in frozen}

    def load_state_dict(state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        result = load(state_dict, strict=False)
        missing = [k for k in result.missing_keys
                   if k not in names and not k.endswith("_extra_state")]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"checkpoint load: missing {missing}, unexpected "
                               f"{result.unexpected_keys}")
        return result

    model.sharded_state_dict = sharded_state_dict
    model.load_state_dict = load_state_dict


def saved_args(folder: Path) -> argparse.Namespace | None:
    """The ``args`` the run that saved iteration ``folder`` wrote into its common state."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(str(folder)).get("args")


def _saved(saved: argparse.Namespace, attr: str, default: Any) -> Any:
    value = getattr(saved, attr, default)
    return default if value is None else value


def check_resume(args: argparse.Namespace, saved: argparse.Namespace, where: str,
                 layout: ParallelLayout, continues: bool = True) -> None:
    """A run loading a checkpoint against the ``args`` the checkpoint saved (``where`` names it):
    the frozen base the checkpoint left out must be this run's; a run that ``continues`` it
    (optimizer loaded) must also have its ``--lora`` and per-part optimizer settings."""
    references, recorded = getattr(args, BASE_ATTR, {}), _saved(saved, BASE_ATTR, {})
    for part in sorted(set(references) | set(recorded) if continues else recorded):
        mine, old = references.get(part), recorded.get(part)
        if mine != old:
            raise PeftCheckpointError(
                f"{where} was trained over {part}'s frozen base {describe_reference(old)}, but "
                f"this run's is {describe_reference(mine)}; give the same, unchanged folder")
    if not continues:
        return
    ours = describe(lora_specs(args.lora, layout))
    theirs = describe(lora_specs(_saved(saved, "lora", []), layout))
    if ours != theirs:
        raise PeftCheckpointError(
            f"--lora {' '.join(ours) or '(none)'} differs from the checkpoint's "
            f"({' '.join(theirs) or 'none'}, {where}); resume with its --lora, or start a new "
            "run from its weights (--finetune --no-load-optim --no-load-rng)")
    settings, old_settings = getattr(args, SETTINGS_ATTR, {}), _saved(saved, SETTINGS_ATTR, {})
    if settings != old_settings and not args.override_opt_param_scheduler:
        changed = [part for part in dict.fromkeys([*old_settings, *settings])
                   if settings.get(part) != old_settings.get(part)]
        mine = "; ".join(f"{part} {_settings_text(settings.get(part))}" for part in changed)
        theirs = "; ".join(f"{part} {_settings_text(old_settings.get(part))}" for part in changed)
        raise PeftCheckpointError(
            f"--module-lr / --module-min-lr / --module-weight-decay give {mine}, but {where} was "
            f"trained with {theirs}; give the checkpoint's, or add "
            "--override-opt_param-scheduler to go on with the new ones")


def _settings_text(values: Mapping[str, float] | None) -> str:
    """A part's scheduler values as one reads them (the run-wide ones when it has none)."""
    if not values:
        return "(the run-wide settings)"
    text = f"lr {values['max_lr']:g}, min lr {values['min_lr']:g}"
    return text + (f", weight decay {values['end_wd']:g}" if "end_wd" in values else "")
