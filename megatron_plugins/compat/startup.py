"""Start-up bridges every entry point needs (Gaps 1 and 7), applied before stock ``pretrain()``
or stock argument parsing."""

from __future__ import annotations

import importlib
from typing import Any

from megatron_plugins.compat import MegatronCompatError, record

__all__ = ["escape_unformattable_help", "install", "prebuilt_dataset_helpers_available"]

_installed = False


def prebuilt_dataset_helpers_available() -> bool:
    """Whether the wheel's compiled dataset index helpers import."""
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return False
    return True


def _use_prebuilt_dataset_helpers() -> None:
    if not prebuilt_dataset_helpers_available():
        raise MegatronCompatError(
            "megatron.core.datasets.helpers_cpp does not import, and the megatron-core wheel ships "
            "no Makefile to build it. Reinstall megatron-core==0.19.2 from a binary wheel for this "
            "Python (pip install --force-reinstall --only-binary=:all: megatron-core==0.19.2)."
        )


def install() -> None:
    """Gap 1 (dataset helpers): use the wheel's prebuilt dataset helpers instead of compiling them.

    Stock ``pretrain()`` calls ``megatron.core.datasets.utils.compile_helpers``, which runs
    ``make`` in a folder the wheel ships without a Makefile, so every process exits with code 1.
    The wheel does ship the prebuilt ``helpers_cpp`` extension; when it imports there is nothing
    to compile. Every entry point needs this (the MiMo bridges are applied where MiMo code needs
    them). Idempotent; call before stock ``pretrain()``.
    """
    global _installed
    if _installed:
        return
    import megatron.core.datasets.utils as dataset_utils

    dataset_utils.compile_helpers = _use_prebuilt_dataset_helpers
    record("1")
    _installed = True


def _help_expands(action: Any, parser: Any) -> bool:
    """Whether argparse can expand ``action.help`` (it formats it with the action's attributes)."""
    try:
        (action.help or "") % {**vars(action), "prog": parser.prog}
    except (ValueError, TypeError, KeyError):
        return False
    return True


def escape_unformattable_help(parser: Any) -> list[str]:
    """Double the ``%`` of every help string of ``parser`` that breaks ``--help`` (Gap 7).

    Gap 7 (``--help``): argparse expands ``%`` in help strings; the stock help of
    ``--moe-paged-stash-buffer-size-factor-cuda`` has a bare ``%`` (training/arguments.py), so
    ``--help`` of every stock entry point dies with ``ValueError: unsupported format character``.
    Only the one parser given is changed. Returns the first option string of each action it
    escaped.
    """
    escaped = []
    for action in parser._actions:
        if action.help and not _help_expands(action, parser):
            action.help = action.help.replace("%", "%%")
            escaped.append(action.option_strings[0] if action.option_strings else action.dest)
    if escaped:
        record("7")
    return escaped
