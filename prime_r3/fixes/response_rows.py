"""response_rows: a request's routed experts gathered as they arrive, not concatenated at finish.

Upstream's ``RequestState`` (``vllm.v1.engine.output_processor``, the API server's
output loop, i.e. its event loop) appends every step's routed-expert array to
``routed_experts_chunks`` and, when the request finishes, ``np.concatenate``s them in
``_new_completion_output``: one array per step (16k for a 16k-token generation) kept
alive until then, and ~13 ms of concatenation per request, all at once when a wave of
requests finishes in the same step (100 of them: over a second in one call).

Here ``routed_experts_chunks`` is a ``RowChunks`` (a ``list`` subclass, set in
``RequestState.__init__`` where upstream sets its list): ``append`` copies each chunk's
bytes onto one buffer and drops the chunk, and ``[-1] = prefix`` (upstream's trim of
tokens dropped after a stop string) rewinds the last chunk and appends the prefix. The
buffer is a ``bytearray`` while the rows are under ``MAPPED_FROM`` (256 KiB); past that
they move, once, into a private anonymous mapping (``mmap``, advised ``MADV_NOHUGEPAGE``),
which grows by ``mremap`` (the kernel moves pages, never the rows; reserved pages hold no
memory until written).
Its list storage stays empty, so upstream's ``if finished and self.routed_experts_chunks``
builds its output with ``routed_experts=None``; our ``_new_completion_output`` wrapper then
sets the output's ``routed_experts`` to the rows as one array of their exact size
(``finished()``):

* rows in a mapping: the mapping shrunk to their bytes and handed out as the array's
  buffer (``np.frombuffer``; no copy, so a wave of long requests finishing in one step
  costs the loop no copying); from then on the buffer takes no rows in place (a later
  chunk or trim spills, below), so the array handed out never changes;
* rows in the ``bytearray``: one copy of them (at most 256 KiB);
* a streaming-input request (``streaming_input``: its state lives on for the next input
  chunk, and later finishes read the same rows): one copy (``streaming_input``), so the
  buffer never lends memory that a later finish reads.

That array equals upstream's concatenation: same dtype, shape and values, C-contiguous,
writeable, and nothing but its rows is kept alive with it (a mapping of their bytes,
rounded up to a page as glibc rounds its own mapped allocations). What differs, for
mapped rows only: the array's memory is the mapping it references (``base``), not
numpy's own (``flags.owndata`` is false, so ``ndarray.resize`` refuses it).

Fast case: every chunk an exact ``np.ndarray`` of the first chunk's dtype (one that
``np.concatenate`` keeps as it is: native or no byte order, no padding), ndim >= 1 and
trailing shape (no zero-size dimension, no zero-size items), C-contiguous. Anything
else (another dtype or shape, which ``np.concatenate`` would promote or refuse; a
non-contiguous array; any other assignment than ``[-1] =``; a chunk or ``[-1] =`` once
mapped rows were handed out; no mapping to be had, below) *spills*: the rows so far
become two ordinary chunks in the list (copies of those before the last chunk, and of
the last chunk, so ``[-1]`` still names it) and the list is upstream's from then on
(upstream's concatenation of ``[rows before, last, chunk, ...]`` equals that of the
original chunks); counted in ``COUNTERS`` by reason.

The other list operations are not overridden: code that reads the list directly
(upstream does not) sees it empty until a spill. On revert every live buffer spills
(``on_revert``; one with no rows yet sends its first chunk to the list), so a request in
flight finishes with upstream's own concatenation; revert runs where the buffers are
appended to (the API server's loop thread), as a spill is not atomic with an append.
Copied or pickled, a buffer is upstream's list of its rows (one array).

Mappings and the kernel. Upstream's list and ``np.concatenate`` make no call on a
mapping; the kernel may refuse each of ours (``ENOMEM`` under memory pressure, or at
``vm.max_map_count``, where even a shrink or an advice fails when it has to split a
mapping the kernel merged with its neighbours). No refusal reaches vLLM: each
``OSError`` takes upstream's path, counted by the call refused:

* ``map`` (``mmap``) and ``advise`` (``madvise`` other than ``EINVAL``; the new mapping
  is closed, which at the map-count limit may itself leave it mapped: CPython ignores
  ``munmap``'s error, as glibc does for upstream's freed arrays): the rows stay in the
  ``bytearray`` and spill with the chunk;
* ``grow`` (``mremap`` to a larger size; the kernel leaves the mapping as it was): the
  rows spill from the mapping with the chunk;
* ``shrink`` (``mremap`` at finish): the finished output gets a copy of the rows (the
  buffer keeps them, unchanged), as rows in a ``bytearray`` do.

A copy equals upstream's concatenation: the rows' bytes in an array of their own, as
``np.concatenate`` of the chunks makes it. Two caps keep the process far from
``vm.max_map_count`` (together at most 8192 mappings, an eighth of Linux's default
65530): at most ``MAX_IN_FLIGHT`` (4096) mappings of requests in flight are alive at
once, and a request that would map one past that spills (``mappings_in_flight``) and
finishes with upstream's concatenation; at most ``MAX_HANDED_OUT`` (4096) handed-out
mappings are alive at once, and past that a finished output gets a copy
(``mappings_held``). ``live_note()`` shows these counts in ``prime-r3 status`` and the
log line.

Huge pages: every mapping is advised ``MADV_NOHUGEPAGE``, so it
holds memory in 4 KiB pages as its rows are written, whatever the machine's THP setting.
Without it, on a THP ``always`` host the first touch of an untouched, aligned 2 MiB range
of a mapping (the kernel merges our neighbouring mappings into one) takes a whole 2 MiB
page, and khugepaged may collapse a range with a few written pages into one, so a
request in flight could hold up to 2 MiB more than its rows, where upstream's chunks fill
heap pages as they come. A kernel without THP refuses the advice (``EINVAL``): there is
nothing to avoid there, and the mapping is kept.
"""

