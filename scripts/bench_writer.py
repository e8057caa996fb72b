"""The store writer thread at steady state: where its time goes, and what batching could win.

    .venv/bin/python scripts/bench_writer.py [-n 400] [--window 200] [--rounds 7]
        [--no-sweep] [--perf PATH]

Issue 10 asks for "a batch of blocks written without one Python object per block" on the
writer thread (``vllm-aux-output-writer``, ``BackgroundBlockObjectStore``). Before building
one, this measures how much of the writer's time that per-block Python is. It runs
``prime-r3 bench``'s real engine loop (``Simulator``: real scheduler, worker connector,
store and writer thread) with every patch that applies, until the store is full (evictions,
no first touches: the steady state), then:

1. **In the engine** (one window of ``--window`` steps): the writer thread's CPU per step
   (``ThreadClock``), split with ``time.thread_time`` wrappers installed on the store
   instance by this script (the package is not changed): ``put`` as a whole, its
   ``_retain``, ``_release`` and ``_evict_to_fit``, the rest of ``put`` (the per-block
   part: de-duplication, LRU inserts and moves, slot allocation, payload copies), and the
   thread's time outside ``put`` (queue hand-off, wake-ups, and the wrappers' own
   bookkeeping: the next window, untimed, gives the writer's CPU without them); page
   faults per step from ``getrusage(RUSAGE_THREAD)``; how many puts wrote their blocks
   into consecutive slots (what "one copy into consecutive arena slots" needs).
2. **Replay** (same process, after the engine window): the window's recorded puts (the same
   ``BlockObject`` lists, retain and release keys) replayed on stores restored to the
   window's starting state, ``--rounds`` rounds, arms in rotating order, each put after an
   untimed sweep of 8 MiB (the step loop runs between two of the writer's puts in vLLM and
   takes the caches; ``--no-sweep`` adds a warm-cache replay). Arms: ``put`` as the bench
   runs it (upstream's body under the applied store patches); the same again (noise
   control); ``candidate_put``, a batched write loop (the step's slots allocated at once in
   upstream's order, one copy when they are consecutive, else a tight copy loop), whose
   store state equals upstream's after every call (tests/test_bench_writer.py); and
   ``bound_put``, the write loop cut to the LRU stores alone, no payload copied: not a
   patch, a price: what any batch that must still copy every payload could save at most.
   0.31/0.32 only (0.33's ``put`` differs); on 0.33 step 1 still runs.

``--perf PATH`` records the writer thread alone (``perf record -g -t``) over step 1's window.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
if __name__ == "__main__":
    # Only when run as a script: tests import this module, and on vLLM 0.31 a later
    # vLLM logger set-up reads the variable, so setting it at import silenced the
    # warnings other tests in the same process assert on.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import numpy as np  # noqa: E402
from vllm.distributed.aux_output_connector.store import BlockObjectStoreError  # noqa: E402

import prime_r3  # noqa: E402

PARTS = ("_retain", "_release", "_evict_to_fit")
WRITER = "vllm-aux-output-writer"


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


class WriterMeter:
    """Per-call thread CPU of the store's ``put`` and its parts, on the store instance."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.on = False
        self.calls: list[dict[str, Any]] = []
        self._parts: dict[str, int] = {}
        for name in PARTS:
            setattr(store, name, self._timed_part(name, getattr(store, name)))
        self._put = store.put
        store.put = self.put

    def _timed_part(self, name: str, inner: Callable[..., Any]) -> Callable[..., Any]:
        def part(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return inner(*args, **kwargs)
            start = time.thread_time_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                self._parts[name] = self._parts.get(name, 0) + time.thread_time_ns() - start

        return part

    def put(
        self,
        objects: list[Any],
        *,
        retain_keys: Iterable[str] = (),
        release_keys: Iterable[str] = (),
    ) -> None:
        if not self.on:
            return self._put(objects, retain_keys=retain_keys, release_keys=release_keys)
        self._parts = {}
        where = getattr(self.store, "_slots", self.store._lru)  # key -> slot
        new = [k for k in dict.fromkeys(obj.key for obj in objects) if k not in where]
        faults, start = _minor_faults(), time.thread_time_ns()
        try:
            self._put(objects, retain_keys=retain_keys, release_keys=release_keys)
        finally:
            ns = time.thread_time_ns() - start
            self.calls.append(
                {
                    "ns": ns,
                    "faults": _minor_faults() - faults,
                    "written": [where.get(k) for k in new],
                    "objects": list(objects),
                    "retain": tuple(retain_keys),
                    "release": tuple(release_keys),
                    **self._parts,
                }
            )


def _snapshot(store: Any) -> dict[str, Any]:
    return {
        "lru": OrderedDict(store._lru),
        "references": dict(store._references),
        "free_slots": list(store._free_slots),
        "next_slot": store._next_slot,
        "slots": dict(getattr(store, "_slots", {})),
        "arena": bytes(store._arena[:]),
    }


def _restore(cls: Any, snap: dict[str, Any], num_slots: int, nbytes: int) -> Any:
    """A store built by the real constructor (patches applied), set to ``snap``'s state."""
    store = cls(max_bytes=num_slots * nbytes, object_nbytes=nbytes)
    store._lru = OrderedDict(snap["lru"])
    store._references = dict(snap["references"])
    store._free_slots = list(snap["free_slots"])
    store._next_slot = snap["next_slot"]
    if hasattr(store, "_slots"):
        store._slots = dict(snap["slots"])
    store._arena[: len(snap["arena"])] = snap["arena"]
    return store


def _place(
    self: Any, objects: list[Any], retain_keys: Iterable[str], release_keys: Iterable[str]
) -> tuple[dict[str, Any], list[str], list[int]]:
    """0.31/0.32 ``put`` up to its per-block write loop: the batch's keys de-duplicated,
    retains, releases, LRU moves and evictions in upstream's order (through the instance's
    own, possibly patched, parts), then the new keys' slots taken as upstream takes them
    (free list from its end, then fresh slots). The LRU is left at ``-1`` for the new keys:
    what follows decides what a slot costs. One body for ``bound_put`` and ``candidate_put``,
    so the two devices differ only in the write loop they measure."""
    if self._arena is None:
        raise RuntimeError("auxiliary output store is closed")
    unique = {obj.key: obj for obj in objects}
    self._retain(retain_keys)
    terminal_order = self._release(release_keys)
    lru = self._lru
    for key in unique:
        lru.setdefault(key, -1)
        lru.move_to_end(key)
    for key in terminal_order:
        if key in lru:
            lru.move_to_end(key)
    try:
        self._evict_to_fit(set(unique) - set(terminal_order))
    except BlockObjectStoreError:  # upstream's: forget the batch's keys never written
        for key in unique:
            if lru.get(key) == -1:
                del lru[key]
        raise
    new = [key for key in unique if lru.get(key) == -1]
    free = self._free_slots
    take = min(len(new), len(free))
    slots = free[len(free) - take :][::-1]
    del free[len(free) - take :]
    slots += range(self._next_slot, self._next_slot + len(new) - take)
    self._next_slot += len(new) - take
    return unique, new, slots


def bound_put(
    self: Any,
    objects: list[Any],
    *,
    retain_keys: Iterable[str] = (),
    release_keys: Iterable[str] = (),
) -> None:
    """0.31/0.32 ``put`` with its per-block write loop cut to the LRU stores alone.

    A measuring device, not a patch: it writes no payload. Everything before the loop is
    upstream's order of operations (``_place``).
    """
    _, new, slots = _place(self, objects, retain_keys, release_keys)
    self._lru.update(zip(new, slots, strict=True))


def candidate_put(
    self: Any,
    objects: list[Any],
    *,
    retain_keys: Iterable[str] = (),
    release_keys: Iterable[str] = (),
) -> None:
    """``bound_put`` plus the payload copies: what a batched write loop would cost.

    Slots are allocated in upstream's order (``_place``); payloads are copied with one
    slice assignment when the slots are consecutive, else one per block in a tight loop
    (no per-block method call). A measuring device: the parity of this device is tested
    against upstream's ``put`` (tests/test_bench_writer.py).
    """
    unique, new, slots = _place(self, objects, retain_keys, release_keys)
    if not new:
        return
    arena = self._arena
    size = self.object_nbytes
    first = slots[0]
    if slots == list(range(first, first + len(slots))):
        arena[first * size : (first + len(slots)) * size] = b"".join(
            unique[key].payload for key in new
        )
    else:
        for slot, key in zip(slots, new, strict=True):
            offset = slot * size
            arena[offset : offset + size] = unique[key].payload
    self._lru.update(zip(new, slots, strict=True))


def replay_models(store: Any) -> bool:
    """Whether the replay's loops model this store's ``put``: 0.31/0.32's, not 0.33's
    (which keeps a ``_slots`` key -> slot map beside the LRU and grows its arena)."""
    return "_slots" not in vars(store)


def _perf_record(path: str) -> subprocess.Popen[bytes]:
    """``perf record -g`` on the writer thread alone (its thread id), into ``path``."""
    tid = next(t.native_id for t in threading.enumerate() if t.name == WRITER)
    command = ["perf", "record", "-q", "-F", "4999", "-g", "-t", str(tid), "-o", path]
    recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # let perf attach before the window starts
    return recorder


def engine(
    n: int, window: int, min_warmup: int, max_warmup: int, perf: str | None = None
) -> tuple[Any, list[dict[str, Any]], dict[str, Any]]:
    """Run the bench loop to a full store (at least ``min_warmup`` steps), then one measured
    window; return the recording."""
    from prime_r3.bench import loop
    from prime_r3.bench.workload import BenchConfig

    report = prime_r3.apply(log=False)
    from prime_r3 import layer

    active = sorted(report.names(layer.APPLIED, layer.PENDING, layer.ALREADY))
    cfg = BenchConfig(concurrency=n, steps=window, warmup=max_warmup, parity=False)
    sim = loop.Simulator(cfg, True)
    background = sim.connector._store
    store = background._store
    meter = WriterMeter(store)
    used = lambda: len(getattr(store, "_slots", store._lru))  # noqa: E731
    warm = 0
    while warm < max_warmup and (warm < min_warmup or used() < store.num_slots):
        sim.step()
        warm += 1
    background._queue.join()
    snap = _snapshot(store)
    recorder = _perf_record(perf) if perf else None
    meter.on = True
    writer = sim.writer_clock.seconds()
    for _ in range(window):
        sim.step()
    background._queue.join()
    writer = sim.writer_clock.seconds() - writer
    if recorder is not None:
        recorder.send_signal(signal.SIGINT)
        recorder.wait()
        print(f"perf samples of the writer thread in the window: {perf} (perf report -i {perf})")
    meter.on = False
    # The same number of steps again without timing: the writer's CPU without the
    # wrappers' own work (which the timed window's writer CPU includes).
    bare = sim.writer_clock.seconds()
    for _ in range(window):
        sim.step()
    background._queue.join()
    bare = sim.writer_clock.seconds() - bare
    calls = meter.calls
    put_ns = sum(c["ns"] for c in calls)
    per = lambda total: total / window / 1e3  # noqa: E731  ns in the window -> us/step
    parts = {p: per(sum(c.get(p, 0) for c in calls)) for p in PARTS}
    rest = per(put_ns) - sum(parts.values())
    print(f"vLLM {_vllm_version()}, patches active: {', '.join(active)}")
    print(
        f"engine: N={n}, {window} steps after {warm} (store {used()}/{store.num_slots} at the "
        f"end; full at the window's start: {len(snap['slots'] or snap['lru']) >= store.num_slots})"
    )
    blocks = sum(len(c["objects"]) for c in calls)
    print(
        f"  per step: {blocks / window:.1f} blocks, {len(calls) / window:.2f} puts, "
        f"{sum(len(c['retain']) for c in calls) / window:.1f} retains, "
        f"{sum(len(c['release']) for c in calls) / window:.1f} releases, "
        f"{sum(c['faults'] for c in calls) / window:.1f} page faults"
    )
    written = [c["written"] for c in calls if c["written"]]
    consecutive = sum(w == list(range(w[0], w[0] + len(w))) for w in written)
    print(f"  puts writing blocks: {len(written)}, into consecutive slots: {consecutive}")
    print(f"  writer thread CPU        {writer / window * 1e6:7.1f} us/step (timed window)")
    print(f"    next {window} steps untimed {bare / window * 1e6:7.1f}  (no wrappers)")
    print(
        f"    outside put            {bare / window * 1e6 - per(put_ns):7.1f}"
        "  (untimed writer - put: queue hand-off, wake-ups)"
    )
    print(f"    put                    {per(put_ns):7.1f}")
    for p in PARTS:
        print(f"      {p:<20} {parts[p]:7.1f}")
    print(
        f"      rest of put          {rest:7.1f}"
        "  (per-block: dedupe, LRU inserts/moves, slots, copies)"
    )
    sim.close()
    return (type(store), store.num_slots, store.object_nbytes, store), calls, snap


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def replay(
    cls_info: Any,
    calls: list[dict[str, Any]],
    snap: dict[str, Any],
    rounds: int,
    window: int,
    sweep_caches: bool,
) -> None:
    cls, num_slots, nbytes, _ = cls_info
    sweep = np.zeros(8 << 20, dtype=np.uint8)
    arms: dict[str, Callable[[Any], Callable[..., Any]]] = {
        "put (bench)": lambda store: store.put,
        "put (bench) again": lambda store: store.put,
        "candidate: batched loop": lambda store: candidate_put.__get__(store),
        "bound: no per-block loop": lambda store: bound_put.__get__(store),
    }
    results: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            store = _restore(cls, snap, num_slots, nbytes)
            put = arms[name](store)
            gc.collect()
            total = 0
            for call in calls:
                if sweep_caches:
                    sweep += 1  # untimed: take the caches as the step loop does
                start = time.thread_time_ns()
                put(call["objects"], retain_keys=call["retain"], release_keys=call["release"])
                total += time.thread_time_ns() - start
            results[name].append(total / window / 1e3)
            store.close()
    caches = "an 8 MiB sweep before each put" if sweep_caches else "no sweep (warm caches)"
    print(
        f"replay: the window's {len(calls)} puts on the restored store, {caches}, {rounds} "
        "rounds, us/step (median [rounds])"
    )
    base = results[names[0]]
    for name in names:
        values = results[name]
        ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
        shown = ", ".join(f"{v:.0f}" for v in values)
        print(
            f"  {name:<26} {statistics.median(values):7.1f}   "
            f"paired ratio to put {ratio:.3f}   [{shown}]"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=400, help="concurrent requests (400)")
    parser.add_argument("--window", type=int, default=200, help="measured steps (200)")
    parser.add_argument(
        "--min-warmup",
        type=int,
        default=100,
        help="warm-up steps at least (100; 0.33 grows its store once)",
    )
    parser.add_argument("--max-warmup", type=int, default=1500, help="warm-up cap (1500)")
    parser.add_argument("--rounds", type=int, default=7, help="replay rounds (7)")
    parser.add_argument("--no-sweep", action="store_true", help="replay with warm caches too")
    parser.add_argument("--perf", metavar="PATH", help="perf record the writer over the window")
    args = parser.parse_args(argv)
    for name, value in (("-n", args.n), ("--window", args.window), ("--rounds", args.rounds)):
        if value < 1:
            parser.error(f"{name} must be a positive integer, got {value}")
    cls_info, calls, snap = engine(args.n, args.window, args.min_warmup, args.max_warmup, args.perf)
    if not replay_models(cls_info[3]):
        print("replay skipped: vLLM 0.33's put differs (the bound arm is 0.31/0.32's put)")
        return 0
    replay(cls_info, calls, snap, args.rounds, args.window, True)
    if args.no_sweep:
        replay(cls_info, calls, snap, args.rounds, args.window, False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
