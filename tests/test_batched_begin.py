"""batched_begin: begin_step on trimmed metadata leaves upstream's worker state and errors.

Oracle: upstream's ``begin_step`` (the original the layer saved) on a second real
connector fed the same steps (tests/batched_harness.py). begin_step differs between
0.32 and 0.33 (retained/released block hashes); both fingerprints were verified, so the
patch is expected to apply on 0.31.0, 0.32.0 and 0.33.0.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import random  # noqa: E402
import threading  # noqa: E402
import types  # noqa: E402
from collections import Counter  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402
import wrapt  # noqa: E402
from vllm.distributed.aux_output_connector import worker as aux_worker  # noqa: E402
from vllm.distributed.aux_output_connector.connector import (  # noqa: E402
    AuxOutputConnectorMetadata,
)

import prime_r3  # noqa: E402
from prime_r3 import guards  # noqa: E402
from prime_r3.fixes import batched_begin  # noqa: E402
from tests import batched_harness as harness  # noqa: E402
from tests import scale  # noqa: E402


def _apply(*names: str) -> None:
    report = prime_r3.apply(list(names), log=False)
    for name in names:
        assert report.outcome(name).state == "applied", report.summary()


def test_applies_on_every_supported_release(reverted: pytest.MonkeyPatch) -> None:
    assert guards.installed_vllm_version() in {"0.31.0", "0.32.0", "0.33.0"}
    _apply("batched_begin")
    target = aux_worker.AuxOutputWorkerConnector.__dict__["begin_step"]
    assert isinstance(target, wrapt.FunctionWrapper)
    prime_r3.revert(["batched_begin"])
    assert aux_worker.AuxOutputWorkerConnector.__dict__["begin_step"] is harness.upstream(
        "begin_step"
    )


@pytest.mark.parametrize("chunk", range(2 if scale.FULL else 1))  # 24 seeds each
def test_differential_parity_with_batched_commit(reverted: pytest.MonkeyPatch, chunk: int) -> None:
    """24 seeds per chunk x 300 steps with both batched patches: state, store, outputs, errors."""
    _apply("batched_commit", "batched_begin")
    batched_begin.COUNTERS.reset()
    seen: Counter[str] = Counter()
    steps = 0
    for seed in range(2000 + 24 * chunk, 2000 + 24 * (chunk + 1)):
        shape = harness.Shape(store_slots=(1024, 160)[seed % 2], background=seed % 8 == 0)
        episode = harness.run_episode(seed, 300, shape, async_scheduling=seed % 2 == 1)
        seen.update(episode.seen)
        steps += episode.steps
    counts = batched_begin.COUNTERS.snapshot()
    assert counts["fast_requests"] > 0 and counts["fallback_reasons"].get("new"), counts
    assert counts["fallback_reasons"].get("step"), counts  # generation changes, finishes
    assert seen["generation_change"] and seen["finished_in_flight"] and steps > 3000


def test_settled_emit_ahead_raises_upstreams_error(reverted: pytest.MonkeyPatch) -> None:
    """A settled request whose scheduler emit start moved ahead: upstream's assertion."""
    _apply("batched_begin")
    batched_begin.COUNTERS.reset()
    errors = {}
    for reference in (True, False):
        connector = harness.make_connector(harness.Shape(), reference)
        connector.begin_step(AuxOutputConnectorMetadata(0, {"a": 0, "b": 3}, {}, ()))
        try:
            connector.begin_step(AuxOutputConnectorMetadata(0, {"a": 0, "b": 4}, {}, ()))
        except AssertionError as error:
            errors[reference] = (str(error), sorted(connector._requests))
        connector.close()
    assert errors[True] == errors[False]
    assert errors[True][0] == "auxiliary output Scheduler emit cursor moved ahead"
    counts = batched_begin.COUNTERS.snapshot()
    # First metadata: both new (upstream's loop); second: handed to upstream whole.
    assert counts["fallback_reasons"] == {"new": 2, "step": 2}, counts


def test_known_requests_skip_upstreams_loop(reverted: pytest.MonkeyPatch) -> None:
    """Known requests are checked here; upstream sees only the new one, in order."""
    _apply("batched_begin")
    batched_begin.COUNTERS.reset()
    connector = harness.make_connector(harness.Shape(), reference=False)
    first = AuxOutputConnectorMetadata(0, {"a": 0, "b": 0}, {}, ())
    connector.begin_step(first)
    second = AuxOutputConnectorMetadata(0, {"c": 5, "a": 0, "b": 0}, {}, ())
    connector.begin_step(second)
    assert connector._step_metadata is second  # as upstream leaves it
    assert list(connector._requests) == ["a", "b", "c"]
    assert connector._requests["c"].emit_cursor == 5
    assert batched_begin.COUNTERS.snapshot()["fast_requests"] == 2
    connector.close()


