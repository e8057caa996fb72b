"""EngineCore's build_connector_meta per step: upstream vs batched_meta, same steps.

    .venv/bin/python scripts/bench_meta.py [-n 400,1000] [--steps 60] [--rounds 5]

The bench's simulator (vLLM's real Scheduler, scheduler and worker connectors, only
the model simulated; prefix caching, chunked prefill, a KV cache that preempts) runs
``-n`` concurrent requests until every request has been prefilled, then for
``--steps`` steps intercepts the scheduler's ``build_connector_meta`` call: on that
step's real ``scheduler_output`` and requests, each arm runs ``--rounds`` times (arms
interleaved), each time on a fresh copy of the connector's state, timed as thread CPU
time; the simulation itself then continues with upstream's call on the real
connector, so both arms see the same steps. Printed: per arm the median over steps of
the per-step median over rounds, the ratio, and how many requests per step
batched_meta's pass took and how many went to upstream's code (by reason). ``--before
FILE`` adds another batched_meta.py's wrapper as an arm, called directly (the
``batched_meta`` arm goes through the layer: with FILE the current file, that alone
made the layer arm 3-11% slower here).

That measure runs each call on hot caches (the same step ``--rounds`` times). Between
engine steps the requests' objects are cold, and the cost is touching them, so

    .venv/bin/python scripts/bench_meta.py --loop [-n 400,1000] [--rounds 5]
        [--steps 150] [--warmup 100] [--before OLD_batched_meta.py]
        [--control COPY_OF_batched_meta.py]

measures in the bench's real engine loop (``prime_r3.bench.loop.Simulator``, the bench's
default workload, every patch applied). ``build_connector_meta`` rotates step by step
over the variants, each on the real connector (they compute the same metadata and state,
so the simulation is the same whichever runs): ``upstream`` (upstream's function),
``meta`` (batched_meta's wrapper), ``before`` (with ``--before``: the ``_batched_meta``
of another batched_meta.py, e.g. ``git show REV:prime_r3/fixes/batched_meta.py >
FILE``, loaded under another name), ``control`` (with ``--control``: the same for
another file, usually a copy of the current one) and ``touch`` (only the reads the emit
start and the hash test need, per scheduled request, timed; upstream then builds the
metadata untimed): a lower bound for any exact build_connector_meta on cold requests.
All run under packed_outputs' reader declaration, as the layer stacks them. Adjacent
steps share the machine's load, so the comparison survives other work on a shared
machine. Measured: the ``meta`` slot (right after ``upstream``) reads 5-24% above the
same code in the ``before``/``control`` slots, so compare a change as ``before`` against
``control`` (both loaded from files), swapping the two files between runs. ``--rounds``
fresh processes; printed per variant: the median over rounds of the per-step median of
the call's thread CPU ms, the sched phase of the steps it ran in, each round's values,
and the medians of per-round ratios.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import prime_r3  # noqa: E402

_CONNECTOR = "vllm.distributed.aux_output_connector.connector"
_ATTR = "AuxOutputSchedulerConnector.build_connector_meta"


def _state_copy(connector: Any) -> Any:
    """The connector with its own copy of everything build_connector_meta may change."""
    clone = copy.copy(connector)
    clone.__dict__.pop("build_connector_meta", None)  # our interception below
    for name, value in vars(connector).items():
        if isinstance(value, dict | list):
            setattr(clone, name, copy.copy(value))
    if isinstance(getattr(connector, "_loading", None), dict):  # 0.33: sets are popped whole
        clone._loading = {k: set(v) for k, v in connector._loading.items()}
    return clone


def _before_wrapper(path: str) -> Any:
    """``_batched_meta`` of an older batched_meta.py (e.g. ``git show REV:prime_r3/fixes/
    batched_meta.py``), loaded under another name: that code, same process, same steps."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_batched_meta_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._batched_meta({})


