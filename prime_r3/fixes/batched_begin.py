"""batched_begin: begin_step without a Python pass (and a new state object) per running request.

``AuxOutputWorkerConnector.begin_step`` walks every scheduled request each step:
``self._requests.setdefault(request_id, _WorkerRequestState(emit_cursor=emit_start))``
builds a dataclass per request even when the request is known (almost always), then
checks ``emit_start <= state.emit_cursor`` for settled requests. At 400-2000 running
requests that is most of the step's begin_step cost.

We wrap ``begin_step``. For the requests the worker already knows, the settled check is
done at once (upstream's ``emit_start <= emit_cursor`` over all of them in one C-level
pass; ``pending_outputs`` is read only if that fails somewhere);
upstream's ``begin_step`` then runs on a copy of the metadata whose ``requests`` holds
only the requests it does not know yet, in the scheduler's order, so everything else
(new states, block hashes, retained/released keys on 0.33, terminal events, teardown,
publication) is upstream's code on upstream's data. ``_step_metadata`` is set back to
the scheduler's metadata object, as upstream leaves it.

The whole metadata goes to upstream unchanged when anything is unusual: no data plane,
no metadata, a generation change (upstream clears every state first), a request both
running and finished, or a settled request whose emit start is ahead of its cursor
(upstream raises there, with its own message and effects).
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
        metadata = args[0] if args else kwargs.get("metadata")
        if instance is None:
            return wrapped(*args, **kwargs)
        # Read the worker's states as upstream does, under the connector lock (the
        # output thread's process_output changes pending_outputs and tears states
        # down under it); released before upstream's begin_step takes it again.
        with instance._lock:
            trimmed = _trim(instance, metadata)
        if trimmed is None:
            count = len(getattr(metadata, "requests", None) or ())
            COUNTERS.add(0, {"step": count} if count else {})
            return wrapped(*args, **kwargs)
        known, new = trimmed
        COUNTERS.add(known, {"new": len(new.requests)} if new.requests else {})
        try:
            return wrapped(new)
        finally:
            instance._step_metadata = metadata

    return batched_begin


def _trim(connector: Any, metadata: Any) -> tuple[int, Any] | None:
    """(known requests checked here, metadata for upstream), or None for upstream whole."""
    if (
        metadata is None
        or connector._buffer is None
        or type(metadata.requests) is not dict
        or metadata.generation != connector._generation
    ):
        return None
    scheduled = metadata.requests
    if not scheduled or scheduled.keys() & metadata.finished_requests:
        return None
    states = connector._requests
    unknown = scheduled.keys() - states.keys()
    k = len(scheduled) - len(unknown)
    if k:
        # One pass over the scheduler's order; an unknown request reads as _NEW, which
        # passes (upstream makes its state with emit_cursor = emit_start and nothing in
        # flight, so its check holds), so no list of known ids is built per step.
        # Comprehensions, not attrgetter maps: CPython 3.11's specialised attribute reads
        # are about twice as fast (see batched_commit._select).
        cursors = [state.emit_cursor for state in map(states.get, scheduled, repeat(_NEW))]
        # Upstream's predicate (emit_start <= emit_cursor) on Python values, in one C
        # pass; only when it fails somewhere does it matter whether a step is in flight.
        if not all(map(operator.le, scheduled.values(), cursors)) and any(
            [
                state.pending_outputs == 0 and not emit <= cursor
                for state, emit, cursor in zip(
                    map(states.get, scheduled, repeat(_NEW)),
                    scheduled.values(),
                    cursors,
                    strict=True,
                )
            ]
        ):
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
    Anywhere else, the pass. (A review measured an earlier ``list.index`` search: it
    scanned the whole list per new request, 2.8-45x slower than the pass.)"""
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