def test_the_trimmed_metadata_keeps_the_packed_reader_declaration(
    reverted: pytest.MonkeyPatch,
) -> None:
    """Upstream holds the copy as the step's metadata while begin_step runs: a concurrent
    process_output must still see EngineCore's declaration there (found by review)."""
    from prime_r3.fixes import batched_begin
    from prime_r3.packed import FORMAT_VERSION, READS_MARK, reader_declared

    _apply("batched_begin")
    connector = harness.make_connector(harness.Shape(), reference=False)
    connector.begin_step(AuxOutputConnectorMetadata(0, {"a": 0, "b": 0}, {}, ()))
    metadata = AuxOutputConnectorMetadata(0, {"c": 5, "a": 0, "b": 0}, {}, ())
    setattr(metadata, READS_MARK, FORMAT_VERSION)
    trimmed = batched_begin._trim(connector, metadata, metadata.requests)
    assert trimmed is not None
    known, new = trimmed
    assert known == 2 and list(new.requests) == ["c"]
    assert reader_declared(new)
    connector.close()


def test_worker_states_are_read_under_the_connector_lock(
    reverted: pytest.MonkeyPatch,
) -> None:
    """The output thread's process_output changes pending_outputs and tears states down
    under ``_lock``: the known-request check reads them under it too, as upstream's loop
    does, and releases it before upstream's begin_step takes it (a plain Lock)."""
    _apply("batched_begin")
    connector = harness.make_connector(harness.Shape(), reference=False)
    connector.begin_step(AuxOutputConnectorMetadata(0, {"a": 0, "b": 0}, {}, ()))
    held = []
    trim = batched_begin._trim

    def recording_trim(instance, metadata, scheduled):  # noqa: ANN001, ANN202
        held.append(instance._lock.locked())
        return trim(instance, metadata, scheduled)

    reverted.setattr(batched_begin, "_trim", recording_trim)
    connector.begin_step(AuxOutputConnectorMetadata(0, {"c": 5, "a": 0, "b": 0}, {}, ()))
    assert held == [True]
    assert not connector._lock.locked()
    assert list(connector._requests) == ["a", "b", "c"]
    connector.close()


def test_in_flight_emit_ahead_stays_fast(reverted: pytest.MonkeyPatch) -> None:
    """Upstream checks only settled requests: with a step in flight the scheduler's
    optimistic emit start may be ahead of the worker's cursor. Such a request is
    checked here (not handed to upstream whole), mixed with a settled one that is not
    ahead; the states end as upstream's."""
    _apply("batched_begin")
    batched_begin.COUNTERS.reset()
    ends = {}
    for reference in (True, False):
        connector = harness.make_connector(harness.Shape(), reference)
        connector.begin_step(AuxOutputConnectorMetadata(0, {"a": 0, "b": 3}, {}, ()))
        connector._requests["a"].pending_outputs = 1  # a step in flight covers "a"
        connector.begin_step(AuxOutputConnectorMetadata(0, {"a": 7, "b": 3}, {}, ()))
        ends[reference] = {r: vars(s) for r, s in connector._requests.items()}
        connector._requests["a"].pending_outputs = 0
        connector.close()
    assert ends[True] == ends[False]
    counts = batched_begin.COUNTERS.snapshot()
    # First metadata: both new (upstream's loop); second: both checked here.
    assert counts["fallback_reasons"] == {"new": 2}, counts
    assert counts["fast_requests"] == 2, counts


@pytest.mark.parametrize(
    "new_at",
    [(0, 17), (0, 3, 9, 17, 25, 33, 40, 41), (40, 41, 42), (17, 41)],
    ids=["few", "many", "tail", "middle_and_tail"],
)
def test_new_requests_among_known_ones_keep_the_scheduler_order(
    reverted: pytest.MonkeyPatch, new_at: tuple[int, ...]
) -> None:
    """New requests anywhere among the known ones (all after them, as the scheduler
    orders them: taken from the tail; elsewhere: one pass) reach upstream in the
    scheduler's order, so the worker's states are made in upstream's order with
    upstream's values; a known one ahead of its settled cursor
    still hands the whole metadata to upstream, new ones or not."""
    _apply("batched_begin")
    batched_begin.COUNTERS.reset()
    known = {f"k{i}": i for i in range(40)}
    order = list(known)
    for at in new_at:
        order.insert(at, f"n{at}")
    requests = {r: known.get(r, 5) for r in order}
    ends, errors = {}, {}
    for reference in (True, False):
        connector = harness.make_connector(harness.Shape(max_num_seqs=64), reference)
        connector.begin_step(AuxOutputConnectorMetadata(0, known, {}, ()))
        connector.begin_step(AuxOutputConnectorMetadata(0, requests, {}, ()))
        ends[reference] = [(r, vars(s)) for r, s in connector._requests.items()]
        ahead = {**requests, "k7": 8}  # settled, emit start ahead of its cursor
        try:
            connector.begin_step(AuxOutputConnectorMetadata(0, ahead, {}, ()))
        except AssertionError as error:
            errors[reference] = str(error)
        connector.close()
    assert ends[True] == ends[False]
    assert [r for r, _ in ends[False]][40:] == [r for r in order if r.startswith("n")]
    assert errors[True] == errors[False] == "auxiliary output Scheduler emit cursor moved ahead"
    counts = batched_begin.COUNTERS.snapshot()
    assert counts["fallback_reasons"] == {"new": 40 + len(new_at), "step": 40 + len(new_at)}
    assert counts["fast_requests"] == 40, counts


