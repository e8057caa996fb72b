"""Where R3's cost on EngineCore's scheduler thread goes (``prime-r3 bench``'s ``sched``).

    .venv/bin/python scripts/bench_sched.py [-n 400] [--rounds 5] [--steps 150]
                                            [--warmup 100] [--before REF]

The ``sched`` column is main-thread CPU in ``schedule()``, ``update_from_output()`` and
``add_request`` (the bench's engine loop, ``prime_r3.bench.loop.Simulator``). Each round
runs, in fresh interpreters back to back (order rotated between rounds), the R3-off
arm and the prime arm (R3 on, every patch this release takes), and with ``--before`` the
prime arm of prime_r3 at git revision REF (``git archive`` on ``PYTHONPATH``, as
``scripts/benchkit.py``'s ``export_revision``). Per step, without a profiler:

* ``schedule`` / ``update`` / ``add``: thread CPU of each of the three calls.
* ``meta``: thread CPU of ``build_connector_meta`` (one call per step, timed around the
  class attribute, i.e. every layer prime_r3 stacks there), inside ``schedule``.
* ``take``: ``take_output``'s calls inside ``update_from_output``, in place: for the
  duration of that one call the class attribute is a wrapper that times each call with
  ``perf_counter_ns`` (the scheduler thread; 0.06 us per clock read) and calls the
  function that was there; the wrapper's own cost (measured per process on an empty
  function) is subtracted. It is installed after ``schedule()``, so packed_outputs'
  handshake (judged in ``build_connector_meta``) sees the real consumer.
* ``take_replay``: the same step's ``take_output`` calls again, right after
  ``update_from_output`` (the requests' ``num_tokens`` is what the calls saw), on a
  fresh unfilled copy of the received step, timed as one thread-CPU interval: prime's
  take (its per-step lookup included); ``take_up``: upstream's ``take_output`` on a
  filled copy (upstream's dict); ``take_floor``: only ``request.request_id`` and
  ``request.num_tokens`` per call.
* ``fin``: ``request_finished`` calls (thread CPU).

Printed: medians over rounds of each arm's mean per step, ms; prime - off; and with
``--before`` after / before (medians and paired per round). ``add`` and ``schedule``
minus ``meta`` are pieces a take_output change does not touch: the noise control.

Separate processes drift by tens of percent on this shared machine, so a take_output
change is better judged by

    .venv/bin/python scripts/bench_sched.py --take-before REV|FILE [-n 400] [--rounds 5]

where each fresh prime process alternates take_output step by step between this
checkout's and REV's ``batched_take.py`` (or FILE, a module with the same
``_batched_take`` factory, e.g. a measurement variant that returns a constant: the
difference in ``update`` is then take_output's whole in-place cost). Printed per piece
(``take`` in place, ``update``, and ``schedule``, which take_output does not touch:
the noise control) the median over rounds of each variant's per-step median, and the
per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import export_revision as _export  # noqa: E402 - the harness
from benchkit import medians, rotated, run_child, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
_TAKE_FILE = "prime_r3/fixes/batched_take.py"
_CONNECTOR = "vllm.distributed.aux_output_connector.connector"
PIECES = (
    "sched",
    "schedule",
    "update",
    "add",
    "meta",
    "take",
    "take_calls",
    "take_replay",
    "take_up",
    "take_floor",
    "fin",
    "meta_up",
)


def _wrapper_cost() -> float:
    """ns a timing wrapper adds per call (measured on an empty function)."""
    clock = time.perf_counter_ns
    spent = [0]

    def empty(a: Any, b: Any, c: Any) -> None:
        return None

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


def _split_meta(cls: Any, acc: dict[str, float], cpu: Any) -> Any:
    """build_connector_meta as the layer stacks it (packed_outputs' declaration around
    upstream), composed here so each part is timed: ``meta`` the whole, ``meta_up``
    upstream alone."""
    import prime_r3
    from prime_r3.fixes import packed_outputs

    upstream = prime_r3.get_original(_CONNECTOR, "AuxOutputSchedulerConnector.build_connector_meta")
    declare = packed_outputs._declare_packed_reader({})

    def build_connector_meta(self: Any, *args: Any) -> Any:
        def bare(*a: Any, **k: Any) -> Any:
            t0 = cpu()
            try:
                return upstream(self, *a, **k)
            finally:
                acc["meta_up"] += cpu() - t0

        t0 = cpu()
        try:
            return declare(bare, self, args, {})
        finally:
            acc["meta"] += cpu() - t0

    return build_connector_meta


def _arm(
    n: int,
    steps: int,
    warmup: int,
    r3: bool,
    split_meta: bool = True,
    take_before: str = "",
    replay: bool = True,
) -> dict[str, Any]:
    """One arm in this (fresh) interpreter: per-step means of every piece, ms."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import prime_r3

    if r3:
        prime_r3.apply(log=False)
    else:
        os.environ["PRIME_R3"] = "0"
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    from prime_r3.bench import loop
    from prime_r3.bench.workload import BenchConfig

    cpu = time.thread_time_ns
    clock = time.perf_counter_ns
    overhead = _wrapper_cost()
    cfg = BenchConfig(concurrency=n, steps=steps, warmup=warmup, parity=False)
    sim = loop.Simulator(cfg, r3)
    sched = sim.scheduler
    cls = AuxOutputSchedulerConnector
    acc = dict.fromkeys(PIECES, 0.0)
    installed = {name: cls.__dict__[name] for name in ("build_connector_meta", "request_finished")}
    take_installed = cls.__dict__["take_output"]
    upstream_take = (
        prime_r3.get_original(_CONNECTOR, "AuxOutputSchedulerConnector.take_output")
        if r3
        else take_installed
    )

    def timed_cpu(name: str, key: str) -> Any:
        inner = installed[name]

        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = cpu()
            try:
                return inner.__get__(self, cls)(*args, **kwargs)
            finally:
                acc[key] += cpu() - t0

        return timed

    spent = [0, 0]
    takes = {"new": take_installed}
    if take_before:  # batched_take.py of before a change, under another name
        import importlib.util

        from prime_r3 import packed

        if not hasattr(packed, "_Index"):
            # batched_take.py from before the split (6921192 and earlier) builds its own
            # index as packed._Index(places, rows), a type this checkout no longer has.
            from typing import NamedTuple

            class _Index(NamedTuple):
                places: dict[Any, Any]
                rows: Any

            packed._Index = _Index
        spec = importlib.util.spec_from_file_location("_batched_take_before", take_before)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        takes["before"] = module._batched_take({})(upstream_take)
    current = ["new"]
    counter = [0]
    per_step: dict[str, dict[str, list[float]]] = {
        name: {"take": [], "update": [], "schedule": []} for name in takes
    }

    def timed_take(self: Any, request: Any, output: Any) -> Any:
        t0 = clock()
        try:
            return takes[current[0]](self, request, output)
        finally:
            spent[0] += clock() - t0
            spent[1] += 1

    if r3 and split_meta:
        cls.build_connector_meta = _split_meta(cls, acc, cpu)
    if r3:
        cls.request_finished = timed_cpu("request_finished", "fin")

    def replay(connector: Any, received: Any, emitted: list[Any]) -> None:
        from prime_r3.packed import PackedAuxOutputs, _Unfilled

        output = received.aux_output_connector_output
        if type(output) is not _Unfilled or not emitted:
            return
        take = cls.take_output
        # packed(): the step as received, or (split by its first take, which dropped
        # the packed rows) packed again from its per-request arrays. Not timed.
        packed = output.packed()
        fresh = PackedAuxOutputs._trusted(*packed)
        filled = PackedAuxOutputs._trusted(*packed)
        filled._fill()
        t0 = cpu()
        for request in emitted:
            take(connector, request, fresh)
        t1 = cpu()
        for request in emitted:
            upstream_take(connector, request, filled)
        t2 = cpu()
        for request in emitted:
            request.request_id  # noqa: B018 - the read is the point
            request.num_tokens  # noqa: B018
        t3 = cpu()
        acc["take_replay"] += t1 - t0
        acc["take_up"] += t2 - t1
        acc["take_floor"] += t3 - t2

    def step() -> None:
        sched_ = sched
        names = list(takes)
        name = current[0] = names[counter[0] % len(names)]
        counter[0] += 1
        if sched_.has_requests():
            t0 = cpu()
            so = sched_.schedule()
            spent_schedule = cpu() - t0
            acc["schedule"] += spent_schedule
            per_step[name]["schedule"].append(spent_schedule / 1e6)
            sim._note_schedule(so)
            sim.batch_queue.appendleft(sim._execute(so, dict.fromkeys(loop.PHASES, 0.0)))
            executed = so.total_num_scheduled_tokens > 0
            if len(sim.batch_queue) < sim.queue_size and (executed or sched_.has_requests()):
                return
        elif not sim.batch_queue:
            return
        job = sim.batch_queue.pop()
        received = sim._complete(job, dict.fromkeys(loop.PHASES, 0.0))
        spent[0] = spent[1] = 0
        if r3:
            cls.take_output = timed_take
        t0 = cpu()
        try:
            outputs = sched_.update_from_output(job.scheduler_output, received)
        finally:
            spent_update = cpu() - t0
            acc["update"] += spent_update
            if r3:
                cls.take_output = take_installed
        acc["take"] += spent[0] - overhead * spent[1]
        acc["take_calls"] += spent[1]
        per_step[name]["take"].append((spent[0] - overhead * spent[1]) / 1e6)
        per_step[name]["update"].append(spent_update / 1e6)
        if r3 and replay:
            emitted = [
                sched_.requests[o.request_id]
                for eco in outputs.values()
                for o in eco.outputs
                if o.routed_experts is not None and o.request_id in sched_.requests
            ]
            replay(sched_.aux_output_connector, received, emitted)
        finished = sim._consume(outputs, job.scheduler_output)
        t0 = cpu()
        for _ in range(finished):
            sim._add_request()
        acc["add"] += cpu() - t0

    try:
        for k in range(cfg.total_steps):
            if k == warmup:
                for key in acc:
                    acc[key] = 0.0
                for lists in per_step.values():
                    for values in lists.values():
                        values.clear()
            step()
    finally:
        for name, value in installed.items():
            setattr(cls, name, value)
        sim.close()
    out = {key: value / steps / 1e6 for key, value in acc.items()}
    out["take_calls"] = acc["take_calls"] / steps
    out["sched"] = out["schedule"] + out["update"] + out["add"]
    out["package"] = str(Path(prime_r3.__file__).resolve().parent)
    import vllm

    out["vllm"] = str(Path(vllm.__file__).parent.absolute())
    out["variants"] = {
        name: {key: statistics.median(v) for key, v in lists.items() if v}
        for name, lists in per_step.items()
    }
    out["overhead_ns"] = overhead
    if r3:
        from prime_r3.fixes import batched_take, packed_outputs

        out["handshake"] = packed_outputs.COUNTERS.snapshot()
        out["take_counts"] = batched_take.COUNTERS.snapshot()
    return out


