"""Fingerprints of stock wheel source, for canaries that pin what a bridge replicates."""

from __future__ import annotations

import hashlib
import inspect


def source_digest(function: object) -> str:
    """The first 16 hex digits of the SHA-256 of ``function``'s source."""
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]
