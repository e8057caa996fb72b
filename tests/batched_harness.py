"""Differential harness: upstream's worker connector and the patched one, fed the same steps.

A small scheduler model produces what vLLM's scheduler hands the output worker: the
connector metadata (emit starts as ``build_connector_meta`` computes them, new block
hashes, terminal events, generation), and each step's ``PendingAuxOutput`` (batch
order, token starts, query_start_loc, rows, num_sampled, num_rejected). It covers
decode, chunked prefill, speculative decoding with rejected suffixes, async scheduling
(two steps in flight, optimistic token starts that the worker re-attaches after a
rejection), preemption (terminal event, then the same id resumes, possibly while its
last step is in flight), prefix-cache hits whose rows come from the store,
``routed_experts_prompt_start``, finishes while a step is in flight, and prefix-cache
resets (generation changes) with nothing in flight.

Two real ``AuxOutputWorkerConnector`` objects, each with its own real
``RoutedExpertsBuffer`` and store (``BlockObjectStore``, or the real background writer
around it), run the same sequence. The reference binds upstream's ``_commit_output`` (the
original the layer saved) on its instance, so it runs upstream code whatever is patched
on the class. After every step the harness compares what each returned (keys,
token starts, row bytes), what the real ``AuxOutputSchedulerConnector.take_output``
hands each request (bytes, or the exact error), the errors raised, every request's
worker state and buffered tail, and the store: keys, payloads, references and the
order of evictable keys. An episode ends at the first error (the engine would die);
both sides must raise the same one, and a ``process_output`` that raised must leave the
same worker state, buffer and store behind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import numpy as np
import wrapt
from vllm.distributed.aux_output_connector import worker as aux_worker
from vllm.distributed.aux_output_connector.connector import (
    AuxOutputConnectorMetadata,
    AuxOutputSchedulerConnector,
    PackedBlockHashes,
)
from vllm.distributed.aux_output_connector.store import (
    BackgroundBlockObjectStore,
    BlockObjectStore,
)

import prime_r3
from prime_r3.packed import FORMAT_VERSION, READS_MARK

WORKER = "vllm.distributed.aux_output_connector.worker"
CONNECTOR = "vllm.distributed.aux_output_connector.connector"


#: The cases an episode counts in ``Episode.seen`` that a differential run must reach
#: (tests/test_batched_commit.py, and the upstream-form run in test_upstream_diffs.py).
CASES = (
    "decode",
    "chunked_prefill",
    "rejected_suffix",
    "capture_reattach",
    "preempt",
    "prefix_hit",
    "emit_from_store_or_buffer",
    "generation_change",
    "finished_in_flight",
    "prompt_start",
    "two_in_flight",
)


def _upstream_take_output() -> Any:
    """Upstream's ``take_output`` (the original the layer saved, if batched_take wraps it)."""
    try:
        function = prime_r3.get_original(CONNECTOR, "AuxOutputSchedulerConnector.take_output")
    except KeyError:  # never patched in this process
        function = AuxOutputSchedulerConnector.__dict__["take_output"]
    assert not isinstance(function, wrapt.ObjectProxy)
    return function


# The reference side's consumer: upstream's take_output, whatever is patched on the class
# (it reads nothing from self). The patched side calls the live class attribute.
TAKE = MethodType(_upstream_take_output(), object.__new__(AuxOutputSchedulerConnector))

#: vLLM 0.33's metadata also carries the block hashes the scheduler connector retains
#: (a finished request's blocks the GPU prefix cache holds) and releases (past its
#: capacity, and all of them at a prefix-cache reset): begin_step retains/releases
#: their keys in the namespace it is in. The scheduler model sends them where the
#: release has the fields (``Episode._retain_blocks``), so that path runs too.
KV_RETENTION = "retained_block_hashes" in {
    f.name for f in dataclasses.fields(AuxOutputConnectorMetadata)
}

#: What carries each side's step output to EngineCore before ``take_output``: None is
#: the worker's object itself (uniproc executor); tests set the real MessageQueue hop.
HOP: Any = None


def live_take() -> Any:
    """``take_output`` as the scheduler calls it now (batched_take's wrapper if applied)."""
    return object.__new__(AuxOutputSchedulerConnector).take_output