def measure(concurrency: int, steps: int, rounds: int, before: str | None = None) -> dict[str, Any]:
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    from prime_r3.bench.loop import Simulator
    from prime_r3.bench.workload import BenchConfig
    from prime_r3.fixes import batched_meta

    cfg = BenchConfig(
        concurrency=concurrency,
        layers=4,
        topk=2,
        prefix_len=64,
        problem_len=64,
        max_tokens=512,
        min_tokens=64,
        kv_fraction=0.5,
        parity=False,
    )
    os.environ["PRIME_R3"] = "0"  # vLLM loads its plugins while building the config
    sim = Simulator(cfg, r3=True)
    del os.environ["PRIME_R3"]
    report = prime_r3.apply(["batched_meta"], log=False)
    if report.outcome("batched_meta").state != "applied":
        sim.close()
        sys.exit(f"batched_meta does not apply here: {report.summary()}")
    upstream = prime_r3.get_original(_CONNECTOR, _ATTR)
    # Looked up through the class, as a method call finds it: the wrapper then sees
    # the connector as its instance.
    arms = {"upstream": upstream, "batched_meta": AuxOutputSchedulerConnector.build_connector_meta}
    if before:
        wrapper = _before_wrapper(before)

        def before_arm(clone: Any, *args: Any) -> Any:
            return wrapper(upstream.__get__(clone), clone, args, {})

        arms["before"] = before_arm
    connector = sim.scheduler.aux_output_connector
    samples: dict[str, list[float]] = {name: [] for name in arms}
    sizes: list[int] = []

    def intercept(scheduler_output: Any, requests: Any) -> Any:
        per_arm: dict[str, list[float]] = {name: [] for name in arms}
        for k in range(rounds):
            for name in list(arms)[:: 1 if k % 2 else -1]:
                clone = _state_copy(connector)
                t0 = time.thread_time_ns()
                arms[name](clone, scheduler_output, requests)
                per_arm[name].append((time.thread_time_ns() - t0) / 1e6)
        for name, values in per_arm.items():
            samples[name].append(statistics.median(values))
        sizes.append(len(scheduler_output.num_scheduled_tokens))
        return upstream(connector, scheduler_output, requests)

    try:
        # Warm up until every request has been scheduled once and the batch is decoding.
        for _ in range(2000):
            sim.step()
            if not sim.scheduler.waiting and sim.workload.issued > concurrency + 8:
                break
        for _ in range(20):
            sim.step()
        batched_meta.COUNTERS.reset()
        connector.build_connector_meta = intercept  # this instance only
        for _ in range(steps):
            sim.step()
    finally:
        connector.__dict__.pop("build_connector_meta", None)
        prime_r3.revert(["batched_meta"])
        sim.close()
    counts = batched_meta.COUNTERS.snapshot()
    result = {name: statistics.median(values) for name, values in samples.items()}
    return {
        "n": concurrency,
        "scheduled": statistics.median(sizes),
        **result,
        "counts": counts,
    }


VARIANTS = ("upstream", "meta", "before")


def _touch(connector: Any, scheduler_output: Any, requests: dict[str, Any]) -> None:
    """A lower bound for any build_connector_meta that reads what upstream's emit start
    and hash test need: per scheduled request the request, its sent count, the lengths
    of its three lists, its prompt length and its sampling params' prompt start, read
    once and thrown away (no output built, no call). The ``touch`` variant times this
    on the step's cold requests, then lets upstream build the metadata."""
    get = connector._sent_hash_counts.get
    for request_id in scheduler_output.num_scheduled_tokens:
        request = requests[request_id]
        get(request_id)
        len(request.block_hashes)
        len(request._all_token_ids)
        len(request._output_token_ids)
        request.num_prompt_tokens  # noqa: B018 - the read is the point
        request.sampling_params.routed_experts_prompt_start  # noqa: B018