from __future__ import annotations

import errno
import mmap
import threading
import weakref
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np

from prime_r3.spec import Anchor, PatchSpec, Process, Target, WrapperFn

OUTPUT_PROCESSOR = "vllm.v1.engine.output_processor"


class Counters:
    """The API-server patches' counts: ``fast``, any further counts named in ``extra``
    (e.g. response_b64's ``off_loop``), and the fallbacks to upstream per reason."""

    def __init__(self, *extra: str) -> None:
        self._lock = threading.Lock()
        self._names = ("fast", *extra)
        self.fallback: Counter[str] = Counter()
        self.reset()

    def add_fallback(self, reason: str) -> None:
        with self._lock:
            self.fallback[reason] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            counts = {name: getattr(self, name) for name in self._names}
            return {**counts, "fallback": dict(self.fallback)}

    def reset(self) -> None:
        with self._lock:
            for name in self._names:
                setattr(self, name, 0)
            self.fallback.clear()


COUNTERS = Counters()
_NDARRAY = np.ndarray
#: Rows of at least this many bytes move from a ``bytearray`` into a private mapping.
MAPPED_FROM = 1 << 18
_NO_HUGE_PAGES = getattr(mmap, "MADV_NOHUGEPAGE", None)  # None: no THP on this platform


class _Refused(Exception):
    """No mapping (or no room in it) for the rows: ``reason`` is counted as they spill."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RowChunks(list):
    """``routed_experts_chunks`` as one growing byte buffer (see the module docstring)."""

    __slots__ = ("_rows", "_size", "_dtype", "_tail", "_last", "_spilled", "_handed", "__weakref__")

    def __init__(self) -> None:
        super().__init__()
        key = id(self)
        _LIVE[key] = weakref.ref(self, lambda _, key=key: _LIVE.pop(key, None))
        self._rows: bytearray | mmap.mmap | None = None
        self._size = 0  # bytes of rows in ``_rows``
        self._dtype: Any = None
        self._tail: tuple[int, ...] = ()
        self._last = 0  # bytes of the last chunk appended
        self._spilled = False
        self._handed = False  # the mapping's rows were handed out at finish

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Copied or pickled, the chunks are upstream's list: the rows so far as one array."""
        return (list, ([self.array().copy()] if self.gathered else list(self),))

    @property
    def gathered(self) -> bool:
        """Rows were appended and live in the buffer (the list is empty)."""
        return self._rows is not None

    def append(self, chunk: Any) -> None:
        if self._rows is None:
            if self._spilled:
                return list.append(self, chunk)
            self._start(chunk)
            return None
        if type(chunk) is not _NDARRAY or chunk.ndim == 0 or chunk.shape[1:] != self._tail:
            return self._spill(chunk, "shape")
        if chunk.dtype != self._dtype:
            return self._spill(chunk, "dtype")
        if self._handed:
            return self._spill(chunk, "handed_out")
        if not chunk.flags.c_contiguous:
            return self._spill(chunk, "layout")
        try:
            self._write(chunk)
        except (BufferError, ValueError, TypeError):  # the rows' buffer exported
            return self._spill(chunk, "layout")
        except _Refused as refused:  # no mapping, advice or growth to be had
            return self._spill(chunk, refused.reason)
        return None

    def _start(self, chunk: Any) -> None:
        if (
            type(chunk) is not _NDARRAY
            or chunk.ndim < 1
            or chunk.dtype.hasobject
            or not chunk.flags.c_contiguous
            or chunk.dtype.itemsize == 0
            or 0 in chunk.shape[1:]
        ):
            self._spill(chunk, "first_chunk")
            return
        canonical = np.concatenate((chunk[:0],)).dtype  # the dtype concatenate gives
        if canonical.str != chunk.dtype.str or canonical.descr != chunk.dtype.descr:
            self._spill(chunk, "dtype")  # byte-swapped, padded or aligned: upstream's own
            return
        self._rows, self._dtype, self._tail, self._size = (
            bytearray(),
            chunk.dtype,
            chunk.shape[1:],
            0,
        )
        try:
            self._write(chunk)
        except _Refused as refused:  # nothing written: the chunk goes to the list
            self._rows = None
            self._spill(chunk, refused.reason)

    def _write(self, chunk: Any) -> None:
        """Append a C-contiguous chunk's bytes (the caller checked dtype and shape)."""
        rows, size, n = self._rows, self._size, chunk.nbytes
        if type(rows) is bytearray:
            if size + n <= MAPPED_FROM:
                rows.extend(chunk)  # the chunk's bytes (``+=`` would be numpy's add)
                self._size, self._last = size + n, n
                return
            rows = self._map(rows, size + n)
        if size + n > len(rows):  # grow the mapping (mremap: no copy of the rows)
            try:
                rows.resize(_pages(max(2 * len(rows), size + n)))
            except OSError:  # the kernel left the mapping as it was
                raise _Refused("grow") from None
        rows.seek(size)
        rows.write(chunk)
        self._size, self._last = size + n, n

    def _map(self, small: bytearray, need: int) -> mmap.mmap:
        """Move the rows so far into a private anonymous mapping with room for ``need``,
        advised never to use huge pages; ``_Refused`` (the rows left in ``small``) past
        ``MAX_IN_FLIGHT`` or when the kernel refuses the mapping or the advice."""
        if len(_IN_FLIGHT) >= MAX_IN_FLIGHT:
            raise _Refused("mappings_in_flight")
        try:
            mapped = mmap.mmap(-1, _pages(max(2 * need, 4 * MAPPED_FROM)), flags=mmap.MAP_PRIVATE)
        except OSError:
            raise _Refused("map") from None
        if _NO_HUGE_PAGES is not None:
            try:
                mapped.madvise(_NO_HUGE_PAGES)
            except OSError as refused:
                if refused.errno != errno.EINVAL:  # EINVAL: no THP here, nothing to avoid
                    mapped.close()
                    raise _Refused("advise") from None
        mapped.write(small)
        _IN_FLIGHT.add(mapped)
        self._rows = mapped
        return mapped

    def _spill(self, chunk: Any, reason: str) -> None:
        """Become upstream's list, then append ``chunk`` to it."""
        self._spill_rows(reason)
        list.append(self, chunk)

    def _spill_rows(self, reason: str) -> None:
        """The rows so far into the list: those before the last chunk, and the last chunk
        (so ``[-1]`` still names the last chunk appended); a plain list from then on."""
        COUNTERS.add_fallback(reason)
        if self._rows is not None:
            rows = self.array().copy()
            row_bytes = rows.itemsize * (int(np.prod(self._tail)) if self._tail else 1)
            last = self._last // row_bytes if row_bytes else 0
            list.extend(self, (rows[: len(rows) - last], rows[len(rows) - last :]))
            if type(self._rows) is not bytearray:
                _IN_FLIGHT.discard(self._rows)
        self._rows = None
        self._spilled = True

    def __setitem__(self, index: Any, value: Any) -> None:
        if self._rows is not None:
            if isinstance(index, int) and index == -1 and self._rewind():
                # Upstream's trim: the last chunk replaced by (a prefix of) itself.
                if self._size:
                    self.append(value)
                else:
                    self._rows = None
                    self._start(value)
                return
            self._spill_rows("setitem")
        list.__setitem__(self, index, value)

    def _rewind(self) -> bool:
        """Drop the last chunk's rows in place; False where they cannot be (handed out,
        or a view of the ``bytearray`` is alive)."""
        if self._handed:
            return False
        keep = self._size - self._last
        if type(self._rows) is bytearray:
            try:
                del self._rows[keep:]
            except BufferError:
                return False
        self._size, self._last = keep, 0
        return True

    def finished(self) -> Any:
        """The rows as the finished output's own array: exactly their bytes, nothing else.

        Rows in a mapping are handed out in it, shrunk to their size (mremap: no copy);
        from then on the buffer takes no more rows in place (a later chunk spills). A
        copy of them where the kernel refuses the shrink (``shrink``), past
        ``MAX_HANDED_OUT`` (``mappings_held``) or while a view of them is alive
        (``view_alive``)."""
        rows = self._rows
        if type(rows) is bytearray or self._handed or not self._size:
            return self.array().copy()
        if len(_HANDED_OUT) >= MAX_HANDED_OUT:  # each is a kernel mapping: keep a margin
            COUNTERS.add_fallback("mappings_held")
            return self.array().copy()
        try:
            rows.resize(self._size)
        except BufferError:  # a view of the rows is alive: they cannot be shrunk
            COUNTERS.add_fallback("view_alive")
            return self.array().copy()
        except OSError:  # e.g. ENOMEM splitting a merged mapping at vm.max_map_count
            COUNTERS.add_fallback("shrink")
            return self.array().copy()  # the mapping is as it was: rows and size
        self._handed = True
        _IN_FLIGHT.discard(rows)
        _HANDED_OUT.add(rows)
        return self.array()

    def array(self) -> Any:
        """The rows gathered so far as one array (a view of the buffer)."""
        assert self._rows is not None
        flat = np.frombuffer(
            self._rows, dtype=self._dtype, count=self._size // self._dtype.itemsize
        )
        return flat.reshape((-1, *self._tail))


