"""Why upstream's own scheduler code runs slower in the prime_r3 arm (the ``sched`` residue).

    .venv/bin/python scripts/bench_sched_residue.py [-n 400] [--rounds 5] [--steps 240]
                                                    [--warmup 100] [--flush-kib 2048]
                                                    [--mem-mib 128] [--arms a,b,...]

``scripts/bench_sched.py`` splits ``prime-r3 bench``'s ``sched`` column and finds, with R3
on, upstream's own code (``add_request``, ``schedule()`` minus ``build_connector_meta``,
``update_from_output()`` minus ``take_output``) ~1.3 ms per step slower at N=400 than with
R3 off, though those lines do the same work in both. This script asks why, with
measurements, because a cost in upstream's code is either ours to remove (something
prime_r3 does in EngineCore), R3's in vLLM too (upstream R3 pays it as well), or an
artefact of the simulator (EngineCore's and the worker's work on one thread).

Arms (each a fresh interpreter running the bench's engine loop, ``prime_r3.bench.loop``;
order rotated per round; same workload and seed):

* ``off``, ``off2``: R3 off, twice per round: the A/A pair is the noise control between
  processes (their ratio is what "the same code" looks like across processes here).
* ``off+gc``: R3 off with engine_gc's thresholds set after the startup freeze, as the
  prime arm runs (hypothesis: GC thresholds/allocator reuse).
* ``off+mem``: R3 off holding ``--mem-mib`` of touched memory (the store's arena is
  ~113 MB at N=400; hypothesis: footprint, TLB).
* ``off+thr``: R3 off with a stand-in store writer thread (``_StandInWriter``; arena of
  ``--mem-mib``).
* ``upstream``: R3 on, no patch (``PRIME_R3=0``, the bench's ``r3_upstream``): if it shows
  the residue too, the residue is R3's, not prime_r3's.
* ``prime``: R3 on, every patch this release takes (the bench's ``r3_prime``).
* ``prime-gc``: the prime arm with CPython's default thresholds put back after the freeze.
* ``mix-prime``, ``mix-upstream``: an R3-off engine and a prime (upstream R3) engine in one
  interpreter, stepped alternately, each compared with the other in the same process:
  same heap, GC thresholds, writer thread, arena and machine load, so only what each
  engine does on its own steps differs (its own R3 calls, its worker's R3 work right
  before its own ``update_from_output``). Each engine also runs right after the other's
  step, so both see colder caches than in a process of their own (see ``probe``).

Inside every process, steps rotate through three modes (same process, same workload
phase, so no cross-process drift):

* ``plain``: the step as the bench runs it.
* ``flush``: ``--flush-kib`` of a private buffer written (one byte per cache line, 2× the
  1 MiB L2 by default) right before ``schedule()`` and right before
  ``update_from_output()``, i.e. where the worker's R3 work sits in the simulator
  (hypothesis 1: eviction). If the residue is eviction, flushing raises the R3-off arm's
  upstream pieces towards the R3-on arms' and raises the R3-on arms' less (already cold).
* ``probe``: before ``schedule()``, one read-only pass over the running requests
  (the attributes ``schedule()`` reads and their block lists) timed twice back to back:
  ``cold`` - ``warm`` is what finding that data out of cache costs at that point of the
  step (that step's ``schedule()`` is then partly warmed and is reported apart).

Per step, thread CPU (``time.thread_time_ns``) of ``schedule``, ``update`` and ``add``;
``meta`` (``build_connector_meta``, timed around the class attribute; packed_outputs'
declaration still sees the real consumer, checked by its counters), ``take``
(``take_output``, the class attribute swapped for a timing wrapper only during
``update_from_output``, after ``schedule()``, as ``bench_sched.py``; the wrapper's own
cost subtracted; it is wall time, scaled by ``update``'s CPU/wall so time descheduled is not
counted), ``fin`` (``request_finished``, in ``schedule`` and in ``update`` apart),
``gc`` (collections inside the timed calls, from ``gc.callbacks``), and ``ctrl``, a fixed
pure-Python workload at the end of every step (a per-process speed control). The
upstream-only pieces: ``add``, ``s_up`` = schedule - meta - fin, ``u_up`` = update - take
- fin, ``up`` = their sum. Printed: medians over rounds of each arm's per-step mean, the
ratio to ``off``, each experiment's effect (paired within a process where it is a
mode), and per-round values; ``up-gc`` (the sum without the collections inside it) is
what the per-round table compares, because GC lands in whichever call allocates when a threshold
is crossed (upstream R3's per-step objects make it ~0.7 ms per step at N=400).
``--print-json FILE`` prints the tables of a saved ``--json`` run again.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_CONNECTOR = "vllm.distributed.aux_output_connector.connector"
MODES = ("plain", "flush", "probe")
ARMS = (
    "off",
    "off2",
    "off+gc",
    "off+mem",
    "off+thr",
    "upstream",
    "prime",
    "prime-gc",
    "mix-prime",
    "mix-upstream",
)
RAW = ("schedule", "update", "add", "meta", "take", "fin_s", "fin_u", "gc", "ctrl")
PIECES = ("add", "s_up", "u_up", "up", "gc", "up-gc", "meta", "take", "ctrl")


def _wrapper_cost() -> float:
    """ns a timing wrapper adds per call (measured on an empty function)."""
    clock = time.perf_counter_ns

    def empty(a: Any, b: Any, c: Any) -> None:
        return None

    spent = [0]

    def timed(a: Any, b: Any, c: Any) -> Any:
        t0 = clock()
        try:
            return empty(a, b, c)
        finally:
            spent[0] += clock() - t0

    best_with = best_bare = float("inf")
    for _ in range(9):
        t0 = clock()
        for _ in range(20000):
            timed(1, 2, 3)
        best_with = min(best_with, clock() - t0)
        t0 = clock()
        for _ in range(20000):
            empty(1, 2, 3)
        best_bare = min(best_bare, clock() - t0)
    return (best_with - best_bare) / 20000


def _control() -> None:
    """A fixed pure-Python workload (dicts, lists, attribute-free ints): its thread CPU
    says how fast this process runs Python at this moment, whatever the arm."""
    table = {}
    for i in range(3000):
        table[i * 7 % 3001] = i
    sorted(table.items(), key=lambda kv: kv[1] % 97)


class _StandInWriter:
    """``off+thr``: a thread that does, per step, what the store writer's shape is (one
    step's rows, ``n`` tokens x 368 bytes, copied block by block into an arena of
    ``mem_mib`` at advancing offsets, one dict entry per block), woken by the engine
    loop as the real writer is, so that an R3-off process has a second Python thread
    taking the GIL and touching fresh memory each step (hypothesis: the writer thread,
    not the R3 work on the main thread, slows upstream's code)."""

    def __init__(self, mem_mib: int, n: int) -> None:
        import queue
        import threading

        import numpy as np

        self._arena = np.zeros(mem_mib << 20, np.uint8)
        self._rows = np.ones(n * 368, np.uint8)
        self._block = 16 * 368
        self._slots: dict[int, int] = {}
        self._work: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="stand-in-writer", daemon=True)
        self._thread.start()
        self._step = 0

    def submit(self) -> None:
        self._step += 1
        self._work.put(self._step)

    def _run(self) -> None:
        pos, size, block = 0, len(self._arena), self._block
        while (step := self._work.get()) is not None:
            for start in range(0, len(self._rows) - block + 1, block):
                if pos + block > size:
                    pos = 0
                self._arena[pos : pos + block] = self._rows[start : start + block]
                self._slots[(step << 20) | start] = pos
                pos += block
            if len(self._slots) > 200_000:
                self._slots.clear()

    def close(self) -> None:
        self._work.put(None)
        self._thread.join()


