"""Start-up bridges every entry point needs (Gaps 1 and 7), applied before stock ``pretrain()``
or stock argument parsing, and what a launch says about the bridges: a warning when the installed
megatron-core is not the release they were written for, and one line naming the gaps bridged."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from typing import Any

from megatron_plugins.compat import MEGATRON_CORE_VERSION, MegatronCompatError, installed, record

__all__ = [
    "announce_bridged_gaps", "bridged_gaps_line", "escape_unformattable_help", "install",
    "megatron_core_version", "prebuilt_dataset_helpers_available", "version_warning",
]

_bridged = False


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
    them). Idempotent; call before stock ``pretrain()``. The first call also prints
    :func:`version_warning`, if any, on rank 0 (torchrun's ``RANK``, which stock reads too).
    """
    global _bridged
    if _bridged:
        return
    import megatron.core.datasets.utils as dataset_utils

    dataset_utils.compile_helpers = _use_prebuilt_dataset_helpers
    record("1")
    _bridged = True
    warning = version_warning()
    if warning and os.environ.get("RANK", "0") == "0":
        print(warning, file=sys.stderr, flush=True)


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


def megatron_core_version() -> str:
    """The installed megatron-core release, as its package metadata says (``megatron.core.
    __version__`` appends the commit of any git work tree the wheel happens to sit in)."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:  # a source checkout on the path
        from megatron.core.package_info import __version__

        return __version__


def _prog() -> str:
    """The running script's name, as argparse names it in its messages."""
    return os.path.basename(sys.argv[0])


def version_warning() -> str | None:
    """One line saying how to check the bridges when megatron-core is not the release they and
    their canaries were written for; None when it is."""
    version = megatron_core_version()
    if version == MEGATRON_CORE_VERSION:
        return None
    return (f"{_prog()}: warning: megatron-core {version} is installed, but the bridges of "
            f"megatron_plugins.compat were written for {MEGATRON_CORE_VERSION}; run their canary "
            "tests (pytest tests/unit_tests/compat) to see which gaps this release still has")


def bridged_gaps_line(rank: int) -> str:
    """The megatron-core release and every gap this process (rank ``rank``) has bridged so far,
    in one line."""
    gaps = ", ".join(installed()) or "none"
    return (f"{_prog()}: megatron-core {megatron_core_version()}; gaps bridged on rank {rank}: "
            f"{gaps} (index: megatron_plugins.compat.GAPS)")


def announce_bridged_gaps(model_config: Any, rank: int) -> None:
    """On rank 0, have the build of ``model_config`` (a stock ``ModelConfig``) end by printing
    :func:`bridged_gaps_line` to stderr, once: by then the launch, the pipeline communicator and
    the model builder have installed every bridge the run uses (the optimizer build and the loop
    only use them)."""
    if rank != 0:
        return

    def announce(models: list[Any]) -> list[Any]:
        print(bridged_gaps_line(rank), file=sys.stderr, flush=True)
        return models

    model_config.post_wrap_hooks.append(announce)
