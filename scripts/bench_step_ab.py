"""R3's whole engine-step cost with two prime_r3 versions, against R3 off, in one run.

    .venv/bin/python scripts/bench_step_ab.py --before REF [-n 400,1000] [--rounds 5]
                                              [--steps 250] [--warmup 150]

Issue 10's first target is the engine CPU per step with R3 on and prime_r3 against R3
off (``prime-r3 bench``'s ``x off``). ``prime-r3 bench`` measures one version; a change
is judged here against the version before it, with R3 off measured in the same rounds,
because this machine's load moves every arm by tens of percent within minutes.

Arms, each a fresh interpreter running the bench's real engine loop
(``prime_r3.bench.loop.run``, same workload and seed, no parity hashing) and summarised
by the bench's own ``report.summarize``:

* ``off``: R3 off (``PRIME_R3=0``, the bench's ``r3_off``), this checkout;
* ``before``: R3 on with every patch the release takes, the prime_r3 package of git
  revision ``--before`` (``git archive`` into a temporary directory first on
  ``PYTHONPATH``, as ``bench_aux_ab.py`` does; the child reports which one it imported);
* ``after``: the same with this checkout's working tree.

Round k runs the three arms rotated by k, so no arm always runs first or last.
Printed per N: medians over rounds of ``engine_cpu_ms`` (the bench's ``cpu ms``) and its
``sched`` / ``aux`` / ``transp`` / ``writer`` parts per arm, then per round and as their
median: before/off, after/off and after/before (each round's arms ran back to back).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_aux_ab import ROOT, _arm, _child, _export  # noqa: E402 - shared with it

COLUMNS = ("engine_cpu_ms", "sched_ms", "aux_ms", "transport_ms", "writer_ms")
ARMS = ("off", "before", "after")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="git revision of the 'before' arm")
    parser.add_argument("-n", default="400", help="comma list of concurrencies")
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--warmup", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--arm", choices=("off", "on"), help=argparse.SUPPRESS)  # internal
    args = parser.parse_args()
    if args.arm:
        row = _arm(int(args.n), args.steps, args.warmup, COLUMNS, r3=args.arm == "on")
        print(json.dumps(row))
        return
    with tempfile.TemporaryDirectory(prefix="prime_r3_before_") as before_dir:
        _export(args.before, before_dir)
        paths = {"off": str(ROOT), "before": before_dir, "after": str(ROOT)}
        for n in [int(x) for x in args.n.split(",")]:
            results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
            for round_ in range(args.rounds):
                k = round_ % len(ARMS)
                for arm in ARMS[k:] + ARMS[:k]:
                    argv = ["--arm", "off" if arm == "off" else "on", "-n", str(n)]
                    argv += ["--before", "-", "--steps", str(args.steps)]
                    argv += ["--warmup", str(args.warmup)]
                    row = _child(__file__, argv, paths[arm], arm)
                    results[arm].append(row)
                    print(
                        f"  N={n} round {round_ + 1} {arm}: {row['engine_cpu_ms']:.3f} ms",
                        flush=True,
                    )
            _print(n, args, results)


def _print(n: int, args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> None:
    print(
        f"N={n}: medians of {args.rounds} rounds (rotating order), {args.steps} steps after "
        f"{args.warmup}, ms per step; before = {args.before}, after = this checkout"
    )
    print(f"{'arm':>8} " + " ".join(f"{c[:-3]:>12}" for c in COLUMNS))
    for arm in ARMS:
        row = " ".join(f"{statistics.median(r[c] for r in results[arm]):>12.3f}" for c in COLUMNS)
        print(f"{arm:>8} {row}")
    for top, bottom in (("before", "off"), ("after", "off"), ("after", "before")):
        ratios = [
            a["engine_cpu_ms"] / b["engine_cpu_ms"]
            for a, b in zip(results[top], results[bottom], strict=True)
        ]
        rounds = " ".join(f"{x:.3f}" for x in ratios)
        print(f"  {top}/{bottom} per round: {rounds}   median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
