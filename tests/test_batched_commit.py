"""batched_commit: the fast decode commit gives upstream's rows, worker state and store.

The oracle is upstream's ``_commit_output`` (the original the layer saved), run on a
second real connector fed the same steps (tests/batched_harness.py). The same
fingerprints verify on vLLM 0.31.0, 0.32.0 and 0.33.0 (``_commit_output`` and everything
it relies on are byte-identical there), so every test expects the patch to apply on all
three and runs unchanged on each.
"""

from __future__ import annotations

import contextlib
import os
import pickle

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from collections import Counter  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import wrapt  # noqa: E402
from vllm.distributed.aux_output_connector import worker as aux_worker  # noqa: E402
from vllm.distributed.aux_output_connector.connector import (  # noqa: E402
    AuxOutputConnectorMetadata,
)

import prime_r3  # noqa: E402
from prime_r3 import guards  # noqa: E402
from prime_r3.fixes import batched_commit  # noqa: E402
from prime_r3.packed import PackedAuxOutputs  # noqa: E402
from tests import batched_harness as harness  # noqa: E402
from tests import scale  # noqa: E402

CHUNKS = scale.share(8)  # 25 seeds each: 200 on the default release, 50 on the others
SEEDS = 25 * CHUNKS
STEPS = 300
CASES = harness.CASES


def _shape(seed: int) -> harness.Shape:
    # Mostly roomy stores; some small enough to evict and to overflow (0.31/0.32 raise
    # there, 0.33 grows), and every tenth behind the real background writer thread.
    return harness.Shape(store_slots=(1024, 1024, 160, 96)[seed % 4], background=seed % 10 == 0)


def _apply(*names: str) -> None:
    report = prime_r3.apply(list(names), log=False)
    for name in names:
        assert report.outcome(name).state == "applied", report.summary()


def _run(seeds: range) -> tuple[Counter[str], Counter[Any], int, int]:
    seen: Counter[str] = Counter()
    ends: Counter[Any] = Counter()
    steps = checks = 0
    for seed in seeds:
        episode = harness.run_episode(seed, STEPS, _shape(seed), async_scheduling=seed % 2 == 1)
        seen.update(episode.seen)
        ends[episode.dead] += 1
        steps += episode.steps
        checks += episode.checks
    return seen, ends, steps, checks


def test_applies_on_every_supported_release(reverted: pytest.MonkeyPatch) -> None:
    """0.31.0, 0.32.0 and 0.33.0 all carry the verified _commit_output: it applies."""
    version = guards.installed_vllm_version()
    assert version in {"0.31.0", "0.32.0", "0.33.0"}, version
    _apply("batched_commit")
    target = aux_worker.AuxOutputWorkerConnector.__dict__["_commit_output"]
    assert isinstance(target, wrapt.FunctionWrapper)
    prime_r3.revert(["batched_commit"])
    assert aux_worker.AuxOutputWorkerConnector.__dict__["_commit_output"] is harness.upstream()


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_differential_parity(reverted: pytest.MonkeyPatch, chunk: int) -> None:
    """SEEDS x 300 steps over all chunks: outputs, take_output, state, store, errors."""
    _apply("batched_commit")
    batched_commit.COUNTERS.reset()
    per = SEEDS // CHUNKS
    seen, ends, steps, checks = _run(range(chunk * per, (chunk + 1) * per))
    counts = batched_commit.COUNTERS.snapshot()
    # The harness really drove the patch, on both of its paths.
    assert counts["fast_requests"] > 0 and counts["fallback_requests"] > 0, counts
    assert {"multi_token", "cursor", "step"} <= set(counts["fallback_reasons"]), counts
    assert steps > per * STEPS // 2, (steps, ends)
    assert checks > steps
    missing = [case for case in CASES if not seen[case]]
    assert not missing, f"workload never reached {missing}: {seen}"


@contextlib.contextmanager
def _packed_steps_built() -> Iterator[list[Any]]:
    """Record every ``PackedAuxOutputs`` the fast path builds (``_trusted``) meanwhile."""
    built: list[Any] = []
    original = PackedAuxOutputs._trusted.__func__

    def recording(cls: Any, *args: Any) -> Any:
        result = original(cls, *args)
        built.append(result)
        return result

    PackedAuxOutputs._trusted = classmethod(recording)  # type: ignore[method-assign]
    try:
        yield built
    finally:
        PackedAuxOutputs._trusted = classmethod(original)  # type: ignore[method-assign]


def test_packed_path_parity(reverted: pytest.MonkeyPatch) -> None:
    """With packed_outputs in force the fast path builds the PackedAuxOutputs itself."""
    _apply("packed_outputs", "batched_commit")
    with _packed_steps_built() as built:
        seen, ends, steps, _ = _run(range(1000, 1024))
    assert built and steps > 1000
    assert seen["decode"] and seen["emit_from_store_or_buffer"]


def test_no_packed_step_for_an_engine_core_that_did_not_declare(
    reverted: pytest.MonkeyPatch,
) -> None:
    """The packed_outputs handshake holds on the batched path too: without EngineCore's
    declaration in the step's metadata, every step goes out as upstream's dict."""
    _apply("packed_outputs", "batched_commit")
    reverted.setattr(harness, "DECLARE_PACKED_READER", False)
    batched_commit.COUNTERS.reset()
    with _packed_steps_built() as built:
        _run(range(1000, 1004))
    assert batched_commit.COUNTERS.snapshot()["fast_requests"] > 0  # the fast path ran
    assert built == []


def test_fast_path_counts_and_rows(reverted: pytest.MonkeyPatch) -> None:
    """A decode step is committed by the fast path (counted), with upstream's rows."""
    _apply("batched_commit")
    batched_commit.COUNTERS.reset()
    episode = harness.Episode(7, harness.Shape(), async_scheduling=False)
    try:
        for _ in range(60):
            episode.step()
    finally:
        episode.close()
    counts = batched_commit.COUNTERS.snapshot()
    assert counts["fast_requests"] > 100, counts
    assert 0 < counts["batched_steps"] <= counts["steps"]


def test_a_reason_counted_zero_times_is_not_recorded() -> None:
    """A mixed step's one-token non-decodes count ``rejected`` and ``not_sampled`` in one
    go (``reasons[...] += int(...)``), so one of them is often 0: the counters keep only
    the reasons that occurred (the bench prints them as the step's fallback reasons)."""
    counters = batched_commit.Counters()
    step_reasons: Counter[str] = Counter()
    step_reasons["rejected"] += 0
    step_reasons["not_sampled"] += 2
    counters.add(5, step_reasons)
    counters.add(7, Counter())
    snapshot = counters.snapshot()
    assert snapshot["fallback_reasons"] == {"not_sampled": 2}
    assert snapshot["fallback_requests"] == 2 and snapshot["fast_requests"] == 12


