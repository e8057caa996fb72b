"""R3's whole engine-step cost with two prime_r3 versions, or with the upstream-form diffs,
against R3 off, in one run.

    .venv/bin/python scripts/bench_step_ab.py [--before REF] [--tree] [--tree-before REF]
                                              [-n 400,1000] [--rounds 5] [--steps 250]
                                              [--warmup 150]

Issue 10's first target is the engine CPU per step with R3 on and prime_r3 against R3
off (``prime-r3 bench``'s ``x off``). ``prime-r3 bench`` measures one version; a change
is judged here against the version before it, with R3 off measured in the same rounds,
because this machine's load moves every arm by tens of percent within minutes.

Arms, each a fresh interpreter running the bench's real engine loop
(``prime_r3.bench.loop.run``, same workload and seed, no parity hashing) and summarised
by the bench's own ``report.summarize``:

* ``off``: R3 off (``PRIME_R3=0``, the bench's ``r3_off``), this checkout;
* ``before`` (with ``--before REF``): R3 on with every patch the release takes, the
  prime_r3 package of git revision REF (``git archive`` into a temporary directory first
  on ``PYTHONPATH``; the child reports which one it imported);
* ``after``: the same with this checkout's working tree;
* ``tree`` (with ``--tree``): this checkout's overlay on a vLLM patched with this
  checkout's upstream-form diffs (``patches/``, built once per run by
  ``scripts/patches.py``'s ``apply`` into a temporary directory put first on
  ``PYTHONPATH``). The overlay still applies every patch whose targets the diffs left
  unchanged; one whose upstream the diffs rewrote is skipped by its own guards. Each
  arm's applied patches are printed, so it is plain which code ran.
* ``tree_before`` (with ``--tree-before REF``): the same, on a vLLM patched with the
  diffs of git revision REF (its ``patches/``, exported with ``git archive`` and applied by this
  checkout's ``scripts/patches.py``), so a change to the diffs is judged against the
  diffs before it in the same rounds (``tree/tree_before``).

Round k runs the arms rotated by k, so no arm always runs first or last. Printed per
N: medians over rounds of ``engine_cpu_ms`` (the bench's ``cpu ms``) and its ``sched`` /
``aux`` (and its ``begin`` / ``prepare`` / ``process`` parts) / ``transp`` / ``writer``
per arm, then per round and as their median: each R3 arm over off, after/before and
tree/after (each round's arms ran back to back), and with ``--before`` the median of
per-round after/before of every column (``aux`` and its parts: a part neither version
changes is the noise control; this replaces the former ``bench_aux_ab.py``).
``--json PATH`` writes the header, every round's rows and the medians.
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
from benchkit import (  # noqa: E402 - the benchmarks' harness
    ROOT,
    bench_arm,
    export_revision,
    medians,
    print_applied,
    print_per_round,
    rotated,
    run_child,
    write_json,
)

import patches as upstream_diffs  # noqa: E402 - scripts/patches.py

COLUMNS = (
    "engine_cpu_ms",
    "sched_ms",
    "aux_ms",
    "aux_begin_ms",
    "aux_prepare_ms",
    "aux_process_ms",
    "transport_ms",
    "writer_ms",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="git revision of the 'before' arm")
    parser.add_argument(
        "--tree", action="store_true", help="add the 'tree' arm (vLLM patched with patches/)"
    )
    parser.add_argument(
        "--tree-before",
        metavar="REF",
        help="add the 'tree_before' arm (vLLM patched with REF's patches/); implies --tree",
    )
    parser.add_argument("-n", default="400", help="comma list of concurrencies")
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--warmup", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--json", metavar="PATH", help="write header, rows and medians ('-': stdout)"
    )
    parser.add_argument("--arm", choices=("off", "on"), help=argparse.SUPPRESS)  # internal
    args = parser.parse_args()
    if args.arm:
        row = bench_arm(int(args.n), args.steps, args.warmup, COLUMNS, r3=args.arm == "on")
        print(json.dumps(row))
        return
    args.tree = args.tree or bool(args.tree_before)
    if not args.before and not args.tree:
        parser.error("give --before REF, --tree, or both (the arms to compare with 'after')")
    arms = (
        "off",
        *(("before",) if args.before else ()),
        "after",
        *(("tree",) * args.tree),
        *(("tree_before",) if args.tree_before else ()),
    )
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="prime_r3_step_ab_") as tmp:
        paths = dict.fromkeys(("off", "after", "tree", "tree_before"), str(ROOT))
        trees: dict[str, str | None] = dict.fromkeys(arms)
        if args.before:
            paths["before"] = str(Path(tmp) / "before")
            export_revision(args.before, paths["before"])
        if args.tree:
            site, release = upstream_diffs.installed_site(), upstream_diffs.installed_release()
            diffs = [d.path.name for d in upstream_diffs.series(release)]
            trees["tree"] = str(upstream_diffs.apply(site, release, Path(tmp) / "tree"))
            print(f"tree: vLLM {release} + {', '.join(diffs)}", flush=True)
        if args.tree_before:
            export_revision(args.tree_before, str(Path(tmp) / "before_patches"), "patches")
            old = Path(tmp) / "before_patches" / "patches"
            diffs = [d.path.name for d in upstream_diffs.series(release, old)]
            out = Path(tmp) / "tree_before"
            trees["tree_before"] = str(upstream_diffs.apply(site, release, out, old))
            print(f"tree_before: vLLM {release} + {args.tree_before}'s {', '.join(diffs)}")
        for n in [int(x) for x in args.n.split(",")]:
            results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
            for round_ in range(args.rounds):
                for arm in rotated(arms, round_):
                    argv = ["--arm", "off" if arm == "off" else "on", "-n", str(n)]
                    argv += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
                    row = run_child(__file__, argv, paths[arm], arm, trees[arm])
                    results[arm].append(row)
                    print(
                        f"  N={n} round {round_ + 1} {arm}: {row['engine_cpu_ms']:.3f} ms",
                        flush=True,
                    )
            _print(n, args, arms, results)
            out[str(n)] = {
                "rounds": results,
                "medians": {arm: medians(results[arm], COLUMNS) for arm in arms},
            }
    write_json(args.json, "step-ab", vars(args), out)


def _print(
    n: int, args: argparse.Namespace, arms: tuple[str, ...], results: dict[str, list[dict]]
) -> None:
    print(
        f"N={n}: medians of {args.rounds} rounds (rotating order), {args.steps} steps after "
        f"{args.warmup}, ms per step; after = this checkout"
        + (f", before = {args.before}" if args.before else "")
        + (", tree = after on vLLM + patches/" if args.tree else "")
        + (f", tree_before = after on {args.tree_before}'s patches/" if args.tree_before else "")
    )
    print(f"{'arm':>11} " + " ".join(f"{c[:-3]:>12}" for c in COLUMNS))
    for arm in arms:
        row = " ".join(f"{statistics.median(r[c] for r in results[arm]):>12.3f}" for c in COLUMNS)
        print(f"{arm:>11} {row}")
    pairs = [(arm, "off") for arm in arms if arm != "off"]
    pairs += [
        (top, bottom)
        for top, bottom in (("after", "before"), ("tree", "after"), ("tree", "tree_before"))
    ]
    for top, bottom in pairs:
        if top not in results or bottom not in results:
            continue
        ratios = [
            a["engine_cpu_ms"] / b["engine_cpu_ms"]
            for a, b in zip(results[top], results[bottom], strict=True)
        ]
        print_per_round(f"{top}/{bottom}", ratios)
    if "before" in results:
        pairs = list(zip(results["after"], results["before"], strict=True))
        paired = " ".join(
            f"{statistics.median(a[c] / b[c] for a, b in pairs):>12.3f}" for c in COLUMNS
        )
        print(f"{'paired a/b':>11} {paired}   (median of per-round after/before)")
    print_applied(arms, results)


if __name__ == "__main__":
    main()
