"""batched_meta: the scheduler connector's metadata, step by step, equals upstream's.

Differential, on the installed release's real code: the bench's simulator (vLLM's real
``Scheduler`` with prefix caching and chunked prefill, its real
``AuxOutputSchedulerConnector``, the real worker connector and ``MessageQueue``, only
the model simulated) runs the same randomised workload twice, upstream and with
``batched_meta``, and every step's ``AuxOutputConnectorMetadata`` (generation,
``requests`` with its order, block hashes as bytes with their order, finished ids,
0.33's retained/released hashes, any extra attribute) and the connector's state after
it (sent-hash counts with their order, pending terminal events; 0.33's ``_loading``)
must be equal, as must the rows of every request: finished ones whole, and those still
in flight at the end on the rows received so far (as the bench's parity). Workloads: new requests,
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

import copy  # noqa: E402
import dataclasses  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import prime_r3  # noqa: E402
from prime_r3.bench.loop import RequestRecord, Simulator  # noqa: E402
from prime_r3.bench.workload import BenchConfig  # noqa: E402
from prime_r3.fixes import batched_meta  # noqa: E402
from prime_r3.guards import installed_vllm_version  # noqa: E402
from tests import fake_layers  # noqa: E402

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


def run(
    seed: int, recorder: type[Recorder] = Recorder
) -> tuple[list[Any], dict[str, dict[str, Any]], dict[str, int]]:
    """The metadata trace, the rows (SHA and count) of every request that received any,
    finished and still in flight at the end, and what the workload went through."""
    sim = recorder(config(seed), events_seed=seed)
    try:
        for _ in range(STEPS):
            sim.abort_some()
            sim.step()
        rows = {
            kind: {r: (sha, count) for r, (sha, _, count) in digests.items()}
            for kind, digests in (("finished", sim.finished), ("in flight", sim.in_flight()[0]))
        }
        seen = {"preempted": sim.preemptions, "hit_tokens": sim.prefix_hit_tokens}
        return sim.trace, rows, seen
    finally:
        sim.close()


def assert_same_rows(expected: dict[str, Any], got: dict[str, Any], where: str) -> None:
    """Every request's rows as upstream's: the finished ones whole, and the ones still in
    flight at the end on the rows received so far (a preempted request recomputes and is
    often still running when the run ends: without them its rows would go unchecked)."""
    for kind in ("finished", "in flight"):
        assert got[kind].keys() == expected[kind].keys(), f"{where}: {kind} requests differ"
        differ = sorted(r for r, digest in expected[kind].items() if got[kind][r] != digest)
        assert not differ, f"{where}: rows of {kind} request(s) {differ} differ"


def test_a_divergence_in_a_request_still_running_at_the_end_fails(
    reverted: pytest.MonkeyPatch,
) -> None:
    """The comparison covers requests in flight at the end, not only finished ones.

    The second run flips one routing value in the last rows a request received that is
    still running when the run ends (as a fix that broke only, say, resumed requests
    would): the metadata and every finished request are unchanged, and the comparison
    must still fail, naming that request.
    """
    expected, expected_rows, _ = run(0)
    target = sorted(expected_rows["in flight"])[0]

    class Corrupting(Recorder):
        def _consume(self, outputs: dict[int, Any], scheduler_output: Any) -> int:
            for eco in outputs.values():
                for out in eco.outputs:
                    rows = out.routed_experts
                    if out.request_id == target and rows is not None and len(rows):
                        rows = np.array(rows, copy=True)
                        rows.reshape(-1)[-1] ^= 1
                        out.routed_experts = rows
            return super()._consume(outputs, scheduler_output)

    got, got_rows, _ = run(0, Corrupting)
    assert got == expected and got_rows["finished"] == expected_rows["finished"]
    with pytest.raises(AssertionError, match=rf"in flight request\(s\) \['{target}'\] differ"):
        assert_same_rows(expected_rows, got_rows, "seed 0")


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
    totals = {"preempted": 0, "hit_tokens": 0, "steps": 0, "in_flight": 0}
    batched_meta.COUNTERS.reset()
    for seed in range(SEEDS):
        prime_r3.revert()
        expected, expected_rows, seen = run(seed)
        report = prime_r3.apply(["batched_meta"], log=False)
        assert report.outcome("batched_meta").state == "applied", report.summary()
        got, got_rows, _ = run(seed)
        assert got == expected, f"seed {seed}: {_first_difference(expected, got)}"
        assert_same_rows(expected_rows, got_rows, f"seed {seed}")
        totals["preempted"] += seen["preempted"]
        totals["hit_tokens"] += seen["hit_tokens"]
        totals["steps"] += len(got)
        totals["in_flight"] += len(got_rows["in flight"])
    counts = batched_meta.COUNTERS.snapshot()
    # The paths that matter were exercised, and the fast path did the common case.
    assert totals["preempted"] > 0 and totals["hit_tokens"] > 0, totals
    assert totals["in_flight"] > 0, totals  # unfinished requests' rows were compared
    assert counts["fast_requests"] > counts["fallback_requests"] > 0, counts
    assert {"new", "hashes"} <= counts["fallback_reasons"].keys(), counts
    print(f"\n{RELEASE}: {SEEDS} seeds, {totals['steps']} steps, {counts}, {totals}")
    print(f"took {time.perf_counter() - started:.1f}s")


# -- single steps on crafted requests: errors, overrides, the packed reader's mark ------


def _requests(real: Any, count: int) -> dict[str, Any]:
    """Real Requests decoding past their prompts (block hashes from the real hasher)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from prime_r3.bench.loop import _block_hasher

    hasher = _block_hasher(real.vllm_config, real.kv_cache_config)
    requests = {}
    for k in range(count):
        params = SamplingParams(max_tokens=64, routed_experts_prompt_start=k % 3)
        request = Request(
            f"q{k:03d}", list(range(1 + k, 11 + k)), params, None, block_hasher=hasher
        )
        request.append_output_token_ids(list(range(2 + k % 5)))
        request.num_computed_tokens = request.num_tokens - 1
        requests[request.request_id] = request
    return requests


