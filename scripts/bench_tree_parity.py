"""Rows parity of the upstream-form diffs on the bench's workload: ``patches/`` vs upstream.

    .venv/bin/python scripts/bench_tree_parity.py [-n 400] [--steps 400] [--warmup 150]

``prime-r3 bench``'s parity line compares each arm with ``r3_upstream`` in one process,
so it cannot hold the installed vLLM and a patched copy side by side. This runs the
bench's real engine loop (``prime_r3.bench.loop.run``, R3 on, same workload and seed,
row hashing on) twice, each in a fresh interpreter with ``PRIME_R3=0`` (no overlay):

* ``upstream``: the installed vLLM, as it ships;
* ``diffs``: a copy of it with this checkout's whole series applied
  (``scripts/patches.py``'s ``apply`` into a temporary directory first on
  ``PYTHONPATH``); the child checks which ``vllm`` it imported.

and compares every request's rows with the bench's own ``parity.compare`` (finished
requests whole, requests in flight on the rows received so far; it raises on the first
difference). Printed like the bench's parity line, with preempted and prefix-hit
requests counted, so it is plain the window went through both.

The diffs carry no counters (upstream code has none), so the ``diffs`` child counts
where 06-batched_commit's commits went, with pass-through wrappers around two of the
patched worker's methods: every request ``_commit_output`` commits, and those a run of
plain decodes took (``_commit_decodes``, the array path); the rest ran upstream's loop
body (first captures, prompts, rejected suffixes, rewinds, emits from the store, ...).
Counted over the whole run, warm-up included.
"""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import check_vllm, child_env, write_json  # noqa: E402 - the harness

import patches as upstream_diffs  # noqa: E402 - scripts/patches.py

ROOT = Path(__file__).resolve().parent.parent


def _child(n: int, steps: int, warmup: int, out: str) -> None:
    """One run in this (fresh) interpreter; its digests pickled to ``out``."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ["PRIME_R3"] = "0"
    import vllm

    from prime_r3.bench import arms, loop
    from prime_r3.bench.workload import BenchConfig

    arms._settle_imports()
    counts = _count_commits() if hasattr(_worker_class(), "_commit_decodes") else None
    result = loop.run(BenchConfig(concurrency=n, steps=steps, warmup=warmup), True)
    if result["error"]:
        raise RuntimeError(result["error"])
    keep = {k: result[k] for k in ("digests", "in_flight", "flags")}
    keep["vllm"] = str(Path(vllm.__file__).parent.absolute())
    keep["commits"] = counts
    with open(out, "wb") as handle:
        pickle.dump(keep, handle)


def _worker_class() -> Any:
    from vllm.distributed.aux_output_connector import worker

    return worker.AuxOutputWorkerConnector


def _count_commits() -> dict[str, int]:
    """Count the requests the patched worker commits, and those on its array path."""
    cls = _worker_class()
    counts = {"requests": 0, "array_path": 0, "steps": 0}
    commit_output, commit_decodes = cls._commit_output, cls._commit_decodes

    def counted_output(self: Any, pending: Any) -> Any:
        counts["steps"] += 1
        counts["requests"] += len(pending.request_ids)
        return commit_output(self, pending)

    def counted_decodes(
        self: Any, pending: Any, experts: Any, begin: int, end: int, *a: Any
    ) -> Any:
        counts["array_path"] += end - begin
        return commit_decodes(self, pending, experts, begin, end, *a)

    cls._commit_output, cls._commit_decodes = counted_output, counted_decodes
    return counts


def _run(args: argparse.Namespace, arm: str, out: str, tree: str | None) -> dict[str, Any]:
    argv = ["--child", out, "-n", str(args.n), "--steps", str(args.steps)]
    argv += ["--warmup", str(args.warmup)]
    env = child_env(str(ROOT), tree)
    subprocess.run([sys.executable, __file__, *argv], check=True, env=env, cwd=ROOT)
    with open(out, "rb") as handle:
        result = pickle.load(handle)
    check_vllm(arm, result["vllm"], tree)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=400, help="concurrency")
    parser.add_argument("--steps", type=int, default=400, help="measured steps")
    parser.add_argument("--warmup", type=int, default=150, help="steps before the window")
    parser.add_argument("--json", metavar="PATH", help="write header and the parity result")
    parser.add_argument("--child", metavar="OUT", help=argparse.SUPPRESS)  # internal
    args = parser.parse_args()
    if args.child:
        _child(args.n, args.steps, args.warmup, args.child)
        return
    from prime_r3.bench import parity

    site, release = upstream_diffs.installed_site(), upstream_diffs.installed_release()
    diffs = [d.path.name for d in upstream_diffs.series(release)]
    with tempfile.TemporaryDirectory(prefix="prime_r3_tree_parity_") as tmp:
        tree = str(upstream_diffs.apply(site, release, Path(tmp) / "tree"))
        upstream = _run(args, "upstream", str(Path(tmp) / "upstream.pickle"), None)
        patched = _run(args, "diffs", str(Path(tmp) / "diffs.pickle"), tree)
    found = parity.compare(upstream, patched, ("upstream", "diffs"))
    print(f"vLLM {release}, N={args.n}, {args.steps} steps after {args.warmup}")
    print(f"diffs: {', '.join(diffs)}")
    print(
        f"parity diffs vs upstream: {found['finished_requests']} finished + "
        f"{found['in_flight_requests']} in flight / {found['rows']} rows identical "
        f"({found['preempted_requests']} preempted, {found['prefix_hit_requests']} prefix-hit)"
    )
    commits = patched["commits"]
    write_json(args.json, "tree-parity", vars(args), {"parity": found, "commits": commits})
    if commits is not None:
        loop_body = commits["requests"] - commits["array_path"]
        print(
            f"06 commits over {commits['steps']} steps: {commits['requests']} requests, "
            f"{commits['array_path']} on the array path, {loop_body} through upstream's "
            f"loop body ({loop_body / max(commits['requests'], 1):.2%})"
        )


if __name__ == "__main__":
    main()
