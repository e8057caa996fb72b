"""batched_meta: the scheduler connector's metadata, step by step, equals upstream's.

Differential, on the installed release's real code: the bench's simulator (vLLM's real
``Scheduler`` with prefix caching and chunked prefill, its real
``AuxOutputSchedulerConnector``, the real worker connector and ``MessageQueue``, only
the model simulated) runs the same randomised workload twice, upstream and with
``batched_meta``, and every step's ``AuxOutputConnectorMetadata`` (generation,
``requests`` with its order, block hashes as bytes with their order, finished ids,
0.33's retained/released hashes, any extra attribute) and the connector's state after
it (sent-hash counts with their order, pending terminal events; 0.33's ``_loading``)
must be equal, as must every finished request's rows. Workloads: new requests,
chunked prefill, decode, preemption (KV sized to overflow), prefix hits (repeated
prompts), aborts (terminal events, some with a step in flight), routed-experts prompt
starts inside and beyond the prompt, async scheduling's two steps in flight.

Errors: steps upstream fails on (a scheduled id missing from ``requests``, a request
without sampling params, a hash history that shrank) are handed to upstream whole, so
the same exception leaves the same state.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import dataclasses  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import prime_r3  # noqa: E402
from prime_r3.bench.loop import RequestRecord, Simulator  # noqa: E402
from prime_r3.bench.workload import BenchConfig  # noqa: E402
from prime_r3.fixes import batched_meta  # noqa: E402
from prime_r3.guards import installed_vllm_version  # noqa: E402

RELEASE = installed_vllm_version()
SEEDS = 12
STEPS = 128
#: vLLM 0.31.0 does not clamp the prompt start to the prompt (0.32 added ``min(...,
#: num_prompt_tokens)``): a start beyond the prompt makes upstream 0.31 itself fail
#: (``take_output`` finds no output for the request), so 0.31 gets starts inside it.
BEYOND_PROMPT = not (RELEASE or "").startswith("0.31.")


class Recorder(Simulator):
    """The bench simulator plus prompt starts, aborts and a record of every step."""

    def __init__(self, cfg: BenchConfig, events_seed: int) -> None:
        self.events = np.random.default_rng([events_seed, 1])
        self.trace: list[Any] = []
        # vLLM loads its general plugins (prime_r3) while building a config: the arms
        # decide what is applied, not the plugin.
        saved = os.environ.get("PRIME_R3")
        os.environ["PRIME_R3"] = "0"
        try:
            super().__init__(cfg, r3=True)
        finally:
            if saved is None:
                del os.environ["PRIME_R3"]
            else:
                os.environ["PRIME_R3"] = saved
        printer = self.printer  # the bench's fingerprint reshapes; empty chunks have none
        self.printer = lambda rows: printer(rows) if len(rows) else np.zeros(0, np.uint64)
        schedule = self.scheduler.schedule

        def recording_schedule() -> Any:
            so = schedule()
            self.trace.append(snapshot(so.aux_output_connector_metadata, self.scheduler))
            return so

        self.scheduler.schedule = recording_schedule  # this test's instance only

    def _add_request(self) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        spec = self.workload.next_request()
        kind = self.events.integers(0, 6)
        # Mostly 0 (upstream's default); some inside the prompt, some beyond it.
        beyond = len(spec.prompt) + 3 if BEYOND_PROMPT else len(spec.prompt) - 1
        start = {0: len(spec.prompt) // 2, 1: beyond}.get(int(kind), 0)
        params = SamplingParams(
            max_tokens=spec.max_tokens,
            ignore_eos=True,
            temperature=0.0,
            routed_experts_prompt_start=start,
        )
        # Ids in no particular order, so dict order is not also id order.
        request_id = f"{int(self.events.integers(0, 1 << 30)):09d}-{spec.request_id}"
        request = Request(request_id, spec.prompt, params, None, block_hasher=self.block_hasher)
        self.scheduler.add_request(request)
        self.records[request_id] = RequestRecord()

    def abort_some(self) -> None:
        from vllm.v1.request import RequestStatus

        if self.events.random() >= 0.08 or not self.scheduler.requests:
            return
        ids = sorted(self.scheduler.requests)
        request_id = ids[int(self.events.integers(0, len(ids)))]
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        self._finish(request_id)
        self._add_request()


def snapshot(metadata: Any, scheduler: Any) -> tuple[Any, ...]:
    """Everything the step's metadata carries and the connector keeps, in order."""

    def packed(value: Any) -> Any:
        return None if value is None else (type(value).__name__, value.data, value.item_size)

    fields = {f.name for f in dataclasses.fields(metadata)}
    extra = sorted((k, v) for k, v in vars(metadata).items() if k not in fields)
    connector = scheduler.aux_output_connector
    state = [
        list(connector._sent_hash_counts.items()),
        [(k, packed(v)) for k, v in connector._finished_requests.items()],
        connector._generation,
    ]
    if hasattr(connector, "_loading"):  # 0.33
        state += [
            sorted((k, sorted(v)) for k, v in connector._loading.items()),
            list(connector._kv_cached),
            list(connector._retained_hashes),
            list(connector._released_hashes),
        ]
    return (
        type(metadata).__name__,
        metadata.generation,
        list(metadata.requests.items()),
        [type(v) for v in metadata.requests.values()],
        [(k, packed(v)) for k, v in metadata.block_hashes.items()],
        metadata.finished_requests,
        packed(getattr(metadata, "retained_block_hashes", None)),
        packed(getattr(metadata, "released_block_hashes", None)),
        extra,
        state,
    )