def _connector_copy(connector: Any, sent: dict[str, int]) -> Any:
    clone = copy.copy(connector)
    for name, value in vars(connector).items():
        if isinstance(value, dict | list):
            setattr(clone, name, copy.copy(value))
    clone._sent_hash_counts = dict(sent)
    return clone


def _outcome(call: Any, connector: Any, *args: Any) -> tuple[Any, ...]:
    try:
        metadata = call(connector, *args)
        result: Any = ("ok", snapshot_metadata(metadata))
    except Exception as error:  # noqa: BLE001 - the error is the result compared
        result = ("raise", type(error), str(error))
    state = (
        list(connector._sent_hash_counts.items()),
        list(connector._finished_requests),
        sorted(getattr(connector, "_loading", {})),  # 0.33
    )
    return result, state


def snapshot_metadata(metadata: Any) -> tuple[Any, ...]:
    def packed(value: Any) -> Any:
        return None if value is None else (value.data, value.item_size)

    return (
        metadata.generation,
        list(metadata.requests.items()),
        [(k, packed(v)) for k, v in metadata.block_hashes.items()],
        metadata.finished_requests,
        [(k, v) for k, v in vars(metadata).items() if k.startswith("prime_r3")],
    )


def _step(requests: dict[str, Any]) -> Any:
    from vllm.v1.core.sched.output import SchedulerOutput

    so = SchedulerOutput.make_empty()
    so.num_scheduled_tokens = dict.fromkeys(requests, 1)
    return so


def _sent_all(requests: dict[str, Any]) -> dict[str, int]:
    """Every request known, its hashes sent: the fast case (0.33: keyed ones only)."""
    return {r: len(q.block_hashes) for r, q in requests.items()}


def _case(name: str, requests: dict[str, Any], sent: dict[str, int]) -> tuple[Any, Any, Any]:
    scheduler_output = _step(requests)
    if name == "missing request":
        scheduler_output.num_scheduled_tokens["nobody"] = 1
    elif name == "no sampling params":
        next(iter(requests.values())).sampling_params = None
    elif name == "hash history shrank":
        sent[next(iter(requests))] += 1
    elif name == "prompt start None":  # found by review: 0.32/0.33 did not read it
        list(requests.values())[5].sampling_params.routed_experts_prompt_start = None
    return scheduler_output, requests, sent


