"""Publishing completed R3 blocks, per engine step: where the time goes; upstream vs store_arena.

    .venv/bin/python scripts/bench_publish.py [--rounds 5] [--puts 60] [--blocks 28,70]

One "step" publishes ``blocks`` completed blocks of 16 tokens x 46 int64 (5,888 bytes,
the bench model's block): 28 at N=400 and ~70 at N=1000 (what ``prime-r3 bench``
publishes per step). Every put also retains the step's keys and releases as many older
ones, as ``begin_step`` and finished requests do. Times are ``time.thread_time`` (CPU of
the timing thread; the writer thread in vLLM), medians over ``--rounds`` rounds of the
per-round mean, arms alternating in each round, all in this process:

* ``main publish``: upstream's ``publish_routed_experts`` (validation, one
  ``BlockObject`` + ``tobytes()`` per block) into a store stand-in that keeps the list:
  the main thread's share; no patch changes it (shown for what batching could win).
* ``put fresh``: the writer's ``BlockObjectStore.put`` into never-used slots (a store
  filling up, as the bench's and a real engine's for a long time): upstream's shared
  arena vs store_arena's private one. The difference is the kernel's first-touch cost.
* ``put touched``: the same puts into slots already written once (a full store reusing
  slots): both arms' floor, no page faults.
* ``copies``: the put's 'blocks' payload copies alone, upstream's slice assignments vs
  one numpy copy into consecutive slots (what batching the writer could save at most).

``--simulator N`` instead runs ``prime-r3 bench``'s real engine loop (its ``Simulator``:
real scheduler, worker connector, store and writer thread) at N concurrent requests,
every patch on vs every patch but store_arena, each arm in a fresh process, arms
alternating, and prints the writer thread's CPU per step (``ThreadClock``) over the
window: medians of ``--rounds`` (default here 3; each arm takes ~30-60 s at N=400).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import numpy as np  # noqa: E402

import prime_r3  # noqa: E402

PATCH = "store_arena"
BLOCK_SIZE = 16
ROW = 46  # layers x top-k of the bench model, int64
NBYTES = BLOCK_SIZE * ROW * 8


class _KeepList:
    """A store stand-in for the main-thread arm: ``put`` keeps what it is given."""

    def put(self, objects: Any, *, retain_keys: Any = (), release_keys: Any = ()) -> None:
        self.objects = objects


def _steps(count: int, blocks: int) -> list[tuple[list[tuple[list[str], list[Any]]], list[str]]]:
    """``count`` steps of ``blocks`` one-block batches (keys, [(0, rows)]) and their keys."""
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 256, (BLOCK_SIZE, ROW), dtype=np.int64) for _ in range(blocks)]
    steps = []
    for step in range(count):
        keys = [f"vllm-artifact/0/{step:08x}{i:024x}" for i in range(blocks)]
        steps.append(([([key], [(0, row)]) for key, row in zip(keys, rows, strict=True)], keys))
    return steps


def _objects(store_mod: Any, steps: list[Any]) -> list[list[Any]]:
    return [
        [store_mod.BlockObject(keys[0], row.tobytes()) for keys, ((_, row),) in batches]
        for batches, _ in steps
    ]


def _timed(run: Callable[[int], None], count: int) -> float:
    """Mean CPU seconds of ``run(i)`` for i in range(count)."""
    start = time.thread_time()
    for i in range(count):
        run(i)
    return (time.thread_time() - start) / count


def _store(store_mod: Any, slots: int, patched: bool) -> Any:
    """A store built by the real constructor, with or without store_arena applied."""
    prime_r3.revert()
    if patched:
        prime_r3.apply(names=[PATCH], log=False)
    try:
        return store_mod.BlockObjectStore(max_bytes=slots * NBYTES, object_nbytes=NBYTES)
    finally:
        prime_r3.revert()


def _puts(store: Any, objects: list[list[Any]], steps: list[Any], lag: int = 4) -> Callable:
    def put(i: int) -> None:
        release = steps[i - lag][1] if i >= lag else ()
        store.put(objects[i], retain_keys=steps[i][1], release_keys=release)

    return put


def round_(store_mod: Any, routed: Any, blocks: int, puts: int, order: int) -> dict[str, float]:
    steps = _steps(puts, blocks)
    objects = _objects(store_mod, steps)
    out: dict[str, float] = {}
    keep = _KeepList()
    out["main publish"] = _timed(
        lambda i: routed.publish_routed_experts(keep, batches=steps[i][0], block_size=BLOCK_SIZE),
        puts,
    )
    slots = puts * blocks
    arms = [("upstream", False), (PATCH, True)]
    for name, patched in arms[::order]:
        store = _store(store_mod, slots, patched)
        out[f"put fresh {name}"] = _timed(_puts(store, objects, steps), puts)
        # A store whose slots were all written once (a full store reusing its slots).
        again = _store(store_mod, slots, patched)
        again._arena[:] = bytes(len(again._arena))  # every page touched once
        out[f"put touched {name}"] = _timed(_puts(again, objects, steps), puts)
        store.close()
        again.close()
    out.update(_copies(store_mod, objects[0], blocks, puts))
    return out


def _copies(store_mod: Any, payloads: list[Any], blocks: int, count: int) -> dict[str, float]:
    """One step's payload copies into consecutive (touched) slots: per block vs at once."""
    store = _store(store_mod, blocks, False)
    arena = store._arena
    arena[:] = bytes(len(arena))
    # Held in a dict so the view (an export of the arena's buffer) can be dropped before close.
    view = {"slots": np.frombuffer(arena, dtype=np.uint8).reshape(blocks, NBYTES)}
    joined = np.frombuffer(b"".join(o.payload for o in payloads), np.uint8).reshape(blocks, NBYTES)

    def per_block(_: int) -> None:
        for slot, obj in enumerate(payloads):
            arena[slot * NBYTES : (slot + 1) * NBYTES] = obj.payload

    def at_once(_: int) -> None:
        view["slots"][:] = joined

    out = {
        "copies: slice per block": _timed(per_block, count),
        "copies: one numpy copy": _timed(at_once, count),
    }
    view.clear()
    store.close()
    return out


