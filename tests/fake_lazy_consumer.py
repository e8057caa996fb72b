"""A second lazily imported stand-in module (a patch can span two lazy modules)."""

from __future__ import annotations


def consume(x: int) -> int:
    return x * 10
