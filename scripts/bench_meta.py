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
batched_meta's pass took and how many went to upstream's code (by reason).
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


def measure(concurrency: int, steps: int, rounds: int) -> dict[str, Any]:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", default="400,1000", help="comma list of concurrencies")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    from prime_r3.guards import installed_vllm_version

    print(f"vLLM {installed_vllm_version()}: build_connector_meta, ms CPU per step")
    print(
        f"{'N':>6} {'scheduled':>9} {'upstream':>9} {'patched':>9} {'ratio':>6}  "
        "requests per step: fast / upstream's (reasons)"
    )
    for n in (int(x) for x in args.n.split(",")):
        r = measure(n, args.steps, args.rounds)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