def test_whole_step_goes_upstream_when_the_step_is_malformed(reverted: pytest.MonkeyPatch) -> None:
    """Mismatched lengths: upstream raises its own error, and the step is counted as such."""
    _apply("batched_commit")
    batched_commit.COUNTERS.reset()
    results = {}
    for reference in (True, False):
        connector = harness.make_connector(harness.Shape(), reference)
        pending = aux_worker.PendingAuxOutput(
            connector=connector,
            request_ids=["a", "b"],
            token_starts=np.array([0, 0], dtype=np.int32),
            query_start_loc=np.array([0, 1, 2], dtype=np.int32),
            routed_experts_gpu=None,  # type: ignore[arg-type]
        )
        pending.routed_experts = np.zeros((2, 3, 2), np.uint16)
        pending.num_sampled = np.array([1, 1, 1])
        pending.num_rejected = np.array([0, 0])
        connector.begin_step(AuxOutputConnectorMetadata(0, {"a": 0, "b": 0}, {}, ()))
        try:
            connector._commit_output(pending)
        except Exception as error:  # noqa: BLE001
            results[reference] = harness.error_of(error)
        connector.close()
    assert results[True] == results[False] and results[True][0] == "ValueError"
    assert batched_commit.COUNTERS.snapshot()["fallback_reasons"] == {"step": 2}


def _decode_pending(
    connector: Any, ids: list[str], starts: list[int], qsl: list[int], rows: np.ndarray
) -> Any:
    """A copied step for ``ids`` (query start locations ``qsl``), every request sampling
    one token and rejecting none, with the runner's int32 arrays."""
    return aux_worker.PendingAuxOutput(
        connector=connector,
        request_ids=ids,
        token_starts=np.array(starts, dtype=np.int32),
        query_start_loc=np.array(qsl, dtype=np.int32),
        routed_experts_gpu=None,
        routed_experts=rows,
        num_sampled=np.ones(len(ids), dtype=np.int32),
        num_rejected=np.zeros(len(ids), dtype=np.int32),
    )


def _same_key_step(reference: bool) -> tuple[list[int], dict[str, list[int]]]:
    """A (decode, fast path) and B (prefill chunk, fallback) complete the same block key K
    in one step with different routing; then C hits the prefix cache on K and emits from
    the store. Returns the store's rows for K and every request's emitted rows."""
    shape = harness.Shape(block=4, token_shape=(3, 2), dtype=np.uint16)
    connector = harness.make_connector(shape, reference)
    key = "vllm-artifact/0/aa"
    connector._store.put([], retain_keys=[key, key])
    state = aux_worker._WorkerRequestState
    connector._requests["A"] = state(
        aux_output_keys=[key], capture_cursor=3, scheduled_cursor=3, emit_cursor=3
    )
    connector._buffer.capture("A", 0, np.full((3, 3, 2), 7, np.uint16))
    connector._requests["B"] = state(aux_output_keys=[key], emit_cursor=0)
    rows = np.zeros((5, 3, 2), np.uint16)
    rows[0] = 7  # A's decode row, token 3
    rows[1:5] = 9  # B's prefill rows, tokens 0..3: the same key, other routing
    outputs: dict[str, Any] = {}
    for request_id in ("A", "B"):
        connector._requests[request_id].pending_outputs += 1
    steps = [
        (["A", "B"], [3, 0], [0, 1, 5], rows),
        (["C"], [4], [0, 1], np.full((1, 3, 2), 5, np.uint16)),
    ]
    for number, (ids, starts, qsl, step_rows) in enumerate(steps):
        if number == 1:
            connector._store.put([], retain_keys=[key])
            connector._requests["C"] = state(
                aux_output_keys=[key], emit_cursor=0, pending_outputs=1
            )
        pending = _decode_pending(connector, ids, starts, qsl, step_rows)
        connector._pending_outputs.append(pending)
        outputs.update(connector.process_output(pending))
    _, payloads, _, _ = harness.store_state(connector)
    stored = np.frombuffer(payloads, np.uint16)[: 4 * 6].reshape(4, 3, 2)[:, 0, 0].tolist()
    return stored, {r: o.rows[:, 0, 0].tolist() for r, o in outputs.items()}


def test_a_key_completed_twice_in_one_step_keeps_upstreams_payload(
    reverted: pytest.MonkeyPatch,
) -> None:
    """Upstream publishes the step in one put, where the later request in batch order wins
    a key both complete; the fast path must not publish its blocks in a put of their own
    (found by review: C's prefix-hit rows were A's, not B's)."""
    expected = _same_key_step(reference=True)
    _apply("batched_commit")
    batched_commit.COUNTERS.reset()
    assert _same_key_step(reference=False) == expected
    assert expected[0] == [9, 9, 9, 9] and expected[1]["C"] == [9, 9, 9, 9, 5]
    counts = batched_commit.COUNTERS.snapshot()
    assert counts["fast_requests"] >= 1 and counts["fallback_requests"] >= 1  # both paths