#: Mappings handed out in finished outputs and still alive (weakly), and how many may be:
#: past that a finished output gets a copy, so a process keeping many outputs (an offline
#: ``LLM.generate`` returns them all at once) stays far from ``vm.max_map_count``.
_HANDED_OUT: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()
MAX_HANDED_OUT = 4096

#: Mappings of requests in flight (not handed out yet), weakly: an aborted request's goes
#: with its state. Past ``MAX_IN_FLIGHT`` a request keeps upstream's list of chunks.
_IN_FLIGHT: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()
MAX_IN_FLIGHT = 4096

#: Every live buffer, so that revert can hand each one's rows back to upstream's list.
_LIVE: dict[int, weakref.ref[RowChunks]] = {}


def _spill_live() -> None:
    """On revert: every live buffer becomes upstream's list of its rows (upstream's
    ``_new_completion_output`` then concatenates them), so no request in flight loses
    its rows with the wrapper gone."""
    for ref in list(_LIVE.values()):
        chunks = ref()
        if chunks is None:
            continue
        if chunks.gathered:
            chunks._spill_rows("revert")
        else:  # no rows yet: its first chunk goes to the list
            chunks._spilled = True


def live_note() -> str:
    """What the patch has done in this process (``prime-r3 status``, the log)."""
    c = COUNTERS.snapshot()
    why = ", ".join(f"{k} {v}" for k, v in sorted(c["fallback"].items()))
    return (
        f"finished outputs from the buffer {c['fast']}; mappings in flight "
        f"{len(_IN_FLIGHT)} of {MAX_IN_FLIGHT}, handed out {len(_HANDED_OUT)} of "
        f"{MAX_HANDED_OUT}; upstream's path: {why or 'none'}"
    )


