"""A patch's record of what it did: named counts, per-reason tallies and per-key states.

One class for the transport patches (``packed_outputs``' handshake, ``packed_hop``'s
hop). Writers increment plain attributes and dict entries from the one thread that
does the counted work (EngineCore's scheduler thread, an output thread, a client's
output loop); several such threads in one process (tests, in-process engines) may
lose an increment, which a record read by status lines and tests can afford. Readers
never iterate a live dict: ``snapshot()`` copies each one with ``dict(d)``, a single
C-level copy during which no Python code runs, so no other thread can add a key in
the middle of it ("dictionary changed size during iteration").
"""

from __future__ import annotations

from collections import Counter
from typing import Any


class Counts:
    """Counts named in ``names`` (ints), tallies (``Counter`` by reason) and records
    (``dict`` of str to str), each an attribute of that name."""

    def __init__(
        self, *names: str, tallies: tuple[str, ...] = (), records: tuple[str, ...] = ()
    ) -> None:
        self._names = names
        self._tallies = tallies
        self._records = records
        self.reset()

    def reset(self) -> None:
        for name in self._names:
            setattr(self, name, 0)
        for name in self._tallies:
            setattr(self, name, Counter())
        for name in self._records:
            setattr(self, name, {})

    def add(self, tally: str, reason: str, total: str | None = None) -> None:
        """Count ``reason`` in ``tally`` (and once in the count ``total``, if given)."""
        getattr(self, tally)[reason] += 1
        if total is not None:
            setattr(self, total, getattr(self, total) + 1)

    def snapshot(self) -> dict[str, Any]:
        found: dict[str, Any] = {name: getattr(self, name) for name in self._names}
        for name in (*self._tallies, *self._records):
            found[name] = dict(getattr(self, name))
        return found