def _decode_step(
    reference: bool, packed: bool, prefill: bool = False
) -> tuple[dict[str, Any], int, np.ndarray, Any]:
    """One decode step of 64 known requests (rows of 4 KiB) on a real connector, with
    ``prefill`` a new request's 8-token prompt after them (upstream's fallback, whose
    output is a view of the snapshot): (outputs and buffered tails as lists, peak bytes
    traced during process_output, the snapshot, the packed rows a pickle would send or
    None for a dict)."""
    import tracemalloc

    from prime_r3.packed import FORMAT_VERSION, READS_MARK

    n, block = 64, 4
    shape = harness.Shape(block=block, token_shape=(256, 8), max_num_seqs=n, max_batched_tokens=n)
    connector = harness.make_connector(shape, reference)
    ids = [f"r{i}" for i in range(n)]
    starts = [block * i + i % block for i in range(n)]  # tails of every length, some new
    metadata = AuxOutputConnectorMetadata(0, dict(zip(ids, starts, strict=True)), {}, ())
    if prefill:
        metadata.requests["p"] = 0
    if packed:
        setattr(metadata, READS_MARK, FORMAT_VERSION)
    connector.begin_step(metadata)
    rng = np.random.default_rng(5)
    for request_id, start in zip(ids, starts, strict=True):
        state = connector._requests[request_id]
        state.capture_cursor = state.scheduled_cursor = state.emit_cursor = start
        if start % block:  # a buffered tail up to the token start
            tail = rng.integers(0, 1 << 16, (start % block, 256, 8), dtype=np.uint16)
            connector._buffer.capture(request_id, start - start % block, tail)
        state.pending_outputs += 1
    qsl = list(range(n + 1))
    if prefill:
        connector._requests["p"].pending_outputs += 1
        ids, starts, qsl = [*ids, "p"], [*starts, 0], [*qsl, n + 8]
    snapshot = rng.integers(0, 1 << 16, (qsl[-1], 256, 8), dtype=np.uint16)
    pending = _decode_pending(connector, ids, starts, qsl, snapshot)
    connector._pending_outputs.append(pending)
    tracemalloc.start()
    try:
        result = connector.process_output(pending)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # What a pickle would send (read before any dict access fills the step).
    sent = result.rows if isinstance(result, PackedAuxOutputs) else None
    outputs = {r: (int(o.token_start), o.rows.tolist()) for r, o in result.items()}
    tails = {r: (t.block_start, t.length) for r, t in connector._buffer._requests.items()}
    buffered = {r: connector._buffer.read(r, b, b + k).tolist() for r, (b, k) in tails.items()}
    connector.close()
    return {"outputs": outputs, "buffered": buffered}, peak, snapshot, sent


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "with_prefill"])
@pytest.mark.parametrize("packed", [False, True], ids=["dict", "packed"])
def test_a_decode_step_allocates_no_step_sized_array(
    reverted: pytest.MonkeyPatch, packed: bool, prefill: bool
) -> None:
    """The common step writes its rows into the buffer from a view of the snapshot and,
    packed, sends a view of it (also when a prefill's rows, a view as upstream's, follow
    the fast rows): no step-sized array is allocated and freed per step (before: a gather
    temporary for the buffer write and a copy or concatenation for the packed rows, each
    the step's size; ~150 KB at N=400, i.e. an mmap and page faults every step)."""
    expected, _, _, _ = _decode_step(reference=True, packed=packed, prefill=prefill)
    _apply("packed_outputs", "batched_commit")
    batched_commit.COUNTERS.reset()
    ours, peak, snapshot, sent = _decode_step(reference=False, packed=packed, prefill=prefill)
    assert ours == expected and ("p" in ours["outputs"]) is prefill
    counts = batched_commit.COUNTERS.snapshot()
    # The new request's prompt is upstream's; the common step records no reason, not
    # even a zero one.
    assert counts["fast_requests"] == 64, counts
    assert counts["fallback_reasons"] == ({"multi_token": 1} if prefill else {}), counts
    assert (sent is not None) is packed
    if packed:
        assert np.shares_memory(sent, snapshot) and np.array_equal(sent, snapshot)
    assert peak < snapshot.nbytes // 4, (peak, snapshot.nbytes)


def _gap_step(reference: bool, case: str) -> tuple[Any, Any]:
    """One step of a decode ("d", fast) and a 6-token chunk ("p") that upstream's capture
    refuses: (the error upstream raises or None, the worker state afterwards)."""
    shape = harness.Shape(block=4, token_shape=(3, 2), dtype=np.uint16)
    connector = harness.make_connector(shape, reference)
    state = aux_worker._WorkerRequestState
    connector._requests["d"] = state(capture_cursor=4, scheduled_cursor=4, emit_cursor=4)
    start = {"gap": 5, "unaligned": 3, "no_slot": 4}[case]
    connector._requests["p"] = state(
        capture_cursor=None if case == "unaligned" else start, emit_cursor=start
    )
    if case == "gap":  # tokens 0-1 buffered, 2-4 never captured
        connector._buffer.capture("p", 0, np.ones((2, 3, 2), np.uint16))
    if case == "no_slot":  # every slot but d's new tail taken: p's rest has none
        del connector._buffer._free_slots[1:]
    rows = np.arange(7 * 6, dtype=np.uint16).reshape(7, 3, 2)
    pending = _decode_pending(connector, ["d", "p"], [4, start], [0, 1, 7], rows)
    for request_id in ("d", "p"):
        connector._requests[request_id].pending_outputs += 1
    connector._pending_outputs.append(pending)
    error = None
    try:
        connector.process_output(pending)
    except AssertionError as caught:
        error = harness.error_of(caught)
    result = error, harness.worker_state(connector)[1]["p"]
    connector.close()
    return result


@pytest.mark.parametrize("case", ["gap", "unaligned", "no_slot"])
def test_a_capture_upstream_refuses_goes_to_upstream(
    reverted: pytest.MonkeyPatch, case: str
) -> None:
    """A decode ahead of a chunk upstream's capture refuses (not contiguous with its
    tail, unaligned without one, or needing a slot the buffer lacks): the decode is
    committed here, the chunk by upstream's loop, which raises its own assertion."""
    expected = _gap_step(reference=True, case=case)
    assert expected[0] is not None and expected[0][0] == "AssertionError", expected
    _apply("batched_commit")
    batched_commit.COUNTERS.reset()
    assert _gap_step(reference=False, case=case) == expected
    counts = batched_commit.COUNTERS.snapshot()
    if case == "no_slot":  # one free slot for two requests: the whole step is upstream's
        assert counts["fallback_reasons"] == {"step": 2}, counts
        assert counts["fast_requests"] == 0, counts
        return
    assert counts["fallback_reasons"] == {"multi_token": 1}, counts
    assert counts["fast_requests"] == 1, counts


def _declared_connector() -> Any:
    """A patched-side connector whose current step metadata declares the packed reader."""
    from prime_r3.packed import FORMAT_VERSION, READS_MARK

    connector = harness.make_connector(harness.Shape(), reference=False)
    metadata = AuxOutputConnectorMetadata(0, {}, {}, ())
    setattr(metadata, READS_MARK, FORMAT_VERSION)
    connector._step_metadata = metadata
    return connector


