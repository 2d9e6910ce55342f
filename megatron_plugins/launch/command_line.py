"""The command line as the user spelled it: which flags it gives, and argparse's errors as one
line.

Parsed values cannot say whether a flag was given (``--exp-avg-dtype fp32`` equals the default);
the command line can. Megatron's parser takes no abbreviations (``allow_abbrev=False``), so a flag
is given exactly when one of its spellings is a token, alone or before ``=``. Every parser of the
launch raises :class:`~megatron_plugins.errors.FlagError` instead of printing its usage and
exiting (:func:`raise_flag_errors`), so each rank reports the same one line.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence

from megatron_plugins.errors import FlagError

__all__ = ["given_flag", "raise_flag_errors", "spellings_of"]


def given_flag(argv: Sequence[str], spellings: Iterable[str]) -> str | None:
    """The first of ``spellings`` on the command line as written there, or None."""
    names = set(spellings)
    return next((token.partition("=")[0] for token in argv
                 if token.partition("=")[0] in names), None)


def spellings_of(parser: argparse.ArgumentParser, attr: str) -> set[str]:
    """Every flag of ``parser`` that stores into ``attr``."""
    return {option for action in parser._actions if action.dest == attr
            for option in action.option_strings}


def raise_flag_errors(parser: argparse.ArgumentParser,
                      rewrite: Callable[[str], str] | None = None) -> argparse.ArgumentParser:
    """``parser`` with its errors raised as :class:`FlagError` (``rewrite`` rewords argparse's
    message first) instead of printed with the usage and exit code 2."""
    def error(message: str) -> None:
        raise FlagError(rewrite(message) if rewrite else message)

    parser.error = error  # type: ignore[method-assign]
    return parser
