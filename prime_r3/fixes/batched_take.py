"""batched_take: EngineCore takes a request's rows from a received packed step by one slice.

The scheduler calls ``AuxOutputSchedulerConnector.take_output(request, output)`` once
per request that emits, every step. Upstream's reads the step as a dict: on a packed
step (``packed_outputs``) the first ``output[request_id]`` fills the whole step (one
``AuxRequestOutput`` and one owned rows array per request), then each call makes dict
lookups, the token range arithmetic and a slice.

We replace ``take_output`` with a plain function of its own signature
(``Calling.PLAIN``): at its call count (400-2000 a step) wrapt's per-call binding would
cost as much as the work itself.
When ``output`` is a received, still unfilled ``PackedAuxOutputs``
(``prime_r3.packed`` leaves it unfilled in a process where this patch is in force) that
holds the request and its accepted range is valid (``0 <= local_end <= its row
count``, upstream's own arithmetic on the same ``request.request_id`` and
``request.num_tokens``), the result is what upstream's is: the request's own rows
array (all its rows: a decode step's one row, a whole prefill chunk), or a view of its
first ``local_end`` rows (upstream's ``rows[:local_end]``). The call is one dict get,
integer arithmetic and a return (or one slice). The step's first take splits it
(``packed._Unfilled._split``): every request's rows copied into an array of its own by
C-level ``map``s, the index (request id -> token start, row count, rows) built by
C-level ``zip``s, and the step's packed rows dropped. The step is not filled.
``take_reference`` is the plain form of the answer, on the packed step's own arrays.

Anything else goes to upstream's ``take_output`` itself (the function under ours,
called directly), so its assertions and their messages are upstream's: a plain dict
(uniproc executor, an EngineCore whose workers send dicts), an already filled step,
``None``, a request missing from the step, ``local_end < 0`` (upstream returns
``None`` or asserts, depending on ``request.is_finished()``) and ``local_end`` beyond
the request's rows. On a packed step that first fallback fills it (upstream reads it
as the dict it is); later requests of that step then go to upstream too.

Memory: as upstream's. Upstream returns a view of the request's own array, which
keeps that whole array alive; ours returns the request's own array or a view of it, so
a kept result pins that request's rows only, never the step. The step holds its rows
once at every point: packed in one array until the first take, then one array per
request (what upstream's dict holds) with the packed rows dropped, until it dies with
the ``ModelRunnerOutput``, as upstream's dict does; a later fill reuses those arrays.

Other readers of ``model_runner_output.aux_output_connector_output`` see upstream's
content: every Python-level dict read of an unfilled step fills it first (``in``,
``[]``, ``get``, ``keys``/``values``/``items``, ``==``, ``copy``, Ray's zero-copy
detach iterating ``values()``), and ``dict(step)`` / ``{**step}`` go through those
reads. Only C extensions that read the dict's storage directly (msgspec) would see it
empty; nothing in vLLM 0.31-0.33 encodes ``ModelRunnerOutput`` that way in EngineCore
(upstream's ``Scheduler.update_from_output`` is the only consumer), a scheduler class
that overrides ``update_from_output`` (where such a reader could be) is never sent a
packed step (``packed_outputs``' handshake), and without this patch a received step is
filled at once as before.

``COUNTERS``: requests taken by the slice vs by upstream, by reason (``not_packed``: output
not an unfilled packed step; ``missing``; ``before_start``: ``local_end < 0``;
``beyond_rows``). ``steps`` counts packed steps read. Calls bind to upstream's own
parameters (same names, and the layer gives ours upstream's ``__qualname__``), so a
call with keywords is served like a positional one and a malformed call raises
upstream's ``TypeError`` message.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from prime_r3.fixes import batched_commit
from prime_r3.fixes.aux_output import CONNECTOR_MODULE as _CONNECTOR
from prime_r3.fixes.aux_output import TAKE_OUTPUT
from prime_r3.spec import Calling, PatchSpec, PlainFactory, Process, Target


class Counters(batched_commit.Counters):
    """Requests ``take_output`` served by the slice vs by upstream, by reason.

    ``batched_commit``'s counters (same fields and ``snapshot()``, for the bench),
    counted per request instead of per step: ``take_output`` runs on EngineCore's
    scheduler thread only, once per emitting request, so the fast count and the
    packed-step counts are plain increments there (a lock per request would cost as
    much as the slice); fallbacks are counted under the lock.
    """

    def fallback(self, reason: str) -> None:
        with self._lock:
            self.fallback_requests += 1
            self.fallback_reasons[reason] += 1


COUNTERS = Counters()


def take_reference(request: Any, packed: Any) -> np.ndarray | None:
    """The reference form of the fast take, read-only: upstream's ``take_output`` body on
    a packed step's own arrays (``packed``: its ``_Packed`` ids, starts, offsets and rows,
    before the split). The request's entry is found by its id; its rows are
    ``rows[offsets[i]:offsets[i + 1]]`` from token ``starts[i]``, and upstream's
    ``local_end = request.num_tokens - 1 - start`` cuts them: ``rows[:local_end]``.
    None where the fast path calls upstream instead (no entry, ``local_end < 0`` or
    beyond the request's rows), whose answer or error is then upstream's own."""
    ids, starts, offsets, rows = packed
    request_id = request.request_id
    for i, candidate in enumerate(ids):
        if candidate != request_id:
            continue
        first, count = int(offsets[i]), int(offsets[i + 1]) - int(offsets[i])
        local_end = request.num_tokens - 1 - int(starts[i])
        if 0 <= local_end <= count:
            return rows[first : first + local_end]
        return None
    return None


def _batched_take(params: Mapping[str, Any]) -> PlainFactory:
    from prime_r3.packed import _Unfilled  # imports vLLM: only when applying

    counters = COUNTERS

    def make(upstream: Callable[..., Any]) -> Callable[..., Any]:
        """``take_output`` around ``upstream`` (upstream's function or the layer under
        ours), which every fallback calls with the same arguments."""

        def take_output(self, request, output):  # noqa: ANN001, ANN202 - upstream's
            if type(output) is not _Unfilled:
                counters.fallback("not_packed")
                return upstream(self, request, output)
            places = output._index
            if places is None:
                places = output._split()
                counters.steps += 1
                counters.batched_steps += 1  # every packed step read is served here
            # Upstream reads request_id first, then (for a present id) num_tokens.
            try:
                place = places.get(request.request_id)
            except TypeError:  # unhashable id: upstream's `in` raises its own error
                place = None
            if place is None:
                counters.fallback("missing")
                return upstream(self, request, output)
            start, count, rows = place
            local_end = request.num_tokens - 1 - start
            if local_end == count:  # all its rows (a decode request's one): its own array
                counters.fast_requests += 1
                return rows
            if local_end < 0:
                counters.fallback("before_start")
                return upstream(self, request, output)
            if local_end > count:
                counters.fallback("beyond_rows")
                return upstream(self, request, output)
            counters.fast_requests += 1
            return rows[:local_end]  # upstream's slice of the request's array

        return take_output

    return make


SPEC = PatchSpec(
    name="batched_take",
    summary="EngineCore takes each request's rows from a received packed step by one slice, "
    "without filling the step",
    vllm_range=">=0.31,<0.34",
    # The scheduler connector lives in EngineCore.
    processes=frozenset({Process.ENGINE_CORE}),
    # take_output is byte-identical in vLLM 0.31.0, 0.32.0 and 0.33.0; its only inputs
    # are the request's request_id / num_tokens / is_finished() and the step output.
    targets=(
        Target(
            _CONNECTOR,
            "AuxOutputSchedulerConnector.take_output",
            TAKE_OUTPUT,
            _batched_take,
            calling=Calling.PLAIN,  # called per request per step: no wrapt binding
        ),
    ),
    # Upstream form: packed_outputs' diff (02) makes take_output split a received
    # PackedAuxOutputs at its first take and hand out each request's array or a view.
    diff_in="packed_outputs",
)
