"""Attributes replaced for the length of a measured run, each put back by :meth:`Patches.remove`.

The measurement wraps stock functions and the run's own objects only while it measures; what it
replaced is listed here, so taking it all away is one call and a run that measures nothing
replaces nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["Patches"]


class Patches:
    """A stack of replaced attributes and other undos."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def replace(self, owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        """``owner.name`` becomes ``make(current)`` (wrapped to keep its name) until
        :meth:`remove`."""
        had_own = name in vars(owner)
        current = getattr(owner, name)
        setattr(owner, name, functools.wraps(current)(make(current)))

        def undo() -> None:
            if had_own:
                setattr(owner, name, current)
            else:
                delattr(owner, name)

        self._undo.append(undo)

    def add(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` at :meth:`remove` (after the later replacements are undone)."""
        self._undo.append(undo)

    def remove(self) -> None:
        """Undo everything, latest first."""
        while self._undo:
            self._undo.pop()()