def _simulator_arm(patches: str, concurrency: int, steps: int, warmup: int) -> None:
    """Child process: the bench's engine loop with ``patches``; prints writer ms/step."""
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    os.environ["PRIME_R3_PATCHES"] = patches
    from prime_r3 import layer
    from prime_r3.bench import loop
    from prime_r3.bench.workload import BenchConfig

    report = prime_r3.apply(log=False)
    cfg = BenchConfig(concurrency=concurrency, steps=steps, warmup=warmup, parity=False)
    sim = loop.Simulator(cfg, True)
    for _ in range(warmup):
        sim.step()
    writer = sim.writer_clock.seconds()
    for _ in range(steps):
        sim.step()
    sim.connector._store._queue.join()  # the window's puts are done
    writer = sim.writer_clock.seconds() - writer
    active = sorted(report.names(layer.APPLIED, layer.PENDING, layer.ALREADY))
    print(json.dumps({"writer_ms": writer / steps * 1e3, "active": active}))


def simulator(concurrency: int, rounds: int, steps: int, warmup: int) -> None:
    arms = {"every patch": "all", f"all but {PATCH}": f"all,-{PATCH}"}
    results: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(rounds):
        for name, patches in list(arms.items())[:: 1 if r % 2 == 0 else -1]:
            args = [str(x) for x in (patches, concurrency, steps, warmup)]
            child = subprocess.run(
                [sys.executable, __file__, "--_arm", *args],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "PRIME_R3": "1"},
            )
            out = json.loads(child.stdout.strip().splitlines()[-1])
            assert (PATCH in out["active"]) == (patches == "all"), out["active"]
            results[name].append(out["writer_ms"])
    print(
        f"writer thread CPU ms/step, bench Simulator N={concurrency}, {steps} steps after "
        f"{warmup}, median of {rounds} rounds (each round's value in brackets):"
    )
    for name, values in results.items():
        shown = ", ".join(f"{v:.3f}" for v in values)
        print(f"  {name:>22}: {statistics.median(values):.3f}  [{shown}]")
    without, with_ = (statistics.median(v) for v in reversed(list(results.values())))
    print(f"  ratio (without / with {PATCH}): {without / with_:.2f}x")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_arm"]:
        _simulator_arm(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help="default 5 (3 with --simulator)")
    parser.add_argument("--simulator", type=int, metavar="N", help="the bench's engine loop")
    parser.add_argument("--steps", type=int, default=150, help="--simulator: measured steps")
    parser.add_argument("--warmup", type=int, default=60, help="--simulator: warm-up steps")
    parser.add_argument("--puts", type=int, default=60, help="steps (puts) per round and arm")
    parser.add_argument("--blocks", default="28,70", help="blocks per step, comma list")
    args = parser.parse_args(argv)
    if args.simulator:
        simulator(args.simulator, args.rounds or 3, args.steps, args.warmup)
        return 0
    args.rounds = args.rounds or 5
    logging.getLogger("vllm.prime_r3").setLevel(logging.WARNING)
    prime_r3.revert()
    from vllm.distributed.aux_output_connector import routed_experts as routed
    from vllm.distributed.aux_output_connector import store as store_mod

    status = prime_r3.status(environ={})
    outcome = status.outcome(PATCH)
    if outcome.state != "would_apply":
        print(f"vllm {status.vllm_version}: {PATCH} {outcome.state} ({outcome.reason})")
        return 0
    print(
        f"vllm {status.vllm_version}; blocks of {NBYTES} bytes; us per step (one put), "
        f"median of {args.rounds} rounds x {args.puts} steps"
    )
    gc.disable()
    try:
        for blocks in (int(b) for b in args.blocks.split(",")):
            rounds = [
                round_(store_mod, routed, blocks, args.puts, 1 if r % 2 == 0 else -1)
                for r in range(args.rounds)
            ]
            med = {k: statistics.median(r[k] for r in rounds) * 1e6 for k in rounds[0]}
            print(f"{blocks} blocks/step:")
            print(f"  main publish (upstream, unchanged)      {med['main publish']:8.1f}")
            for kind in ("fresh", "touched"):
                up, ours = med[f"put {kind} upstream"], med[f"put {kind} {PATCH}"]
                print(
                    f"  writer put, {kind:7} slots: upstream {up:8.1f}  {PATCH} {ours:8.1f}"
                    f"  ratio {up / ours:5.2f}x"
                )
            one, each = med["copies: one numpy copy"], med["copies: slice per block"]
            print(f"  payload copies: slice per block {each:8.1f}  one numpy copy {one:8.1f}")
    finally:
        gc.enable()
    return 0


if __name__ == "__main__":
    sys.exit(main())
