"""Benchmark the API server's per-step R3 work under two GC threshold settings.

Why: ``prime_r3.fixes.engine_gc`` raises the GC thresholds to (50000, 20, 100) in
EngineCore and workers, but leaves the API server at CPython's defaults unless
``PRIME_R3_ENGINE_GC_API_SERVER=1``. This script measures whether the API server would
benefit, on CPU and with vLLM's real code: every step, EngineCore-shaped
``EngineCoreOutputs`` (one ``new_token_ids`` token and ``routed_experts`` uint8 rows
[n_tokens, 46, 8] per request; the first output of a request carries its prompt rows) are
encoded by ``MsgpackEncoder`` and copied to bytes (what ZMQ hands over), then the timed
part runs what the API server runs: ``MsgpackDecoder.decode``, ``OutputProcessor``
(``AsyncLLM.output_handler``'s chunking and ``IterationStats``), the per-request
``RequestOutputCollector`` consumers on one asyncio loop and, on finish, the non-streaming
completion response (``numpy2base64`` of the routed experts, ``CompletionResponse``,
Starlette ``JSONResponse`` rendering). A finished request is replaced at once (closed loop
with N requests, output lengths varied so finishes are spread over steps).

Each arm runs in its own subprocess with the same seed; arms are interleaved across
repeats and the median over repeats is reported. Times are process CPU time (robust to
other load on shared cores); GC pauses come from ``gc.callbacks``. The engine-side work
(building and encoding outputs) runs with GC disabled and is not timed.

    .venv/bin/python scripts/bench_api_server_gc.py --n 400
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

DEFAULT_THRESHOLDS = (700, 10, 10)
TUNED_THRESHOLDS = (50_000, 20, 100)
ARMS = {"default": DEFAULT_THRESHOLDS, "tuned": TUNED_THRESHOLDS}
NUM_LAYERS = 46
TOP_K = 8


@dataclass
class GCStats:
    """Collections, total and longest pause (CPU ns) seen through ``gc.callbacks``."""

    active: bool = False
    count: list[int] = field(default_factory=lambda: [0, 0, 0])
    total_ns: int = 0
    max_ns: int = 0
    max_gen: int = -1
    collected: int = 0
    _start: int = 0

    def callback(self, phase: str, info: dict[str, int]) -> None:
        """Record one GC start/stop event (only while ``active``)."""
        now = time.process_time_ns()
        if phase == "start":
            self._start = now
            return
        if not self.active:
            return
        pause = now - self._start
        self.count[info["generation"]] += 1
        self.total_ns += pause
        self.collected += info["collected"]
        if pause > self.max_ns:
            self.max_ns, self.max_gen = pause, info["generation"]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_arm(args: argparse.Namespace) -> dict[str, Any]:
    """Run one arm in this process and return its metrics (called in a subprocess)."""
    import asyncio
    import gc

    import numpy as np
    from starlette.responses import JSONResponse
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionResponse,
        CompletionResponseChoice,
    )
    from vllm.entrypoints.serve.engine.protocol import UsageInfo
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.utils.gc_utils import freeze_gc_heap
    from vllm.utils.serial_utils import numpy2base64
    from vllm.v1.engine import (
        EngineCoreEvent,
        EngineCoreEventType,
        EngineCoreOutput,
        EngineCoreOutputs,
        EngineCoreRequest,
        FinishReason,
    )
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
    from vllm.v1.metrics.stats import IterationStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    rng = np.random.default_rng(args.seed)
    chunk_size = int(os.environ.get("VLLM_V1_OUTPUT_PROC_CHUNK_SIZE", "128"))
    kind = RequestOutputKind.DELTA if args.stream else RequestOutputKind.FINAL_ONLY
    max_rows = args.max_prompt + args.max_len
    experts = rng.integers(0, 128, size=(max_rows, NUM_LAYERS, TOP_K), dtype=np.uint8)
    encoder = MsgpackEncoder()
    decoder = MsgpackDecoder(EngineCoreOutputs)
    processor = OutputProcessor(None, log_stats=True)
    gc_stats = GCStats()
    gc.callbacks.append(gc_stats.callback)

    @dataclass
    class EngineReq:
        rid: str
        prompt_len: int
        max_tokens: int
        done: int = 0

    engine: dict[str, EngineReq] = {}
    serial = [0]
    responses = [0, 0]  # count, bytes

    def new_request(first_wave: bool) -> tuple[str, RequestOutputCollector]:
        serial[0] += 1
        rid = f"cmpl-{serial[0]:08d}-0"
        prompt_len = int(rng.integers(args.min_prompt, args.max_prompt + 1))
        low = 1 if first_wave else args.min_len  # first wave: spread the finishes
        max_tokens = int(rng.integers(low, args.max_len + 1))
        params = SamplingParams(max_tokens=max_tokens, detokenize=False, output_kind=kind)
        request = EngineCoreRequest(
            request_id=rid,
            prompt_token_ids=rng.integers(0, 150_000, size=prompt_len).tolist(),
            mm_features=None,
            sampling_params=params,
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
            external_req_id=rid,
        )
        queue = RequestOutputCollector(kind, rid)
        processor.add_request(request, None, queue=queue)
        engine[rid] = EngineReq(rid, prompt_len, max_tokens)
        return rid, queue

    def engine_step() -> list[Any]:
        """EngineCore side: one token per running request, encoded; not timed."""
        outs = []
        for req in list(engine.values()):
            first = req.done == 0
            req.done += 1
            finished = req.done >= req.max_tokens
            start = 0 if first else req.prompt_len + req.done - 2
            rows = experts[start : req.prompt_len + req.done - 1]
            events = None
            if first:
                now = time.monotonic()
                events = [
                    EngineCoreEvent.new_event(EngineCoreEventType.QUEUED, now),
                    EngineCoreEvent.new_event(EngineCoreEventType.SCHEDULED, now),
                ]
            outs.append(
                EngineCoreOutput(
                    request_id=req.rid,
                    new_token_ids=[int(rng.integers(0, 150_000))],
                    finish_reason=FinishReason.LENGTH if finished else None,
                    events=events,
                    routed_experts=rows,
                )
            )
            if finished:
                del engine[req.rid]
        frames = encoder.encode(EngineCoreOutputs(outputs=outs, timestamp=time.monotonic()))
        return [bytes(f) for f in frames]  # ZMQ delivers its own copy

    async def client(rid: str, queue: RequestOutputCollector) -> None:
        """AsyncLLM.generate + the non-streaming completion handler for one request."""
        final = None
        while True:
            out = queue.get_nowait() or await queue.get()
            final = out
            if out.finished:
                break
        assert final is not None
        output = final.outputs[0]
        routed_b64 = (
            numpy2base64(output.routed_experts) if output.routed_experts is not None else None
        )
        choice = CompletionResponseChoice(
            index=0,
            text=output.text,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
            token_ids=list(output.token_ids),
            routed_experts=routed_b64,
        )
        prompt_tokens = len(final.prompt_token_ids or ())
        usage = UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=len(output.token_ids),
            total_tokens=prompt_tokens + len(output.token_ids),
        )
        response = CompletionResponse(id=rid, model="bench", choices=[choice], usage=usage)
        body = JSONResponse(content=response.model_dump()).body
        responses[0] += 1
        responses[1] += len(body)
        start_client()  # closed loop: the client sends its next request

    tasks: set[asyncio.Task[None]] = set()

    def start_client(first_wave: bool = False) -> None:
        rid, queue = new_request(first_wave)
        task = asyncio.get_running_loop().create_task(client(rid, queue))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    step_ns: list[int] = []

    async def output_handler() -> None:
        """AsyncLLM.output_handler: decode, process in chunks, let consumers run."""
        for _ in range(args.n):
            start_client(first_wave=True)
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                gc_stats.active = True
            gc.disable()
            frames = engine_step()
            gc.enable()
            t0 = time.process_time_ns()
            outputs = decoder.decode(frames)
            iteration_stats = IterationStats()
            eco = outputs.outputs
            for start in range(0, len(eco), chunk_size):
                processed = processor.process_outputs(
                    eco[start : start + chunk_size],
                    outputs.timestamp,
                    iteration_stats,
                    weight_version=outputs.weight_version,
                )
                assert not processed.request_outputs and not processed.reqs_to_abort
                await asyncio.sleep(0)
            del outputs, eco, iteration_stats, processed, frames
            await asyncio.sleep(0)  # consumers woken by this step finish here
            if step >= args.warmup:
                step_ns.append(time.process_time_ns() - t0)
        gc_stats.active = False

    async def setup_and_run() -> None:
        # Like server_utils.lifespan: freeze the startup heap, then (our patch) thresholds.
        freeze_gc_heap()
        gc.set_threshold(*ARMS[args.arm])
        await output_handler()

    asyncio.run(setup_and_run())
    total_s = sum(step_ns) / 1e9
    ms = [v / 1e6 for v in step_ns]
    return {
        "arm": args.arm,
        "steps_per_s": len(step_ns) / total_s,
        "step_ms_median": statistics.median(ms),
        "step_ms_p99": _percentile(ms, 0.99),
        "step_ms_max": max(ms),
        "gc_gen0": gc_stats.count[0],
        "gc_gen1": gc_stats.count[1],
        "gc_gen2": gc_stats.count[2],
        "gc_total_ms": gc_stats.total_ns / 1e6,
        "gc_share": gc_stats.total_ns / 1e9 / total_s,
        "gc_max_pause_ms": gc_stats.max_ns / 1e6,
        "gc_max_pause_gen": gc_stats.max_gen,
        "gc_collected": gc_stats.collected,
        "responses": responses[0],
        "response_mb": responses[1] / 1e6,
    }


ROWS = (
    ("steps/s", "steps_per_s", "{:.1f}"),
    ("step CPU ms median", "step_ms_median", "{:.3f}"),
    ("step CPU ms p99", "step_ms_p99", "{:.3f}"),
    ("step CPU ms max", "step_ms_max", "{:.2f}"),
    ("GC collections gen0", "gc_gen0", "{:.0f}"),
    ("GC collections gen1", "gc_gen1", "{:.0f}"),
    ("GC collections gen2", "gc_gen2", "{:.0f}"),
    ("GC total ms", "gc_total_ms", "{:.1f}"),
    ("GC share of step CPU", "gc_share", "{:.2%}"),
    ("longest GC pause ms", "gc_max_pause_ms", "{:.2f}"),
    ("GC objects collected", "gc_collected", "{:.0f}"),
    ("responses finished", "responses", "{:.0f}"),
)


def _fmt(fmt: str, value: float) -> str:
    return fmt.format(value)


def print_table(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> None:
    """Print the median over repeats of each metric per arm, and tuned/default ratios."""
    med = {
        arm: {key: statistics.median(r[key] for r in results) for _, key, _ in ROWS}
        for arm, results in runs.items()
    }
    pause_gen = {arm: [r["gc_max_pause_gen"] for r in results] for arm, results in runs.items()}
    print(
        f"N={args.n} steps={args.steps} (+{args.warmup} warm-up) out_len={args.min_len}.."
        f"{args.max_len} prompt={args.min_prompt}..{args.max_prompt} "
        f"routed=[n,{NUM_LAYERS},{TOP_K}] uint8 kind={'delta' if args.stream else 'final'} "
        f"repeats={args.repeats} (median; CPU time)"
    )
    header = f"{'metric':<24}{'default (700,10,10)':>22}{'tuned (50000,20,100)':>22}{'ratio':>9}"
    print(header)
    print("-" * len(header))
    for label, key, fmt in ROWS:
        d, t = med["default"][key], med["tuned"][key]
        ratio = f"{t / d:.2f}x" if d else ("-" if not t else "inf")
        print(f"{label:<24}{_fmt(fmt, d):>22}{_fmt(fmt, t):>22}{ratio:>9}")
    print(f"longest-pause generation per repeat: {pause_gen}")
    for arm, results in runs.items():
        print(f"{arm} steps/s per repeat: " + ", ".join(f"{r['steps_per_s']:.1f}" for r in results))


def main() -> None:
    """Run the interleaved arms in subprocesses, or one arm with ``--worker``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=400, help="concurrent requests")
    parser.add_argument("--steps", type=int, default=800, help="measured engine steps")
    parser.add_argument("--warmup", type=int, default=400, help="unmeasured steps first")
    parser.add_argument("--min-len", type=int, default=512)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--min-prompt", type=int, default=128)
    parser.add_argument("--max-prompt", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3, help="runs per arm, interleaved")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stream", action="store_true", help="DELTA outputs every step")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--arm", choices=sorted(ARMS), default="default", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        print(json.dumps(run_arm(args)))
        return

    base = [a for a in sys.argv[1:] if a not in ("--worker",)]
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    env = dict(os.environ, PRIME_R3="0", VLLM_LOGGING_LEVEL="WARNING")
    for rep in range(args.repeats):
        order = ["default", "tuned"] if rep % 2 == 0 else ["tuned", "default"]
        for arm in order:
            cmd = [sys.executable, __file__, *base, "--worker", "--arm", arm]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr)
                raise SystemExit(f"arm {arm} failed (rc={proc.returncode})")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            runs[arm].append(result)
            print(
                f"  rep {rep} {arm:<7} {result['steps_per_s']:.1f} steps/s, "
                f"GC {result['gc_total_ms']:.0f} ms, max pause {result['gc_max_pause_ms']:.2f} ms",
                file=sys.stderr,
            )
    print_table(args, runs)


if __name__ == "__main__":
    main()
