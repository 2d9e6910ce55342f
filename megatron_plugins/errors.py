"""The one kind of error a bad flag or setting raises, whatever part of the run it concerns.

Each part has its own subclass (layout, flags, checkpoints, encoder plugins, language model,
optimizer precision), so a message says what it is about; the entry points catch this base class
and print the message as one line, exit code 2, on every rank.
"""

from __future__ import annotations


class UsageError(ValueError):
    """A flag or setting that cannot run; the message names it and what would fix it."""
