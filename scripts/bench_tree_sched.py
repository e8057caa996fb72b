"""The diffs' scheduler side and transport: two trees' ``connector.py``, same steps.

    python scripts/bench_tree_sched.py --base DIR [--tree DIR] [-n 400,1000]
        [--rounds 3] [--steps 120] [--warmup 150] [--hot]

``DIR`` is a vLLM tree patched by ``scripts/patches.py apply --out DIR`` (e.g. main's
checkout's diffs); ``--tree`` defaults to this checkout's diffs applied into a temporary
directory. Each round is a fresh interpreter that runs the bench's engine loop
(``prime_r3.bench.loop.Simulator``, its default workload, ``PRIME_R3=0``) on ``--tree``
and loads both trees' ``connector.py`` as modules of their own (``base``, ``new``).
After ``--warmup`` steps, every step, arms interleaved in a rotating order:

- ``take``: the scheduler's real ``take_output`` calls of the step are recorded (the
  request, and the received step before its first take splits it); after the step each
  arm builds its own ``PackedAuxOutputs`` from the same fields and runs its
  ``take_output`` on the recorded requests in the scheduler's order (the first take
  splits the step, as in the engine);
- ``meta``: at the scheduler's ``build_connector_meta`` call, each arm runs its
  ``build_connector_meta`` on its own copy of the connector's state, then the real call
  runs;
- ``transp``: the step's ``ModelRunnerOutput`` as the worker sent it, with
  ``aux_output_connector_output`` = None (``none``), the step's rows as one ``bytes``
  object (``bytes``: what MessageQueue's own copies of those bytes cost, the floor for
  any form that sends them in band) or each arm's packed step built from the same
  fields, through the simulator's real ``MessageQueue`` (``enqueue`` + ``dequeue``);
  the received object is freed outside the timed region.

Every arm's results are compared each step (rows, shapes, owning/view, metadata and
connector state, the received rows); a difference stops the run. Unless ``--hot``,
a 16 MiB buffer is written before each timed call, so the data is as cold as between
engine steps. Timed as thread CPU with the cyclic GC paused. Printed per N: each
piece's median over rounds of the per-step median per arm, new/base (for ``transp``,
the increment over ``none`` per round), and every round's values.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import operator
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONNECTOR = "vllm/distributed/aux_output_connector/connector.py"
ARMS = ("base", "new")


def _load(alias: str, tree: Path) -> Any:
    """A tree's connector.py as module ``alias`` (registered: pickle finds its classes)."""
    spec = importlib.util.spec_from_file_location(alias, tree / CONNECTOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    spec.loader.exec_module(module)
    return module


def _meta_snapshot(metadata: Any, clone: Any) -> Any:
    return (
        vars(metadata).__repr__(),
        list(clone._sent_hash_counts.items()),
        list(clone._finished_requests),
    )


def _take_snapshot(rows: Any) -> Any:
    if rows is None:
        return None
    return (rows.tobytes(), rows.shape, rows.dtype.str, rows.base is None)


class _Cold:
    """Writes a buffer larger than the caches before a timed call (unless hot)."""

    def __init__(self, hot: bool) -> None:
        import numpy as np

        self.hot = hot
        self.junk = np.zeros(16 << 20, np.uint8)

    def __call__(self) -> None:
        if not self.hot:
            self.junk[::64] += 1


def child(args: argparse.Namespace) -> dict[str, list[float]]:
    """One round in this interpreter (``--tree`` first on sys.path)."""
    import vllm
    from bench_meta import _state_copy  # the connector's state, copied as bench_meta does

    from prime_r3.bench.loop import Simulator
    from prime_r3.bench.workload import BenchConfig

    assert Path(vllm.__file__).is_relative_to(args.tree), vllm.__file__
    from vllm.distributed.aux_output_connector import connector as live

    mods = {"base": _load("bench_tree_base_connector", args.base)}
    mods["new"] = _load("bench_tree_new_connector", args.tree)
    cold = _Cold(args.hot)
    clock = time.thread_time_ns
    samples: dict[str, list[float]] = {
        f"{piece}_{arm}": []
        for piece in ("take", "meta", "transp")
        for arm in (*ARMS, "none", "bytes")
        if piece == "transp" or arm in ARMS
    }
    samples["rows_bytes"] = []
    samples["ids_shared"] = []
    state = {"measure": False, "step": 0, "calls": [], "fields": None, "sent": None}
    cls = live.AuxOutputSchedulerConnector
    real_take, real_meta = cls.take_output, cls.build_connector_meta

    def order(arms: tuple[str, ...]) -> tuple[str, ...]:
        k = state["step"] % len(arms)
        return arms[k:] + arms[:k]

    def take_output(self: Any, request: Any, output: Any) -> Any:
        if state["measure"]:
            if state["fields"] is None or state["fields"][0] is not output:
                assert output.rows is not None  # not split yet
                state["fields"] = (
                    output,
                    (output.request_ids, output.token_starts, output.offsets, output.rows),
                )
            state["calls"].append(request)
        return real_take(self, request, output)

    def build_connector_meta(self: Any, scheduler_output: Any, requests: Any) -> Any:
        if state["measure"]:
            seen = {}
            for arm in order(ARMS):
                clone = _state_copy(self)
                function = mods[arm].AuxOutputSchedulerConnector.build_connector_meta
                cold()
                gc.disable()
                t0 = clock()
                metadata = function(clone, scheduler_output, requests)
                t1 = clock()
                gc.enable()
                samples[f"meta_{arm}"].append(t1 - t0)
                seen[arm] = _meta_snapshot(metadata, clone)
            assert seen["base"] == seen["new"], "build_connector_meta differs"
        return real_meta(self, scheduler_output, requests)

    cls.take_output = take_output  # type: ignore[method-assign]
    cls.build_connector_meta = build_connector_meta  # type: ignore[method-assign]
    cfg = BenchConfig(concurrency=args.n, steps=args.steps, warmup=args.warmup, parity=False)
    sim = Simulator(cfg, True)
    real_send = sim.transport.send

    def send(output: Any) -> Any:
        if state["measure"]:
            state["sent"] = output
        return real_send(output)

    sim.transport.send = send  # type: ignore[method-assign]
    try:
        for step in range(args.warmup + args.steps):
            state.update(step=step, measure=step >= args.warmup, calls=[], fields=None, sent=None)
            sim.step()
            if not state["measure"]:
                continue
            if state["fields"] is not None:
                _replay_takes(state, mods, samples, cold, order)
            if state["sent"] is not None and state["fields"] is not None:
                _transport(sim, state, mods, samples, cold, order)
    finally:
        sim.close()
    return samples


def _replay_takes(state: Any, mods: Any, samples: Any, cold: Any, order: Any) -> None:
    import numpy as np

    fields = state["fields"][1]
    requests = state["calls"]
    seen = {}
    for arm in order(ARMS):
        step = mods[arm].PackedAuxOutputs(*fields)
        take = mods[arm].AuxOutputSchedulerConnector.take_output
        connector = object.__new__(mods[arm].AuxOutputSchedulerConnector)
        results = []
        cold()
        gc.disable()
        t0 = time.thread_time_ns()
        for request in requests:
            results.append(take(connector, request, step))
        t1 = time.thread_time_ns()
        gc.enable()
        samples[f"take_{arm}"].append(t1 - t0)
        seen[arm] = [_take_snapshot(rows) for rows in results]
        assert all(r is None or isinstance(r, np.ndarray) for r in results)
        step = results = None
    assert seen["base"] == seen["new"], "take_output differs"


def _transport(sim: Any, state: Any, mods: Any, samples: Any, cold: Any, order: Any) -> None:
    sent = state["sent"]
    aux = sent.aux_output_connector_output
    # The worker's step as sent (its ids are the ModelRunnerOutput's req_ids objects,
    # which pickle writes once and references after).
    fields = (aux.request_ids, aux.token_starts, aux.offsets, aux.rows)
    samples["ids_shared"].append(all(map(operator.is_, aux.request_ids, sent.req_ids)))
    transport = sim.transport
    try:
        for arm in order(("none", "bytes", *ARMS)):
            if arm == "none":
                sent.aux_output_connector_output = None
            elif arm == "bytes":  # the rows' bytes alone: MessageQueue's copies of them
                sent.aux_output_connector_output = fields[3].tobytes()
            else:
                sent.aux_output_connector_output = mods[arm].PackedAuxOutputs(*fields)
            cold()
            gc.disable()
            t0 = time.thread_time_ns()
            transport.writer.enqueue((0, sent))
            status, received = transport.reader.dequeue(timeout=60)
            t1 = time.thread_time_ns()
            received_aux = received.aux_output_connector_output
            received = None
            gc.enable()
            samples[f"transp_{arm}"].append(t1 - t0)
            if arm == "bytes":
                assert received_aux == fields[3].tobytes()
            elif arm != "none":
                assert type(received_aux) is mods[arm].PackedAuxOutputs
                assert received_aux.rows.tobytes() == fields[3].tobytes()
                assert received_aux.token_starts.tolist() == fields[1].tolist()
                assert received_aux.offsets.tolist() == fields[2].tolist()
                assert received_aux.request_ids == fields[0]
            received_aux = None
        samples["rows_bytes"].append(fields[3].nbytes)
    finally:
        sent.aux_output_connector_output = aux


def _build_tree() -> Path:
    out = Path(tempfile.mkdtemp(prefix="bench_tree_sched_"))
    subprocess.run(
        [sys.executable, str(ROOT / "scripts/patches.py"), "apply", "--out", str(out)],
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--tree", type=Path)
    parser.add_argument("-n", default="400,1000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=150)
    parser.add_argument("--hot", action="store_true")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        args.n = args.child
        args.base, args.tree = args.base.resolve(), args.tree.resolve()
        print(json.dumps(child(args)))
        return 0
    tree = (args.tree or _build_tree()).resolve()
    env = dict(os.environ, PRIME_R3="0", VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="ERROR")
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(ROOT)])
    print(f"base {args.base}  new {tree}  ({'hot' if args.hot else 'cold'} caches)")
    for n in map(int, args.n.split(",")):
        rounds: list[dict[str, float]] = []
        for _ in range(args.rounds):
            cmd = [sys.executable, __file__, "--child", str(n), "--base", str(args.base)]
            cmd += ["--tree", str(tree), "--steps", str(args.steps), "--warmup", str(args.warmup)]
            cmd += ["--hot"] if args.hot else []
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if done.returncode:
                print(done.stderr[-3000:])
                return 1
            raw = json.loads(done.stdout.strip().splitlines()[-1])
            scale = {k: 1 if k in ("rows_bytes", "ids_shared") else 1e6 for k in raw}
            rounds.append({k: statistics.median(v) / scale[k] for k, v in raw.items()})
        print(f"\nN={n}, {args.rounds} rounds x {args.steps} steps, ms per step (thread CPU)")
        for piece in ("take", "meta", "transp"):
            if piece == "transp":
                per = {a: [r[f"transp_{a}"] - r["transp_none"] for r in rounds] for a in ARMS}
                label = "transp - none"
            else:
                per = {a: [r[f"{piece}_{a}"] for r in rounds] for a in ARMS}
                label = piece
            ratios = [new / base for base, new in zip(per["base"], per["new"], strict=True)]
            base, new = statistics.median(per["base"]), statistics.median(per["new"])
            print(
                f"  {label:14s} base {base:.4f}  new {new:.4f}  new/base "
                f"{statistics.median(ratios):.3f}  per round "
                + " ".join(f"{x:.3f}" for x in ratios)
            )
        none = statistics.median(r["transp_none"] for r in rounds)
        raw = statistics.median(r["transp_bytes"] - r["transp_none"] for r in rounds)
        nbytes = statistics.median(r["rows_bytes"] for r in rounds)
        print(f"  {'transp none':14s} {none:.4f}")
        print(f"  {'transp bytes':14s} {raw:.4f} above none: the rows' {nbytes:.0f} bytes alone")
        shared = min(r["ids_shared"] for r in rounds)
        print(f"  packed ids are the req_ids' str objects in every step: {shared == 1}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
