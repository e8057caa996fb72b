"""The worker-side R3 cost (``prime-r3 bench``'s ``aux`` column) of two prime_r3 versions.

    .venv/bin/python scripts/bench_aux_ab.py --before REF [-n 400,1000] [--rounds 5]
                                             [--steps 200] [--warmup 100]

Issue 10 asks for ``aux`` <= 0.35 ms per step at N=400. A change to the worker's fast
paths is judged against the version before it on the same machine in the same run:
this machine's cores are shared, and load drifts by tens of percent within minutes,
so figures from separate runs do not compare.

Arms, each a fresh interpreter running the bench's real engine loop
(``prime_r3.bench.loop.run``, R3 on, every patch this release takes, as the prime arm
of ``prime-r3 bench``; same workload and seed):

* ``before``: the prime_r3 package of git revision ``--before`` (``git archive`` into a
  temporary directory put first on ``PYTHONPATH``; the child checks which one it
  imported).
* ``after``: this checkout's working tree.

Rounds alternate the order (A B, B A, ...) so drift hits both arms alike. Printed per
N: medians over rounds of ``aux`` and its parts (``begin_step``, ``prepare_output``,
``process_output``, main-thread CPU per step, ms) per arm, after / before of the
medians, the median of each round's after / before (its two runs were back to back),
and each round's ``aux``. A part neither version changes is the noise control.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ("aux_ms", "aux_begin_ms", "aux_prepare_ms", "aux_process_ms")


def _arm(
    n: int, steps: int, warmup: int, columns: tuple[str, ...] = COLUMNS, r3: bool = True
) -> dict[str, Any]:
    """One arm in this (fresh) interpreter: the bench's steady-window summary's
    ``columns``; the prime arm, or with ``r3=False`` the bench's ``r3_off``
    (``PRIME_R3=0``). Also used by ``bench_step_ab.py``."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if not r3:
        os.environ["PRIME_R3"] = "0"
    import prime_r3

    prime_r3.apply(log=False)
    from prime_r3.bench import loop, report
    from prime_r3.bench.workload import BenchConfig

    cfg = BenchConfig(concurrency=n, steps=steps, warmup=warmup, parity=False)
    result = loop.run(cfg, r3)
    if result["error"]:
        raise RuntimeError(result["error"])
    summary = report.summarize(result, cfg)
    out = {name: summary[name] for name in columns}
    out["package"] = str(Path(prime_r3.__file__).resolve().parent)
    import vllm

    out["vllm"] = str(Path(vllm.__file__).parent.absolute())
    out["applied"] = applied_patches()
    return out


def applied_patches() -> list[str]:
    """The patches this process runs; one still waiting for a module the bench never
    imports (engine_gc's server and GPU worker halves) is listed with its state, as it
    ran in part."""
    import prime_r3

    return [
        o.name if o.state in ("applied", "already_applied") else f"{o.name} ({o.state})"
        for o in prime_r3.status().outcomes
        if o.state in ("applied", "already_applied", "pending_import")
    ]


def print_per_round(label: str, ratios: list[float]) -> None:
    """One line: each round's ratio (its arms ran back to back) and their median."""
    rounds = " ".join(f"{x:.3f}" for x in ratios)
    print(f"  {label} per round: {rounds}   median {statistics.median(ratios):.3f}")


def print_applied(arms: tuple[str, ...], results: dict[str, list[dict[str, Any]]]) -> None:
    """Each arm's applied patches (every distinct list its rounds reported), so it is
    plain which code ran."""
    for arm in arms:
        applied = {tuple(r["applied"]) for r in results[arm]}
        print(f"  {arm} applied: " + " | ".join(", ".join(a) or "(none)" for a in applied))


def _child(
    script: str, argv: list[str], path: str, arm: str, vllm_tree: str | None = None
) -> dict[str, Any]:
    """Run ``script argv`` in a fresh interpreter with ``path`` first on ``PYTHONPATH``
    (and as its working directory); its last stdout line is a JSON row whose
    ``package`` must be ``path``'s prime_r3 (else the arm measured another version).
    With ``vllm_tree`` (a directory holding a ``vllm/`` package, e.g. one built by
    ``scripts/patches.py apply --out``) that tree goes first, and the row's ``vllm``
    must be its package; without it, the row's ``vllm`` must be the installed one."""
    out = subprocess.run(
        [sys.executable, script, *argv],
        check=True,
        capture_output=True,
        text=True,
        env=child_env(path, vllm_tree),
        cwd=path,
    ).stdout
    row = json.loads(out.strip().splitlines()[-1])
    expected = Path(path).resolve() / "prime_r3"
    if Path(row["package"]) != expected:
        raise RuntimeError(f"{arm} arm imported {row['package']}, not {expected}")
    check_vllm(arm, row["vllm"], vllm_tree)
    return row


