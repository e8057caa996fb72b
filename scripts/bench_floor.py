"""How close to R3-off can R3 get while upstream's scheduler stays as it is? A lower bound.

    .venv/bin/python scripts/bench_floor.py [-n 400,1000] [--steps 200] [--warmup 100]
                                            [--rounds 3]

Issue 10 asks for R3 with prime_r3 at <= 1.15x the R3-off engine CPU per step. This
script measures what no overlay of vLLM's current structure can go below, so the gap
to that target can be split into "ours to remove" and "upstream's structure".

Arms, each a fresh interpreter running the bench's real engine loop
(``prime_r3.bench.loop.run``: vLLM's real Scheduler, MessageQueue and update path;
same workload and seed), run round-robin ``--rounds`` times, medians reported:

* ``r3_off``: R3 disabled (the baseline).
* ``r3_floor``: R3 enabled in vLLM's config, but the connectors do only what cannot
  be avoided while upstream's ``Scheduler`` is unchanged. The worker connector is gone
  (no capture buffer, no block store, no writer thread); the model's routing rows for
  the step are sent as one array plus the request ids through the real MessageQueue;
  EngineCore's ``build_connector_meta`` returns ``None`` and ``request_finished`` does
  nothing; ``take_output`` (still called by upstream's ``update_from_output`` once per
  emitting request) is one plain function doing a dict lookup and a slice copy, the
  least that returns rows a caller may keep. This arm is not a working R3: it drops
  prefix-hit replay (the store) and preemption handling. It only prices upstream's
  per-request call structure and the rows' transport, so it is a lower bound.
* ``r3_prime``: R3 with every prime_r3 patch this release can take (as ``prime-r3
  bench``).

Printed per N: engine CPU per step (main thread minus the model stand-in and the
output-processor role, plus the writer thread: the bench's ``cpu ms``), ``sched``,
``aux``, ``transport`` and ``writer`` per arm, and each arm's ratio to ``r3_off``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

ARMS = ("r3_off", "r3_floor", "r3_prime")
COLUMNS = ("engine_cpu_ms", "sched_ms", "aux_ms", "transport_ms", "writer_ms")


class FloorRows:
    """One step's routing rows as sent in the floor arm: ids, row offsets, one array."""

    def __init__(self, ids: list[str], offsets: list[int], rows: Any) -> None:
        self.ids = ids
        self.offsets = offsets
        self.rows = rows
        self.index: dict[str, int] | None = None


def floor_take(request: Any, output: Any) -> Any:
    """The least ``take_output`` can do: find the request, copy its rows out."""
    index = output.index
    if index is None:
        index = output.index = dict(zip(output.ids, range(len(output.ids)), strict=True))
    i = index[request.request_id]
    return output.rows[output.offsets[i] : output.offsets[i + 1]].copy()


def _floor_simulator(base: type) -> type:
    class FloorSimulator(base):  # type: ignore[misc, valid-type]
        """The bench engine with R3 on in vLLM's config and the connectors at their floor."""

        def __init__(self, cfg: Any, r3: bool) -> None:
            super().__init__(cfg, r3)
            from prime_r3.bench.meters import StoreMeter

            self.connector.close()
            self.connector = None
            self.store = StoreMeter(None)
            sent: dict[str, Any] = {}
            execute, send = self.model.execute, self.transport.send

            def model_execute(so: Any) -> Any:
                batch, rows, sampled, num_sampled = execute(so)
                sent["step"] = FloorRows(
                    list(batch.req_ids), batch.query_start_loc_np.tolist(), rows
                )
                return batch, rows, sampled, num_sampled

            def transport_send(output: Any) -> Any:
                step = sent.pop("step", None)
                if step is not None and output.req_ids:
                    output.aux_output_connector_output = step
                return send(output)

            self.model.execute = model_execute
            self.transport.send = transport_send
            scheduler_connector = self.scheduler.aux_output_connector
            scheduler_connector.build_connector_meta = lambda *args, **kwargs: None
            scheduler_connector.request_finished = lambda request: None
            scheduler_connector.take_output = floor_take

    return FloorSimulator


def _arm(arm: str, n: int, steps: int, warmup: int) -> dict[str, Any]:
    """One arm in this (fresh) interpreter; returns the bench's steady-window summary."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ["PRIME_R3"] = "1" if arm == "r3_prime" else "0"
    import prime_r3

    if arm == "r3_prime":
        prime_r3.apply(log=False)
    from prime_r3.bench import loop, report
    from prime_r3.bench.workload import BenchConfig

    cfg = BenchConfig(concurrency=n, steps=steps, warmup=warmup, parity=False)
    if arm == "r3_floor":
        loop.Simulator = _floor_simulator(loop.Simulator)
    result = loop.run(cfg, arm != "r3_off")
    if result["error"]:
        raise RuntimeError(f"{arm}: {result['error']}")
    summary = report.summarize(result, cfg)
    return {name: summary[name] for name in COLUMNS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", default="400,1000", help="comma list of concurrencies")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arm", help=argparse.SUPPRESS)  # internal: run one arm, print JSON
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(_arm(args.arm, int(args.n), args.steps, args.warmup)))
        return
    for n in [int(x) for x in args.n.split(",")]:
        results: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
        for _ in range(args.rounds):  # round-robin: drift in other load hits every arm
            for arm in ARMS:
                out = subprocess.run(
                    [sys.executable, __file__, "--arm", arm, "-n", str(n)]
                    + ["--steps", str(args.steps), "--warmup", str(args.warmup)],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                results[arm].append(json.loads(out.strip().splitlines()[-1]))
        print(f"N={n}: medians of {args.rounds} rounds, {args.steps} steps after {args.warmup}")
        print(f"{'arm':>10} " + " ".join(f"{c[:-3]:>10}" for c in COLUMNS) + "     x off")
        base = statistics.median(r["engine_cpu_ms"] for r in results["r3_off"])
        for arm in ARMS:
            med = {c: statistics.median(r[c] for r in results[arm]) for c in COLUMNS}
            cells = " ".join(f"{med[c]:>10.3f}" for c in COLUMNS)
            print(f"{arm:>10} {cells} {med['engine_cpu_ms'] / base:>9.3f}")


if __name__ == "__main__":
    main()
