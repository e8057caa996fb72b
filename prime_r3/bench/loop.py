"""The engine-step loop: EngineCore's ``step``/``step_with_batch_queue`` around real vLLM parts.

Per step: the real scheduler schedules; the model stand-in "executes" and the real
worker connector runs ``begin_step`` / ``prepare_output`` / ``enqueue_cpu_copy`` /
``process_output`` as the V2 runner's ``AsyncOutput`` does; the ``ModelRunnerOutput``
crosses vLLM's real ``MessageQueue``; the scheduler consumes it with
``update_from_output`` (which calls ``take_output``). With async scheduling the batch
queue holds two steps, so step N+1's ``begin_step`` runs before step N's output is
processed, exactly the ordering the connector's deferred teardown exists for.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prime_r3.bench import vllm_setup
from prime_r3.bench.meters import GcMeter, StoreMeter, ThreadClock
from prime_r3.bench.model import ModelStandIn
from prime_r3.bench.workload import BenchConfig, Workload

#: Main-thread CPU time (``time.thread_time``) per phase; robust to other load on the box.
_cpu = time.thread_time

#: ``aux`` is the worker connector's total; ``aux_begin``/``aux_prepare``/``aux_process``
#: split it. ``model`` (the stand-in) and ``client`` (output-processor work: collecting
#: rows, hashing them for parity) are not vLLM engine work and are subtracted from it.
PHASES = (
    "sched",
    "aux",
    "aux_begin",
    "aux_prepare",
    "aux_process",
    "transport",
    "writer",
    "model",
    "client",
    "gc",
)


@dataclass
class _Job:
    scheduler_output: Any
    output: Any
    pending: Any = None


@dataclass
class RequestRecord:
    """What the output processor would assemble for one request, plus how it was served."""

    sha: Any = field(default_factory=hashlib.sha256)
    row_prints: list[np.ndarray] = field(default_factory=list)
    rows: int = 0
    preempted: bool = False
    cached_tokens: int = 0

    def digest(self) -> tuple[str, np.ndarray, int]:
        """SHA-256 hex of the rows so far, their row fingerprints, and the row count."""
        prints = np.concatenate(self.row_prints) if self.row_prints else np.zeros(0, np.uint64)
        return self.sha.hexdigest(), prints, self.rows


class RowPrinter:
    """64-bit fingerprint per routing row, so a mismatch can name its first differing row."""

    def __init__(self, row_nbytes: int) -> None:
        self._words = -(-row_nbytes // 8)
        rng = np.random.default_rng(1234)
        self._mult = rng.integers(1, 1 << 63, self._words, dtype=np.uint64) | np.uint64(1)

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        """One print per row; an empty chunk (e.g. ``routed_experts_prompt_start`` beyond
        the prompt hands a request zero rows) has none, where ``reshape(0, -1)`` fails."""
        if len(rows) == 0:
            return np.zeros(0, np.uint64)
        flat = np.ascontiguousarray(rows).reshape(len(rows), -1).view(np.uint8)
        pad = self._words * 8 - flat.shape[1]
        if pad:
            flat = np.pad(flat, ((0, 0), (0, pad)))
        words = np.ascontiguousarray(flat).view(np.uint64)
        return (words * self._mult).sum(axis=1, dtype=np.uint64)


class Simulator:
    """One arm's engine: build everything, then :meth:`step` until done."""

    def __init__(self, cfg: BenchConfig, r3: bool) -> None:
        from vllm.v1.engine import core as engine_core

        self.cfg = cfg
        self.r3 = r3
        self.vllm_config = vllm_setup.build_vllm_config(cfg, r3)
        kv_cache_config = vllm_setup.build_kv_cache_config(cfg)
        self.scheduler = vllm_setup.build_scheduler(self.vllm_config, kv_cache_config)
        # Our stand-in plays the V2 runner, the only runner vLLM wires R3 into.
        self.scheduler.use_v2_model_runner = True
        self.connector = (
            vllm_setup.build_worker_connector(self.vllm_config, kv_cache_config) if r3 else None
        )
        self.transport = vllm_setup.Transport()
        self.model = ModelStandIn(cfg)
        self.workload = Workload(cfg)
        self.block_hasher = _block_hasher(self.vllm_config, kv_cache_config)
        self.batch_queue: deque[_Job] = deque()
        self.queue_size = self.vllm_config.max_concurrent_batches
        self.store = StoreMeter(self.connector)
        self.writer_clock = ThreadClock("vllm-aux-output-writer")
        self.records: dict[str, RequestRecord] = {}
        self.finished: dict[str, tuple[str, np.ndarray, int]] = {}
        self.finished_flags: dict[str, tuple[bool, int]] = {}
        self.preemptions = 0
        self.prefix_hit_tokens = 0
        self.printer = RowPrinter(cfg.layers * cfg.topk * (1 if cfg.experts <= 256 else 2))
        # EngineCore freezes its startup heap here, before any request arrives; looked up
        # through the module so a wrapper (prime_r3's engine_gc) runs as it would in vLLM.
        engine_core.freeze_gc_heap()
        for _ in range(cfg.concurrency):
            self._add_request()

    # -- requests ----------------------------------------------------------------

    def _add_request(self) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        spec = self.workload.next_request()
        params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True, temperature=0.0)
        request = Request(
            spec.request_id, spec.prompt, params, None, block_hasher=self.block_hasher
        )
        self.scheduler.add_request(request)
        self.records[spec.request_id] = RequestRecord()

    def _consume(self, outputs: dict[int, Any], scheduler_output: Any) -> int:
        """Output-processor role: collect rows, finish requests, refill the closed loop."""
        finished = 0
        for eco in outputs.values():
            stats = eco.scheduler_stats
            if stats is not None:
                self.prefix_hit_tokens += stats.prefix_cache_stats.hits
            for out in eco.outputs:
                record = self.records[out.request_id]
                rows = out.routed_experts
                if rows is not None and self.cfg.parity:
                    record.sha.update(np.ascontiguousarray(rows).tobytes())
                    record.row_prints.append(self.printer(rows))
                if rows is not None:
                    record.rows += len(rows)
                if out.finish_reason is not None:
                    finished += 1
                    self._finish(out.request_id)
        return finished

    def _finish(self, request_id: str) -> None:
        record = self.records.pop(request_id)
        self.finished[request_id] = record.digest()
        self.finished_flags[request_id] = (record.preempted, record.cached_tokens)

    def in_flight(
        self,
    ) -> tuple[dict[str, tuple[str, np.ndarray, int]], dict[str, tuple[bool, int]]]:
        """Digests and flags of the requests still running that have received rows.

        Rows reach the output processor step by step, so a request in flight at the end
        has a well-defined stream so far. A preempted request goes back to the waiting
        queue and recomputes once blocks free up, so in a bench-length run it is usually
        still running at the end (at the defaults none finishes): parity has to compare
        these streams or it never sees the preemption path. Called after the measured
        loop, so it adds no work to any step.
        """
        live = {r: rec for r, rec in self.records.items() if rec.rows > 0}
        digests = {r: rec.digest() for r, rec in live.items()}
        return digests, {r: (rec.preempted, rec.cached_tokens) for r, rec in live.items()}

    def _note_schedule(self, so: Any) -> None:
        for req_id in so.preempted_req_ids or ():
            self.preemptions += 1
            self.records[req_id].preempted = True
        for new in so.scheduled_new_reqs:
            record = self.records[new.req_id]
            record.cached_tokens = max(record.cached_tokens, new.num_computed_tokens)

    # -- worker side -------------------------------------------------------------

    def _execute(self, so: Any, times: dict[str, float]) -> _Job:
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

        t0 = _cpu()
        self.model.update_states(so)
        t1 = _cpu()
        if self.connector is not None:
            self.connector.begin_step(so.aux_output_connector_metadata)
        t2 = _cpu()
        times["model"] += t1 - t0
        times["aux_begin"] += t2 - t1
        if so.total_num_scheduled_tokens == 0:
            return _Job(so, EMPTY_MODEL_RUNNER_OUTPUT)
        batch, rows, sampled, num_sampled = self.model.execute(so)
        output = ModelRunnerOutput(
            req_ids=batch.req_ids,
            req_id_to_index={r: i for i, r in enumerate(batch.req_ids)},
            sampled_token_ids=sampled,
        )
        t3 = _cpu()
        times["model"] += t3 - t2
        pending = None
        if self.connector is not None:
            self.connector._capturer.load(rows)
            pending = self.connector.prepare_output(batch)
            if pending is not None:
                pending.enqueue_cpu_copy(num_sampled, np.zeros(len(batch.req_ids), np.int32))
        times["aux_prepare"] += _cpu() - t3
        return _Job(so, output, pending)

    def _complete(self, job: _Job, times: dict[str, float]) -> Any:
        t0 = _cpu()
        if job.pending is not None:
            job.output.aux_output_connector_output = job.pending.process_output()
        t1 = _cpu()
        received = self.transport.send(job.output)
        times["aux_process"] += t1 - t0
        times["transport"] += _cpu() - t1
        return received

    # -- the EngineCore step ------------------------------------------------------

    def step(self) -> dict[str, float]:
        """One ``step_with_batch_queue`` (queue size 1 is exactly ``step``)."""
        times = dict.fromkeys(PHASES, 0.0)
        sched = self.scheduler
        if sched.has_requests():
            t0 = _cpu()
            so = sched.schedule()
            times["sched"] += _cpu() - t0
            self._note_schedule(so)
            self.batch_queue.appendleft(self._execute(so, times))
            executed = so.total_num_scheduled_tokens > 0
            if len(self.batch_queue) < self.queue_size and (executed or sched.has_requests()):
                return times
        elif not self.batch_queue:
            return times
        job = self.batch_queue.pop()
        received = self._complete(job, times)
        t0 = _cpu()
        outputs = sched.update_from_output(job.scheduler_output, received)
        times["sched"] += _cpu() - t0
        t0 = _cpu()
        finished = self._consume(outputs, job.scheduler_output)
        times["client"] += _cpu() - t0
        t0 = _cpu()
        for _ in range(finished):
            self._add_request()
        times["sched"] += _cpu() - t0
        return times

    def close(self) -> None:
        """Stop the writer thread and free the queue; a store error was already reported."""
        try:
            if self.connector is not None:
                self.connector.close()
        except Exception:  # noqa: BLE001 - the failing step recorded it
            pass
        finally:
            self.transport.close()