def _arm(kind: str, n: int, steps: int, warmup: int, flush_kib: int, mem_mib: int) -> dict:
    """One arm in this (fresh) interpreter; per engine, per mode, per piece, the per-step
    mean, ms. ``mix-prime`` / ``mix-upstream``: an R3-off engine and an R3-on engine in
    the same process, stepped alternately."""
    import gc

    import numpy as np

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    engines = {
        "mix-prime": (("off", False), ("prime", True)),
        "mix-upstream": (("off", False), ("upstream", True)),
    }.get(kind, ((kind, kind in ("upstream", "prime", "prime-gc")),))
    prime = kind in ("prime", "prime-gc", "mix-prime")
    if not prime:
        os.environ["PRIME_R3"] = "0"
    import prime_r3
    from prime_r3 import layer

    thresholds_before = gc.get_threshold()
    if prime:
        prime_r3.apply(log=False)
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    from prime_r3.bench import loop
    from prime_r3.bench.workload import BenchConfig
    from prime_r3.fixes import engine_gc

    active = [o.name for o in layer.status().outcomes if o.state in (layer.APPLIED, layer.PENDING)]
    if prime != bool(active):
        raise RuntimeError(f"arm {kind}: active patches {active}")
    cpu = time.thread_time_ns
    clock = time.perf_counter_ns
    overhead = _wrapper_cost()
    cfg = BenchConfig(concurrency=n, steps=steps, warmup=warmup, parity=False)
    # Each Simulator's freeze_gc_heap sets engine_gc's thresholds (prime processes).
    sims = {name: loop.Simulator(cfg, r3) for name, r3 in engines}
    if kind == "off+gc":
        gc.set_threshold(*engine_gc.DEFAULT_THRESHOLDS)
    elif kind == "prime-gc":
        gc.set_threshold(*thresholds_before)
    held = None
    if kind == "off+mem":
        held = np.ones(mem_mib << 20, np.uint8)  # touched: every page resident
    writer = _StandInWriter(mem_mib, n) if kind == "off+thr" else None
    flush_buf = np.zeros(flush_kib << 10, np.uint8)
    lines = flush_buf[::64]

    cls = AuxOutputSchedulerConnector
    acc = dict.fromkeys(RAW, 0)
    phase = ["schedule"]
    gc_start = [0]

    def on_gc(what: str, info: dict) -> None:
        if what == "start":
            gc_start[0] = cpu()
        else:
            acc["gc"] += cpu() - gc_start[0]

    gc.callbacks.append(on_gc)
    installed = {name: cls.__dict__[name] for name in ("build_connector_meta", "request_finished")}
    take_installed = cls.__dict__["take_output"]

    def timed_meta(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = cpu()
        try:
            return installed["build_connector_meta"].__get__(self, cls)(*args, **kwargs)
        finally:
            acc["meta"] += cpu() - t0

    def timed_fin(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = cpu()
        try:
            return installed["request_finished"].__get__(self, cls)(*args, **kwargs)
        finally:
            acc["fin_s" if phase[0] == "schedule" else "fin_u"] += cpu() - t0

    spent = [0, 0]  # perf_counter: a thread-CPU read costs ~0.5 us here, 800 per step

    def timed_take(self: Any, request: Any, output: Any) -> Any:
        t0 = clock()
        try:
            return take_installed(self, request, output)
        finally:
            spent[0] += clock() - t0
            spent[1] += 1

    if any(r3 for _, r3 in engines):
        cls.build_connector_meta = timed_meta
        cls.request_finished = timed_fin
    dummy = dict.fromkeys(loop.PHASES, 0.0)
    probes: dict[str, list[tuple[int, int]]] = {name: [] for name in sims}

    def stepper(name: str, sim: Any, r3: bool) -> Any:
        sched = sim.scheduler
        running = sched.running
        managers = sched.kv_cache_manager.coordinator.single_type_managers

        def probe() -> int:
            t0 = cpu()
            total = 0
            for request in running:
                total += request.num_tokens + request.num_computed_tokens
                total += len(request.spec_token_ids) + request.max_tokens
                request.status  # noqa: B018 - the read is the point
                request.request_id  # noqa: B018
                for manager in managers:
                    total += len(manager.req_to_blocks.get(request.request_id, ()))
            return cpu() - t0

        def step(mode: str) -> dict[str, float]:
            nonlocal running
            running = sched.running  # remove_all may rebind it
            for key in acc:
                acc[key] = 0
            if sched.has_requests():
                if mode == "flush":
                    lines[:] += 1
                elif mode == "probe":
                    probes[name].append((probe(), probe()))
                phase[0] = "schedule"
                t0 = cpu()
                so = sched.schedule()
                acc["schedule"] += cpu() - t0
                sim._note_schedule(so)
                sim.batch_queue.appendleft(sim._execute(so, dummy))
                executed = so.total_num_scheduled_tokens > 0
                if len(sim.batch_queue) < sim.queue_size and (executed or sched.has_requests()):
                    return dict(acc)
            elif not sim.batch_queue:
                return dict(acc)
            job = sim.batch_queue.pop()
            received = sim._complete(job, dummy)
            if writer is not None:
                writer.submit()
            if mode == "flush":
                lines[:] += 1
            spent[0] = spent[1] = 0
            phase[0] = "update"
            if r3:
                cls.take_output = timed_take
            t0, w0 = cpu(), clock()
            try:
                outputs = sched.update_from_output(job.scheduler_output, received)
            finally:
                spent_cpu, spent_wall = cpu() - t0, clock() - w0
                acc["update"] += spent_cpu
                if r3:
                    cls.take_output = take_installed
            # take is wall time: scaled by update's CPU/wall, so that time the thread
            # spent descheduled (other processes on the 2 cores) is not counted as take's.
            scale = min(1.0, spent_cpu / spent_wall) if spent_wall else 1.0
            acc["take"] += (spent[0] - overhead * spent[1]) * scale
            finished = sim._consume(outputs, job.scheduler_output)
            phase[0] = "add"
            t0 = cpu()
            for _ in range(finished):
                sim._add_request()
            acc["add"] += cpu() - t0
            t0 = cpu()
            _control()
            acc["ctrl"] += cpu() - t0
            return dict(acc)

        return step

    steppers = {name: stepper(name, sims[name], r3) for name, r3 in engines}
    records = {name: {mode: [] for mode in MODES} for name in sims}
    try:
        for k in range(cfg.total_steps):
            mode = MODES[k % len(MODES)]
            for name, step in steppers.items():
                row = step(mode)
                if k >= warmup:
                    records[name][mode].append(row)
    finally:
        gc.callbacks.remove(on_gc)
        for name, value in installed.items():
            setattr(cls, name, value)
        for sim in sims.values():
            sim.close()
        if writer is not None:
            writer.close()
    del held
    out: dict[str, Any] = {"engines": {}}
    for name in sims:
        modes = {}
        for mode, rows in records[name].items():
            mean = {key: sum(r[key] for r in rows) / len(rows) / 1e6 for key in RAW}
            mean["s_up"] = mean["schedule"] - mean["meta"] - mean["fin_s"]
            mean["u_up"] = mean["update"] - mean["take"] - mean["fin_u"]
            mean["up"] = mean["add"] + mean["s_up"] + mean["u_up"]
            mean["up-gc"] = mean["up"] - mean["gc"]
            modes[mode] = mean
        out["engines"][name] = {
            "modes": modes,
            "probe_cold": statistics.median(c for c, _ in probes[name]) / 1e6,
            "probe_warm": statistics.median(w for _, w in probes[name]) / 1e6,
        }
    out["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["thresholds"] = list(gc.get_threshold())
    out["active"] = active
    out["package"] = str(Path(prime_r3.__file__).resolve().parent)
    if prime:
        from prime_r3.fixes import packed_outputs

        out["handshake"] = packed_outputs.COUNTERS.snapshot()
    return out


def _rows(res: dict[str, list[dict]], label: str) -> list[dict]:
    """Per round, one engine's result: ``arm`` or ``arm:engine`` (a mixed process)."""
    arm, _, engine = label.partition(":")
    return [r["engines"][engine or arm] for r in res[arm]]


def _get(row: dict, mode: str, key: str) -> float:
    """A piece of one engine's row (``up-gc`` derived, for rows written before it was)."""
    values = row["modes"][mode]
    return values["up"] - values["gc"] if key == "up-gc" else values[key]


def _base(label: str) -> str:
    """What a row is compared with: the same process's R3-off engine for a mixed
    process (paired), else the ``off`` arm of the same round."""
    arm, _, _ = label.partition(":")
    return f"{arm}:off" if arm.startswith("mix-") else "off"


def _print(n: int, args: argparse.Namespace, res: dict[str, list[dict]], arms: list[str]) -> None:
    labels = []
    for arm in arms:
        names = list(res[arm][0]["engines"])
        labels += [arm] if names == [arm] else [f"{arm}:{e}" for e in names]
    print(
        f"N={n}: {len(res[arms[0]])} rounds (fresh interpreter per arm, order rotated per "
        f"round), {args.steps} steps after {args.warmup}, modes rotating step by step; medians "
        "over rounds of each arm's per-step mean, ms thread CPU. mix-X: an R3-off engine and an "
        "X engine stepped alternately in one process (compared with that process's off)"
    )
    print(
        "\n[plain steps] upstream-only: add, s_up = schedule-meta-fin, u_up = update-take-fin, "
        "up = their sum; gc = collections inside them; R3's own calls meta, take; ctrl = fixed "
        "workload; ratios: median of per-round ratios to the base (off, or the process's off)"
    )
    print(
        f"{'arm':>18} "
        + " ".join(f"{p:>6}" for p in PIECES)
        + f" {'up/b':>6} {'-gc/b':>6} {'s_up/b':>6} {'u_up/b':>6} {'add/b':>6} {'ctrl/b':>6}"
    )

    def ratio(label: str, key: str, mode: str = "plain") -> float:
        pairs = zip(_rows(res, label), _rows(res, _base(label)), strict=True)
        return statistics.median(_get(a, mode, key) / _get(b, mode, key) for a, b in pairs)

    for label in labels:
        rows = _rows(res, label)
        vals = [statistics.median(_get(r, "plain", p) for r in rows) for p in PIECES]
        print(
            f"{label:>18} "
            + " ".join(f"{v:>6.3f}" for v in vals)
            + " "
            + " ".join(
                f"{ratio(label, k):>6.3f}" for k in ("up", "up-gc", "s_up", "u_up", "add", "ctrl")
            )
        )
    print("\n[per round] up - gc (plain steps) and its ratio to the base, each round")
    for label in labels:
        ups = [_get(r, "plain", "up-gc") for r in _rows(res, label)]
        bases = [_get(r, "plain", "up-gc") for r in _rows(res, _base(label))]
        print(
            f"{label:>18} "
            + " ".join(f"{u:6.3f}" for u in ups)
            + "   /b: "
            + " ".join(f"{a / b:5.3f}" for a, b in zip(ups, bases, strict=True))
        )
    print(
        f"\n[flush] flush - plain, paired in each process ({args.flush_kib} KiB written before "
        "schedule() and before update_from_output()), median over rounds, ms"
    )
    print(
        f"{'arm':>18} "
        + " ".join(f"{p:>6}" for p in ("add", "s_up", "u_up", "up"))
        + "  per-round up"
    )
    for label in labels:
        rows = _rows(res, label)
        eff = {
            p: [r["modes"]["flush"][p] - r["modes"]["plain"][p] for r in rows]
            for p in ("add", "s_up", "u_up", "up")
        }
        print(
            f"{label:>18} "
            + " ".join(f"{statistics.median(v):>6.3f}" for v in eff.values())
            + "  "
            + " ".join(f"{x:+.3f}" for x in eff["up"])
        )
    print("\n[probe] read-only pass over the running requests before schedule(), ms: cold, warm")
    for label in labels:
        rows = _rows(res, label)
        cold = statistics.median(r["probe_cold"] for r in rows)
        warm = statistics.median(r["probe_warm"] for r in rows)
        gaps = [r["probe_cold"] - r["probe_warm"] for r in rows]
        print(
            f"{label:>18} cold {cold:.3f} warm {warm:.3f} cold-warm {statistics.median(gaps):.3f}"
            "  per round: " + " ".join(f"{g:.3f}" for g in gaps)
        )
    print("\n[process] max RSS MiB, GC thresholds, packed_outputs handshake")
    for arm in arms:
        row = res[arm][0]
        rss = statistics.median(r["maxrss_mib"] for r in res[arm])
        hs = row.get("handshake")
        text = f"declared {hs['declared_steps']} withheld {hs['withheld_steps']}" if hs else "-"
        print(f"{arm:>18} rss {rss:5.0f}  thresholds {row['thresholds']}  {text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", default="400", help="comma list of concurrencies")
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--flush-kib", type=int, default=2048)
    parser.add_argument("--mem-mib", type=int, default=128)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--json", help="write every round's rows here")
    parser.add_argument("--print-json", help="print the tables of a --json file (no run)")
    parser.add_argument("--arm", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        out = _arm(args.arm, int(args.n), args.steps, args.warmup, args.flush_kib, args.mem_mib)
        print(json.dumps(out))
        return
    if args.print_json:
        dump = json.loads(Path(args.print_json).read_text())
        for n, res in dump.items():
            _print(int(n), args, res, list(res))
        return
    arms = args.arms.split(",")
    bad = [a for a in arms if a not in ARMS]
    if bad or "off" not in arms:
        parser.error(f"--arms {args.arms!r}: choose from {', '.join(ARMS)} (off required)")
    dump = {}
    for n in [int(x) for x in args.n.split(",")]:
        res: dict[str, list[dict]] = {arm: [] for arm in arms}
        for round_ in range(args.rounds):
            shift = round_ % len(arms)
            for arm in arms[shift:] + arms[:shift]:
                command = [sys.executable, __file__, "--arm", arm, "-n", str(n)]
                command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
                command += ["--flush-kib", str(args.flush_kib), "--mem-mib", str(args.mem_mib)]
                out = subprocess.run(
                    command, check=True, capture_output=True, text=True, cwd=ROOT
                ).stdout
                res[arm].append(json.loads(out.strip().splitlines()[-1]))
                print(f"  N={n} round {round_ + 1}: {arm} done", file=sys.stderr, flush=True)
        _print(n, args, res, arms)
        dump[n] = res
    if args.json:
        Path(args.json).write_text(json.dumps(dump))


if __name__ == "__main__":
    main()
