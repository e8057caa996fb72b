"""The benchmarks' one harness: fresh interpreters per arm, rotated rounds, medians, JSON.

The benchmarks under ``scripts/`` that compare arms in separate processes build on this
module (``prime-r3 bench NAME`` prints ``header_line`` before any benchmark runs):

* ``run_child``: one arm in a fresh interpreter, with a given checkout (or a ``git
  archive`` of a revision, ``export_revision``) and optionally a patched vLLM tree first
  on ``PYTHONPATH``; the child prints one JSON row, and the row must say it imported the
  prime_r3 and the vLLM it was meant to (else the arm measured other code).
* ``rotated``: round k runs the arms rotated by k, so no arm always runs first or last
  (in one fixed order the last arm ran ~12% slow in every column on this machine).
* ``medians`` / ``print_per_round``: medians over rounds, and per-round ratios of arms
  that ran back to back (drift between rounds cancels in those).
* ``header`` / ``write_json``: every result names the vLLM release, Python, the prime_r3
  commit, the date and the machine's cores; ``--json PATH`` writes it with the rows.

The module lives beside the scripts, not in the ``prime_r3`` package: an arm of another
revision imports *that* revision's prime_r3, which may not have it.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ("aux_ms", "aux_begin_ms", "aux_prepare_ms", "aux_process_ms")


def bench_arm(
    n: int, steps: int, warmup: int, columns: tuple[str, ...] = COLUMNS, r3: bool = True
) -> dict[str, Any]:
    """One arm in this (fresh) interpreter: the bench's steady-window summary's
    ``columns``; the prime arm, or with ``r3=False`` the bench's ``r3_off``
    (``PRIME_R3=0``)."""
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


def rotated(arms: Sequence[str], round_: int) -> list[str]:
    """The arms in round ``round_``'s order: rotated by the round's index."""
    k = round_ % len(arms)
    return [*arms[k:], *arms[:k]]


def medians(rows: Iterable[dict[str, Any]], columns: Iterable[str]) -> dict[str, float]:
    """Each column's median over ``rows`` (one row per round)."""
    rows = list(rows)
    return {c: statistics.median(r[c] for r in rows) for c in columns}


def print_per_round(label: str, ratios: list[float]) -> None:
    """One line: each round's ratio (its arms ran back to back) and their median."""
    rounds = " ".join(f"{x:.3f}" for x in ratios)
    print(f"  {label} per round: {rounds}   median {statistics.median(ratios):.3f}")


def print_applied(arms: Sequence[str], results: dict[str, list[dict[str, Any]]]) -> None:
    """Each arm's applied patches (every distinct list its rounds reported), so it is
    plain which code ran."""
    for arm in arms:
        applied = {tuple(r["applied"]) for r in results[arm]}
        print(f"  {arm} applied: " + " | ".join(", ".join(a) or "(none)" for a in applied))


def run_child(
    script: str,
    argv: list[str],
    path: str,
    arm: str,
    vllm_tree: str | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``script argv`` in a fresh interpreter with ``path`` first on ``PYTHONPATH``
    (and as its working directory); its last stdout line is a JSON row whose
    ``package`` must be ``path``'s prime_r3 (else the arm measured another version).
    With ``vllm_tree`` (a directory holding a ``vllm/`` package, e.g. one built by
    ``scripts/patches.py apply --out``) that tree goes first, and the row's ``vllm``
    must be its package; without it, the row's ``vllm`` must be the installed one.
    ``env`` is set over this environment for that arm only."""
    out = subprocess.run(
        [sys.executable, script, *argv],
        check=True,
        capture_output=True,
        text=True,
        env={**child_env(path, vllm_tree), **(env or {})},
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
    if vllm_tree is None and found.parent != Path(installed_vllm()).parent:
        raise RuntimeError(f"{arm} arm imported vllm from {found}, not the installed one")


def installed_vllm() -> str:
    """Where this interpreter's own ``vllm`` package is (without importing it)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None, "vllm is not installed"
    return str(Path(spec.origin).parent.absolute())


def export_revision(ref: str, into: str, path: str = "prime_r3") -> None:
    """``path`` (``prime_r3/`` by default) as of git revision ``ref`` into ``into``."""
    Path(into).mkdir(parents=True, exist_ok=True)
    archive = Path(into) / "src.tar"
    with archive.open("wb") as handle:
        subprocess.run(["git", "-C", str(ROOT), "archive", ref, path], check=True, stdout=handle)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")


def _commit() -> str:
    """This checkout's commit, ``+dirty`` when the working tree differs from it."""

    def git(*args: str) -> str:
        run = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
        run.check_returncode()
        return run.stdout.strip()

    try:
        rev = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")


def header() -> dict[str, Any]:
    """What every result is stamped with: the vLLM release, Python, prime_r3's commit,
    the date (UTC) and the machine's cores (read from metadata: no vLLM import)."""
    try:
        release = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        release = None
    return {
        "vllm": release,
        "python": platform.python_version(),
        "prime_r3": _commit(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(),
    }


def header_line(title: str, stamp: dict[str, Any] | None = None) -> str:
    """``title`` and the header, one line (what each benchmark prints first)."""
    h = header() if stamp is None else stamp
    return (
        f"{title}: vLLM {h['vllm']}, Python {h['python']}, prime_r3 {h['prime_r3']}, "
        f"{h['date']}, {h['cpus']} cores"
    )


def write_json(path: str | None, benchmark: str, args: dict[str, Any], data: Any) -> None:
    """With ``path`` (``-``: stdout), write ``{"header", "benchmark", "args", "data"}``."""
    if not path:
        return
    text = json.dumps(
        {"header": header(), "benchmark": benchmark, "args": args, "data": data}, indent=2
    )
    if path == "-":
        print(text)
    else:
        Path(path).write_text(text + "\n")