def _block_hasher(vllm_config: Any, kv_cache_config: Any) -> Callable[[Any], Any]:
    """The request block hasher EngineCore builds when prefix caching is on."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        resolve_kv_cache_block_sizes,
    )

    _, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(hash_block_size, hash_fn)


def run(
    cfg: BenchConfig,
    r3: bool,
    progress: Callable[[int], None] | None = None,
    before_step: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Run warm-up plus measured steps; return per-step meters and per-request digests.

    ``before_step(step)`` runs ahead of each step, outside its meters (the interleaved
    runner waits there for its turn)."""
    sim = Simulator(cfg, r3)
    per_step = {name: np.zeros(cfg.total_steps) for name in (*PHASES, "wall", "cpu")}
    gc_counts = np.zeros((cfg.total_steps, 3), dtype=np.int64)
    window: dict[str, Any] = {}
    error = None
    with GcMeter() as gc_meter:
        step = 0
        try:
            for step in range(cfg.total_steps):
                # The writer thread's CPU is read before a wait for the turn: what it
                # finishes of the last step meanwhile is still this arm's, counted here.
                writer_before = sim.writer_clock.seconds()
                if before_step is not None:
                    before_step(step)
                if step == cfg.warmup:
                    window = _snapshot(sim)
                    _reset_fast_path_counters()
                counts_before, gc_before = list(gc_meter.counts), gc_meter.seconds
                t0, c0 = time.perf_counter(), _cpu()
                times = sim.step()
                per_step["wall"][step] = time.perf_counter() - t0
                per_step["cpu"][step] = _cpu() - c0
                times["aux"] = times["aux_begin"] + times["aux_prepare"] + times["aux_process"]
                times["writer"] = sim.writer_clock.seconds() - writer_before
                times["gc"] = gc_meter.seconds - gc_before
                for name, value in times.items():
                    per_step[name][step] = value
                gc_counts[step] = np.subtract(gc_meter.counts, counts_before)
                sim.store.sample()
                if progress is not None:
                    progress(step)
        except Exception as exc:  # noqa: BLE001 - an arm that dies is a result, reported
            error = f"step {step}: {type(exc).__name__}: {exc}"
            per_step = {k: v[:step] for k, v in per_step.items()}
            gc_counts = gc_counts[:step]
    try:
        end = _snapshot(sim)
        in_flight, in_flight_flags = sim.in_flight()
        result = {
            "error": error,
            "per_step": {k: v.tolist() for k, v in per_step.items()},
            "gc_counts": gc_counts.tolist(),
            "window": {k: end[k] - window.get(k, 0) for k in end},
            "store_slots": sim.store.slots,
            "store_size": sim.store.size,
            "store_peak_size": sim.store.peak_size,
            "store_peak_referenced": sim.store.peak_referenced,
            "max_concurrent_batches": sim.queue_size,
            "digests": {r: (sha, prints, rows) for r, (sha, prints, rows) in sim.finished.items()},
            "in_flight": in_flight,
            "flags": sim.finished_flags | in_flight_flags,
            "fast_path": _fast_path_counters(),
            "handshake": _handshake_counters(),
        }
    finally:
        sim.close()
    return result


