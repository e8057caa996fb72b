"""batched_commit: commit the common decode step at once; hand every other request to upstream.

Upstream's ``AuxOutputWorkerConnector._commit_output`` walks the step one request at a
time: numpy scalars out of five arrays, a slice, ``RoutedExpertsBuffer.capture`` (shape
checks, a ``while`` loop, one row assignment), one ``AuxRequestOutput``. At 400-2000
running requests that per-request Python is most of R3's cost on the output worker, and
``packed_outputs`` then reads all those fresh objects back to pack them.

We wrap ``_commit_output``. The *fast* requests of a step are the common decode case:

* one scheduled token, nothing rejected, a token sampled;
* the worker state's ``capture_cursor`` and ``emit_cursor`` both equal the token start
  (no rewind after preemption, no emit from the store after a prefix hit, no
  ``routed_experts_prompt_start`` offset, no first capture);
* the row extends the request's buffered tail contiguously, or starts a new aligned
  block (hash block size > 1, a free buffer slot).

For those, upstream's effects are reproduced on upstream's own objects: the cursors
(capture and emit cursor one ``start + 1`` object, the scheduled cursor another, each
of the type upstream's arithmetic on the runner's arrays gives: ``_CursorTypes``), the
tail's length grown from its own value, one vectorised row write into the buffer's
slots, completion of a full tail exactly as ``capture`` does it (the slot moves to
``_owned_slots`` under the block view's id), and publication through upstream's
``_publish_blocks`` with the same ``(state, completed)`` pairs, in batch order. The
step's output is built directly from the snapshot: one ``take`` of the fast rows into a
``PackedAuxOutputs`` when ``packed_outputs`` is in force in this process, else
upstream's dict of ``AuxRequestOutput`` views, each starting at the emit cursor object
it replaced.

Every other request of the step (a prefill chunk or drafts: several tokens; a rejected
or unsampled token; a capture rewind, a one-token emit from the store, a first one-token
capture, a gap upstream asserts on, ...) goes through upstream's ``_commit_output``
itself, in the same step, on a ``PendingAuxOutput`` holding just those requests
(``dataclasses.replace``, arrays of the step's own dtypes; its rows are a view of the
snapshot when they are contiguous, else one gather). So does every request from the
first one upstream's loop raises on (``upstream_raises``: the state lookup, the cursor
assertions and ``capture``'s checks, read-only) to the end of the step: upstream then
raises there, having committed the requests before it and none after it, as its own
loop does. A step that does not look like upstream's contract at all (mismatched
lengths, duplicate ids, a token count out of range, float token starts or bounds, token
starts or bounds that are not numpy arrays, a different row profile) goes to upstream
whole, so upstream raises; so does a step with fewer free buffer slots than requests
(where upstream may assert "pool is exhausted": at the request it would), a step whose
ids are not a list (counted once: nothing of it is read before upstream), a step with
no fast decode ahead of the first request upstream raises on, and a step whose
buffer's ``capture`` is not upstream's (a subclass's, one set on the instance, a wrapper
added after apply: counted as ``capture_overridden``), since upstream's loop calls
``capture`` through the object and the fast path does what upstream's does.

Differences from upstream, and why they are not observable:

* Store writes: none. Upstream captures the whole step, then publishes it in one
  ``put`` (a key two requests complete in the same step keeps the later one's rows)
  before any emit reads the store. With fallback requests in the step, the fast
  requests' ``(state, completed)`` pairs are merged into the fallback's own single
  ``_publish_blocks`` call, in batch order (``_one_publication``): the same one put.
* Dict order: direct outputs in batch order, then the fallback's outputs read back
  from the store or buffer, in upstream's order.
* Buffer slots: fast requests' new tails pop their slots before the fallback
  requests' (upstream: in batch order); once all captures are in (before the
  publication, or when upstream's loop raised), each new tail is given the slot
  upstream gives it, rows and all (``_slots_in_batch_order``). A capture takes at most
  one free slot, and a step with fewer free slots than requests goes to upstream whole,
  so no request finds the pool exhausted that upstream would not.
* Fallback rows: upstream's outputs for fallback requests are cut from the sub-step's
  rows; when those were gathered (not contiguous) they are re-pointed at the same rows
  of the step's snapshot (``_view_of_step``), so they keep alive what upstream's keep.

Counters (``COUNTERS``) say which requests were ours and which upstream's, by reason.

Why this module is long: the fast path must leave exactly the state upstream's loop
leaves, so each of upstream's effects is a rule here (the cursor and tail values and
their types, a full tail's slot, the one publication shared with the fallback, new
tails' slots in batch order, upstream's error at upstream's request, fallback outputs
as views of the snapshot), besides the packed output built without a per-request object.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import operator
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from prime_r3 import state as prime_state
from prime_r3.fixes.aux_output import (
    AUX_REQUEST_OUTPUT,
    COMMIT_OUTPUT,
    MATERIALIZE_ROUTED_EXPERTS,
    PENDING_AUX_OUTPUT,
    PROCESS_OUTPUT,
    TAKE_OUTPUT,
    WORKER_REQUEST_STATE,
)
from prime_r3.fixes.aux_output import CONNECTOR_MODULE as _CONNECTOR
from prime_r3.fixes.aux_output import ROUTED_EXPERTS_MODULE as _ROUTED_EXPERTS
from prime_r3.fixes.aux_output import WORKER_MODULE as _WORKER
from prime_r3.spec import Anchor, PatchSpec, Process, Target, WrapperFn


class Counters:
    """How many requests the fast path committed and how many went to upstream, by reason.

    Process-wide (every connector in the process adds to it); ``snapshot()`` is what
    the bench and the tests read. batched_commit's reasons for one-token requests:
    ``rejected``, ``not_sampled``, ``cursor`` (capture/emit cursor not at the token
    start: rewind, store emit, prompt start, first capture, no state), ``tail`` (not
    contiguous with the buffered tail, unaligned new block), ``upstream_raises`` (a
    one-token decode after the request upstream's loop raises on); ``multi_token`` for a request of
    several tokens (a prefill chunk, drafts); ``step`` (the whole step went to upstream:
    no fast decode, a malformed step, fewer free buffer slots than requests);
    ``capture_overridden`` (the buffer's ``capture`` is not upstream's).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.steps = 0
            self.batched_steps = 0
            self.fast_requests = 0
            self.fallback_requests = 0
            self.fallback_reasons: Counter[str] = Counter()

    def add(self, fast: int, reasons: Mapping[str, int]) -> None:
        with self._lock:
            self.steps += 1
            self.batched_steps += fast > 0
            self.fast_requests += fast
            if reasons:  # the common step has none: no Counter.update per step
                # A reason counted zero times this step (a mixed step's ``rejected``
                # when only ``not_sampled`` occurred) is not a reason: no 0 entries.
                counted = {reason: count for reason, count in reasons.items() if count}
                self.fallback_requests += sum(counted.values())
                self.fallback_reasons.update(counted)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "steps": self.steps,
                "batched_steps": self.batched_steps,
                "fast_requests": self.fast_requests,
                "fallback_requests": self.fallback_requests,
                "fallback_reasons": dict(self.fallback_reasons),
            }


