"""Which flags the raw command line gives, as the user spelled them.

Parsed values cannot say whether a flag was given (``--exp-avg-dtype fp32`` equals the default);
the command line can. Megatron's parser takes no abbreviations (``allow_abbrev=False``), so a flag
is given exactly when one of its spellings is a token, alone or before ``=``.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence

__all__ = ["given_flag", "spellings_of"]


def given_flag(argv: Sequence[str], spellings: Iterable[str]) -> str | None:
    """The first of ``spellings`` on the command line as written there, or None."""
    names = set(spellings)
    return next((token.partition("=")[0] for token in argv
                 if token.partition("=")[0] in names), None)


def spellings_of(parser: argparse.ArgumentParser, attr: str) -> set[str]:
    """Every flag of ``parser`` that stores into ``attr``."""
    return {option for action in parser._actions if action.dest == attr
            for option in action.option_strings}