def test_packing_answer_follows_the_layers(reverted: pytest.MonkeyPatch) -> None:
    """``_packing_in_force`` answers from the layers on ``process_output`` as they are at
    the step: it follows apply, revert, a foreign wrapper around ours, and a layer made
    a pass-through."""
    from prime_r3 import state

    connector = _declared_connector()
    cls = aux_worker.AuxOutputWorkerConnector

    def check(expected: bool) -> None:
        assert batched_commit._packing_in_force(connector) is expected

    check(False)  # nothing applied
    _apply("packed_outputs", "batched_commit")
    check(True)
    prime_r3.revert(["packed_outputs"])
    check(False)
    _apply("packed_outputs")
    check(True)

    ours = cls.__dict__["process_output"]
    foreign = wrapt.FunctionWrapper(ours, lambda wrapped, instance, args, kwargs: None)
    setattr(cls, "process_output", foreign)  # noqa: B010 - a foreign layer around ours
    try:
        check(False)
    finally:
        setattr(cls, "process_output", ours)  # noqa: B010
    check(True)

    # The same object, its record now a pass-through (what an import rollback leaves).
    reverted.setitem(state._inert, "packed_outputs", dict(state._active["packed_outputs"]))
    check(False)
    del state._inert["packed_outputs"]
    check(True)

    prime_r3.revert()
    check(False)


_DAB_SHAPE = harness.Shape(block=4, token_shape=(3, 2), dtype=np.uint16)
_DAB_CURSORS = {"D": (4, 4, 4), "A": (0, 0, 0), "B": (None, 0, 0)}
_DAB_SIZE = {"D": 1, "A": 7, "B": 6}
_DAB_START = {"D": 4, "A": 0, "B": 0}


def _dab_states(connector: Any, which: str) -> None:
    """Worker states for the requests ``which``, at their ``_DAB_CURSORS``."""
    for request_id in which:
        capture, scheduled, emit = _DAB_CURSORS[request_id]
        connector._requests[request_id] = aux_worker._WorkerRequestState(
            capture_cursor=capture, scheduled_cursor=scheduled, emit_cursor=emit
        )


def _dab_pending(connector: Any, order: str) -> Any:
    """The copied step over ``order`` (every request sampling, "A" rejecting one draft),
    counted as in flight on each request's state, as ``prepare_output`` does."""
    ids = list(order)
    qsl = np.concatenate(([0], np.cumsum([_DAB_SIZE[r] for r in ids]))).astype(np.int32)
    rows = np.arange(int(qsl[-1]) * 6, dtype=np.uint16).reshape(-1, 3, 2)
    pending = aux_worker.PendingAuxOutput(
        connector=connector,
        request_ids=ids,
        token_starts=np.array([_DAB_START[r] for r in ids], dtype=np.int32),
        query_start_loc=qsl,
        routed_experts_gpu=None,
        routed_experts=rows,
        num_sampled=np.ones(len(ids), dtype=np.int32),
        num_rejected=np.array([int(r == "A") for r in ids], dtype=np.int32),
    )
    for request_id in ids:
        connector._requests[request_id].pending_outputs += 1
    return pending


def _slot_step(reference: bool, order: str) -> tuple[Any, ...]:
    """One step in which several requests start a new buffer tail, in batch order
    ``order``: "D" a decode (the fast path), "A" drafts with one rejected and "B" a
    6-token prompt (both upstream's fallback). Returns the outputs and
    the buffer's slot bookkeeping: which slot each tail holds (with its rows), the free
    list in pop order, the owned slots with their blocks' bytes."""
    connector = harness.make_connector(_DAB_SHAPE, reference)
    _dab_states(connector, "DAB")
    pending = _dab_pending(connector, order)
    connector._pending_outputs.append(pending)
    outputs = harness.output_state(connector.process_output(pending))
    buffer = connector._buffer
    tails = {
        r: (t.slot, int(t.block_start), t.length, buffer._rows[t.slot, : t.length].tobytes())
        for r, t in buffer._requests.items()
    }
    owned = sorted((slot, buffer._rows[slot].tobytes()) for slot in buffer._owned_slots.values())
    result = outputs, tails, list(buffer._free_slots), owned
    connector.close()
    return result


@pytest.mark.parametrize("order", ["DAB", "BD", "AD", "BAD"])
def test_new_tails_get_upstreams_slots(reverted: pytest.MonkeyPatch, order: str) -> None:
    """Upstream's loop pops a free slot for each new tail in batch order; the fast path
    pops the decodes' first, then upstream's fallback its own, so a prefill or a partly
    rejected draft ahead of a decode got another slot than upstream gives it (and from
    then on every release order, free list and slot reuse differed). Found by review."""
    expected = _slot_step(reference=True, order=order)
    assert len({tail[0] for tail in expected[1].values()}) == len(order)  # each a new tail
    _apply("batched_commit")
    batched_commit.COUNTERS.reset()
    assert _slot_step(reference=False, order=order) == expected
    counts = batched_commit.COUNTERS.snapshot()
    assert counts["fast_requests"] == order.count("D"), counts


def _process_and_close(connector: Any, pending: Any) -> tuple[Any, Any]:
    """``process_output`` of one in-flight step: (the assertion it raised, as the harness
    names errors, or None; the worker state after it); then the connector is closed."""
    connector._pending_outputs.append(pending)
    error = None
    try:
        connector.process_output(pending)
    except AssertionError as caught:
        error = harness.error_of(caught)
    result = error, harness.worker_state(connector)
    connector.close()
    return result


def _tail_step(reference: bool, block_start: int, length: int) -> tuple[Any, Any]:
    """A decode "D" at the token after a buffered tail (``block_start``, ``length``) that
    ``RoutedExpertsBuffer`` never builds itself (its tails start on a block boundary and
    hold less than a block), after a plain decode "E": (upstream's error or None, the
    worker state afterwards)."""
    from vllm.distributed.aux_output_connector.routed_experts import _RequestTail

    connector = harness.make_connector(harness.Shape(block=4), reference)
    state = aux_worker._WorkerRequestState
    start_d = block_start + length
    for request_id, start in (("D", start_d), ("E", 4)):
        connector._requests[request_id] = state(
            capture_cursor=start, scheduled_cursor=start, emit_cursor=start, pending_outputs=1
        )
    buffer = connector._buffer
    buffer._requests["D"] = _RequestTail(buffer._free_slots.pop(), block_start, length)
    buffer._rows[buffer._requests["D"].slot] = 1
    rows = np.arange(2 * 6, dtype=np.uint16).reshape(2, 3, 2)
    # E first: upstream commits it, then asserts on D (what a fast E after D would not
    # match: the fast path commits every fast request before upstream's loop runs).
    pending = _decode_pending(connector, ["E", "D"], [4, start_d], [0, 1, 2], rows)
    return _process_and_close(connector, pending)