#: Whether the modelled EngineCore declares that it reads packed steps (the default: a
#: patched EngineCore does); tests turn it off to model one that cannot.
DECLARE_PACKED_READER = True


#: Worker methods a batched patch may wrap; the reference binds upstream's for each.
WRAPPED = ("_commit_output",)


def upstream(name: str = "_commit_output") -> Any:
    """Upstream's ``AuxOutputWorkerConnector.<name>``, as the layer saved it (or as it is)."""
    try:
        function = prime_r3.get_original(WORKER, f"AuxOutputWorkerConnector.{name}")
    except KeyError:  # never patched in this process
        function = aux_worker.AuxOutputWorkerConnector.__dict__[name]
    assert not isinstance(function, wrapt.ObjectProxy), name
    return function


@dataclass(frozen=True)
class Shape:
    block: int = 4
    token_shape: tuple[int, ...] = (3, 2)
    dtype: Any = np.uint16
    max_num_seqs: int = 24
    max_batched_tokens: int = 64
    store_slots: int = 1024
    background: bool = False
    #: Free buffer slots left at the start (None: the buffer's own sizing), to run the
    #: pool dry: upstream asserts "block pool is exhausted" where it does.
    free_slots: int | None = None


def make_connector(shape: Shape, reference: bool, worker_module: Any = None) -> Any:
    """The output rank's data plane as ``__init__`` builds it, minus the GPU capturer.

    ``worker_module`` (default: the imported ``vllm...worker``) picks whose connector
    and buffer: the upstream-form diffs' array-held state (``_WorkerRequests``) or
    upstream's objects, each from its own module (tests/upstream_form_parity.py).
    """
    module = aux_worker if worker_module is None else worker_module
    dtype = np.dtype(shape.dtype)
    nbytes = shape.block * int(np.prod(shape.token_shape)) * dtype.itemsize
    connector = object.__new__(module.AuxOutputWorkerConnector)
    store = BlockObjectStore(max_bytes=shape.store_slots * nbytes, object_nbytes=nbytes)
    if shape.background:
        store = BackgroundBlockObjectStore(store, max_pending_batches=2 * shape.max_num_seqs)
    _record_store_calls(store)
    connector._store = store
    connector._buffer = module.RoutedExpertsBuffer(
        dtype, shape.token_shape, shape.block, shape.max_num_seqs, shape.max_batched_tokens, 2
    )
    if shape.free_slots is not None:  # the last ones: those the buffer pops first
        free = connector._buffer._free_slots
        free[:] = free[len(free) - shape.free_slots :]
    table = getattr(module, "_WorkerRequests", None)
    connector._requests = {} if table is None else table()
    connector._generation = 0
    connector._step_metadata = None
    connector._pending_outputs = []
    connector._lock = aux_worker.Lock()
    connector._max_concurrent_batches = 2
    if reference:
        for name in WRAPPED:
            setattr(connector, name, MethodType(upstream(name), connector))
    return connector


def _record_store_calls(store: Any) -> None:
    """Log, on the store object itself, every ``put`` (keys with payloads, retained and
    released keys, in call order) and every ``get_concatenated`` (keys) the connector
    makes, so the harness compares the sequence of store calls and not only the store's
    end state (``store_calls``). Instance attributes shadow the class's methods (and any
    patch's wrapper of them, which the bound originals still go through)."""
    log: list[Any] = []
    put, get = store.put, store.get_concatenated

    def recording_put(objects: Any, **kwargs: Any) -> Any:
        # The objects as (key, bytes): a list of BlockObjects, or the upstream-form
        # diff's BlockObjectBatch (keys and one buffer, iterating yields its
        # BlockObjects), which the store then gets as it is, to take its batch path.
        if not hasattr(objects, "keys"):
            objects = list(objects)
        log.append(
            (
                "put",
                [(item.key, bytes(item.payload)) for item in objects],
                list(kwargs.get("retain_keys", ())),
                list(kwargs.get("release_keys", ())),
            )
        )
        return put(objects, **kwargs)

    def recording_get(keys: Any) -> Any:
        log.append(("get", list(keys)))
        return get(keys)

    store.put, store.get_concatenated, store.calls = recording_put, recording_get, log


