"""batched_begin: begin_step without a Python pass (and a new state object) per running request.

Replaces ``AuxOutputWorkerConnector.begin_step`` (wrapped). Upstream walks every
scheduled request each step: ``self._requests.setdefault(request_id,
_WorkerRequestState(emit_cursor=emit_start))`` builds a dataclass per request even when
the request is known (almost always), then asserts ``emit_start <= state.emit_cursor``
for settled requests (``pending_outputs == 0``).

Fast case: for the requests the worker already knows, the settled check is made at
once (``_settled``; its reference form, upstream's loop on the same objects, is
``settled_reference``, and the tests hold the two equal). Upstream's ``begin_step`` then
runs on a copy of the metadata whose ``requests`` holds only the requests it does not
know yet, in the scheduler's order (``_in_order``), so everything else (new states,
block hashes, retained/released keys on 0.33, terminal events, teardown, publication)
is upstream's code on upstream's data. ``_step_metadata`` is set back to the scheduler's
metadata object, as upstream leaves it.

Fallback rules (the call goes to upstream unchanged, counted in ``COUNTERS``):

* ``metadata is None`` or no data plane (``_buffer is None``, a non-output rank):
  upstream stores the metadata and returns; the wrapper reads nothing of the metadata
  and takes no lock on that path either;
* judged from the metadata before any lock, as upstream's assertions are: requests not
  a non-empty dict, a metadata that is not a dataclass, a generation that is not the
  connector's (a change clears every state first; a step backwards raises), a finished
  set that is not a plain collection, a request both running and finished;
* under the lock (as upstream reads the states): a settled request whose emit start is
  ahead of its cursor (upstream raises there, with its own message and effects).

Why equal to upstream: upstream's loop changes nothing for a known request whose
check passes, so dropping known requests from ``requests`` leaves upstream's effects
on every other field and request as they were.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from itertools import repeat
from typing import Any

from prime_r3.fixes.aux_output import (
    BEGIN_STEP,
    WORKER_REQUEST_STATE,
)
from prime_r3.fixes.aux_output import CONNECTOR_MODULE as _CONNECTOR
from prime_r3.fixes.aux_output import WORKER_MODULE as _WORKER
from prime_r3.fixes.batched_commit import Counters
from prime_r3.spec import Anchor, PatchSpec, Process, Target, WrapperFn

#: ``fast_requests``: known requests checked at once; ``fallback_requests``: requests
#: upstream's loop handled (new ones: reason ``new``; whole metadata: ``step``).
COUNTERS = Counters()


def _batched_begin(params: Mapping[str, Any]) -> WrapperFn:
    def batched_begin(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        if instance is None:
            return wrapped(*args, **kwargs)
        metadata = args[0] if args else kwargs.get("metadata")
        if metadata is None or instance._buffer is None:
            # Upstream stores the metadata and returns: it reads nothing of it and takes
            # no lock (a non-output rank, a step without metadata). Nor do we.
            COUNTERS.add(0, {})
            return wrapped(*args, **kwargs)
        scheduled = _plain_requests(instance, metadata)
        if scheduled is None:
            # A step whose requests are not a plain dict counts once, unread.
            requests = getattr(metadata, "requests", None)
            COUNTERS.add(0, {"step": len(requests) if type(requests) is dict else 1})
            return wrapped(*args, **kwargs)
        # Read the worker's states as upstream does, under the connector lock (the
        # output thread's process_output changes pending_outputs and tears states
        # down under it); released before upstream's begin_step takes it again.
        with instance._lock:
            trimmed = _trim(instance, metadata, scheduled)
        if trimmed is None:
            COUNTERS.add(0, {"step": len(scheduled)})
            return wrapped(*args, **kwargs)
        known, new = trimmed
        COUNTERS.add(known, {"new": len(new.requests)} if new.requests else {})
        try:
            return wrapped(new)
        finally:
            instance._step_metadata = metadata

    return batched_begin


def _plain_requests(connector: Any, metadata: Any) -> dict[str, Any] | None:
    """``metadata.requests`` when the step may be trimmed, judged from the metadata and
    the connector's generation alone (what upstream's assertions read before it takes
    the lock), else None: the whole metadata goes to upstream, which raises its own
    error on anything malformed. Trimmed only: a non-empty dict of requests, none of
    them finishing, in the connector's generation (a change clears every state first)."""
    if not dataclasses.is_dataclass(metadata):  # the copy is made with dataclasses.replace
        return None
    scheduled = getattr(metadata, "requests", None)
    generation = getattr(metadata, "generation", None)
    finished = getattr(metadata, "finished_requests", None)
    if type(scheduled) is not dict or not scheduled or type(generation) is not int:
        return None
    if generation != connector._generation or type(finished) not in (tuple, list, set, frozenset):
        return None
    try:
        if scheduled.keys() & finished:
            return None
    except TypeError:  # an unhashable id: upstream's assertion raises it
        return None
    return scheduled