COUNTERS = Counters()


def _root(array: Any) -> Any:
    """The array at the end of ``array``'s chain of numpy views (itself if it owns or
    wraps foreign memory): a row is a view of the step's rows iff the roots match."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def _packing_in_force(connector: Any) -> bool:
    """Whether this step is sent packed: EngineCore declared, in this step's connector
    metadata, that it reads the packed format (``prime_r3.packed.reader_declared``, the
    packed_outputs handshake) **and** packed_outputs' wrapper is in force among ours on
    the connector class's ``process_output`` (another patch may stack there).

    The fast path then builds the ``PackedAuxOutputs`` directly; otherwise it returns
    upstream's dict, exactly as packed_outputs' own wrapper decides, so an EngineCore
    that cannot read packed steps (overlay off there, another prime_r3, a custom
    consumer) never gets one from the batched path either.
    """
    from prime_r3.packed import reader_declared

    if not reader_declared(getattr(connector, "_step_metadata", None)):
        return False
    process_output = inspect.getattr_static(type(connector), "process_output", None)
    return "packed_outputs" in prime_state.wrapped_by(process_output)


#: The reason counted for a step whose buffer's ``capture`` is not upstream's.
CAPTURE_OVERRIDDEN = "capture_overridden"


def _whole_step_reason(connector: Any, pending: Any, capture: Any) -> str | None:
    """Why the step must go to upstream whole (so its assertions fire there), else None.

    ``capture`` is upstream's ``RoutedExpertsBuffer.capture`` as the class defined it:
    the fast path does what that function does, on its objects, so a buffer whose
    ``capture`` is another (a subclass's, one set on the instance, a wrapper added to
    the class after apply) gets upstream's loop, which calls it through the object."""
    buffer, store = connector._buffer, connector._store
    if buffer is None or store is None or buffer.block_size <= 1:
        return "no data plane or 1-token blocks"
    if type(buffer).capture is not capture or "capture" in getattr(buffer, "__dict__", ()):
        return CAPTURE_OVERRIDDEN
    rows, sampled, rejected = pending.routed_experts, pending.num_sampled, pending.num_rejected
    if rows is None or sampled is None or rejected is None:
        return "CPU copy not enqueued"
    if type(rows) is not np.ndarray or rows.shape[1:] != tuple(buffer.shape_per_token):
        return "row profile"
    if rows.dtype != buffer.dtype:
        return "row profile"
    return None