def _begin_in_thread(connector: object, metadata: object) -> list[object]:
    """begin_step(metadata) on another thread while this one holds the connector lock:
    returns what it returned or raised, or nothing when it blocked on the lock."""
    done: list[object] = []

    def run() -> None:
        try:
            done.append(connector.begin_step(metadata))
        except Exception as error:  # noqa: BLE001 - reported to the test
            done.append(error)

    with connector._lock:
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(timeout=5)
        blocked = thread.is_alive()
    thread.join()
    return [] if blocked else done


@pytest.mark.parametrize("rank", ["non_output_rank", "no_metadata"])
def test_begin_step_reads_and_locks_nothing_where_upstream_returns_at_once(
    reverted: pytest.MonkeyPatch, rank: str
) -> None:
    """Upstream's begin_step stores the metadata and returns when there is no data plane
    (a non-output rank) or no metadata: it reads nothing of the metadata and takes no
    lock. vLLM's own test_aux_output_worker_connector_binds_capture_on_non_output_rank
    hands a Mock (``len()`` of its ``requests`` raised); the lock held by another thread
    must not block the call."""
    _apply("batched_begin")
    batched_begin.COUNTERS.reset()
    connector = harness.make_connector(harness.Shape(), reference=False)
    metadata: object = None
    if rank == "non_output_rank":
        connector._buffer = None
        metadata = mock.Mock()  # any attribute read would return a Mock; len() raises
    assert _begin_in_thread(connector, metadata) == [None]
    assert connector._step_metadata is metadata
    if isinstance(metadata, mock.Mock):
        assert metadata.mock_calls == [] and not metadata.method_calls
        assert "requests" not in vars(metadata)["_mock_children"]
    assert batched_begin.COUNTERS.snapshot()["fallback_requests"] == 0
    connector.close()


def test_malformed_metadata_gets_upstreams_error_not_the_wrappers(
    reverted: pytest.MonkeyPatch,
) -> None:
    """Requests that are not a dict, or a metadata missing a field: the wrapper reads
    nothing that raises first, so the error is upstream's own (same type and message as
    the unpatched call)."""
    errors: dict[bool, list[str]] = {}
    for patched in (False, True):
        if patched:
            _apply("batched_begin")
        connector = harness.make_connector(harness.Shape(), reference=False)
        errors[patched] = []
        for metadata in (
            AuxOutputConnectorMetadata(0, ["a"], {}, ()),  # type: ignore[arg-type]
            types.SimpleNamespace(requests={"a": 0}),
            types.SimpleNamespace(generation=0, requests={"a": 0}, finished_requests=5),
        ):
            try:
                connector.begin_step(metadata)
            except Exception as error:  # noqa: BLE001 - compared below
                errors[patched].append(f"{type(error).__name__}: {error}")
            else:
                errors[patched].append("no error")
        connector.close()
    assert errors[True] == errors[False]
    assert all(e != "no error" for e in errors[False]), errors


def test_the_settled_check_is_upstreams_loop() -> None:
    """``_settled`` (one C-level pass, then upstream's question only where it fails) is
    ``settled_reference`` (upstream's loop on the same states) on random states: known
    and new requests, steps in flight, cursors behind, equal to and ahead of the start."""
    rng = random.Random(27)
    state = aux_worker._WorkerRequestState
    for _ in range(2000):
        states = {
            f"r{i}": state(emit_cursor=rng.randrange(6), pending_outputs=rng.choice((0, 0, 1)))
            for i in range(rng.randrange(6))
        }
        scheduled = {f"r{i}": rng.randrange(6) for i in rng.sample(range(8), rng.randrange(1, 8))}
        fast = batched_begin._settled(states, scheduled)
        assert fast == batched_begin.settled_reference(states, scheduled), (states, scheduled)


def test_new_requests_are_taken_in_upstreams_order() -> None:
    """``_in_order`` (the tail slice when the new requests are last) equals the reference
    comprehension upstream's order gives, wherever the new requests are."""
    rng = random.Random(7)
    for _ in range(500):
        keys = [f"r{i}" for i in range(rng.randrange(1, 12))]
        rng.shuffle(keys)
        scheduled = {k: i for i, k in enumerate(keys)}
        unknown = set(rng.sample(keys, rng.randrange(1, len(keys) + 1)))
        expected = {r: e for r, e in scheduled.items() if r in unknown}
        assert list(batched_begin._in_order(scheduled, unknown).items()) == list(expected.items())