@pytest.mark.parametrize(("block_start", "length"), [(3, 2), (4, 4)], ids=["unaligned", "full"])
def test_a_decode_on_a_tail_upstream_refuses_goes_to_upstream(
    reverted: pytest.MonkeyPatch, block_start: int, length: int
) -> None:
    """A tail that ends at the token start but does not start on its block boundary (or
    holds a whole block) makes upstream's ``_tail`` assert; the decode fast path only
    checked that the tail ends at the token start and committed it (found by review)."""
    expected = _tail_step(reference=True, block_start=block_start, length=length)
    assert expected[0] is not None and "skipped an incomplete block" in expected[0][1]
    _apply("batched_commit")
    batched_commit.COUNTERS.reset()
    assert _tail_step(reference=False, block_start=block_start, length=length) == expected
    assert batched_commit.COUNTERS.snapshot()["fallback_reasons"] == {"tail": 1}


def _failing_step(reference: bool, raising: str) -> tuple[Any, Any, Any]:
    """A step "A B X D P": decodes "A" (fast) and "B" (a re-attach: upstream's), then
    "X", a request upstream's loop refuses, then a decode "D" the fast path would
    commit and a 6-token chunk "P". ``raising``: "decode" (capture cursor 2, nothing
    scheduled past it, token start 5: an unbacked gap) or "prefill" (a 2-token chunk at
    5 with tokens 0-1 buffered: not contiguous). Returns (the error, the worker state
    and the buffer's free list after process_output raised)."""
    connector = harness.make_connector(harness.Shape(block=4), reference)
    state = aux_worker._WorkerRequestState
    buffer = connector._buffer
    for request_id, start in (("A", 4), ("D", 8), ("P", 0)):
        connector._requests[request_id] = state(
            capture_cursor=start if start else None,
            scheduled_cursor=start,
            emit_cursor=start,
            pending_outputs=1,
        )
    connector._requests["B"] = state(
        capture_cursor=5, scheduled_cursor=7, emit_cursor=5, pending_outputs=1
    )
    buffer.capture("B", 4, np.ones((1, 3, 2), np.uint16))
    connector._requests["X"] = state(
        capture_cursor=2, scheduled_cursor=2, emit_cursor=2, pending_outputs=1
    )
    if raising == "prefill":
        connector._requests["X"].scheduled_cursor = 5
        connector._requests["X"].capture_cursor = 5
        buffer.capture("X", 0, np.ones((2, 3, 2), np.uint16))
    sizes = [1, 1, 1 if raising == "decode" else 2, 1, 6]
    qsl = np.concatenate(([0], np.cumsum(sizes))).tolist()
    rows = np.arange(qsl[-1] * 6, dtype=np.uint16).reshape(qsl[-1], 3, 2)
    pending = _decode_pending(connector, ["A", "B", "X", "D", "P"], [4, 6, 5, 8, 0], qsl, rows)
    error, worker = _process_and_close(connector, pending)
    return error, worker[1], worker[3:5]


@pytest.mark.parametrize("raising", ["decode", "prefill"])
def test_an_assertion_leaves_later_requests_as_upstream_does(
    reverted: pytest.MonkeyPatch, raising: str
) -> None:
    """Upstream's loop commits the requests ahead of the one it raises on and leaves
    those after it untouched. The fast path committed every fast request before
    upstream's loop ran, so "D" (a decode) after the raising "X" had moved cursors,
    grown tails and taken buffer slots where upstream's had not (pinned by a strict
    xfail until the fix: the first request upstream raises on, and all after it, now go
    to upstream's loop)."""
    expected = _failing_step(reference=True, raising=raising)
    message = {"decode": "unbacked token gap", "prefill": "skipped an incomplete block"}[raising]
    assert expected[0] is not None and message in expected[0][1], expected
    assert expected[1]["D"][2] == 8 and expected[1]["A"][2] == 5  # D untouched, A done
    _apply("batched_commit")
    batched_commit.COUNTERS.reset()
    assert _failing_step(reference=False, raising=raising) == expected
    counts = batched_commit.COUNTERS.snapshot()
    assert counts["fast_requests"] == 1, counts  # A
    assert counts["fallback_reasons"][batched_commit.UPSTREAM_RAISES] == 1, counts  # D
    chunks = 1 if raising == "decode" else 2  # P, and X when it is the chunk
    assert counts["fallback_reasons"]["multi_token"] == chunks, counts


def _waiting_block_step(reference: bool) -> tuple[Any, ...]:
    """A decode "W" (fast path: cursors at its token start 5, a one-row tail in block 1)
    whose state holds block 0 in ``pending_blocks`` with block 0's key already in
    ``aux_output_keys``, beside a plain decode "E". Returns the store calls, the store,
    the worker state and the outputs after the step."""
    shape = harness.Shape(block=4, token_shape=(3, 2), dtype=np.uint16)
    connector = harness.make_connector(shape, reference)
    key = "vllm-artifact/0/aa"
    connector._store.put([], retain_keys=[key])  # as begin_step retains a new key
    state = aux_worker._WorkerRequestState
    buffer = connector._buffer
    waiting = buffer.retain_block(np.full((4, 3, 2), 3, np.uint16))  # block 0, unkeyed once
    connector._requests["W"] = state(
        aux_output_keys=[key],
        pending_blocks=[(0, waiting)],
        capture_cursor=5,
        scheduled_cursor=5,
        emit_cursor=5,
        pending_outputs=1,
    )
    buffer.capture("W", 4, np.full((1, 3, 2), 4, np.uint16))
    connector._requests["E"] = state(
        capture_cursor=8, scheduled_cursor=8, emit_cursor=8, pending_outputs=1
    )
    harness.store_calls(connector)  # only the step's own calls from here
    rows = np.arange(2 * 6, dtype=np.uint16).reshape(2, 3, 2)
    pending = _decode_pending(connector, ["W", "E"], [5, 8], [0, 1, 2], rows)
    connector._pending_outputs.append(pending)
    outputs = harness.output_state(connector.process_output(pending))
    result = (
        harness.store_calls(connector),
        harness.store_state(connector),
        harness.worker_state(connector),
        outputs,
    )
    connector.close()
    return result