#: Patches that count which requests their fast path took and which went to upstream.
_COUNTED = ("batched_commit", "batched_take")


def _counted_modules() -> list[Any]:
    """The counting patches' modules, if this arm imported them (i.e. applied them)."""
    import sys

    return [
        (name, module)
        for name in _COUNTED
        if (module := sys.modules.get(f"prime_r3.fixes.{name}")) is not None
    ]


def _handshake_module() -> Any:
    """packed_outputs' module, if this arm imported it (i.e. applied it)."""
    import sys

    return sys.modules.get("prime_r3.fixes.packed_outputs")


def _reset_fast_path_counters() -> None:
    for _, module in _counted_modules():
        module.COUNTERS.reset()
    if (module := _handshake_module()) is not None:
        module.COUNTERS.reset()


def _handshake_counters() -> dict[str, Any] | None:
    """packed_outputs' handshake over the measured window: steps EngineCore declared it
    reads the packed form, and steps withheld (sent per request, as upstream) by reason.
    None where packed_outputs did not run or counted nothing."""
    module = _handshake_module()
    if module is None:
        return None
    counts = module.COUNTERS.snapshot()
    return counts if counts["declared_steps"] or counts["withheld_steps"] else None


def _fast_path_counters() -> dict[str, Any]:
    """Fast-path vs upstream counts over the measured window, per counting patch."""
    return {
        name: counts
        for name, module in _counted_modules()
        if (counts := module.COUNTERS.snapshot())["steps"] or counts["fallback_requests"]
    }


def _snapshot(sim: Simulator) -> dict[str, int]:
    return {
        "preemptions": sim.preemptions,
        "prefix_hit_tokens": sim.prefix_hit_tokens,
        "evictions": sim.store.evictions,
        "released": sim.store.released,
        "finished": len(sim.finished),
    }
