"""Stock argument parsing without re-reading Megatron's sources in every test rank.

megatron-core 0.19.2 builds each config dataclass's flags with ``ArgumentGroupFactory``, which
re-reads and AST-parses the class's source for the flags' help texts on every ``parse_args`` (and
again in ``validate_args``' argument print): about 1 s of CPU per rank on this project's 2-core
machine, the largest fixed cost of a forked test rank. The texts depend only on the class, so the
suite keeps them per class; parsing, defaults and validation are untouched.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["remember_field_docstrings"]


def remember_field_docstrings(warm: bool = False) -> None:
    """Keep ``ArgumentGroupFactory``'s field docstrings per class (idempotent); ``warm`` builds
    stock's whole parser once, so that forks of this process inherit every class's texts."""
    from megatron.training import argument_utils

    factory = argument_utils.ArgumentGroupFactory
    read = factory._get_field_docstrings
    if getattr(read, "remembered", False):
        return
    texts: dict[type, dict[str, str]] = {}

    def remembered(self: Any, src_cfg_class: type) -> dict[str, str]:
        if src_cfg_class not in texts:
            texts[src_cfg_class] = read(self, src_cfg_class)
        return dict(texts[src_cfg_class])

    remembered.remembered = True  # type: ignore[attr-defined]
    factory._get_field_docstrings = remembered
    if warm:
        from megatron.training.arguments import add_megatron_arguments

        add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