def config(seed: int) -> BenchConfig:
    rng = np.random.default_rng([seed, 2])
    return BenchConfig(
        concurrency=int(rng.integers(20, 48)),
        steps=STEPS,
        warmup=0,
        layers=2,
        topk=2,
        experts=8,
        prefix_len=int(rng.choice([16, 32])),
        problem_len=int(rng.integers(8, 40)),
        samples_per_prompt=int(rng.integers(1, 6)),
        max_tokens=int(rng.integers(16, 64)),
        min_tokens=2,
        max_num_batched_tokens=int(rng.choice([64, 128, 512])),
        kv_fraction=float(rng.choice([0.15, 0.3, 1.0])),
        async_scheduling=bool(seed % 2),
        seed=seed,
    )


def run(seed: int) -> tuple[list[Any], dict[str, Any], dict[str, int]]:
    sim = Recorder(config(seed), events_seed=seed)
    try:
        for _ in range(STEPS):
            sim.abort_some()
            sim.step()
        digests = {r: (sha, rows) for r, (sha, _, rows) in sim.finished.items()}
        seen = {"preempted": sim.preemptions, "hit_tokens": sim.prefix_hit_tokens}
        return sim.trace, digests, seen
    finally:
        sim.close()


def _first_difference(a: list[Any], b: list[Any]) -> str:
    for step, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            parts = [i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q]
            return f"step {step}: parts {parts}: upstream {x!r} != patched {y!r}"
    return f"lengths {len(a)} != {len(b)}"


@pytest.fixture
def small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Most steps here have 20-48 requests: let the fast path take steps of 2 and more."""
    monkeypatch.setattr(batched_meta, "MIN_BATCH", 2)


def test_metadata_and_state_equal_upstream_every_step(
    reverted: pytest.MonkeyPatch, small_batches: None
) -> None:
    started = time.perf_counter()
    totals = {"preempted": 0, "hit_tokens": 0, "steps": 0}
    batched_meta.COUNTERS.reset()
    for seed in range(SEEDS):
        prime_r3.revert()
        expected, expected_rows, seen = run(seed)
        report = prime_r3.apply(["batched_meta"], log=False)
        assert report.outcome("batched_meta").state == "applied", report.summary()
        got, got_rows, _ = run(seed)
        assert got == expected, f"seed {seed}: {_first_difference(expected, got)}"
        assert got_rows == expected_rows, f"seed {seed}: finished rows differ"
        totals["preempted"] += seen["preempted"]
        totals["hit_tokens"] += seen["hit_tokens"]
        totals["steps"] += len(got)
    counts = batched_meta.COUNTERS.snapshot()
    # The paths that matter were exercised, and the fast path did the common case.
    assert totals["preempted"] > 0 and totals["hit_tokens"] > 0, totals
    assert counts["fast_requests"] > counts["fallback_requests"] > 0, counts
    assert {"new", "hashes"} <= counts["fallback_reasons"].keys(), counts
    print(f"\n{RELEASE}: {SEEDS} seeds, {totals['steps']} steps, {counts}, {totals}")
    print(f"took {time.perf_counter() - started:.1f}s")