def settled_reference(states: Mapping[str, Any], scheduled: Mapping[str, Any]) -> bool:
    """The reference form of ``_settled``: upstream's loop over the scheduled requests,
    read-only. False where upstream's assertion would fire (a settled request, nothing
    in flight, whose emit start is ahead of its cursor); a new request passes (upstream
    makes its state with ``emit_cursor = emit_start``)."""
    for request_id, emit_start in scheduled.items():
        state = states.get(request_id)
        if state is None:
            continue
        if state.pending_outputs == 0 and not emit_start <= state.emit_cursor:
            return False
    return True


def _settled(states: Mapping[str, Any], scheduled: Mapping[str, Any]) -> bool:
    """``settled_reference(states, scheduled)``, checked at once: every emit start against
    its cursor in one C-level pass (an unknown request reads as ``_NEW``, whose cursor
    every start passes); only when that fails somewhere does it matter whether a step
    is in flight, and the second pass asks exactly upstream's question."""
    cursors = [state.emit_cursor for state in map(states.get, scheduled, repeat(_NEW))]
    if all(map(operator.le, scheduled.values(), cursors)):
        return True
    return not any(
        [
            state.pending_outputs == 0 and not emit <= cursor
            for state, emit, cursor in zip(
                map(states.get, scheduled, repeat(_NEW)), scheduled.values(), cursors, strict=True
            )
        ]
    )


def _trim(connector: Any, metadata: Any, scheduled: dict[str, Any]) -> tuple[int, Any] | None:
    """(known requests checked here, metadata for upstream), or None for upstream whole.
    Called under the connector's lock, with ``scheduled = _plain_requests(...)``."""
    states = connector._requests
    unknown = scheduled.keys() - states.keys()
    k = len(scheduled) - len(unknown)
    if k and not _settled(states, scheduled):
        return None  # upstream's assertion, with upstream's effects before it
    new_requests = _in_order(scheduled, unknown) if unknown else {}
    trimmed = dataclasses.replace(metadata, requests=new_requests)
    # Attributes beyond the dataclass fields (packed_outputs' reader declaration, which
    # EngineCore sets) go with the copy: upstream stores it as the step's metadata while
    # it runs, and a concurrent process_output reads the declaration from there.
    fields = {field.name for field in dataclasses.fields(metadata)}
    extra = {k: v for k, v in getattr(metadata, "__dict__", {}).items() if k not in fields}
    trimmed.__dict__.update(extra)
    return k, trimmed


class _Passes:
    """A cursor every emit start is ``<=`` to, whatever its type (no check of a new
    request can fail or raise here; upstream checks it against its own start)."""

    def __ge__(self, other: object) -> bool:
        return True


class _New:
    """Stands in for a request the worker does not know yet in the settled check."""

    emit_cursor = _Passes()  # passes, as upstream's fresh state (cursor = start) does
    pending_outputs = 1  # never "settled": the second pass skips it


_NEW = _New()


def _in_order(scheduled: dict[str, Any], unknown: set[str]) -> dict[str, Any]:
    """``{r: e for r, e in scheduled.items() if r in unknown}``: upstream creates the new
    states in the scheduler's order. The scheduler schedules running requests before
    waiting ones, and ``build_connector_meta`` keeps that order, so the new requests are
    normally the last ``len(unknown)`` keys: then they are taken from that tail (C-level
    slices and one set check) instead of a Python pass over every scheduled request.
    Anywhere else, the pass."""
    keys = list(scheduled)
    tail = keys[len(keys) - len(unknown) :]
    if unknown.issuperset(tail):  # as many keys as unknown ids, all unknown: exactly them
        return {r: scheduled[r] for r in tail}
    return {r: e for r, e in scheduled.items() if r in unknown}


# Verified source fingerprints (scripts/fingerprint.py): begin_step is identical in vLLM
# 0.31.0 and 0.32.0; 0.33.0 adds the retained/released block hashes (read in its wheel:
# the requests loop this patch trims is unchanged, and those keys pass through).
_METADATA = frozenset({"675d2b630402ee5b", "39ee9e24bf7fd4e4"})

SPEC = PatchSpec(
    name="batched_begin",
    summary="output worker's begin_step checks known requests at once; upstream handles new ones",
    vllm_range=">=0.31,<0.34",
    processes=frozenset({Process.WORKER}),
    targets=(Target(_WORKER, "AuxOutputWorkerConnector.begin_step", BEGIN_STEP, _batched_begin),),
    anchors=(
        # We read pending_outputs and emit_cursor of the states upstream made.
        Anchor(_WORKER, "_WorkerRequestState", WORKER_REQUEST_STATE),
        # We copy it with dataclasses.replace (0.33 adds two fields; kept as they are).
        Anchor(_CONNECTOR, "AuxOutputConnectorMetadata", _METADATA),
    ),
    # patches/vllm-0.3{1,2,3}.0/07-batched_begin.patch: the check over the array-held
    # request state of 06-batched_commit, in begin_step itself.
)