ERROR_CASES = {  # case -> what upstream raises (each release's real code)
    "missing request": KeyError,
    "no sampling params": AssertionError,
    "hash history shrank": AssertionError,
    "prompt start None": TypeError,  # upstream's min/max with None
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_upstream_errors_raised_by_upstream_with_its_effects(
    case: str, reverted: pytest.MonkeyPatch
) -> None:
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    from tests.test_packed_outputs import real_vllm

    real = real_vllm()
    connector = real.scheduler.aux_output_connector
    requests = _requests(real, 24)
    scheduler_output, requests, sent = _case(case, requests, _sent_all(requests))
    upstream = AuxOutputSchedulerConnector.build_connector_meta
    expected = _outcome(upstream, _connector_copy(connector, sent), scheduler_output, requests)
    assert expected[0][0] == "raise" and expected[0][1] is ERROR_CASES[case], expected
    prime_r3.apply(["batched_meta"], log=False)
    batched_meta.COUNTERS.reset()
    patched = AuxOutputSchedulerConnector.build_connector_meta
    got = _outcome(patched, _connector_copy(connector, sent), scheduler_output, requests)
    assert got == expected
    expected_reasons = (
        {"prompt": 1}  # that request alone goes to upstream, which raises on it
        if case == "prompt start None"
        else {"step": 25 if (case == "missing request") else 24}
    )
    assert batched_meta.COUNTERS.snapshot()["fallback_reasons"] == expected_reasons


def test_connector_subclass_with_own_hash_helper_goes_to_upstream(
    reverted: pytest.MonkeyPatch,
) -> None:
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    from tests.test_packed_outputs import real_vllm

    helper = "_take_new_hashes" if RELEASE.startswith("0.33.") else "_pack_new_hashes"
    calls: list[str] = []
    original = getattr(AuxOutputSchedulerConnector, helper)

    def counting(*args: Any) -> Any:
        calls.append(helper)
        return original(*args)

    subclass = type("Custom", (AuxOutputSchedulerConnector,), {helper: staticmethod(counting)
        if helper == "_pack_new_hashes" else counting})  # fmt: skip
    real = real_vllm()
    requests = _requests(real, 24)
    prime_r3.apply(["batched_meta"], log=False)
    batched_meta.COUNTERS.reset()
    connector = _connector_copy(real.scheduler.aux_output_connector, _sent_all(requests))
    connector.__class__ = subclass
    connector.build_connector_meta(_step(requests), requests)
    assert len(calls) == 24  # its helper saw every request, as under upstream
    assert batched_meta.COUNTERS.snapshot()["fallback_reasons"] == {"step": 24}


def test_fast_step_keeps_what_an_inner_wrapper_set_on_the_metadata(
    reverted: pytest.MonkeyPatch,
) -> None:
    """Nested as the layer stacks patches in registry order: packed_outputs' reader
    declaration (registered earlier) is the inner wrapper, batched_meta the outer one.
    The outer one's fast path still calls the inner one (on the trimmed step), so the
    step's metadata carries the inner wrapper's mark, and is otherwise upstream's."""
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    from prime_r3.fixes import packed_outputs
    from prime_r3.packed import FORMAT_VERSION, READS_MARK
    from tests.test_packed_outputs import real_vllm

    real = real_vllm()
    requests = _requests(real, 24)
    first = next(iter(requests))
    sent = _sent_all(requests)
    sent[first] -= 1  # one request with a hash to send: upstream packs it
    upstream = AuxOutputSchedulerConnector.build_connector_meta
    reference = _connector_copy(real.scheduler.aux_output_connector, sent)
    expected = _outcome(upstream, reference, _step(requests), requests)
    declare = packed_outputs._declare_packed_reader({})
    outer = batched_meta._batched_meta({})
    connector = _connector_copy(real.scheduler.aux_output_connector, sent)

    def inner(*args: Any, **kwargs: Any) -> Any:
        return declare(upstream.__get__(connector), connector, args, kwargs)

    batched_meta.COUNTERS.reset()
    metadata = outer(inner, connector, (_step(requests), requests), {})
    assert getattr(metadata, READS_MARK) == FORMAT_VERSION
    got_result, got_state = _outcome(lambda c, *a: metadata, connector)
    assert got_state == expected[1]
    assert got_result[1][:4] == expected[0][1][:4]  # upstream's metadata, order included
    assert got_result[1][4] == [(READS_MARK, FORMAT_VERSION)]
    assert batched_meta.COUNTERS.snapshot()["fast_requests"] == 23


@pytest.mark.parametrize("how", ["plain", *sorted(fake_layers.FUNCTION_LAYERS)])
def test_property_anchor_guard_sees_a_wrapped_getter(
    reverted: pytest.MonkeyPatch, how: str
) -> None:
    """Request.num_tokens is a property anchor: upstream's getter is plain; a getter that
    another layer wrapped (same property, new function) skips the patch."""
    from vllm.v1 import request as request_module

    cls = request_module.Request
    original = cls.__dict__["num_tokens"]
    if how != "plain":
        wrapped = fake_layers.FUNCTION_LAYERS[how](original.fget)
        reverted.setattr(cls, "num_tokens", property(wrapped))
    outcome = prime_r3.status().outcome("batched_meta")
    if how == "plain":
        assert outcome.state == "would_apply", outcome.reason
    else:
        assert outcome.state == "skipped"
        assert outcome.reason.startswith(
            "anchor vllm.v1.request:Request.num_tokens is not upstream's plain object"
        ), outcome.reason


@pytest.mark.skipif(not (RELEASE or "").startswith("0.33."), reason="0.33 has _loading")
def test_loading_entry_is_popped_by_upstream(reverted: pytest.MonkeyPatch) -> None:
    """0.33 pops a scheduled request's `_loading` entry (an external KV load finished):
    such a request goes to upstream, which pops it; the step equals upstream's."""
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    from tests.test_packed_outputs import real_vllm

    real = real_vllm()
    requests = _requests(real, 24)
    loading_id = list(requests)[5]
    connector = real.scheduler.aux_output_connector
    sent = _sent_all(requests)
    upstream = AuxOutputSchedulerConnector.build_connector_meta
    reference = _connector_copy(connector, sent)
    reference._loading = {loading_id: set(), "elsewhere": set()}
    expected = _outcome(upstream, reference, _step(requests), requests)
    assert expected[1][2] == ["elsewhere"]  # upstream popped the scheduled one
    prime_r3.apply(["batched_meta"], log=False)
    batched_meta.COUNTERS.reset()
    patched = _connector_copy(connector, sent)
    patched._loading = {loading_id: set(), "elsewhere": set()}
    got = _outcome(
        AuxOutputSchedulerConnector.build_connector_meta, patched, _step(requests), requests
    )
    assert got == expected
    counts = batched_meta.COUNTERS.snapshot()
    assert counts["fallback_reasons"] == {"loading": 1} and counts["fast_requests"] == 23


def test_with_packed_outputs_stacked_under_it(
    reverted: pytest.MonkeyPatch, small_batches: None
) -> None:
    """Both patches wrap build_connector_meta; the layer nests them in registry order
    (packed_outputs inner). Every step equals upstream's plus packed_outputs' reader
    mark, the fast path ran, and the rows (sent packed) are upstream's. Skips while the
    layer cannot stack two patches on one target (before the `stack` branch)."""
    from prime_r3.packed import FORMAT_VERSION, READS_MARK

    batched_meta.COUNTERS.reset()
    for seed in range(4):
        prime_r3.revert()
        expected, expected_rows, _ = run(seed)
        try:
            prime_r3.apply(["packed_outputs", "batched_meta"], log=False)
        except prime_r3.PatchNotApplied as error:
            reason = error.report.outcome("batched_meta").reason
            assert "is not upstream's plain object" in reason, reason
            pytest.skip(f"this layer does not stack patches on one target: {reason}")
        got, got_rows, _ = run(seed)
        marks = [step[8] for step in got]
        assert marks == [[(READS_MARK, FORMAT_VERSION)]] * len(got)
        unmarked = [(*step[:8], [], *step[9:]) for step in got]
        assert unmarked == expected, f"seed {seed}: {_first_difference(expected, unmarked)}"
        assert_same_rows(expected_rows, got_rows, f"seed {seed}")
    assert batched_meta.COUNTERS.snapshot()["fast_requests"] > 0


class _CountsHidden:
    """A request mixin whose token counts are its own (say, a draft token held back):
    upstream reads ``num_tokens`` / ``num_output_tokens``, never the lists behind them."""

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids) - 1

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids) - 1


