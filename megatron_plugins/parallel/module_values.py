"""Flags that give one value per named module, ``FLAG NAME=VALUE`` (``--encoder NAME=PROVIDER``,
``--encoder-hf-weights NAME=DIR``, ``--encoder-megatron-checkpoint NAME=DIR``), parsed into a
``NAME -> VALUE`` dict once, by :class:`ModuleValues` as argparse reads the flag.

A bad value is one line naming the flag: a missing ``=``, an empty name or value, a name given
twice. The ``args`` of runs saved before these flags were dicts hold their ``NAME=VALUE``
strings; :func:`module_values` reads either form with the same rules.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from typing import Any

from megatron_plugins.errors import FlagError, UsageError

__all__ = ["ModuleValues", "module_values"]


def _assign(into: dict[str, str], texts: Iterable[str], flag: str, metavar: str,
            example: str | None, error: type[UsageError], each: str = "encoder"
            ) -> dict[str, str]:
    """``into`` with each ``NAME=VALUE`` of ``texts`` added; a bad one raises ``error``."""
    hint = f" (e.g. {example})" if example else ""
    for text in texts:
        name, sep, value = text.partition("=")
        if not sep:
            raise error(f"{flag} {text}: expected {metavar}{hint}")
        if not name:
            raise error(f"{flag} {text}: no name before '='; expected {metavar}{hint}")
        if not value:
            raise error(f"{flag} {text}: nothing after '='; expected {metavar}{hint}")
        if name in into:
            raise error(f"{flag} {name} given twice; give each {each} once")
        into[name] = value
    return into


class ModuleValues(argparse.Action):
    """Store ``NAME=VALUE`` values of a repeatable flag as one dict (default ``{}``).

    ``words``: one value may hold several space-separated ``NAME=VALUE`` words (as ``--encoder``
    takes them); ``error``: the :class:`UsageError` kind a bad value raises, at parse time;
    ``example``: a correct use, shown in that error; ``each``: what a name names, for the
    error when one is given twice.
    """

    def __init__(self, option_strings: list[str], dest: str, *, words: bool = False,
                 error: type[UsageError] = FlagError, example: str | None = None,
                 each: str = "encoder", **kwargs: Any) -> None:
        kwargs.setdefault("default", {})
        kwargs.setdefault("metavar", "NAME=VALUE")
        super().__init__(option_strings, dest, **kwargs)
        self.words = words
        self.error = error
        self.example = example
        self.each = each

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        texts = str(values).split() if self.words else [str(values)]
        current = dict(getattr(namespace, self.dest, None) or {})
        setattr(namespace, self.dest,
                _assign(current, texts, option_string or self.option_strings[0],
                        str(self.metavar), self.example, self.error))


def module_values(given: Mapping[str, str] | Iterable[str] | None, flag: str,
                  error: type[UsageError] = FlagError) -> dict[str, str]:
    """A per-module flag's ``NAME -> VALUE`` dict from parsed ``args`` (a dict), or from the
    ``NAME=VALUE`` strings an older run saved; None or empty gives ``{}``."""
    if isinstance(given, Mapping):
        return dict(given)
    return _assign({}, given or [], flag, "NAME=VALUE", None, error)
