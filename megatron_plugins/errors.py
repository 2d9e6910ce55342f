"""The one kind of error a bad flag or setting raises, whatever part of the run it concerns.

Each part has its own subclass (layout, flags, checkpoints, encoder plugins, language model,
optimizer precision), so a message says what it is about; the entry points catch this base class
and print the message as one line, exit code 2, on every rank. The generic bad-flag error and the
data flags' error live here because modules on both sides of the data package raise them.
"""

from __future__ import annotations

import sys

__all__ = ["DataFlagError", "FlagError", "UsageError", "report"]


class UsageError(ValueError):
    """A flag or setting that cannot run; the message names it and what would fix it."""


class FlagError(UsageError):
    """A flag that cannot be used (unknown, mistyped, or meaningless here); one line names it."""


class DataFlagError(UsageError):
    """Data flags that cannot work together; the message names them."""


def report(prog: str, error: BaseException) -> int:
    """Print ``prog: error: message`` in one write, so lines that several ranks print at once never
    interleave; returns the exit code for a usage error, 2."""
    sys.stderr.write(f"{prog}: error: {error}\n")
    sys.stderr.flush()
    return 2
