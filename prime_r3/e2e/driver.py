"""One vLLM engine in its own process, driven over a pipe: ``python -m prime_r3.e2e.driver``.

The parent (``prime_r3.e2e.client``) starts it with the arm's environment and one JSON
argument (the engine's kwargs), then sends JSON commands on stdin and reads one JSON
reply per command on the original stdout. vLLM's own output (this process's and its
EngineCore's and workers', which inherit the descriptors) goes to stderr, which the
parent writes to a log file.

Commands:
  {"op": "run", "requests": [...], "abort": {"index": i, "after_steps": k} | null}
      adds every request to the offline engine (``LLM.llm_engine``, the loop
      ``LLM.generate`` runs), steps it until none is left, aborting request ``i``
      after ``k`` steps if asked. A request is {"prompt": [ids], "max_tokens": m,
      "n": 1, "seed": s, "temperature": t, "routed_experts_prompt_start": 0}.
      Replies per request: the token ids and routed experts (dtype, shape, sha256 of
      the bytes) of each sample, and for the run: wall time, engine steps, the CPU
      seconds of the engine's processes (EngineCore and workers, or this process
      when in-process) and vLLM's own counters.
  {"op": "pids"}: this process's and its children's pids and titles.
  {"op": "exit"}: shut the engine down (``LLM`` and its processes) and exit.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any


def _counters(llm: Any) -> dict[str, float]:
    """vLLM's own counters: engine steps (iterations with tokens), preemptions,
    prefix-cache hits/queries, generated tokens."""
    from vllm.v1.metrics.reader import Counter, Histogram

    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter):
            out[metric.name] = out.get(metric.name, 0) + metric.value
        elif isinstance(metric, Histogram) and metric.name == "vllm:iteration_tokens_total":
            out["steps"] = out.get("steps", 0) + metric.count
    return out


def _engine_processes() -> list[Any]:
    import psutil

    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def _cpu_seconds(procs: list[Any], in_process: bool) -> float:
    """CPU seconds of the engine's processes (all but this one, unless in-process)."""
    total = 0.0
    for p in procs if in_process else procs[1:]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except Exception:  # noqa: BLE001 - a process that exited adds nothing
            pass
    return total


def _rows(array: Any) -> dict[str, Any] | None:
    if array is None:
        return None
    import numpy as np

    a = np.ascontiguousarray(array)
    return {
        "dtype": str(a.dtype),
        "shape": list(a.shape),
        "sha256": hashlib.sha256(a.tobytes()).hexdigest(),
    }


def _run(llm: Any, cmd: dict[str, Any], in_process: bool) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    ids = []
    for i, r in enumerate(cmd["requests"]):
        params = SamplingParams(
            n=r.get("n", 1),
            max_tokens=r["max_tokens"],
            temperature=r.get("temperature", 1.0),
            seed=r.get("seed", i),
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
            routed_experts_prompt_start=r.get("routed_experts_prompt_start", 0),
        )
        rid = f"r{i}"
        engine.add_request(rid, {"prompt_token_ids": r["prompt"]}, params)
        ids.append(rid)
    abort = cmd.get("abort")
    procs = _engine_processes()
    before = _counters(llm)
    cpu0, t0 = _cpu_seconds(procs, in_process), time.perf_counter()
    finished: dict[str, Any] = {}
    calls = 0
    deadline = time.monotonic() + cmd.get("timeout", 600)
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"run not finished after {cmd.get('timeout', 600)} s")
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        calls += 1
        if abort and calls == abort["after_steps"]:
            engine.abort_request([ids[abort["index"]]])
    wall, cpu = time.perf_counter() - t0, _cpu_seconds(procs, in_process) - cpu0
    after = _counters(llm)
    results = []
    for rid in ids:
        out = finished.get(rid)
        if out is None:
            results.append({"id": rid, "finished": False, "samples": []})
            continue
        samples = [
            {
                "token_ids": list(c.token_ids),
                "routed_experts": _rows(c.routed_experts),
                "finish_reason": c.finish_reason,
            }
            for c in sorted(out.outputs, key=lambda c: c.index)
        ]
        results.append({"id": rid, "finished": True, "samples": samples})
    counters = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return {"results": results, "wall_s": wall, "cpu_s": cpu, "counters": counters}


def main(argv: list[str]) -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's output (and its children's) goes to stderr
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    kwargs = json.loads(argv[0])
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    proto.write(json.dumps({"ready": True, "start_s": time.perf_counter() - t0}) + "\n")
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                break
            try:
                if cmd["op"] == "run":
                    reply = _run(llm, cmd, in_process)
                elif cmd["op"] == "pids":
                    reply = {
                        "pids": [
                            {"pid": p.pid, "name": " ".join(p.cmdline()[:1]) or p.name()}
                            for p in _engine_processes()
                        ]
                    }
                else:
                    reply = {"error": f"unknown op {cmd['op']!r}"}
            except Exception as error:  # noqa: BLE001 - reported to the parent
                reply = {"error": f"{type(error).__name__}: {error}"}
            proto.write(json.dumps(reply) + "\n")
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    proto.write(json.dumps({"exited": True}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