def store_calls(connector: Any) -> list[Any]:
    """The store calls logged since the last call of this (see ``_record_store_calls``)."""
    log = connector._store.calls
    calls = list(log)
    log.clear()
    return calls


def inner_store(connector: Any) -> Any:
    store = connector._store
    if isinstance(store, BackgroundBlockObjectStore):
        store._queue.join()
        return store._store
    return store


def store_state(connector: Any) -> tuple[Any, ...]:
    """Keys with their payloads, references, and the order of evictable keys."""
    store = inner_store(connector)
    size = store.object_nbytes
    slots = getattr(store, "_slots", store._lru)  # 0.33 keeps slots apart from the LRU
    keys = sorted(slots)
    index = np.fromiter(map(slots.__getitem__, keys), dtype=np.int64, count=len(keys))
    assert (index >= 0).all(), "a key without a slot outside put"
    arena = np.frombuffer(store._arena, dtype=np.uint8)[: store.num_slots * size]
    payloads = arena.reshape(-1, size)[index].tobytes()
    evictable = [key for key in store._lru if key not in store._references]
    return keys, payloads, dict(store._references), evictable


def _request_states(connector: Any) -> dict[str, tuple[Any, ...]]:
    """Each request's worker state as upstream's ``_WorkerRequestState`` fields, read
    from its objects or from the upstream-form diff's arrays (``_WorkerRequests``)."""
    table = connector._requests
    if isinstance(table, dict):
        return {
            request_id: (
                tuple(state.aux_output_keys),
                tuple((start, rows.tobytes()) for start, rows in state.pending_blocks),
                state.capture_cursor,
                state.scheduled_cursor,
                state.emit_cursor,
                state.pending_outputs,
                state.finished,
            )
            for request_id, state in table.items()
        }
    states = {}
    for request_id, row in table.rows.items():
        capture = int(table.capture_cursor[row])
        states[request_id] = (
            tuple(table.aux_output_keys[row]),
            tuple((start, rows.tobytes()) for start, rows in table.pending_blocks[row]),
            None if capture == -1 else capture,
            int(table.scheduled_cursor[row]),
            int(table.emit_cursor[row]),
            int(table.pending_outputs[row]),
            bool(table.finished[row]),
        )
        assert bool(table.has_pending_blocks[row]) == bool(table.pending_blocks[row])
    return states


def _tails(buffer: Any) -> dict[Any, tuple[int, int, int]]:
    """Each buffered tail as (slot, block start, length), from upstream's ``_RequestTail``
    objects or the upstream-form diff's tail arrays."""
    if hasattr(buffer, "_tail_slot"):
        return {
            request_id: (
                int(buffer._tail_slot[tail]),
                int(buffer._tail_start[tail]),
                int(buffer._tail_length[tail]),
            )
            for request_id, tail in buffer._requests.items()
        }
    return {
        request_id: (tail.slot, tail.block_start, tail.length)
        for request_id, tail in buffer._requests.items()
    }


def worker_state(connector: Any) -> tuple[Any, ...]:
    buffer = connector._buffer
    tails = _tails(buffer)
    requests = {}
    for request_id, state in _request_states(connector).items():
        tail = tails.get(request_id)
        requests[request_id] = (
            *state,
            None
            if tail is None
            else (tail[1], tail[2], buffer._rows[tail[0], : tail[2]].tobytes()),
        )
    stray = set(tails) - set(requests)
    return (
        connector._generation,
        requests,
        sorted(stray),
        # Which slot each tail holds, the free list in pop order and the owned slots with
        # their blocks' bytes: slot reuse follows upstream's exactly. (A tail's slot past
        # its length holds a former tenant's rows, which nothing reads.)
        {request_id: tail[0] for request_id, tail in tails.items()},
        list(buffer._free_slots),
        sorted((slot, buffer._rows[slot].tobytes()) for slot in buffer._owned_slots.values()),
        len(connector._pending_outputs),
    )