def _batched_commit(params: Mapping[str, Any]) -> WrapperFn:
    # Imports vLLM: only when applying.
    from vllm.distributed.aux_output_connector.connector import AuxRequestOutput
    from vllm.distributed.aux_output_connector.routed_experts import (
        RoutedExpertsBuffer,
        _RequestTail,
    )

    from prime_r3.packed import PackedAuxOutputs

    # Upstream's capture, as the class defines it (the anchor verified the class source);
    # None when something already replaced it: then no buffer's capture is upstream's.
    capture = RoutedExpertsBuffer.__dict__.get("capture")
    if getattr(capture, "__qualname__", None) != "RoutedExpertsBuffer.capture" or (
        getattr(capture, "__module__", None) != RoutedExpertsBuffer.__module__
    ):
        capture = None

    def batched_commit(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        pending = args[0] if args else kwargs.get("pending")
        if instance is None or pending is None:  # through the class, or no step: upstream's
            return _upstream_step(wrapped, args, kwargs, pending)
        why = _whole_step_reason(instance, pending, capture)
        if why is not None:
            reason = CAPTURE_OVERRIDDEN if why == CAPTURE_OVERRIDDEN else "step"
            return _upstream_step(wrapped, args, kwargs, pending, reason)
        ids = pending.request_ids
        if type(ids) is not list:  # the runner's list; anything else: upstream's zip
            return _upstream_step(wrapped, args, kwargs, pending)
        n = len(ids)
        step_qsl = pending.query_start_loc
        token_starts = pending.token_starts
        sampled = np.asarray(pending.num_sampled)
        rejected = np.asarray(pending.num_rejected)
        rows = pending.routed_experts
        if (
            # The runner's arrays: upstream's cursors are their elements' numpy scalars
            # (a list's elements would be Python ints), so the types are read from them.
            type(step_qsl) is not np.ndarray
            or type(token_starts) is not np.ndarray
            or n == 0
            or step_qsl.shape != (n + 1,)
            or token_starts.shape != (n,)
            or sampled.shape != (n,)
            or rejected.shape != (n,)
            # Upstream indexes rows and buffer slots with these: it raises on floats, where
            # a cast here would commit them (and a float start left float tail lengths).
            or step_qsl.dtype.kind not in "iu"
            or token_starts.dtype.kind not in "iu"
        ):
            return _upstream_step(wrapped, args, kwargs, pending)
        qsl = step_qsl.astype(np.int64, copy=False)
        num_tokens = qsl[1:] - qsl[:-1]
        if (
            bool((num_tokens <= 0).any())
            or bool((rejected < 0).any())
            or bool((rejected > num_tokens).any())
            or qsl[0] < 0
            or qsl[-1] > len(rows)
            or len(set(ids)) != n
        ):
            return _upstream_step(wrapped, args, kwargs, pending)

        decode = (num_tokens == 1) & (rejected == 0) & (sampled > 0)
        # Upstream's loop raises at the first request whose capture it refuses, leaving
        # every later request untouched: that request and all after it go to upstream.
        # The other requests are few (prefill chunks, drafts); decodes are checked as
        # the fast path meets them (_select).
        stop = _first_raising(instance, ids, token_starts, num_tokens, rejected, ~decode)
        reasons: Counter[str] = Counter()
        cursor_types = _cursor_types(token_starts, step_qsl)
        selected = _select(
            instance, ids, token_starts, decode, reasons, _RequestTail, cursor_types, stop
        )
        if selected is None:
            return _upstream_step(wrapped, args, kwargs, pending)
        fast, fallback = selected.fast, selected.fallback
        created = selected.created
        published, published_at = selected.published, selected.published_at
        decode_created = len(created)  # in batch order among themselves
        buffer_rows = instance._buffer._rows
        if fast[-1] - fast[0] + 1 == len(fast):  # one run: a view, no list conversion
            fast_rows = qsl[fast[0] : fast[-1] + 1]
        else:
            fast_rows = qsl[fast]
        buffer_rows[selected.slots, selected.in_block] = _rows_at(rows, fast_rows)

        if len(fast) + len(fallback) != n:
            # Every other request is upstream's: a rejected or unsampled token, or
            # several tokens (a prefill chunk, drafts: multi_token).
            not_decode = ~decode
            single = not_decode & (num_tokens == 1)
            counts = (
                ("rejected", single & (rejected != 0)),
                ("not_sampled", single & (rejected == 0) & (sampled <= 0)),
                ("multi_token", not_decode & (num_tokens > 1)),
            )
            for reason, which in counts:
                count = int(which.sum())
                if count:  # no zero entries in the counters' reasons
                    reasons[reason] += count
            fallback.extend(np.flatnonzero(not_decode).tolist())
            fallback.sort()
        COUNTERS.add(len(fast), reasons)

        direct: list[tuple[int, str, Any]] = []
        materialised: list[tuple[str, Any]] = []
        if not fallback:
            if published:  # upstream's own publication, same pairs, batch order
                instance._publish_blocks(published)
        else:
            sub, sub_rows = _sub_step(pending, fallback, qsl, num_tokens, token_starts)
            sub_root = _root(sub_rows)
            position = dict(zip(sub.request_ids, fallback, strict=True))
            tails = instance._buffer._requests
            before = [tails.get(request_id) for request_id in sub.request_ids]
            ordered: list[bool] = []

            def order_slots() -> None:
                # The tails upstream's capture made for the fallback requests (their
                # slots were popped after ours, in batch order) join the step's others.
                ordered.append(True)
                for j, request_id, old in zip(fallback, sub.request_ids, before, strict=True):
                    tail = tails.get(request_id)
                    if tail is not None and tail is not old:
                        created.append((j, tail))
                if decode_created and len(created) > decode_created:
                    _slots_in_batch_order(instance._buffer, created)

            try:
                with _one_publication(instance, published, published_at, fallback, order_slots):
                    sub_outputs = wrapped(sub)
            except BaseException:
                # Upstream raised in its capture loop (nothing after that request was
                # committed: see `stop`): the tails made so far hold upstream's slots.
                if not ordered:
                    order_slots()
                raise
            gathered = sub_root is not _root(rows)  # sub_rows is a copy (non-contiguous)
            for request_id, output in sub_outputs.items():
                value_rows = output.rows
                if isinstance(value_rows, np.ndarray) and _root(value_rows) is sub_root:
                    j = position[request_id]
                    if gathered:
                        output.rows = _view_of_step(value_rows, sub_rows, sub, rows, qsl, j)
                    direct.append((j, request_id, output))
                else:
                    materialised.append((request_id, output))

        if _packing_in_force(instance):
            return _packed(
                PackedAuxOutputs, ids, token_starts, rows, fast, fast_rows, direct, materialised
            )
        # Upstream's dict: each fast request's output starts at its emit cursor as it was
        # (the object upstream's loop passes), a view of its row of the snapshot.
        built = [
            (j, ids[j], AuxRequestOutput(emit, rows[at : at + 1]))
            for j, emit, at in zip(fast, selected.emits, fast_rows.tolist(), strict=True)
        ]
        merged = sorted(built + direct, key=operator.itemgetter(0)) if direct else built
        outputs: dict[str, Any] = {request_id: output for _, request_id, output in merged}
        outputs.update(materialised)
        return outputs

    return batched_commit


def _pick(items: Any, index: list[int]) -> list[Any]:
    if len(index) == 1:
        return [items[index[0]]]
    return list(operator.itemgetter(*index)(items))


#: The reason counted for a one-token decode sent to upstream because upstream's loop
#: raises on a request before it in the step.
UPSTREAM_RAISES = "upstream_raises"


class _CursorTypes(NamedTuple):
    """The numpy types upstream's arithmetic gives the values it writes.

    Upstream iterates the runner's arrays: a token start is a scalar of
    ``token_starts``' dtype, and so are the capture and emit cursors it sets (``start +
    len(rows)``) and the block starts ``capture`` computes; the scheduled cursor is
    ``start + (end - start)`` with ``end`` and ``start`` scalars of ``query_start_loc``'s
    dtype, so of the two dtypes' result type."""

    token: np.dtype[Any]
    scheduled: np.dtype[Any]


def _cursor_types(token_starts: np.ndarray, query_start_loc: np.ndarray) -> _CursorTypes:
    return _CursorTypes(
        token_starts.dtype, np.result_type(token_starts.dtype, query_start_loc.dtype)
    )


class _Decodes(NamedTuple):
    """What ``_select`` did with a step's one-token decode candidates (batch positions)."""

    #: Committed here, ascending.
    fast: list[int]
    #: Left to upstream's ``_commit_output``, ascending.
    fallback: list[int]
    #: Each fast request's buffer slot and row in it: where its row is written.
    slots: np.ndarray
    in_block: np.ndarray
    #: ``(state, completed)`` pairs for the publication, and their batch positions.
    published: list[Any]
    published_at: list[int]
    #: New buffer tails, as (position, tail), in the order their slots were popped.
    created: list[tuple[int, Any]]
    #: Each fast request's emit cursor before the step (its output's ``token_start``).
    emits: list[Any]


def upstream_raises(connector: Any, request_id: Any, token_start: int, num_rows: int) -> bool:
    """Whether upstream's ``_commit_output`` loop body raises on this request, read-only:
    the state lookup, its capture-cursor assertions, then ``RoutedExpertsBuffer.capture``
    of ``num_rows`` rows (``num_tokens - rejected``) walked on the request's buffered
    tail. Its checks read only the request's own state and tail (a step's ids are
    unique and, with a free slot per request, the pool is never exhausted), so earlier
    requests of the step cannot change the answer. (``python -O`` drops upstream's
    assertions: then an answer of True only sends more to upstream.)"""
    try:
        state = connector._requests.get(request_id)
    except TypeError:  # an unhashable id: upstream's lookup raises
        return True
    if state is None:
        return True  # upstream's self._requests[request_id]: KeyError
    capture_start = token_start
    cursor = state.capture_cursor
    if cursor is None:
        cursor = capture_start
    if capture_start < cursor:
        return True  # "capture moved backwards"
    if capture_start > cursor:
        if not cursor < state.scheduled_cursor:
            return True  # "unbacked token gap"
        capture_start = cursor
    if capture_start < 0:
        return True  # capture's ValueError
    buffer = connector._buffer
    block_size = buffer.block_size
    tail = buffer._requests.get(request_id)
    has_tail = tail is not None
    tail_start, tail_length = (tail.block_start, tail.length) if has_tail else (0, 0)
    offset = 0
    while offset < num_rows:  # capture's loop, on the tail's start and length only
        position = capture_start + offset
        block_start = position // block_size * block_size
        local_start = position - block_start
        if not has_tail and local_start == 0 and num_rows - offset >= block_size:
            offset += block_size
            continue
        if has_tail and tail_start != block_start:
            return True  # "skipped an incomplete block"
        if not has_tail:
            has_tail, tail_start, tail_length = True, block_start, 0
        if local_start != tail_length:
            return True  # "capture is not contiguous"
        count = min(block_size - local_start, num_rows - offset)
        tail_length += count
        offset += count
        if tail_length == block_size:
            has_tail = False
    return False


def _first_raising(
    connector: Any,
    ids: list[str],
    token_starts: np.ndarray,
    num_tokens: np.ndarray,
    rejected: np.ndarray,
    which: np.ndarray,
) -> int:
    """The first batch position among ``which`` (a mask) where upstream's loop raises,
    else ``len(ids)``."""
    for j in np.flatnonzero(which).tolist():
        rows = int(num_tokens[j]) - int(rejected[j])
        if upstream_raises(connector, ids[j], int(token_starts[j]), rows):
            return j
    return len(ids)


def _select(
    connector: Any,
    ids: list[str],
    token_starts: np.ndarray,
    decode: np.ndarray,
    reasons: Counter[str],
    request_tail: Any,
    types: _CursorTypes,
    stop: int,
) -> _Decodes | None:
    """Find the fast decodes before ``stop`` and apply upstream's capture bookkeeping to
    them, or None when no request is fast (nothing was touched: the step goes to
    upstream whole).

    One pass over the candidates, each reading its state and tail once and, when they
    pass, writing them right away: what decides a request is its own state and tail
    (a free slot is left for every request of the step: see below), so nothing is
    written for a request that goes to upstream, and nothing at all when none is fast.
    The first candidate upstream's loop raises on ends the pass: it and every later
    candidate go to upstream, untouched here, as upstream's loop leaves them. The values
    written are upstream's objects: cursors and block starts of ``types``, a tail's
    length grown from its own value, the output's start the emit cursor it replaces.
    """
    every = np.flatnonzero(decode)
    candidates = every[: int(np.searchsorted(every, stop))]
    m = len(candidates)
    if m == 0:
        return None
    buffer = connector._buffer
    block_size = buffer.block_size
    tails = buffer._requests
    free_slots = buffer._free_slots
    if len(free_slots) < len(ids):
        # A capture takes at most one free slot (its new tail), so with a slot per request
        # no request of the step can find the pool exhausted, whatever the order the
        # slots are taken in. With fewer, one may: upstream asserts at the first request
        # in batch order that finds none, after the slots went to the requests ahead of
        # it, so such a step goes to upstream whole.
        return None
    first = int(candidates[0])
    if int(candidates[-1]) - first + 1 == m:  # one run (decodes before prefills): slices
        cand: Any = range(first, first + m)
        cand_ids = ids[first : first + m]
        start_array = token_starts[first : first + m]
    else:
        cand = candidates.tolist()
        cand_ids = _pick(ids, cand)
        start_array = token_starts[candidates]
    starts = start_array.tolist()  # Python ints for the checks; numpy values are written
    ends = start_array + 1  # upstream's token_end, capture_start + len(rows)
    scheduled_ends = np.add(start_array, 1, dtype=types.scheduled)  # start + num_tokens
    get_state = connector._requests.get
    get_tail = tails.get
    rows_of = buffer._rows
    owned_slots = buffer._owned_slots
    fallback: list[int] = []
    slots: list[int] = []
    emits: list[Any] = []
    published: list[Any] = []
    published_at: list[int] = []
    created: list[tuple[int, Any]] = []
    cursor_misses = 0
    last = block_size - 1
    for j, request_id, start, end, scheduled in zip(
        cand, cand_ids, starts, ends, scheduled_ends, strict=True
    ):
        state = get_state(request_id)
        # No rewind, store emit, prompt start or first capture: both cursors at the start.
        if state is None or state.capture_cursor != start or (emit := state.emit_cursor) != start:
            cursor_misses += 1
            fallback.append(j)
            if upstream_raises(connector, request_id, start, 1):
                stop = j
                break
            continue
        local = start % block_size
        tail = get_tail(request_id)
        if tail is None:
            # Upstream's _tail makes a tail for an aligned start, from a free slot (there
            # is one: checked above).
            if local:
                fallback.append(j)
                if upstream_raises(connector, request_id, start, 1):  # "not contiguous"
                    stop = j
                    break
                continue
            tail = request_tail(free_slots.pop(), end - 1)  # start, of upstream's type
            tails[request_id] = tail
            created.append((j, tail))
            length = 0
        else:
            length = tail.length
            if length != local or tail.block_start != start - local:
                # Upstream's _tail and capture accept a tail only where the token start
                # falls in it, at its length: it starts on the token's block boundary.
                fallback.append(j)
                if upstream_raises(connector, request_id, start, 1):
                    stop = j
                    break
                continue
        # capture() grows the tail by one row; _commit_output advances all three cursors
        # (capture and emit to one token_end object, scheduled to another).
        tail.length = length + 1
        state.capture_cursor = state.emit_cursor = end
        state.scheduled_cursor = scheduled
        emits.append(emit)
        slot = tail.slot
        slots.append(slot)
        if local == last:
            # capture(): a full tail leaves _requests; the block view owns its slot.
            block = rows_of[slot]
            del tails[request_id]
            owned_slots[id(block)] = slot
            published.append((state, [(end - block_size, block)]))  # its block start
            published_at.append(j)
        elif state.pending_blocks:
            # Blocks waiting for keys: upstream's _publish_blocks gets (state, []) and
            # retries them, as upstream's loop hands it every request's pair.
            published.append((state, []))
            published_at.append(j)
    k = len(slots)
    if not k:
        return None
    if cursor_misses:
        reasons["cursor"] += cursor_misses
    not_tail = len(fallback) - cursor_misses
    if not_tail:  # no zero entry: the common step then has no reasons at all
        reasons["tail"] += not_tail
    after = every[int(np.searchsorted(every, stop, side="right")) :]
    if len(after):  # after the request upstream raises on: not visited
        reasons[UPSTREAM_RAISES] += len(after)
    # The fast requests are the candidates less the fallback ones (no per-request list
    # of them in the loop: the common step has no fallback). Index arrays for the one
    # row write: numpy reads a list index far slower than an array built by fromiter.
    if fallback or len(after):
        keep = np.ones(m, dtype=bool)
        keep[np.searchsorted(candidates, fallback)] = False
        keep[len(slots) + len(fallback) :] = False  # after a break: not visited
        fast = np.asarray(cand)[keep].tolist()
        start_array = start_array[keep]
        fallback.extend(after.tolist())
    else:
        fast = list(cand)
    slot_index = np.fromiter(slots, np.int64, k)
    in_block = start_array.astype(np.int64) % block_size
    return _Decodes(fast, fallback, slot_index, in_block, published, published_at, created, emits)


def _slots_in_batch_order(buffer: Any, created: list[tuple[int, Any]]) -> None:
    """Give the step's new buffer tails the slots upstream's capture gives them.

    Upstream's loop pops a free slot for each new tail in batch order; here the fast
    decode tails pop first, then upstream's fallback pops its own. The same slots leave
    the free list either way (the top ones, before any ``retain_block`` of the
    publication), only who holds which differs, and with it every later release order,
    free-list order and slot reuse. ``created`` lists the step's new tails in pop order
    (a tail made this step is never completed in the same capture, so each is still
    buffered): when their batch positions are not already ascending, the i-th tail in
    batch order gets the i-th slot popped and its rows (its length's worth) move with it.
    A slot's bytes past its tail's length are a former tenant's here and upstream, not
    always the same one's: nothing reads them (``read`` stays within the length, a tail
    is completed by writing the rest). Done once all captures are in and before the
    publication (which reads no new tail's slot), so a publication that raises leaves
    the tails where upstream's does.
    """
    positions = [j for j, _ in created]
    if all(a < b for a, b in zip(positions, positions[1:], strict=False)):
        return
    rows = buffer._rows
    popped = [tail.slot for _, tail in created]
    ordered = [tail for _, tail in sorted(created, key=operator.itemgetter(0))]
    saved = [rows[tail.slot, : tail.length].copy() for tail in ordered]
    for tail, slot, data in zip(ordered, popped, saved, strict=True):
        tail.slot = slot
        rows[slot, : len(data)] = data


@contextlib.contextmanager
def _one_publication(
    connector: Any,
    published: list[Any],
    published_at: list[int],
    fallback: list[int],
    before: Any,
) -> Iterator[None]:
    """Upstream's single ``_publish_blocks`` call for the whole step, in batch order.

    Upstream captures every request, then publishes the batch in one store ``put``
    (where, for a key two requests complete in the same step, the later one in batch
    order wins) and only then reads the store for emits. The fallback runs upstream's
    ``_commit_output`` on the other requests, which calls ``_publish_blocks`` exactly
    once: for that call the connector's ``_publish_blocks`` merges the fast requests'
    ``(state, completed)`` pairs with the fallback's by batch position, so the store
    gets the one ``put`` upstream makes, before any fallback emit reads it. The
    instance attribute lives only for this call (under the connector's lock).

    ``before()`` runs first (all captures are done then): it gives the step's new tails
    upstream's slots, so a publication that raises (``retain_block`` finding the pool
    exhausted) leaves them where upstream's does.
    """
    publish = connector._publish_blocks  # upstream's bound method

    def merged(batches: list[Any], *args: Any, **kwargs: Any) -> Any:
        before()
        pairs = sorted(
            [*zip(published_at, published, strict=True), *zip(fallback, batches, strict=True)],
            key=operator.itemgetter(0),
        )
        return publish([pair for _, pair in pairs], *args, **kwargs)

    connector._publish_blocks = merged
    try:
        yield
    finally:
        # The instance attribute goes after the call; if upstream raised first (an
        # assertion on a fallback request), nothing of this step was published, as upstream.
        connector.__dict__.pop("_publish_blocks", None)


def _upstream_step(
    wrapped: Any,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    pending: Any,
    reason: str = "step",
) -> Any:
    """The whole step through upstream's ``_commit_output``, counted under ``reason``
    without reading anything upstream would not first: a list of ids counts its
    requests, anything else once (upstream raises its own error on it)."""
    ids = getattr(pending, "request_ids", None) if pending is not None else None
    if pending is not None:
        COUNTERS.add(0, {reason: len(ids) if type(ids) is list else 1})
    else:
        COUNTERS.add(0, {})
    return wrapped(*args, **kwargs)


def _sub_step(
    pending: Any,
    positions: list[int],
    qsl: np.ndarray,
    num_tokens: np.ndarray,
    token_starts: np.ndarray,
) -> tuple[Any, np.ndarray]:
    """A ``PendingAuxOutput`` of just the requests at ``positions`` (batch order), its
    arrays of the step's own dtypes (upstream's cursors are their scalars)."""
    index = np.asarray(positions, dtype=np.int64)
    rows = pending.routed_experts
    first, last = positions[0], positions[-1]
    if last - first + 1 == len(positions):  # one contiguous run: a view, no copy
        sub_rows = rows[int(qsl[first]) : int(qsl[last + 1])]
        sub_qsl = qsl[first : last + 2] - qsl[first]
    else:
        lengths = num_tokens[index]
        sub_qsl = np.zeros(len(index) + 1, dtype=np.int64)
        np.cumsum(lengths, out=sub_qsl[1:])
        gather = np.repeat(qsl[index] - sub_qsl[:-1], lengths)
        gather += np.arange(int(sub_qsl[-1]), dtype=np.int64)
        sub_rows = rows.take(gather, axis=0)
    ids = pending.request_ids
    sub = dataclasses.replace(
        pending,
        request_ids=[ids[j] for j in positions],
        token_starts=token_starts[index],
        query_start_loc=sub_qsl.astype(pending.query_start_loc.dtype, copy=False),
        routed_experts=sub_rows,
        num_sampled=np.asarray(pending.num_sampled)[index],
        num_rejected=np.asarray(pending.num_rejected)[index],
    )
    return sub, sub_rows


def _view_of_step(
    value_rows: np.ndarray, sub_rows: np.ndarray, sub: Any, rows: np.ndarray, qsl: Any, j: int
) -> np.ndarray:
    """The same rows of the step's own ``rows``, as upstream's output holds them (a view
    of the snapshot), for an output upstream's loop cut from the gathered ``sub_rows``
    of the request at batch position ``j``: else the outputs keep the whole gather
    alive, more than upstream would."""
    if not len(value_rows):
        return rows[int(qsl[j]) : int(qsl[j])]
    first = (
        value_rows.__array_interface__["data"][0] - sub_rows.__array_interface__["data"][0]
    ) // sub_rows.strides[0]
    sub_qsl = sub.query_start_loc
    at = int(np.searchsorted(sub_qsl, first, side="right")) - 1  # its request in the sub-step
    start = int(qsl[j]) + int(first - sub_qsl[at])
    return rows[start : start + len(value_rows)]


def _rows_at(rows: np.ndarray, at: np.ndarray) -> np.ndarray:
    """``rows[at]`` for increasing positions ``at``: a slice view when they are one
    contiguous run (the common step), so no step-sized temporary (~150 KB at N=400)
    is written, read and freed each step; else one gather."""
    first = int(at[0])
    if int(at[-1]) - first + 1 == len(at):
        return rows[first : first + len(at)]
    return rows.take(at, axis=0)


def _one_run(rows: np.ndarray, pieces: list[Any]) -> np.ndarray | None:
    """The rows ``pieces`` concatenate to, as one slice view of ``rows``, when they are
    consecutive runs of ``rows`` in order (the common step with fallback requests: the
    fast rows, then a final prefill chunk's rows, which upstream returned as a view of
    the snapshot); else None (the caller concatenates, as before).

    Placement is read from the views' data pointers, inside ``rows``' own bounds; every
    piece must have ``rows``' dtype and row shape, so a piece ``np.concatenate(...,
    casting="no")`` would refuse still goes there and raises as it did.
    """
    if not rows.flags.c_contiguous or rows.ndim == 0:
        return None
    root = _root(rows)
    row_shape, dtype = rows.shape[1:], rows.dtype
    row_nbytes = rows.itemsize * int(np.prod(row_shape, dtype=np.int64))
    base = rows.__array_interface__["data"][0]
    begin = expect = None
    total = 0
    for piece in pieces:
        if (
            type(piece) is not np.ndarray
            or piece.ndim != rows.ndim
            or piece.dtype != dtype
            or piece.shape[1:] != row_shape
            or not piece.flags.c_contiguous
        ):
            return None
        if not len(piece):
            continue
        if _root(piece) is not root:
            return None
        at = piece.__array_interface__["data"][0]
        if expect is None:
            begin, expect = at, at
        if at != expect:
            return None
        expect = at + piece.nbytes
        total += len(piece)
    if begin is None or row_nbytes == 0:
        return None
    offset = begin - base
    if offset < 0 or offset % row_nbytes:
        return None
    first = offset // row_nbytes
    if first + total > len(rows):
        return None
    return rows[first : first + total]


def _packed(
    packed_cls: Any,
    ids: list[str],
    token_starts: np.ndarray,
    rows: np.ndarray,
    fast: list[int],
    fast_rows: np.ndarray,
    direct: list[tuple[int, str, Any]],
    materialised: list[tuple[str, Any]],
) -> Any:
    """The step's ``PackedAuxOutputs``: fast rows taken straight from the snapshot."""
    if not direct and not materialised:
        if len(fast) == len(ids):  # fast is sorted and unique: every request, in order
            out_ids, out_starts = list(ids), token_starts.astype(np.int64)
        else:
            out_ids = list(operator.itemgetter(*fast)(ids)) if len(fast) > 1 else [ids[fast[0]]]
            out_starts = token_starts[fast].astype(np.int64)
        offsets = np.arange(len(fast) + 1, dtype=np.int64)
        # The common step: a view of the snapshot, as upstream's own values are (it is
        # this step's fresh copy, written by nobody after the capture, and a view keeps
        # alive exactly what upstream's per-request views keep alive). Pickling copies
        # it out of band; an unfilled reader copies each request's rows out of it.
        out_rows = _rows_at(rows, fast_rows)
        if not out_rows.flags.c_contiguous:
            out_rows = np.ascontiguousarray(out_rows)
    else:
        # Merge the fast rows with upstream's direct outputs by batch position, then
        # upstream's materialised ones: the order upstream's dict has.
        cuts = (
            np.searchsorted(np.asarray(fast, dtype=np.int64), [j for j, _, _ in direct]).tolist()
            if direct
            else []
        )
        # Fast requests' starts stay arrays (slices of token_starts); the few outputs
        # from upstream are placed among them by position (no per-request int list).
        out_ids, start_parts, pieces = [], [], []
        extra_at, extra_starts, extra_lengths = [], [], []
        count = previous = 0
        extra = [(None, request_id, output) for request_id, output in materialised]
        for cut, (_, request_id, output) in zip(
            [*cuts, len(fast)] + [len(fast)] * len(extra),
            [*direct, (None, None, None), *extra],
            strict=True,
        ):
            if cut > previous:
                first, last = fast[previous], fast[cut - 1]
                if last - first == cut - previous - 1:  # consecutive positions: slices
                    out_ids.extend(ids[first : last + 1])
                    start_parts.append(token_starts[first : last + 1])
                else:
                    chunk = fast[previous:cut]
                    out_ids.extend(_pick(ids, chunk))
                    start_parts.append(token_starts[chunk])
                pieces.append(_rows_at(rows, fast_rows[previous:cut]))
                count += cut - previous
                previous = cut
            if request_id is not None:
                out_ids.append(request_id)
                extra_at.append(count)
                extra_starts.append(int(output.token_start))
                extra_lengths.append(len(output.rows))
                pieces.append(output.rows)
                count += 1
        out_starts = np.empty(count, dtype=np.int64)
        lengths = np.ones(count, dtype=np.int64)
        is_fast = np.ones(count, dtype=bool)
        is_fast[extra_at] = False
        out_starts[is_fast] = np.concatenate(start_parts)
        out_starts[extra_at] = extra_starts
        lengths[extra_at] = extra_lengths
        offsets = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        # Outputs upstream materialised (store bytes, buffer copies) are never views of
        # the snapshot, so the pieces cannot be one run of it: no need to look.
        out_rows = None if materialised else _one_run(rows, pieces)
        if out_rows is None:
            out_rows = np.concatenate(pieces, axis=0, dtype=rows.dtype, casting="no")
    # The ids stay upstream's own str objects (ModelRunnerOutput.req_ids' elements):
    # pickled inside the output they are memo references (prime_r3.packed).
    return packed_cls._trusted(out_ids, out_starts, offsets, out_rows)


# Verified source fingerprints (scripts/fingerprint.py; those shared with other patches
# are in fixes/aux_output.py): worker.py's _publish_blocks and all of routed_experts.py
# are byte-identical in vLLM 0.31.0, 0.32.0 and 0.33.0.
_PUBLISH_BLOCKS = frozenset({"cf38981d0625b2c8"})
_BUFFER = frozenset({"ad486671c35e902f"})
_REQUEST_TAIL = frozenset({"81eb99451d75a944"})

SPEC = PatchSpec(
    name="batched_commit",
    summary="output worker commits the common decode step with array operations; other "
    "requests go to upstream's _commit_output in the same step",
    vllm_range=">=0.31,<0.34",
    # Commits in the output worker; the packed output it builds is read in EngineCore.
    processes=frozenset({Process.WORKER, Process.ENGINE_CORE}),
    targets=(
        Target(_WORKER, "AuxOutputWorkerConnector._commit_output", COMMIT_OUTPUT, _batched_commit),
    ),
    anchors=(
        # Its only caller, under the connector lock.
        Anchor(_WORKER, "AuxOutputWorkerConnector.process_output", PROCESS_OUTPUT),
        # Called with the fast requests' (state, completed) pairs, as upstream does.
        Anchor(_WORKER, "AuxOutputWorkerConnector._publish_blocks", _PUBLISH_BLOCKS),
        # The cursors we set; the step fields we read and replace for the fallback.
        Anchor(_WORKER, "_WorkerRequestState", WORKER_REQUEST_STATE),
        Anchor(_WORKER, "PendingAuxOutput", PENDING_AUX_OUTPUT),
        # capture()/_tail(): tails, free and owned slots, the row array.
        Anchor(_ROUTED_EXPERTS, "RoutedExpertsBuffer", _BUFFER),
        Anchor(_ROUTED_EXPERTS, "_RequestTail", _REQUEST_TAIL),
        # The store read _commit_output makes for emits (rows we then tell apart from
        # snapshot views), where worker.py looks it up (`from ... import`).
        Anchor(_WORKER, "materialize_routed_experts", MATERIALIZE_ROUTED_EXPERTS),
        # Values we build for the dict path; the consumer of the packed path.
        Anchor(
            _CONNECTOR,
            "AuxRequestOutput",
            AUX_REQUEST_OUTPUT,
        ),
        Anchor(
            _CONNECTOR,
            "AuxOutputSchedulerConnector.take_output",
            TAKE_OUTPUT,
        ),
    ),
    # patches/vllm-0.3{1,2,3}.0/06-batched_commit.patch: array-held request state in
    # _commit_output itself (issue 10's worker side), not this fast path beside it.
)