def child_env(path: str, vllm_tree: str | None = None) -> dict[str, str]:
    """This environment with ``path`` (and before it ``vllm_tree``, if any) first on
    ``PYTHONPATH``: what an arm's fresh interpreter imports prime_r3 and vllm from."""
    env = dict(os.environ)
    front = [vllm_tree, path] if vllm_tree else [path]
    env["PYTHONPATH"] = os.pathsep.join([*front, *filter(None, [env.get("PYTHONPATH")])])
    return env


def check_vllm(arm: str, vllm: str, vllm_tree: str | None) -> None:
    """Raise unless an arm's ``vllm`` package is ``vllm_tree``'s (when given) or else
    this interpreter's installed one: an arm that imported another measured nothing."""
    found = Path(vllm)
    if vllm_tree is not None and found != Path(vllm_tree).absolute() / "vllm":
        raise RuntimeError(f"{arm} arm imported vllm from {found}, not the tree {vllm_tree}")
    if vllm_tree is None and found.parent != Path(_installed_vllm()).parent:
        raise RuntimeError(f"{arm} arm imported vllm from {found}, not the installed one")


def _installed_vllm() -> str:
    """Where this interpreter's own ``vllm`` package is (without importing it)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None, "vllm is not installed"
    return str(Path(spec.origin).parent.absolute())


def _export(ref: str, into: str, path: str = "prime_r3") -> None:
    """``path`` (``prime_r3/`` by default) as of ``ref`` into ``into``."""
    Path(into).mkdir(parents=True, exist_ok=True)
    archive = Path(into) / "src.tar"
    with archive.open("wb") as handle:
        subprocess.run(["git", "-C", str(ROOT), "archive", ref, path], check=True, stdout=handle)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="git revision of the 'before' arm")
    parser.add_argument("-n", default="400", help="comma list of concurrencies")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--arm", action="store_true", help=argparse.SUPPRESS)  # internal
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(_arm(int(args.n), args.steps, args.warmup)))
        return
    with tempfile.TemporaryDirectory(prefix="prime_r3_before_") as before_dir:
        _export(args.before, before_dir)
        paths = {"before": before_dir, "after": str(ROOT)}
        for n in [int(x) for x in args.n.split(",")]:
            results: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
            for round_ in range(args.rounds):
                order = ("before", "after") if round_ % 2 == 0 else ("after", "before")
                for arm in order:
                    argv = ["--arm", "-n", str(n), "--before", "-", "--steps", str(args.steps)]
                    argv += ["--warmup", str(args.warmup)]
                    results[arm].append(_child(__file__, argv, paths[arm], arm))
            print(
                f"N={n}: medians of {args.rounds} rounds (alternating order), "
                f"{args.steps} steps after {args.warmup}; before = {args.before}"
            )
            print(f"{'arm':>8} " + " ".join(f"{c[:-3]:>12}" for c in COLUMNS))
            med = {
                arm: {c: statistics.median(r[c] for r in results[arm]) for c in COLUMNS}
                for arm in results
            }
            for arm in ("before", "after"):
                print(f"{arm:>8} " + " ".join(f"{med[arm][c]:>12.3f}" for c in COLUMNS))
            ratio = " ".join(f"{med['after'][c] / med['before'][c]:>12.3f}" for c in COLUMNS)
            print(f"{'after/b':>8} {ratio}")
            # Each round's two runs ran back to back: their ratio cancels slower drift.
            pairs = list(zip(results["after"], results["before"], strict=True))
            paired = " ".join(
                f"{statistics.median(a[c] / b[c] for a, b in pairs):>12.3f}" for c in COLUMNS
            )
            print(f"{'paired':>8} {paired}   (median of per-round after/before)")
            for arm in ("before", "after"):
                rounds = " ".join(f"{r['aux_ms']:.3f}" for r in results[arm])
                print(f"  {arm} aux per round: {rounds}")


if __name__ == "__main__":
    main()