def test_a_fast_request_with_waiting_blocks_retries_them_as_upstream_does(
    reverted: pytest.MonkeyPatch,
) -> None:
    """Upstream's ``_commit_output`` hands ``_publish_blocks`` every request's
    ``(state, completed)`` pair, so a state's waiting (``pending_blocks``) are retried
    each step, and published once their keys are there. The fast path publishes
    ``(state, [])`` for a fast request with waiting blocks for that reason: without it
    block 0 stays pending here, where upstream puts it under its key and frees its slot.

    (Upstream's ``begin_step`` publishes a state's waiting blocks when their keys
    arrive, under the lock, so at commit time they are still unkeyed and the retry finds
    nothing ready: removing the branch changed nothing the differential harness
    compares. The state is built here, keys present without a publication, to pin the
    retry to upstream's.)
    Failed when the fast path's ``elif state.pending_blocks`` branch was removed."""
    expected = _waiting_block_step(reference=True)
    calls = expected[0]
    assert [call[0] for call in calls] == ["put"], calls  # upstream's retry published
    assert [item[0] for item in calls[0][1]] == ["vllm-artifact/0/aa"]
    assert expected[2][1]["W"][1] == (), expected[2][1]["W"]  # nothing left waiting
    _apply("batched_commit")
    batched_commit.COUNTERS.reset()
    assert _waiting_block_step(reference=False) == expected
    counts = batched_commit.COUNTERS.snapshot()
    assert counts["fast_requests"] == 2 and counts["fallback_requests"] == 0, counts


def _short_pool_step(reference: bool, order: str, free: int) -> tuple[Any, Any]:
    """One step over requests in batch order ``order`` with ``free`` free buffer slots:
    "A" a first capture at token 0 (upstream's fallback; its new tail takes a slot), "X"
    a capture upstream refuses (an unbacked gap: capture cursor 2, token start 5), "D" a
    decode at token 4 without a tail (the fast path; its new tail takes a slot), "E" a
    decode on its buffered tail (the fast path, no slot). Returns (the error, the worker
    state after process_output)."""
    connector = harness.make_connector(harness.Shape(block=4), reference)
    state = aux_worker._WorkerRequestState
    cursors = {"A": (None, 0, 0), "X": (2, 2, 2), "D": (4, 4, 4), "E": (5, 5, 5)}
    for request_id in order:
        capture, scheduled, emit = cursors[request_id]
        connector._requests[request_id] = state(
            capture_cursor=capture,
            scheduled_cursor=scheduled,
            emit_cursor=emit,
            pending_outputs=1,
        )
    if "E" in order:
        connector._buffer.capture("E", 4, np.full((1, 3, 2), 7, np.uint16))
    del connector._buffer._free_slots[:-free]
    starts = {"A": 0, "X": 5, "D": 4, "E": 5}
    n = len(order)
    rows = np.arange(n * 6, dtype=np.uint16).reshape(n, 3, 2)
    pending = _decode_pending(
        connector, list(order), [starts[r] for r in order], list(range(n + 1)), rows
    )
    return _process_and_close(connector, pending)


@pytest.mark.parametrize(
    ("order", "free"),
    [("AXD", 1), ("AD", 1), ("DA", 1), ("EAD", 1), ("ED", 1), ("AD", 2), ("EAD", 3)],
)
def test_a_short_pool_raises_upstreams_error_at_upstreams_request(
    reverted: pytest.MonkeyPatch, order: str, free: int
) -> None:
    """With fewer free buffer slots than requests, the decodes' new tails took the last
    slots before upstream's loop ran the fallback, so a fallback request ahead of them in
    batch order found the pool exhausted. "AXD" with one slot raised "block pool is
    exhausted" (for A) where upstream gives A the slot and raises X's unbacked token gap:
    the engine died naming the wrong cause. "AD" and "EAD" with one slot raised upstream's
    error but left D committed on the slot upstream gives A (upstream raises at D). Found
    by review of the one-pass ``_select``; those three failed on 9026d1b, "DA" and "ED"
    (parity held there) only pin the rule: such a step now goes to upstream whole. With
    a slot per request ("AD" with two, "EAD" with three) the fast path still runs."""
    expected = _short_pool_step(reference=True, order=order, free=free)
    _apply("batched_commit")
    batched_commit.COUNTERS.reset()
    assert _short_pool_step(reference=False, order=order, free=free) == expected
    counts = batched_commit.COUNTERS.snapshot()
    if free < len(order):
        assert counts["fallback_reasons"] == {"step": len(order)}, counts
    else:
        assert counts["fast_requests"] >= 1, counts


def _float_step(reference: bool, field: str) -> tuple[Any, Any, Any]:
    """A decode "D" (cursors at its token start 4) whose step carries ``field`` as
    float64, as no runner sends it: (the error, the outputs, the worker state)."""
    connector = harness.make_connector(harness.Shape(block=4), reference)
    connector._requests["D"] = aux_worker._WorkerRequestState(
        capture_cursor=4, scheduled_cursor=4, emit_cursor=4, pending_outputs=1
    )
    rows = np.arange(6, dtype=np.uint16).reshape(1, 3, 2)
    pending = _decode_pending(connector, ["D"], [4], [0, 1], rows)
    setattr(pending, field, getattr(pending, field).astype(np.float64))
    connector._pending_outputs.append(pending)
    error = outputs = None
    try:
        outputs = harness.output_state(connector.process_output(pending))
    except Exception as caught:  # noqa: BLE001
        error = harness.error_of(caught)
    state = harness.worker_state(connector)
    connector.close()
    return error, outputs, state


@pytest.mark.parametrize("field", ["token_starts", "query_start_loc"])
def test_float_starts_or_bounds_go_to_upstream(reverted: pytest.MonkeyPatch, field: str) -> None:
    """Upstream indexes the rows and the buffer with the token starts and query start
    locations, so float ones raise there (IndexError, TypeError); the fast path cast them
    (``np.asarray(..., dtype=np.int64)``, ``tolist``) and committed the step, a float
    start leaving a float length in upstream's ``_RequestTail``. Found by review of the
    one-pass ``_select``; failed on 9026d1b. Such a step goes to upstream whole."""
    expected = _float_step(reference=True, field=field)
    assert expected[0] is not None and expected[0][0] in {"IndexError", "TypeError"}
    _apply("batched_commit")
    batched_commit.COUNTERS.reset()
    assert _float_step(reference=False, field=field) == expected
    assert batched_commit.COUNTERS.snapshot()["fallback_reasons"] == {"step": 1}


