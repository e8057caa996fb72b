"""Per-step meters: GC callbacks, writer-thread CPU clock, store occupancy and evictions."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any


class GcMeter:
    """Counts collections per generation and the time spent in them (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.seconds = 0.0
        self._start = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._start

    def __enter__(self) -> GcMeter:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


class ThreadClock:
    """CPU seconds used so far by another thread of this process (Linux per-thread clock)."""

    def __init__(self, name: str) -> None:
        self._clock: int | None = None
        for thread in threading.enumerate():
            if thread.name == name and thread.ident is not None:
                self._clock = time.pthread_getcpuclockid(thread.ident)

    def seconds(self) -> float:
        if self._clock is None:
            return 0.0
        try:
            return time.clock_gettime(self._clock)
        except OSError:  # the thread has exited
            return 0.0


class StoreMeter:
    """Reads the worker connector's ``BlockObjectStore`` without changing its behaviour.

    Evictions are counted by an instance-level pass-through around ``_evict_to_fit``
    (whatever the class attribute is -- upstream or patched -- still does the work).
    """

    def __init__(self, connector: Any) -> None:
        background = getattr(connector, "_store", None) if connector is not None else None
        self.store = getattr(background, "_store", None)
        self.evictions = 0
        #: Keys whose last reference was dropped (in 0.33 also when the KV cache evicts
        #: the block: the scheduler connector sends its hashes as released).
        self.released = 0
        self.peak_size = 0
        self.peak_referenced = 0
        if self.store is None:
            return
        inner = self.store._evict_to_fit
        store = self.store

        def counting_evict(*args: Any, **kwargs: Any) -> Any:
            before = len(_stored(store))
            try:
                return inner(*args, **kwargs)
            finally:
                self.evictions += max(before - len(_stored(store)), 0)
                self.peak_referenced = max(self.peak_referenced, len(store._references))

        store._evict_to_fit = counting_evict
        inner_release = self.store._release

        def counting_release(*args: Any, **kwargs: Any) -> Any:
            terminal = inner_release(*args, **kwargs)
            self.released += len(terminal)
            return terminal

        store._release = counting_release

    @property
    def slots(self) -> int:
        return int(getattr(self.store, "num_slots", 0))

    @property
    def size(self) -> int:
        return len(_stored(self.store)) if self.store is not None else 0

    def sample(self) -> None:
        if self.store is None:
            return
        self.peak_size = max(self.peak_size, len(_stored(self.store)))
        self.peak_referenced = max(self.peak_referenced, len(self.store._references))


def _stored(store: Any) -> Any:
    """The keys a store holds: ``_lru`` in vLLM 0.31/0.32; 0.33 keeps referenced keys out
    of its LRU and holds every key in ``_slots``."""
    slots = getattr(store, "_slots", None)
    return store._lru if slots is None else slots