class _DuckRequest:
    """What upstream's build_connector_meta reads of a request, and nothing else."""

    def __init__(self, request: Any) -> None:
        self.request_id = request.request_id
        self.block_hashes = request.block_hashes
        self.sampling_params = request.sampling_params
        self.num_prompt_tokens = request.num_prompt_tokens
        self.num_computed_tokens = request.num_computed_tokens
        self._counts = (request.num_tokens, request.num_output_tokens)

    @property
    def num_tokens(self) -> int:
        return self._counts[0]

    @property
    def num_output_tokens(self) -> int:
        return self._counts[1]


@pytest.mark.parametrize("kind", ["subclass", "duck_typed"])
def test_requests_are_read_through_their_token_count_properties(
    kind: str, reverted: pytest.MonkeyPatch
) -> None:
    """A Request subclass with its own counts gets upstream's emit starts (the lists'
    lengths gave others), and a duck-typed request with only what upstream reads works
    (``_all_token_ids`` raised AttributeError)."""
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    from tests.test_packed_outputs import real_vllm

    real = real_vllm()
    requests = _requests(real, 24)
    for request_id, request in list(requests.items()):
        if kind == "subclass":
            request.__class__ = type("Hidden", (_CountsHidden, type(request)), {})
        else:
            requests[request_id] = _DuckRequest(request)
    sent = _sent_all(requests)
    connector = real.scheduler.aux_output_connector
    upstream = AuxOutputSchedulerConnector.build_connector_meta
    expected = _outcome(upstream, _connector_copy(connector, sent), _step(requests), requests)
    assert expected[0][0] == "ok", expected
    prime_r3.apply(["batched_meta"], log=False)
    batched_meta.COUNTERS.reset()
    patched = AuxOutputSchedulerConnector.build_connector_meta
    got = _outcome(patched, _connector_copy(connector, sent), _step(requests), requests)
    assert got == expected
    assert batched_meta.COUNTERS.snapshot()["fast_requests"] > 0