def pickled_state(connector: Any) -> tuple[dict[Any, bytes], dict[Any, bytes]]:
    """Each request's ``_WorkerRequestState`` and each buffered tail, pickled one by one:
    equal bytes mean equal values of the same types (a cursor upstream leaves as a numpy
    scalar is not a Python int), sharing the same objects within the state (capture and
    emit cursor are one ``token_end`` upstream). Upstream's objects only (dict-held)."""
    states = {rid: pickle.dumps(state) for rid, state in connector._requests.items()}
    tails = {rid: pickle.dumps(tail) for rid, tail in connector._buffer._requests.items()}
    return states, tails


def output_state(output: Any) -> Any:
    if output is None:
        return None
    return [
        (
            request_id,
            int(item.token_start),
            item.rows.dtype.str,
            item.rows.shape,
            item.rows.tobytes(),
        )
        for request_id, item in output.items()
    ]


def error_of(error: BaseException) -> tuple[str, str]:
    return type(error).__name__, str(error)


# -- the scheduler model ---------------------------------------------------------------


def _hash(previous: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(
        previous + np.asarray(tokens, np.int64).tobytes(), digest_size=8
    ).digest()


@dataclass
class Req:
    request_id: str
    tokens: list[int]
    num_prompt: int
    prompt_start: int
    max_out: int
    num_computed: int = 0
    running: bool = False
    sent_hashes: int = 0
    hashes: list[bytes] = field(default_factory=list)
    in_flight: int = 0  # sampling steps in flight
    expected: int = 0  # tokens they sample if every draft is accepted
    finished: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    def is_finished(self) -> bool:
        return self.finished

    def update_hashes(self, block: int) -> None:
        while (len(self.hashes) + 1) * block <= len(self.tokens):
            start = len(self.hashes) * block
            previous = self.hashes[-1] if self.hashes else b""
            self.hashes.append(_hash(previous, self.tokens[start : start + block]))


@dataclass
class Job:
    metadata: Any
    pending: dict[str, Any]  # per side
    items: list[tuple[Req, int, int, int, bool]]  # req, token_start, n, drafts, samples


class Episode:
    """One seed: a random workload driven through both connectors, compared every step."""

    PREFIXES = 3

    def __init__(self, seed: int, shape: Shape, async_scheduling: bool) -> None:
        self.rng = np.random.default_rng(seed)
        self.shape = shape
        self.async_scheduling = async_scheduling
        self.sides = {
            "upstream": make_connector(shape, True),
            "patched": make_connector(shape, False),
        }
        self.requests: dict[str, Req] = {}
        self.waiting: list[Req] = []
        self.finished_events: dict[str, PackedBlockHashes | None] = {}
        self.generation = 0
        self.next_id = 0
        self.queue: list[Job] = []
        self.prefixes = [
            self.rng.integers(1, 50, int(self.rng.integers(2, 5)) * shape.block).tolist()
            for _ in range(self.PREFIXES)
        ]
        self.steps = 0
        self.checks = 0
        #: Which of the cases the workload reached (the test asserts every one is hit).
        self.seen: Counter[str] = Counter()
        self.dead: tuple[str, str] | None = None
        # 0.33's retained/released block hashes (KV_RETENTION), drawn from a stream of
        # their own so the rest of the workload is the seed's on every release.
        self.kv_rng = np.random.default_rng([seed, 33])
        self.kv_capacity = int(self.kv_rng.integers(2, 2 * shape.max_num_seqs))
        self.kv_cached: OrderedDict[bytes, None] = OrderedDict()
        self.retained: list[bytes] = []
        self.released: list[bytes] = []
        self.sent_generation = 0

    # -- requests ------------------------------------------------------------------

    def _new_request(self) -> None:
        rng = self.rng
        prefix = self.prefixes[int(rng.integers(self.PREFIXES))] if rng.random() < 0.6 else []
        prompt = prefix + rng.integers(1, 50, int(rng.integers(1, 3 * self.shape.block))).tolist()
        start = 0 if rng.random() < 0.7 else int(rng.integers(0, len(prompt) + 2))
        request = Req(f"r{self.next_id}", prompt, len(prompt), start, int(rng.integers(1, 40)))
        self.next_id += 1
        request.update_hashes(self.shape.block)
        self.waiting.append(request)

    def _cached_tokens(self, request: Req) -> int:
        """Longest prefix whose keys the store holds (a KV hit the worker can serve)."""
        store = inner_store(self.sides["upstream"])
        slots = getattr(store, "_slots", store._lru)
        hit = 0
        for block_hash in request.hashes:
            if f"vllm-artifact/{self.generation}/{block_hash.hex()}" not in slots:
                break
            hit += self.shape.block
        return min(hit, request.num_tokens - 1) // self.shape.block * self.shape.block

    def _terminal(self, request: Req) -> None:
        """Scheduler connector's request_finished: queue the terminal event + last hashes."""
        if not request.running:
            return
        request.running = False
        self._retain_blocks(request)
        new = request.hashes[request.sent_hashes :]
        self.finished_events[request.request_id] = (
            PackedBlockHashes(b"".join(new), 8) if new else None
        )
        request.sent_hashes = 0

    def _retain_blocks(self, request: Req) -> None:
        """0.33's request_finished: the request's computed blocks the GPU prefix cache
        holds (here: each with probability 0.7) are retained, once; past the capacity the
        oldest that are no longer GPU-cached are released."""
        if not KV_RETENTION:
            return
        rng = self.kv_rng
        num_blocks = min(request.num_computed // self.shape.block, len(request.hashes))
        for block_hash in request.hashes[:num_blocks]:
            if block_hash not in self.kv_cached and rng.random() < 0.7:
                self.kv_cached[block_hash] = None
                self.retained.append(block_hash)
        excess = len(self.kv_cached) - self.kv_capacity
        if excess > 0:
            victims = [h for h in self.kv_cached if rng.random() < 0.8][:excess]
            for block_hash in victims:
                del self.kv_cached[block_hash]
            self.released.extend(victims)

    # -- one engine step -----------------------------------------------------------

    def schedule(self) -> tuple[Any, list[tuple[Req, int, int, int, bool]]]:
        rng = self.rng
        block = self.shape.block
        budget = self.shape.max_batched_tokens
        in_flight_ids = {item[0].request_id for job in self.queue for item in job.items}
        if rng.random() < 0.05 and not self.queue:
            self._reset()
        for request in list(self.requests.values()):
            if (
                request.running
                and rng.random() < 0.03
                and request.request_id not in self.finished_events
            ):
                self.seen["preempt"] += 1
                self.seen["finished_in_flight"] += request.request_id in in_flight_ids
                self._terminal(request)  # preempted: recompute later under the same id
                request.num_computed = request.in_flight = request.expected = 0
                self.waiting.append(request)
                del self.requests[request.request_id]
        while (
            len(self.requests) + len(self.waiting) < self.shape.max_num_seqs - 4
            and rng.random() < 0.5
        ):
            self._new_request()
        items = []
        for request in list(self.requests.values()):
            if rng.random() < 0.1 or budget <= 0:
                continue
            if request.request_id in in_flight_ids:
                if not self.async_scheduling or request.in_flight > 1 or rng.random() < 0.2:
                    continue
            item = self._plan(request, budget)
            if item is not None:
                items.append(item)
                budget -= item[2]
        while self.waiting and budget > block and len(items) < self.shape.max_num_seqs - 2:
            request = self.waiting.pop(0)
            if request.request_id in self.finished_events or request.request_id in in_flight_ids:
                self.waiting.append(request)  # the worker has not seen its terminal event yet
                break
            request.num_computed = self._cached_tokens(request) if rng.random() < 0.8 else 0
            self.seen["prefix_hit"] += request.num_computed > 0
            request.running = True
            self.requests[request.request_id] = request
            item = self._plan(request, budget)
            if item is not None:
                items.append(item)
                budget -= item[2]
        # Decodes first, as vLLM's V2 runner orders a batch, except sometimes.
        if rng.random() < 0.8:
            items.sort(key=lambda item: item[2] != 1)
        else:
            rng.shuffle(items)
        metadata = self._metadata(items)
        return metadata, items

    def _plan(self, request: Req, budget: int) -> tuple[Req, int, int, int, bool] | None:
        rng = self.rng
        start = request.num_computed
        known = request.num_tokens + request.expected  # tokens still in flight
        remaining = known - start
        if remaining <= 0:
            return None
        drafts = 0
        if remaining == 1:
            n = 1
            # Drafts are proposed from a sampled token on, never in a prefill.
            if request.num_output + request.expected > 0 and rng.random() < 0.25:
                drafts = int(rng.integers(1, 4))
                n += drafts
        else:
            n = int(min(remaining, budget, rng.integers(1, 3 * self.shape.block + 2)))
        if n <= 0 or n > budget:
            return None
        samples = start + n >= known
        request.num_computed = start + n  # optimistic, as with async scheduling
        if samples:
            request.in_flight += 1
            request.expected += 1 + drafts
        return (request, start, n, drafts, samples)

    def _metadata(self, items: list[tuple[Req, int, int, int, bool]]) -> Any:
        scheduled = {}
        hashes = {}
        for request, *_ in items:
            new = request.hashes[request.sent_hashes :]
            if new:
                hashes[request.request_id] = PackedBlockHashes(b"".join(new), 8)
            request.sent_hashes = len(request.hashes)
            scheduled[request.request_id] = max(
                min(request.prompt_start, request.num_prompt),
                0 if request.num_output == 0 else request.num_tokens - 1,
            )
        for request in self.requests.values():
            if request.request_id in scheduled or not request.running:
                continue
            new = request.hashes[request.sent_hashes :]
            if new:
                hashes[request.request_id] = PackedBlockHashes(b"".join(new), 8)
                request.sent_hashes = len(request.hashes)
        finished = tuple(self.finished_events)
        for request_id, packed in self.finished_events.items():
            if packed is not None:
                hashes[request_id] = packed
        self.finished_events = {}
        kv: dict[str, Any] = {}
        if KV_RETENTION:
            for name, sent in (("retained", self.retained), ("released", self.released)):
                kv[f"{name}_block_hashes"] = PackedBlockHashes(b"".join(sent), 8) if sent else None
                self.seen[f"{name}_block_hashes"] += len(sent)
            if self.generation != self.sent_generation:
                self.seen["released_at_generation_change"] += len(self.released)
            self.retained, self.released = [], []
        self.sent_generation = self.generation
        metadata = AuxOutputConnectorMetadata(self.generation, scheduled, hashes, finished, **kv)
        if DECLARE_PACKED_READER:
            # What EngineCore's packed_outputs wrapper of build_connector_meta adds (the
            # handshake): workers may send packed steps. Upstream ignores the attribute.
            setattr(metadata, READS_MARK, FORMAT_VERSION)
        return metadata

    def _reset(self) -> None:
        """reset_prefix_cache: every running request preempted, then a new namespace."""
        self.seen["generation_change"] += 1
        for request in list(self.requests.values()):
            self._terminal(request)
            request.num_computed = request.in_flight = request.expected = 0
            self.waiting.append(request)
        self.requests.clear()
        self.finished_events.clear()
        for request in self.waiting:
            request.sent_hashes = 0
        # 0.33's connector reset: every retained block is released (the worker takes
        # these keys in the namespace it leaves).
        self.released.extend(self.kv_cached)
        self.kv_cached.clear()
        self.generation += 1

    #: Build each step's PendingAuxOutput with the connector's own ``prepare_output``
    #: and ``enqueue_cpu_copy`` (a stub capturer hands out the step's rows) instead of
    #: the harness doing prepare_output's bookkeeping on upstream's state objects.
    real_prepare = False

    #: Compare the pickled worker states, tails and (unpacked) step outputs too: upstream's
    #: types and object sharing, not only equal values (both sides hold upstream's objects).
    compare_pickles = True

    def _prepare(
        self, connector: Any, items: list, rows: np.ndarray, sampled: Any, rejected: Any
    ) -> Any:
        """The step's PendingAuxOutput, counted in flight as prepare_output does."""
        if self.real_prepare:
            sizes = [n for _, _, n, _, _ in items]
            batch = _InputBatch(
                req_ids=[request.request_id for request, *_ in items],
                query_start_loc_np=np.concatenate(([0], np.cumsum(sizes))).astype(np.int32),
                num_computed_tokens_np=np.array([start for _, start, *_ in items], np.int32),
            )
            connector._capturer = _Capturer(rows)
            pending = connector.prepare_output(batch)
            pending.enqueue_cpu_copy(sampled, rejected)
            return pending
        pending = self._pending(connector, items, rows, sampled, rejected)
        with connector._lock:  # the bookkeeping prepare_output does
            connector._pending_outputs.append(pending)
            for request, *_ in items:
                connector._requests[request.request_id].pending_outputs += 1
        return pending

    def _pending(
        self, connector: Any, items: list, rows: np.ndarray, sampled: Any, rejected: Any
    ) -> Any:
        sizes = [n for _, _, n, _, _ in items]
        pending = aux_worker.PendingAuxOutput(
            connector=connector,
            request_ids=[request.request_id for request, *_ in items],
            token_starts=np.array([start for _, start, *_ in items], dtype=np.int32),
            query_start_loc=np.concatenate(([0], np.cumsum(sizes))).astype(np.int32),
            routed_experts_gpu=None,  # type: ignore[arg-type]
        )
        pending.routed_experts = rows
        pending.num_sampled = sampled
        pending.num_rejected = rejected
        return pending

    def step(self) -> None:
        """Schedule, begin_step and prepare on both sides; consume the oldest step."""
        metadata, items = self.schedule()
        rng = self.rng
        total = sum(n for _, _, n, _, _ in items)
        rows = rng.integers(0, 300, (total, *self.shape.token_shape)).astype(self.shape.dtype)
        rejected = np.array(
            [int(rng.integers(0, d + 1)) if d and s else 0 for _, _, _, d, s in items], np.int32
        )
        sampled = (
            np.array(
                [
                    1 + d - r if s else 0
                    for (_, _, _, d, s), r in zip(items, rejected.tolist(), strict=True)
                ],
                np.int32,
            )
            if items
            else np.zeros(0, np.int32)
        )
        job = Job(metadata, {}, items)
        up = self.sides["upstream"]._requests
        for (request, start, n, _drafts, samples), r in zip(items, rejected.tolist(), strict=True):
            state = up.get(request.request_id)
            cursor = None if state is None else state.capture_cursor
            self.seen["rejected_suffix"] += r > 0
            self.seen["capture_reattach"] += cursor is not None and start > cursor
            self.seen["chunked_prefill"] += n > 1 and not samples
            self.seen["prompt_start"] += request.prompt_start > 0
            self.seen["decode"] += n == 1
        self.seen["two_in_flight"] += len(self.queue) > 0
        results = {}
        for name, connector in self.sides.items():
            try:
                connector.begin_step(metadata)
                if items:
                    pending = self._prepare(connector, items, rows, sampled, rejected)
                    job.pending[name] = pending
                results[name] = None
            except Exception as error:  # noqa: BLE001
                results[name] = error_of(error)
        self._compare_errors(results, "begin_step")
        if items:
            job_rejected = rejected
            self.queue.append(job)
            job.rejected = job_rejected  # type: ignore[attr-defined]
        self.steps += 1
        depth = 2 if self.async_scheduling else 1
        while self.queue and (len(self.queue) >= depth or not items):
            self._complete(self.queue.pop(0))
            if not items:
                break

    def _complete(self, job: Job) -> None:
        outputs = {}
        errors = {}
        for name, pending in job.pending.items():
            try:
                outputs[name] = pending.process_output()
                errors[name] = None
            except Exception as error:  # noqa: BLE001
                outputs[name] = None
                errors[name] = error_of(error)
        if errors["upstream"] is not None and errors["upstream"] == errors["patched"]:
            # The engine dies with this error, but what it left behind must be what
            # upstream leaves: the worker state, buffer slots, store calls and store.
            self._compare_state()
        self._compare_errors(errors, "process_output")
        # The scheduler's update_from_output: rejected tokens roll back, samples append.
        takers = []
        for (request, _start, _n, drafts, samples), rejected in zip(
            job.items,
            job.rejected.tolist(),
            strict=True,  # type: ignore[attr-defined]
        ):
            if (
                request.request_id not in self.requests
                or self.requests[request.request_id] is not request
            ):
                continue  # preempted or finished meanwhile: its output is dropped
            request.num_computed -= rejected
            if samples:
                request.in_flight -= 1
                request.expected -= 1 + drafts
                accepted = 1 + drafts - rejected
                for _ in range(accepted):
                    request.tokens.append(int(self.rng.integers(1, 50)))
                request.update_hashes(self.shape.block)
                if request.num_output >= request.max_out:
                    request.finished = True
                takers.append(request)
        # EngineCore's side first: the patched output may still be unfilled here (what
        # batched_take reads without filling it), so it is taken before it is compared.
        received = {
            name: out if HOP is None or out is None else HOP(out) for name, out in outputs.items()
        }
        takers_of = {"upstream": TAKE, "patched": live_take()}
        for request in takers:
            taken = {}
            for name, out in received.items():
                try:
                    rows = takers_of[name](request, out)
                    taken[name] = (
                        None if rows is None else (rows.dtype.str, rows.shape, rows.tobytes())
                    )
                except Exception as error:  # noqa: BLE001
                    taken[name] = error_of(error)
            assert taken["upstream"] == taken["patched"], (
                f"step {self.steps}: take_output({request.request_id}) differs"
            )
            self.checks += 1
        got = {name: output_state(out) for name, out in outputs.items()}
        for request, start, *_ in job.items:
            item = (outputs["upstream"] or {}).get(request.request_id)
            self.seen["emit_from_store_or_buffer"] += item is not None and item.token_start < start
        assert got["upstream"] == got["patched"], f"step {self.steps}: outputs differ"
        if self.compare_pickles and type(outputs["patched"]) is dict:  # not a packed step
            assert pickle.dumps(outputs["upstream"]) == pickle.dumps(outputs["patched"]), (
                f"step {self.steps}: pickled outputs differ"
            )
        for request in takers:
            if request.finished and request.request_id in self.requests:
                self.seen["finished_in_flight"] += request.request_id in {
                    item[0].request_id for job in self.queue for item in job.items
                }
                self._terminal(request)
                del self.requests[request.request_id]
        self._compare_state()

    def _compare_errors(self, errors: dict[str, Any], where: str) -> None:
        assert errors["upstream"] == errors["patched"], f"step {self.steps} {where}: {errors}"
        if errors["upstream"] is not None:
            self.dead = errors["upstream"]
            raise EpisodeOver

    def _compare_state(self) -> None:
        up, ours = (self.sides[name] for name in ("upstream", "patched"))
        assert worker_state(up) == worker_state(ours), f"step {self.steps}: worker state differs"
        if self.compare_pickles:
            assert pickled_state(up) == pickled_state(ours), f"step {self.steps}: types differ"
        assert store_calls(up) == store_calls(ours), f"step {self.steps}: store calls differ"
        assert store_state(up) == store_state(ours), f"step {self.steps}: store differs"
        self.checks += 1

    def close(self) -> None:
        for connector in self.sides.values():
            try:
                connector.close()
            except Exception:  # noqa: BLE001 - a failed store already ended the episode
                pass


@dataclass
class _InputBatch:
    """What prepare_output reads of the model runner's InputBatch."""

    req_ids: list[str]
    query_start_loc_np: np.ndarray
    num_computed_tokens_np: np.ndarray


class _Snapshot:
    """A step's rows where prepare_output expects the capturer's GPU tensor:
    enqueue_cpu_copy's ``.to("cpu", non_blocking=True).numpy()`` returns them."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    def to(self, device: str, non_blocking: bool = False) -> _Snapshot:
        assert device == "cpu" and non_blocking
        return self

    def numpy(self) -> np.ndarray:
        return self.rows


@dataclass
class _Capturer:
    rows: np.ndarray

    def snapshot_routing_data(self, num_rows: int) -> _Snapshot:
        assert num_rows == len(self.rows)
        return _Snapshot(self.rows)


class EpisodeOver(Exception):
    """Both sides raised the same error: the engine would be dead; stop the episode."""


def run_episode(seed: int, steps: int, shape: Shape, async_scheduling: bool) -> Episode:
    episode = Episode(seed, shape, async_scheduling)
    try:
        for _ in range(steps):
            episode.step()
    except EpisodeOver:
        pass
    finally:
        episode.close()
    return episode