def test_reasons_have_no_zero_entries(reverted: pytest.MonkeyPatch) -> None:
    """A decode beside a one-token prefill chunk that samples nothing: the counters give
    the chunk's reason only (before: ``{"rejected": 0, "not_sampled": 1}``, a zero entry
    for every such step; found by review, failed on 9026d1b)."""
    _apply("batched_commit")
    batched_commit.COUNTERS.reset()
    connector = harness.make_connector(harness.Shape(block=4), reference=False)
    state = aux_worker._WorkerRequestState
    connector._requests["D"] = state(
        capture_cursor=4, scheduled_cursor=4, emit_cursor=4, pending_outputs=1
    )
    connector._requests["P"] = state(emit_cursor=0, pending_outputs=1)
    rows = np.arange(2 * 6, dtype=np.uint16).reshape(2, 3, 2)
    pending = _decode_pending(connector, ["D", "P"], [4, 0], [0, 1, 2], rows)
    pending.num_sampled = np.array([1, 0], dtype=np.int32)
    connector._pending_outputs.append(pending)
    assert list(connector.process_output(pending)) == ["D"]
    connector.close()
    counts = batched_commit.COUNTERS.snapshot()
    assert counts["fast_requests"] == 1, counts
    assert counts["fallback_reasons"] == {"not_sampled": 1}, counts


def _short_publication_step(reference: bool, order: str) -> tuple[Any, Any]:
    """One step over requests in batch order ``order`` (as in ``_slot_step``: "D" a
    decode, "A" drafts with one rejected, "B" a 6-token prompt; each starts a new tail,
    "A" and "B" also complete a block no key is known for) with exactly one free buffer
    slot per request: the captures find a slot each, the publication's
    ``retain_block`` of the unkeyed blocks finds the pool exhausted. Returns (the error,
    the worker state after process_output)."""
    connector = harness.make_connector(_DAB_SHAPE, reference)
    _dab_states(connector, order)
    del connector._buffer._free_slots[: -len(order)]
    pending = _dab_pending(connector, order)
    return _process_and_close(connector, pending)


@pytest.mark.parametrize("order", ["BD", "BAD", "ADB"])
def test_a_publication_that_raises_leaves_upstreams_slots(
    reverted: pytest.MonkeyPatch, order: str
) -> None:
    """When the step's publication raises (here ``retain_block`` finds the pool
    exhausted), the step's new tails hold the slots upstream gives them: the fast path
    gave them upstream's slots (``_slots_in_batch_order``) only after the publication,
    so a raising one left them in the fast path's pop order (decodes first). Found by
    fuzzing the differential harness with tiny pools and comparing the state after the
    error; failed on 9026d1b for each order."""
    expected = _short_publication_step(reference=True, order=order)
    assert expected[0] is not None and "pool is exhausted" in expected[0][1], expected
    _apply("batched_commit")
    batched_commit.COUNTERS.reset()
    assert _short_publication_step(reference=False, order=order) == expected
    counts = batched_commit.COUNTERS.snapshot()
    assert counts["fast_requests"] == order.count("D"), counts


@pytest.mark.parametrize("free_slots", [None, 5, 9], ids=["roomy", "pool5", "pool9"])
@pytest.mark.parametrize("block", [2, 3, 8])
def test_differential_parity_other_blocks_and_tiny_pools(
    reverted: pytest.MonkeyPatch, block: int, free_slots: int | None
) -> None:
    """The differential workload at hash block sizes 2, 3 and 8 (the main test runs 4),
    with the buffer's own pool and with pools of 5 and 9 free slots, which run dry: the
    episodes then end on upstream's "block pool is exhausted", and the harness compares
    what that ``process_output`` left behind (worker state, slots, store). Before the
    one-slot-per-request rule and the tails' slots being ordered before the publication,
    the tiny pools failed on 9026d1b."""
    _apply("batched_commit")
    batched_commit.COUNTERS.reset()
    ends: Counter[Any] = Counter()
    for seed in range(8):
        shape = harness.Shape(
            block=block,
            max_num_seqs=12,
            max_batched_tokens=32,
            store_slots=(1024, 96)[seed % 2],
            free_slots=free_slots,
        )
        episode = harness.run_episode(seed, 150, shape, async_scheduling=seed % 2 == 1)
        ends[None if episode.dead is None else episode.dead[1]] += 1
    counts = batched_commit.COUNTERS.snapshot()
    assert counts["fast_requests"] > 0 and counts["fallback_reasons"]["multi_token"] > 0, counts
    if free_slots is not None:  # the pool ran dry, and short steps went upstream whole
        assert ends["auxiliary output block pool is exhausted"] > 0, ends
        assert counts["fallback_reasons"].get("step", 0) > 0, counts


def _small_decode_step(connector: Any) -> Any:
    """Eight known requests one token into their blocks, each decoding one token."""
    n, block = 8, connector._buffer.block_size
    ids = [f"r{i}" for i in range(n)]
    starts = [block * i + 1 for i in range(n)]
    connector.begin_step(AuxOutputConnectorMetadata(0, dict(zip(ids, starts, strict=True)), {}, ()))
    rng = np.random.default_rng(3)
    shape = tuple(connector._buffer.shape_per_token)
    for request_id, start in zip(ids, starts, strict=True):
        state = connector._requests[request_id]
        state.capture_cursor = state.scheduled_cursor = state.emit_cursor = start
        connector._buffer.capture(
            request_id, start - 1, rng.integers(0, 9, (1, *shape)).astype(connector._buffer.dtype)
        )
        state.pending_outputs += 1
    rows = rng.integers(0, 9, (n, *shape)).astype(connector._buffer.dtype)
    pending = _decode_pending(connector, ids, starts, list(range(n + 1)), rows)
    connector._pending_outputs.append(pending)
    return pending


@pytest.mark.parametrize("how", ["subclass", "instance", "wrapped_after_apply"])
def test_a_capture_that_is_not_upstreams_is_called_as_upstream_calls_it(
    reverted: pytest.MonkeyPatch, how: str
) -> None:
    """Upstream's loop calls ``buffer.capture`` through the object, once per request: a
    subclass's capture, one set on the instance, or a wrapper added to the class after
    apply sees every call it sees under upstream (the fast path made none), with the
    same outputs; the step is counted as ``capture_overridden``."""
    from vllm.distributed.aux_output_connector.routed_experts import RoutedExpertsBuffer

    original = RoutedExpertsBuffer.capture
    results = {}
    for reference in (True, False):
        if not reference:
            _apply("batched_commit")
            batched_commit.COUNTERS.reset()
        calls: list[str] = []

        def counting(self: Any, request_id: Any, *rest: Any, _calls: list = calls) -> Any:
            _calls.append(request_id)
            return original(self, request_id, *rest)

        connector = harness.make_connector(harness.Shape(), reference=False)
        buffer = connector._buffer
        if how == "subclass":
            buffer.__class__ = type("Counting", (RoutedExpertsBuffer,), {"capture": counting})
        elif how == "instance":
            buffer.capture = counting.__get__(buffer)
        else:
            reverted.setattr(RoutedExpertsBuffer, "capture", counting)
        pending = _small_decode_step(connector)
        calls.clear()  # the setup's captures
        outputs = connector.process_output(pending)
        results[reference] = (
            calls,
            {r: (o.token_start, o.rows.tolist()) for r, o in outputs.items()},
            harness.worker_state(connector),
        )
        connector.close()
        if how == "wrapped_after_apply":
            reverted.setattr(RoutedExpertsBuffer, "capture", original)
    assert results[False] == results[True]
    assert len(results[True][0]) == 8
    assert batched_commit.COUNTERS.snapshot()["fallback_reasons"] == {"capture_overridden": 8}


