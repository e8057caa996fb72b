"""batched_take: EngineCore takes a request's rows from a received packed step by one slice.

The scheduler calls ``AuxOutputSchedulerConnector.take_output(request, output)`` once
per request that emits, every step. On a packed step (``packed_outputs``) the first
``output[request_id]`` used to fill the whole step: one ``AuxRequestOutput`` and one
owned rows array per request, then dict lookups, the token range arithmetic and a
slice. Half of EngineCore's R3 cost at 400 requests was that fill plus those calls.

We replace ``take_output`` with a plain function of its own signature
(``Calling.PLAIN``): the call count (400-2000 a step) makes wrapt's per-call binding
(about 0.4 us a call, ten times a plain method call) as costly as the work itself.
When ``output`` is a received, still unfilled ``PackedAuxOutputs``
(``prime_r3.packed`` leaves it unfilled in a process where this patch is in force) that
holds the request and its accepted range is valid (``0 <= local_end <= its row
count``, upstream's own arithmetic on the same ``request.request_id`` and
``request.num_tokens``), the result is a fresh array owning exactly
``rows[low:low + local_end]`` of the step: one dict get, integer arithmetic, one slice
and one ``.copy()``. The dict (request id -> first row, token start, row count, as
Python ints) is built once per step by C-level ``zip``s and cached on the step. The
step is not filled. A one-row request (a decode step's) whose range is its row gets
that row copied already: the step's first take copies every one-row request's row into
an array of its own by one C-level ``map`` (``_lookup``), about half the cost of the
per-call slice and ``.copy()`` (measured in the bench's engine loop, take_output
alternating step by step with the per-call version: ``scripts/bench_sched.py
--take-before``); the call is then one dict get, integer arithmetic and a return.

Anything else goes to upstream's ``take_output`` itself (the function under ours,
called directly), so its assertions and their messages are upstream's: a plain dict
(uniproc executor, an EngineCore whose workers send dicts), an already filled step,
``None``, a request missing from the step, ``local_end < 0`` (upstream returns
``None`` or asserts, depending on ``request.is_finished()``) and ``local_end`` beyond
the request's rows. On a packed step that first fallback fills it (upstream reads it
as the dict it is); later requests of that step then go to upstream too.

Memory: upstream returns a view of the request's own array, which keeps that whole
array alive; ours owns exactly the rows it returns (a one-row request's copy made
ahead is its own row only; those of requests that do not emit die with the step, as
upstream's dict values do). The unfilled step holds one array
of the step's rows (what upstream's dict holds in per-request arrays) and dies with
the ``ModelRunnerOutput``, as upstream's dict does.

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

from collections import deque
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


_copy = np.ndarray.copy


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
            index = output._index
            if index is None:
                index = output._index = _lookup(output)
                counters.steps += 1
                counters.batched_steps += 1  # every packed step read is served here
            places, rows = index
            # Upstream reads request_id first, then (for a present id) num_tokens.
            try:
                place = places.get(request.request_id)
            except TypeError:  # unhashable id: upstream's `in` raises its own error
                place = None
            if place is None:
                counters.fallback("missing")
                return upstream(self, request, output)
            low, start, count, own = place
            local_end = request.num_tokens - 1 - start
            if own is not None and local_end == 1:  # the request's one row, already copied
                counters.fast_requests += 1
                return own
            if local_end < 0:
                counters.fallback("before_start")
                return upstream(self, request, output)
            if local_end > count:
                counters.fallback("beyond_rows")
                return upstream(self, request, output)
            counters.fast_requests += 1
            return rows[low : low + local_end].copy()

        return take_output

    return make


def _lookup(output: Any) -> Any:
    """The step's placement for ``take_output``: request id -> (first row, token start,
    row count, own), Python ints, and the step's rows, as ``packed._Index``.

    ``own`` is, for a request with exactly one row (a decode step's request, i.e. almost
    every request of almost every step), that row already copied into an array of its
    own, or None. The copies are made for all such requests at once by a C-level
    ``map`` over the rows (``packed._fill``'s copy without its per-request
    ``AuxRequestOutput``), which costs about half of the slice plus ``.copy()`` that
    ``take_output`` would otherwise make per call; a one-row request whose accepted
    range is its row (``local_end == 1``) is then handed that array. A second take of
    the same request in the same step (vLLM's scheduler takes each once) is handed the
    same array, where upstream hands a second view of the same memory: the same bytes,
    shared the same way.

    Memory: each such array owns exactly one request's row (what the slice copy
    returned), so a kept result pins that request's row only, never the step; the arrays
    of requests that do not emit this step die with the step, as upstream's dict values
    do. The whole index lives in the unfilled step's ``_index`` slot, which this is the
    only producer of (a second producer of another shape would break every take of the
    step) and this patch the only reader; ``_fill`` drops it.
    """
    from prime_r3.packed import _Index  # imported by then (the patch applied)

    ids, starts, offsets, rows = output._packed
    n = len(ids)
    counts = offsets[1:] - offsets[:-1]
    ones = counts == 1
    if n and int(offsets[-1]) == n and bool(ones.all()):  # a decode step: one row each
        own: list[Any] = list(map(_copy, rows.reshape((n, 1, *rows.shape[1:]))))
    else:
        own = [None] * n
        picked = np.flatnonzero(ones)
        if len(picked):
            gathered = rows[offsets[picked]]  # their rows, in one gather
            copies = map(_copy, gathered.reshape((len(picked), 1, *rows.shape[1:])))
            deque(map(own.__setitem__, picked.tolist(), copies), maxlen=0)
    places = zip(offsets[:-1].tolist(), starts.tolist(), counts.tolist(), own, strict=True)
    return _Index(dict(zip(ids, places, strict=True)), rows)


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
    diff_pending=(
        "its upstream form is a packed step type that take_output slices, "
        "which belongs with packed_outputs' upstream diff"
    ),
)