def _pages(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def _request_state_init(params: Mapping[str, Any]) -> WrapperFn:
    def gather_rows(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        wrapped(*args, **kwargs)
        if instance is not None and type(instance.routed_experts_chunks) is list:
            instance.routed_experts_chunks = RowChunks()

    return gather_rows


def _new_completion_output(params: Mapping[str, Any]) -> WrapperFn:
    def rows_on_finish(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        output = wrapped(*args, **kwargs)
        chunks = getattr(instance, "routed_experts_chunks", None)
        if (
            type(chunks) is RowChunks
            and chunks.gathered
            and output.finish_reason is not None
            and output.routed_experts is None
        ):
            if getattr(instance, "streaming_input", False):  # the state lives on
                COUNTERS.add_fallback("streaming_input")
                output.routed_experts = chunks.array().copy()
            else:
                output.routed_experts = chunks.finished()
            with COUNTERS._lock:
                COUNTERS.fast += 1
        return output

    return rows_on_finish


# Verified source fingerprints (scripts/fingerprint.py) for vLLM 0.31.0, 0.32.0, 0.33.0.
_INIT = frozenset({"dfa5c0731076a8f7", "8750ef83ec92aaf8"})
_NEW_COMPLETION_OUTPUT = frozenset({"efefc18d9703c782", "d5b9232463170bdd"})
_PROCESS_OUTPUTS = frozenset({"90d56f0accc430e5", "6b34329e4cd2b800", "9dca97ca534c81d9"})
_TRIM = frozenset({"cb63ed262aba33f0"})

SPEC = PatchSpec(
    name="response_rows",
    summary="API server: a request's routed experts gathered into one buffer, no concat at finish",
    vllm_range=">=0.31,<0.34",
    processes=frozenset({Process.API_SERVER}),
    targets=(
        Target(OUTPUT_PROCESSOR, "RequestState.__init__", _INIT, _request_state_init),
        Target(
            OUTPUT_PROCESSOR,
            "RequestState._new_completion_output",
            _NEW_COMPLETION_OUTPUT,
            _new_completion_output,
        ),
    ),
    anchors=(
        # The only writers of the chunks: the per-step append and (0.32+) the trim.
        Anchor(OUTPUT_PROCESSOR, "OutputProcessor.process_outputs", _PROCESS_OUTPUTS),
        Anchor(OUTPUT_PROCESSOR, "OutputProcessor._trim_surplus_tokens", _TRIM, releases=">=0.32"),
    ),
    on_revert=_spill_live,
    live_note=live_note,
    notes="Array equal to upstream's concatenation (dtype, shape, values, C order, writeable).",
)
