"""Cost of one BlockObjectStore.put on a full store: upstream vs store_eviction (+growth).

    .venv/bin/python scripts/bench_store.py [--slots 450000] [--live 10000,40000,160000,320000]

Setup per row: a store of ``--slots`` slots, full, whose first ``live`` keys are
referenced by running requests (the pile-up vLLM 0.31-0.32 reach under load: a
referenced key is never moved, so they collect at the LRU front), followed by
unreferenced keys. Each timed put adds 25 new unreferenced objects, so it evicts 25.
Keys look like vLLM's (``vllm-artifact/<gen>/<hash hex>``); payloads are 64 bytes
(the object size does not change the scan being measured, and keeps RSS small).

Both arms run on the same store in the same process: upstream first (its puts leave
the pile-up in place), then the overlay is applied and the patched arm runs.
The patched arm's first put moves the whole pile-up to the end (shown on its own).
After that a referenced key is moved again once per pass of the eviction front
through the LRU, i.e. every ``(slots - live) / 25`` puts: ``amortised`` is the mean
over the remaining puts, passes included; ``median`` is the typical put.
Ratio = upstream median / patched median.

On a vLLM that has the fixes upstream (0.33: referenced keys leave the LRU, the arena
grows) the patches skip: the script prints why and times upstream's own put only.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import prime_r3  # noqa: E402

PATCHED = ["store_eviction", "store_growth"]
OBJECT_NBYTES = 64
BATCH = 25


def _stored(store: Any) -> dict[str, int]:
    """Key -> slot: ``_lru`` in vLLM 0.31/0.32; ``_slots`` in 0.33 (its LRU: unreferenced)."""
    slots = getattr(store, "_slots", None)
    return store._lru if slots is None else slots


def _key(kind: str, index: int) -> str:
    return f"vllm-artifact/0/{kind}{index:031x}"


def build(store_mod: Any, slots: int, live: int) -> Any:
    """A full store with ``live`` referenced keys at the front of its LRU."""
    store = store_mod.BlockObjectStore(max_bytes=slots * OBJECT_NBYTES, object_nbytes=OBJECT_NBYTES)
    payload = b"\x01" * OBJECT_NBYTES
    chunk = 10_000
    for start in range(0, slots, chunk):
        keys = [_key("a", i) for i in range(start, min(start + chunk, slots))]
        retain = [k for i, k in enumerate(keys, start) if i < live]
        store.put([store_mod.BlockObject(k, payload) for k in keys], retain_keys=retain)
    assert len(_stored(store)) == slots and len(store._references) == live
    return store


class Puts:
    """Fresh batches of new unreferenced objects, each put timed on its own."""

    def __init__(self, store_mod: Any) -> None:
        self.store_mod = store_mod
        self.next = 0
        self.payload = b"\x02" * OBJECT_NBYTES

    def run(self, store: Any, count: int, budget_s: float) -> list[float]:
        block = self.store_mod.BlockObject
        times = []
        deadline = time.perf_counter() + budget_s
        for _ in range(count):
            batch = [block(_key("n", self.next + i), self.payload) for i in range(BATCH)]
            self.next += BATCH
            start = time.perf_counter()
            store.put(batch)
            times.append(time.perf_counter() - start)
            if time.perf_counter() > deadline and len(times) >= 5:
                break
        return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=450_000)
    parser.add_argument("--live", default="10000,40000,160000,320000")
    parser.add_argument("--upstream-puts", type=int, default=60)
    parser.add_argument("--patched-puts", type=int, default=12_000)
    args = parser.parse_args(argv)
    logging.getLogger("vllm.prime_r3").setLevel(logging.WARNING)
    prime_r3.revert()
    from vllm.distributed.aux_output_connector import store as store_mod

    lives = [int(x) for x in args.live.split(",")]
    status = prime_r3.status(environ={})
    skipped = {o.name: o.reason for o in status.outcomes if o.name in PATCHED and o.reason}
    print(f"BlockObjectStore.put, {BATCH} new objects per put, full store of {args.slots} slots")
    if skipped:
        print(f"vllm {status.vllm_version}: patches skipped, upstream only:")
        for name, reason in skipped.items():
            print(f"  {name}: {reason}")
        header = f"{'live keys':>10} {'upstream median':>16} {'upstream mean':>14}"
    else:
        print(f"vllm {status.vllm_version}; patched = {' + '.join(PATCHED)}; times in ms per put")
        header = (
            f"{'live keys':>10} {'upstream median':>16} {'patched median':>15} "
            f"{'patched amortised':>18} {'first patched put':>18} {'ratio':>8}"
        )
    print(header)
    medians: dict[int, float] = {}
    amortised: dict[int, float] = {}
    gc.disable()  # a collection inside a timed put would measure the GC, not the store
    try:
        for live in lives:
            store = build(store_mod, args.slots, live)
            puts = Puts(store_mod)
            prime_r3.revert()
            if skipped:
                upstream = puts.run(store, args.patched_puts, budget_s=30.0)
                medians[live] = statistics.median(upstream) * 1e3
                amortised[live] = statistics.fmean(upstream) * 1e3
                print(f"{live:>10} {medians[live]:>16.4f} {amortised[live]:>14.4f}")
                del store
                gc.collect()
                continue
            upstream = puts.run(store, args.upstream_puts, budget_s=8.0)
            prime_r3.apply(names=PATCHED, log=False)
            patched = puts.run(store, args.patched_puts, budget_s=30.0)
            prime_r3.revert()
            assert len(store._lru) == args.slots and len(store._references) == live
            assert all(_key("a", i) in store._lru for i in range(0, live, 997))
            up_med = statistics.median(upstream) * 1e3
            medians[live] = statistics.median(patched) * 1e3
            amortised[live] = statistics.fmean(patched[1:]) * 1e3
            print(
                f"{live:>10} {up_med:>16.3f} {medians[live]:>15.4f} {amortised[live]:>18.4f} "
                f"{patched[0] * 1e3:>18.1f} {up_med / medians[live]:>7.0f}x"
            )
            del store
            gc.collect()
    finally:
        gc.enable()
    if len(lives) > 1:
        lo, hi = min(lives), max(lives)
        arm, mean = ("upstream", "mean") if skipped else ("patched", "amortised")
        print(
            f"{arm} at {hi} vs {lo} live keys: median {medians[hi] / medians[lo]:.2f}x, "
            f"{mean} {amortised[hi] / amortised[lo]:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
