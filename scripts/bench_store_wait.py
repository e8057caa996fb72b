"""How long the output worker waits for the store writer when a step emits from the store.

    .venv/bin/python scripts/bench_store_wait.py [-n 400,1000] [--rounds 3] [--steps 250]
                                                 [--warmup 150] [--tree]

A request whose prompt hit the prefix cache gets its first rows from the aux-output
store (``materialize_routed_experts`` -> ``BackgroundBlockObjectStore.get_concatenated``),
and ``get_concatenated`` first joins the writer's queue: it waits until every put
enqueued so far, the current step's publication included, is in the store. That wait
is wall time, not CPU, so ``prime-r3 bench``'s ``cpu ms`` (issue 10's measure) does not
show it; but it holds up the step's output on the output worker, where the engine waits
for it. prime_r3 keeps the join (it is what makes the read see exactly upstream's
store: the writer mutates the LRU and evicts, so a read beside it could differ).

Arms, each a fresh interpreter running the bench's real engine loop
(``prime_r3.bench.loop.run``, same workload and seed, no parity hashing), order rotated
per round:

* ``upstream``: R3 on, no patch (``PRIME_R3=0``, the bench's ``r3_upstream``);
* ``prime``: R3 on with every patch this release takes (``r3_prime``);
* ``tree`` (with ``--tree``): this checkout's upstream-form diffs (``patches/``) applied
  to the installed vLLM (``scripts/patches.py apply`` into a temporary directory).

In each, ``BackgroundBlockObjectStore.get_concatenated`` (upstream's, the only reader of
the store on this path) is timed around its call, after ``prime_r3.apply()`` (its guards
never see the timer), in wall and thread-CPU time. Printed per N: medians over rounds of
the per-step means (ms) of the wait (wall - CPU inside the call), the call's wall time,
its calls per step, the step's wall time and engine CPU; then each arm's wait over
upstream's, per round and as the median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import (  # noqa: E402 - the benchmarks' harness
    ROOT,
    applied_patches,
    medians,
    print_applied,
    print_per_round,
    rotated,
    run_child,
    write_json,
)

import patches as upstream_diffs  # noqa: E402 - scripts/patches.py

COLUMNS = ("wait_ms", "read_wall_ms", "reads_per_step", "wall_ms", "engine_cpu_ms")


def _arm(n: int, steps: int, warmup: int, patched: bool) -> dict[str, Any]:
    """One arm in this (fresh) interpreter; the timer counts steady-window steps only."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if not patched:
        os.environ["PRIME_R3"] = "0"
    import prime_r3

    prime_r3.apply(log=False)
    import vllm
    from vllm.distributed.aux_output_connector.store import BackgroundBlockObjectStore

    from prime_r3.bench import loop, report
    from prime_r3.bench.workload import BenchConfig

    totals = {"wall": 0, "cpu": 0, "calls": 0}
    window = {"on": False}
    read = BackgroundBlockObjectStore.get_concatenated

    def timed(self: Any, keys: list[str]) -> bytes:
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        try:
            return read(self, keys)
        finally:
            if window["on"]:
                totals["wall"] += time.perf_counter_ns() - wall
                totals["cpu"] += time.thread_time_ns() - cpu
                totals["calls"] += 1

    step = loop.Simulator.step
    count = {"steps": 0}

    def counted(self: Any) -> dict[str, float]:
        count["steps"] += 1
        window["on"] = count["steps"] > warmup
        return step(self)

    BackgroundBlockObjectStore.get_concatenated = timed  # type: ignore[method-assign]
    loop.Simulator.step = counted  # type: ignore[method-assign]
    cfg = BenchConfig(concurrency=n, steps=steps, warmup=warmup, parity=False)
    try:
        result = loop.run(cfg, True)
    finally:
        BackgroundBlockObjectStore.get_concatenated = read  # type: ignore[method-assign]
        loop.Simulator.step = step  # type: ignore[method-assign]
    if result["error"]:
        raise RuntimeError(result["error"])
    summary = report.summarize(result, cfg)
    measured = max(count["steps"] - warmup, 1)
    return {
        "wait_ms": (totals["wall"] - totals["cpu"]) / 1e6 / measured,
        "read_wall_ms": totals["wall"] / 1e6 / measured,
        "reads_per_step": totals["calls"] / measured,
        "wall_ms": summary["wall_ms"],
        "engine_cpu_ms": summary["engine_cpu_ms"],
        "package": str(Path(prime_r3.__file__).resolve().parent),
        "vllm": str(Path(vllm.__file__).parent.absolute()),
        "applied": applied_patches(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", default="400,1000", help="comma list of concurrencies")
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--warmup", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", action="store_true", help="add the upstream-form diffs' arm")
    parser.add_argument(
        "--json", metavar="PATH", help="write header, rows and medians ('-': stdout)"
    )
    parser.add_argument("--arm", choices=("upstream", "prime"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        row = _arm(int(args.n), args.steps, args.warmup, patched=args.arm == "prime")
        print(json.dumps(row))
        return
    arms = ("upstream", "prime", *(("tree",) * args.tree))
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="prime_r3_store_wait_") as tmp:
        tree = None
        if args.tree:
            site, release = upstream_diffs.installed_site(), upstream_diffs.installed_release()
            tree = str(upstream_diffs.apply(site, release, Path(tmp) / "tree"))
            print(f"tree: vLLM {release} + patches/vllm-{release}/", flush=True)
        for n in [int(x) for x in args.n.split(",")]:
            results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
            for round_ in range(args.rounds):
                for arm in rotated(arms, round_):
                    argv = ["--arm", "upstream" if arm == "upstream" else "prime", "-n", str(n)]
                    argv += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
                    row = run_child(__file__, argv, str(ROOT), arm, tree if arm == "tree" else None)
                    results[arm].append(row)
                    print(f"  N={n} round {round_ + 1} {arm}: wait {row['wait_ms']:.3f} ms/step")
            _print(n, args, arms, results)
            out[str(n)] = {
                "rounds": results,
                "medians": {arm: medians(results[arm], COLUMNS) for arm in arms},
            }
    write_json(args.json, "store-wait", vars(args), out)


def _print(
    n: int, args: argparse.Namespace, arms: tuple[str, ...], results: dict[str, list[dict]]
) -> None:
    print(
        f"N={n}: medians of {args.rounds} rounds (rotating order), {args.steps} steps after "
        f"{args.warmup}, per step; wait = wall - thread CPU inside get_concatenated"
    )
    print(f"{'arm':>9} " + " ".join(f"{c:>15}" for c in COLUMNS))
    for arm in arms:
        row = " ".join(f"{statistics.median(r[c] for r in results[arm]):>15.3f}" for c in COLUMNS)
        print(f"{arm:>9} {row}")
    for arm in arms[1:]:
        ratios = [
            a["wait_ms"] / b["wait_ms"] if b["wait_ms"] else float("nan")
            for a, b in zip(results[arm], results["upstream"], strict=True)
        ]
        print_per_round(f"{arm}/upstream wait", ratios)
    print_applied(arms, results)


if __name__ == "__main__":
    main()