def _take_ab(args: argparse.Namespace) -> None:
    """``--take-before``: take_output alternating step by step in each fresh process."""
    with tempfile.TemporaryDirectory(prefix="prime_r3_take_") as where:
        path = Path(where) / "batched_take_before.py"
        if Path(args.take_before).is_file():  # a file: measurement variants too
            path.write_bytes(Path(args.take_before).read_bytes())
        else:
            path.write_bytes(
                subprocess.run(
                    ["git", "-C", str(ROOT), "show", f"{args.take_before}:{_TAKE_FILE}"],
                    check=True,
                    capture_output=True,
                ).stdout
            )
        for n in [int(x) for x in args.n.split(",")]:
            rounds = []
            for _ in range(args.rounds):
                command = [sys.executable, __file__, "--arm", "prime", "-n", str(n)]
                command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
                command += ["--take-file", str(path)]
                out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
                rounds.append(json.loads(out.strip().splitlines()[-1])["variants"])
            print(
                f"N={n}: take_output alternating step by step (new = this checkout, before = "
                f"{args.take_before}); {args.rounds} fresh processes, {args.steps} steps after "
                f"{args.warmup}; per round the median over its steps, ms CPU per step"
            )
            print(f"{'piece':>9} {'before':>8} {'new':>8} {'new/before':>10}  per-round new/before")
            for key in ("take", "update", "schedule"):
                before = statistics.median(r["before"][key] for r in rounds)
                new = statistics.median(r["new"][key] for r in rounds)
                ratios = [r["new"][key] / r["before"][key] for r in rounds]
                print(
                    f"{key:>9} {before:>8.3f} {new:>8.3f} {statistics.median(ratios):>10.3f}  "
                    + " ".join(f"{x:.3f}" for x in ratios)
                )
            print("  schedule: not touched by take_output (the noise control)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", default="400", help="comma list of concurrencies")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--json", metavar="PATH", help="write header, rows and medians ('-': stdout)"
    )
    parser.add_argument("--before", help="git revision: also the prime arm of that version")
    parser.add_argument("--no-off", action="store_true", help="skip the R3-off arm")
    parser.add_argument(
        "--take-before",
        help="git revision (or a batched_take.py-like file): the prime arm alternates "
        "take_output step by step between this checkout's batched_take and that one "
        "(same process, same steps)",
    )
    parser.add_argument(
        "--no-replay",
        action="store_true",
        help="skip take_replay/take_up/take_floor (the replay runs between update_from_output "
        "and add_request, so it perturbs the pieces after it: scripts/README.md, 'The residue')",
    )
    parser.add_argument("--arm", choices=("off", "prime"), help=argparse.SUPPRESS)
    parser.add_argument("--take-file", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        result = _arm(
            int(args.n),
            args.steps,
            args.warmup,
            args.arm == "prime",
            take_before=args.take_file,
            replay=not args.no_replay,
        )
        print(json.dumps(result))
        return
    if args.take_before:
        return _take_ab(args)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="prime_r3_before_") as before_dir:
        paths = {"after": str(ROOT)}
        arms = [] if args.no_off else ["off"]
        arms.append("after")
        if args.before:
            _export(args.before, before_dir)
            paths["before"] = before_dir
            arms.append("before")
        for n in [int(x) for x in args.n.split(",")]:
            results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
            for round_ in range(args.rounds):
                for arm in rotated(arms, round_):
                    kind = "off" if arm == "off" else "prime"
                    argv = ["--arm", kind, "-n", str(n)]
                    argv += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
                    argv += ["--no-replay"] if args.no_replay else []
                    results[arm].append(run_child(__file__, argv, paths.get(arm, str(ROOT)), arm))
            out[str(n)] = {
                "rounds": results,
                "medians": {arm: medians(results[arm], PIECES) for arm in arms},
            }
            print(
                f"N={n}: medians of {args.rounds} rounds (fresh interpreters, rotated "
                f"order) of each arm's mean per step over {args.steps} steps after "
                f"{args.warmup}, ms CPU; take_calls per step"
                + (f"; before = {args.before}" if args.before else "")
            )
            med = {
                arm: {p: statistics.median(r[p] for r in results[arm]) for p in PIECES}
                for arm in arms
            }
            print(f"{'arm':>10} " + " ".join(f"{p:>11}" for p in PIECES))
            for arm in arms:
                print(f"{arm:>10} " + " ".join(f"{med[arm][p]:>11.3f}" for p in PIECES))
            if "off" in med:
                diff = " ".join(f"{med['after'][p] - med['off'][p]:>11.3f}" for p in PIECES)
                print(f"{'after-off':>10} {diff}")
            if "before" in med:
                ratio = " ".join(
                    f"{med['after'][p] / med['before'][p]:>11.3f}" if med["before"][p] else " " * 11
                    for p in PIECES
                )
                print(f"{'after/b':>10} {ratio}")
                pairs = list(zip(results["after"], results["before"], strict=True))
                paired = " ".join(
                    f"{statistics.median(a[p] / b[p] for a, b in pairs):>11.3f}"
                    if all(b[p] for _, b in pairs)
                    else " " * 11
                    for p in PIECES
                )
                print(f"{'paired':>10} {paired}   (median of per-round after/before)")
            for arm in arms:
                per_round = " ".join(f"{r['sched']:.3f}" for r in results[arm])
                print(f"  {arm} sched per round: {per_round}")
            print(
                "  timing wrapper cost subtracted: "
                f"{results['after'][0]['overhead_ns']:.0f} ns/call"
            )
    write_json(args.json, "sched", vars(args), out)


if __name__ == "__main__":
    main()