def test_ids_that_are_not_a_list_get_upstreams_error(reverted: pytest.MonkeyPatch) -> None:
    """``request_ids`` that ``len`` refuses (a Mock): the wrapper reads nothing of it
    before upstream, whose own ``zip`` raises; the step is counted once."""
    from unittest import mock

    errors = {}
    for reference in (True, False):
        if not reference:
            _apply("batched_commit")
            batched_commit.COUNTERS.reset()
        connector = harness.make_connector(harness.Shape(), reference=False)
        pending = _small_decode_step(connector)
        pending.request_ids = mock.Mock()
        try:
            connector._commit_output(pending)
        except Exception as error:  # noqa: BLE001 - compared below
            errors[reference] = harness.error_of(error)
        connector.close()
    assert errors[False] == errors[True] and errors[True][0] == "TypeError", errors
    assert batched_commit.COUNTERS.snapshot()["fallback_reasons"] == {"step": 1}


def test_fallback_outputs_are_views_of_the_step_as_upstreams_are(
    reverted: pytest.MonkeyPatch,
) -> None:
    """Two fallback requests (drafts with a rejected suffix) around a fast decode: the
    sub-step gathers their rows (not contiguous), and upstream's loop cuts their outputs
    from that copy. Upstream's outputs are views of the step's snapshot, so the outputs
    here must be too (not of the gather, which they would keep alive), with the same
    rows, on the dict path."""
    results = {}
    for reference in (True, False):
        if not reference:
            _apply("batched_commit")
            batched_commit.COUNTERS.reset()
        connector = harness.make_connector(harness.Shape(), reference=False)
        ids = ["d0", "f", "d1"]
        starts = [1, 5, 9]  # one row buffered in each block
        connector.begin_step(
            AuxOutputConnectorMetadata(0, dict(zip(ids, starts, strict=True)), {}, ())
        )
        rng = np.random.default_rng(11)
        for request_id, start in zip(ids, starts, strict=True):
            state = connector._requests[request_id]
            state.capture_cursor = state.scheduled_cursor = state.emit_cursor = start
            connector._buffer.capture(request_id, start - 1, np.zeros((1, 3, 2), np.uint16))
            state.pending_outputs += 1
        qsl = [0, 3, 4, 7]  # d0: 3 tokens, f: 1, d1: 3
        snapshot = rng.integers(1, 9, (7, 3, 2)).astype(np.uint16)
        pending = _decode_pending(connector, ids, starts, qsl, snapshot)
        pending.num_rejected = np.array([1, 0, 1], dtype=np.int32)  # drafts cut by one
        connector._pending_outputs.append(pending)
        outputs = connector.process_output(pending)
        assert isinstance(outputs, dict) and not isinstance(outputs, PackedAuxOutputs)
        results[reference] = (
            {r: (int(o.token_start), o.rows.tolist()) for r, o in outputs.items()},
            {
                r: batched_commit._root(o.rows) is batched_commit._root(snapshot)
                for r, o in outputs.items()
            },
        )
        connector.close()
    assert results[False] == results[True]
    assert all(results[True][1].values()), results[True]
    assert batched_commit.COUNTERS.snapshot()["fast_requests"] == 1


def _two_decode_steps(reference: bool) -> tuple[list[bytes], Any]:
    """Two decode steps of "a" (mid-block) and "b" (a new block), then a 2-token chunk of
    "c" (first capture): each step's output pickled (what the worker sends EngineCore
    without packed_outputs), then the worker's states and tails pickled one by one."""
    connector = harness.make_connector(harness.Shape(block=4), reference)
    state = aux_worker._WorkerRequestState
    connector._requests["a"] = state(capture_cursor=5, scheduled_cursor=5, emit_cursor=5)
    connector._requests["b"] = state(capture_cursor=8, scheduled_cursor=8, emit_cursor=8)
    connector._requests["c"] = state(emit_cursor=0)
    connector._buffer.capture("a", 4, np.ones((1, 3, 2), np.uint16))
    pickled = []
    for step in range(2):
        rows = np.arange(4 * 6, dtype=np.uint16).reshape(4, 3, 2) + step
        ids, starts, qsl = ["a", "b"], [5 + step, 8 + step], [0, 1, 2]
        if step:
            ids, starts, qsl = [*ids, "c"], [*starts, 0], [*qsl, 4]
        pending = _decode_pending(connector, ids, starts, qsl, rows)
        for request_id in ids:
            connector._requests[request_id].pending_outputs += 1
        connector._pending_outputs.append(pending)
        pickled.append(pickle.dumps(connector.process_output(pending)))
    result = pickled, harness.pickled_state(connector)
    connector.close()
    return result


def test_the_fast_path_writes_upstreams_types(reverted: pytest.MonkeyPatch) -> None:
    """Upstream's loop leaves numpy scalars of the runner's int32 arrays in the cursors
    (``token_start + len(rows)``; scheduled: ``token_start + (end - start)``), in a new
    tail's block start and in each output's ``token_start`` (the emit cursor it
    replaces); the fast path wrote Python ints. Values were equal, but a pickled step
    was another (issue 27, item 5: 314 vs 408 bytes), and so were pickled states."""
    expected = _two_decode_steps(reference=True)
    _apply("batched_commit")
    batched_commit.COUNTERS.reset()
    got = _two_decode_steps(reference=False)
    assert batched_commit.COUNTERS.snapshot()["fast_requests"] == 4  # all but "c"
    assert [len(step) for step in got[0]] == [len(step) for step in expected[0]]
    assert got == expected