def loop_arm(
    concurrency: int, steps: int, warmup: int, before: str | None, control: str | None = None
) -> dict[str, Any]:
    """One ``--loop`` round in this (fresh) interpreter: the bench's engine loop with
    every patch, build_connector_meta rotating over the variants step by step."""
    import importlib.util

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ["PRIME_R3"] = "1"
    prime_r3.apply(log=False)
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector
    from vllm.v1 import request  # noqa: F401 - imported: the patches waiting for it apply

    from prime_r3.bench import loop
    from prime_r3.bench.workload import BenchConfig
    from prime_r3.fixes import batched_meta, packed_outputs

    upstream = prime_r3.get_original(_CONNECTOR, _ATTR)
    # Every variant runs under packed_outputs' reader declaration, as the layer stacks it
    # (the step's metadata must carry its mark, or the worker would not pack).
    declare = packed_outputs._declare_packed_reader({})
    wrappers = {"meta": batched_meta._batched_meta({})}
    counters = {"meta": batched_meta.COUNTERS}
    # The batched_meta module from before a change, and a noise control (usually a copy
    # of the current file: the same code as `meta`), each loaded under another name.
    for name, path in (("before", before), ("control", control)):
        if path:
            spec = importlib.util.spec_from_file_location(f"_batched_meta_{name}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            wrappers[name] = module._batched_meta({})
            counters[name] = module.COUNTERS
    names = ["upstream", *wrappers, "touch"]
    times: dict[str, list[float]] = {name: [] for name in names}
    sched: dict[str, list[float]] = {name: [] for name in names}
    calls = [0]
    current = [names[0]]

    def rotating(self: Any, *args: Any) -> Any:
        def inner(*a: Any, **k: Any) -> Any:
            return declare(upstream.__get__(self), self, a, k)

        name = current[0] = names[calls[0] % len(names)]
        calls[0] += 1
        t0 = time.thread_time_ns()
        if name == "touch":  # only the reads; upstream's call (not timed) then builds
            _touch(self, *args)
            times[name].append((time.thread_time_ns() - t0) / 1e6)
            return inner(*args)
        if name == "upstream":
            metadata = inner(*args)
        else:
            metadata = wrappers[name](inner, self, args, {})
        times[name].append((time.thread_time_ns() - t0) / 1e6)
        return metadata

    AuxOutputSchedulerConnector.build_connector_meta = rotating
    cfg = BenchConfig(concurrency=concurrency, steps=steps, warmup=warmup, parity=False)
    sim = loop.Simulator(cfg, True)
    try:
        for k in range(cfg.total_steps):
            if k == warmup:
                for values in (*times.values(), *sched.values()):
                    values.clear()
                for c in counters.values():
                    c.reset()
            phases = sim.step()
            sched[current[0]].append(phases["sched"] * 1e3)
    finally:
        sim.close()
    return {
        "meta_ms": {name: statistics.median(v) for name, v in times.items()},
        "sched_ms": {name: statistics.median(v) for name, v in sched.items()},
        "counts": {name: c.snapshot() for name, c in counters.items()},
    }


def _loop_main(args: argparse.Namespace) -> int:
    import json
    import subprocess

    print(
        f"bench engine loop, every patch; build_connector_meta rotates over the variants "
        f"step by step; {args.steps} steps after {args.warmup}; median over {args.rounds} "
        "fresh processes of each round's per-step median, ms CPU"
    )
    for n in (int(x) for x in args.n.split(",")):
        rounds = []
        for _ in range(args.rounds):
            command = [sys.executable, __file__, "--loop-arm", "-n", str(n)]
            command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            if args.before:
                command += ["--before", args.before]
            if args.control:
                command += ["--control", args.control]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            rounds.append(json.loads(out.strip().splitlines()[-1]))
        names = list(rounds[0]["meta_ms"])
        med = {
            key: {name: statistics.median(r[key][name] for r in rounds) for name in names}
            for key in ("meta_ms", "sched_ms")
        }
        print(f"N={n}")
        print(f"{'variant':>9} {'build_meta':>10} {'sched':>8}  per step: fast / upstream's")
        for name in names:
            note = ""
            c = rounds[0]["counts"].get(name)
            if c:
                steps = max(c["steps"], 1)
                reasons = ", ".join(
                    f"{k} {v / steps:.1f}" for k, v in sorted(c["fallback_reasons"].items())
                )
                note = (
                    f"{c['fast_requests'] / steps:.1f} (with hashes "
                    f"{c.get('fast_hashes', 0) / steps:.1f}) / "
                    f"{c['fallback_requests'] / steps:.1f} ({reasons}); round 1"
                )
            cells = f"{med['meta_ms'][name]:>10.3f} {med['sched_ms'][name]:>8.3f}"
            print(f"{name:>9} {cells}  {note}")
        per_round = ", ".join(
            "/".join(f"{r['meta_ms'][name]:.3f}" for name in names) for r in rounds
        )
        print(f"  rounds ({'/'.join(names)}): {per_round}")
        pairs = (
            ("meta", "upstream"),
            ("before", "upstream"),
            ("meta", "before"),
            ("meta", "control"),
            ("control", "before"),
        )
        for a, b in (*pairs, ("touch", "upstream"), ("meta", "touch")):
            if a in names and b in names:
                ratio = statistics.median(r["meta_ms"][a] / r["meta_ms"][b] for r in rounds)
                print(f"  {a} / {b}: build_connector_meta {ratio:.3f} (median of per-round ratios)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", default="400,1000", help="comma list of concurrencies")
    parser.add_argument("--steps", type=int, default=None, help="60; --loop: 150")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loop", action="store_true", help="measure in the engine loop")
    parser.add_argument("--warmup", type=int, default=100, help="--loop only")
    parser.add_argument("--before", help="--loop: also an older batched_meta.py (a file)")
    parser.add_argument(
        "--control",
        help="--loop: a noise control, another batched_meta.py in the same rotation "
        "(e.g. a copy of the current file: meta / control is then the same-code ratio)",
    )
    parser.add_argument("--loop-arm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.loop_arm:
        import json

        result = loop_arm(int(args.n), args.steps or 150, args.warmup, args.before, args.control)
        print(json.dumps(result))
        return 0
    if args.loop:
        args.steps = args.steps or 150
        return _loop_main(args)
    args.steps = args.steps or 60
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    from prime_r3.guards import installed_vllm_version

    print(f"vLLM {installed_vllm_version()}: build_connector_meta, ms CPU per step")
    print(
        f"{'N':>6} {'scheduled':>9} {'upstream':>9} {'patched':>9} {'ratio':>6}  "
        "requests per step: fast / upstream's (reasons)"
    )
    for n in (int(x) for x in args.n.split(",")):
        r = measure(n, args.steps, args.rounds, args.before)
        c = r["counts"]
        calls = max(c["steps"], 1)  # the patched arm's calls: rounds x measured steps
        reasons = ", ".join(
            f"{k} {v / calls:.1f}" for k, v in sorted(c["fallback_reasons"].items())
        )
        print(
            f"{r['n']:>6} {r['scheduled']:>9.0f} {r['upstream']:>9.3f} {r['batched_meta']:>9.3f} "
            f"{r['upstream'] / r['batched_meta']:>5.1f}x  {c['fast_requests'] / calls:.1f} / "
            f"{c['fallback_requests'] / calls:.1f} ({reasons})"
        )
        if "before" in r:
            print(
                f"{'':>6} {'before:':>9} {r['before']:>19.3f} "
                f"{r['upstream'] / r['before']:>5.1f}x  "
                f"patched / before {r['batched_meta'] / r['before']:.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