def test_a_malformed_step_gets_upstreams_error(reverted: pytest.MonkeyPatch) -> None:
    """``num_scheduled_tokens`` that is not a dict (here a Mock): the wrapper hands the
    step to upstream without calling ``len`` on it first, so the error is upstream's."""
    from unittest import mock

    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    from tests.test_packed_outputs import real_vllm

    real = real_vllm()
    requests = _requests(real, 24)
    scheduler_output = _step(requests)
    scheduler_output.num_scheduled_tokens = mock.Mock()
    connector = real.scheduler.aux_output_connector
    upstream = AuxOutputSchedulerConnector.build_connector_meta
    expected = _outcome(upstream, _connector_copy(connector, {}), scheduler_output, requests)
    assert expected[0][0] == "raise", expected
    prime_r3.apply(["batched_meta"], log=False)
    batched_meta.COUNTERS.reset()
    patched = AuxOutputSchedulerConnector.build_connector_meta
    assert _outcome(patched, _connector_copy(connector, {}), scheduler_output, requests) == expected
    assert batched_meta.COUNTERS.snapshot()["fallback_reasons"] == {"step": 1}


def test_the_scan_equals_its_reference_form(
    reverted: pytest.MonkeyPatch, small_batches: None
) -> None:
    """On every step of the episodes, the lean scan's fast requests and their emit starts
    are those of ``scan_reference``: upstream's loop, read-only, on the same objects,
    with upstream's emit-start formula (``emit_start_reference``) for the fast ones."""
    from prime_r3 import fingerprint

    variant = fingerprint.of_name(
        batched_meta._CONNECTOR, "AuxOutputSchedulerConnector.build_connector_meta"
    )
    compared: Counter[str] = Counter()

    def checking(scan: Any) -> Any:
        def check(connector: Any, num_scheduled: Any, requests: Any) -> Any:
            values, slow, reasons = scan(connector, num_scheduled, requests)
            expected = batched_meta.scan_reference(connector, num_scheduled, requests, variant)
            assert (values, slow) == expected
            compared["fast"] += len(values) - len(slow)
            compared["slow"] += len(slow)
            return values, slow, reasons

        return check

    for name in ("_scan_031", "_scan_032", "_scan_033"):
        reverted.setattr(batched_meta, name, checking(getattr(batched_meta, name)))
    report = prime_r3.apply(["batched_meta"], log=False)
    assert report.outcome("batched_meta").state == "applied", report.summary()
    for seed in range(3):
        run(seed)
    assert compared["fast"] > compared["slow"] > 0, compared
