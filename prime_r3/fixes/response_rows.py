"""response_rows: a request's routed experts gathered as they arrive, not concatenated at finish.

Upstream's ``RequestState`` (``vllm.v1.engine.output_processor``, the API server's
output loop, i.e. its event loop) appends every step's routed-expert array to
``routed_experts_chunks`` and, when the request finishes, ``np.concatenate``s them in
``_new_completion_output``: one array per step (16k for a 16k-token generation) kept
alive until then, and ~13 ms of concatenation per request, all at once when a wave of
requests finishes in the same step (100 of them: over a second in one call).

Here ``routed_experts_chunks`` is a ``RowChunks`` (a ``list`` subclass, set in
``RequestState.__init__`` where upstream sets its list). Its list storage is upstream's
list: ``append`` is ``list.append``, and every ``FOLD`` (64) chunks the chunks in it are
*folded*: once they hold at least ``MAPPED_FROM`` (16 KiB) of rows, one
``np.concatenate(chunks, out=..., casting="no")`` writes them into a private anonymous
mapping (``mmap``, advised ``MADV_NOHUGEPAGE``) and the list is emptied; from then on
each fold appends to the mapping, which grows by ``mremap`` (the kernel moves pages, never
the rows; reserved pages hold no memory until written). A request that never folds keeps
upstream's list, and upstream's own concatenation at finish (counted as ``short``).
``[-1] = prefix``
(upstream's trim of tokens dropped after a stop string) replaces the last chunk in the
list, or, when the list was just folded, rewinds the last chunk's rows in the mapping and
appends the prefix.

At finish our ``_new_completion_output`` wrapper folds what the list holds before calling
upstream's (``finish_reason`` given), so upstream's ``if finished and
self.routed_experts_chunks`` finds the list empty and builds its output with
``routed_experts=None``; the wrapper then sets the output's ``routed_experts`` to the
rows as one array of their exact size (``finished()``): the mapping shrunk to their bytes
and handed out as the array's buffer (``np.frombuffer``; no copy, so a wave of long
requests finishing in one step costs the loop no copying). From then on the mapping takes
no rows (a later chunk or trim spills, below), so the array handed out never changes. A
streaming-input request (``streaming_input``: its state lives on for the next input
chunk, and later finishes read the same rows) gets a copy (``streaming_input``), so the
mapping never lends memory that a later finish reads.

That array equals upstream's concatenation: same dtype, shape and values, C-contiguous,
writeable, and nothing but its rows is kept alive with it (a mapping of their bytes,
rounded up to a page). What differs: the array's memory is the mapping it references
(``base``), not numpy's own (``flags.owndata`` is false, so ``ndarray.resize`` refuses
it).

Fast case: every chunk an exact ``np.ndarray`` of the first chunk's dtype (one that
``np.concatenate`` keeps as it is: native or no byte order, no padding), ndim >= 1, and
its row shape (no zero-size dimension, no zero-size items). ``casting="no"`` refuses any
other dtype and ``np.concatenate`` any other row shape; strided chunks are copied by it
as upstream's concatenation copies them. Anything else (a fold refused, as below; any
other assignment than ``[-1] =``; a chunk or ``[-1] =`` once the rows were handed out)
*spills*: the folded rows become ordinary chunks at the front of the list (one copy of
them, split where the chunks were: ``_counts`` keeps each folded chunk's row count), the
mapping goes, and the list is upstream's from then on, chunk for chunk (equal arrays,
in upstream's order; ``[-1]`` and every index name what they name in upstream's);
counted in ``COUNTERS`` by reason.

Code that reads the list directly (upstream does not) sees only the chunks not folded
yet; the list methods that remove, insert or reorder chunks (``clear``, ``pop``,
``insert``, ``remove``, ``reverse``, ``sort``, ``del``, ``*=``; upstream calls none)
spill first (``list_op``), so they act on upstream's whole list. On revert every live
buffer spills (``on_revert``), so a request in flight finishes with upstream's own
concatenation; revert runs where the chunks are appended (the API server's loop
thread), as a spill is not atomic with an append. Copied or pickled, a buffer is
upstream's list of its rows (the mapped rows as one array, then the chunks).

Memory. The rows in a mapping cost their bytes (in pages), where upstream's one array
per step costs an object and an allocation each; the chunks folded return to the heap
as upstream's do at finish. A request's first mapped fold frees the chunks that took it
past ``MAPPED_FROM`` (``FOLD`` chunks, a few more folds' worth for rows under 256 B), so
requests crossing together leave at most that behind in the heap, not their rows. The
mapping's room (twice the rows at most) holds no memory until written, though under
``vm.overcommit_memory=2`` it counts against the commit limit.

Mappings and the kernel. Upstream's list and ``np.concatenate`` make no call on a
mapping; the kernel may refuse each of ours (``ENOMEM`` under memory pressure, or at
``vm.max_map_count``, where even a shrink or an advice fails when it has to split a
mapping the kernel merged with its neighbours). No refusal reaches vLLM: each
``OSError`` takes upstream's path, counted by the call refused:

* ``map`` (``mmap``) and ``advise`` (``madvise`` other than ``EINVAL``; the new mapping
  is closed, which at the map-count limit may itself leave it mapped: CPython ignores
  ``munmap``'s error, as glibc does for upstream's freed arrays): the list stays
  upstream's;
* ``grow`` (``mremap`` to a larger size; the kernel leaves the mapping as it was): the
  rows spill from the mapping;
* ``shrink`` (``mremap`` at finish): the finished output gets a copy of the rows (the
  mapping keeps them, unchanged).

A Python without ``mremap`` (not Linux) raises ``SystemError`` for both: counted the same.

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
import itertools
import math
import mmap
import sys
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


COUNTERS = Counters("short")
_NDARRAY = np.ndarray
#: Chunks gathered in the list between two folds.
FOLD = 64
#: Rows of at least this many bytes are folded into a private mapping.
MAPPED_FROM = 1 << 14
_NEVER = sys.maxsize  # a spilled list's next fold
_NO_HUGE_PAGES = getattr(mmap, "MADV_NOHUGEPAGE", None)  # None: no THP on this platform


class _Refused(Exception):
    """No mapping (or no room in it) for the rows: ``reason`` is counted as they spill."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RowChunks(list):
    """``routed_experts_chunks``, folded into one mapping (see the module docstring)."""

    __slots__ = (
        "_rows",
        "_size",
        "_dtype",
        "_tail",
        "_counts",
        "_fold_at",
        "_handed",
        "__weakref__",
    )

    def __init__(self) -> None:
        super().__init__()
        key = id(self)
        _LIVE[key] = weakref.ref(self, lambda _, key=key: _LIVE.pop(key, None))
        self._rows: mmap.mmap | None = None
        self._size = 0  # bytes of rows in ``_rows``
        self._dtype: Any = None
        self._tail: tuple[int, ...] = ()
        self._counts: list[int] = []  # rows of each chunk folded, in order
        self._fold_at = FOLD  # the list's length at the next fold; ``_NEVER`` once spilled
        self._handed = False  # the mapping's rows were handed out at finish

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Copied or pickled, the chunks are upstream's list: the folded chunks (copies),
        then the chunks not folded yet."""
        return (list, ([*self._folded(), *self] if self.gathered else list(self),))

    def _folded(self) -> list[Any]:
        """A copy of the folded rows, split back into the chunks they were folded from."""
        if not self._counts:
            return []
        return np.split(self.array().copy(), list(itertools.accumulate(self._counts[:-1])))

    @property
    def gathered(self) -> bool:
        """Rows were folded and live in the mapping."""
        return self._rows is not None

    def append(self, chunk: Any) -> None:
        list.append(self, chunk)
        if len(self) >= self._fold_at:
            self.fold()

    def fold(self) -> None:
        """Move the chunks in the list into the mapping (mapping it once they hold
        ``MAPPED_FROM``), or spill."""
        if not len(self) or self._fold_at == _NEVER:
            return
        if self._handed:
            return self._spill("handed_out")
        if len(set(map(type, self))) != 1 or type(self[0]) is not _NDARRAY:
            return self._spill("chunk")
        if self._rows is None:
            first = self[0]
            if (
                first.ndim < 1
                or first.dtype.hasobject
                or first.dtype.itemsize == 0
                or 0 in first.shape[1:]
            ):
                return self._spill("chunk")
            canonical = np.concatenate((first[:0],)).dtype  # the dtype concatenate gives
            if canonical.str != first.dtype.str or canonical.descr != first.dtype.descr:
                return self._spill("chunk")  # byte-swapped, padded or aligned
            self._dtype, self._tail = first.dtype, first.shape[1:]
        try:
            lens = list(map(len, self))
        except TypeError:  # a 0-d chunk
            return self._spill("chunk")
        rows = sum(lens)
        items = rows * math.prod(self._tail)
        need = self._size + items * self._dtype.itemsize
        try:
            if self._rows is None:
                if need < MAPPED_FROM:
                    self._fold_at = len(self) + FOLD
                    return None
                self._map(need)
            elif need > len(self._rows):  # grow the mapping (mremap: no copy of the rows)
                try:
                    self._rows.resize(_pages(max(2 * len(self._rows), need)))
                except BufferError:  # a view of the rows is alive
                    raise _Refused("view_alive") from None
                except (OSError, SystemError):  # refused (SystemError: no mremap here)
                    raise _Refused("grow") from None
        except _Refused as refused:
            return self._spill(refused.reason)
        out = np.frombuffer(self._rows, self._dtype, items, self._size)
        try:
            np.concatenate(self, out=out.reshape((rows, *self._tail)), casting="no")
        except (TypeError, ValueError):  # another dtype or row shape: upstream's own
            del out
            return self._spill("chunk")
        del out
        self._counts += lens
        self._size = need
        self._fold_at = FOLD
        list.clear(self)
        return None

    def _map(self, need: int) -> None:
        """A private anonymous mapping with room for ``need`` bytes, advised never to use
        huge pages; ``_Refused`` past ``MAX_IN_FLIGHT`` or when the kernel refuses the
        mapping or the advice."""
        if len(_IN_FLIGHT) >= MAX_IN_FLIGHT:
            raise _Refused("mappings_in_flight")
        try:
            mapped = mmap.mmap(-1, _pages(2 * need), flags=mmap.MAP_PRIVATE)
        except OSError:
            raise _Refused("map") from None
        if _NO_HUGE_PAGES is not None:
            try:
                mapped.madvise(_NO_HUGE_PAGES)
            except OSError as refused:
                if refused.errno != errno.EINVAL:  # EINVAL: no THP here, nothing to avoid
                    mapped.close()
                    raise _Refused("advise") from None
        _IN_FLIGHT.add(mapped)
        self._rows = mapped

    def _spill(self, reason: str) -> None:
        """Upstream's list from now on: the folded chunks (copies) at its front."""
        COUNTERS.add_fallback(reason)
        if self._rows is not None:
            list.__setitem__(self, slice(0, 0), self._folded())
            self._counts = []
            if not self._handed:
                _IN_FLIGHT.discard(self._rows)
            self._rows = None
        self._fold_at = _NEVER

    def __setitem__(self, index: Any, value: Any) -> None:
        if self._rows is not None:
            if type(index) is int and index == -1 and not self._handed:
                # Upstream's trim: the last chunk replaced by (a prefix of) itself.
                if len(self):
                    list.__setitem__(self, -1, value)
                elif self._counts:  # folded: rewind its rows, the prefix goes to the list
                    row = self._dtype.itemsize * math.prod(self._tail)
                    self._size -= self._counts.pop() * row
                    list.append(self, value)
                else:  # nothing folded nor in the list: upstream's IndexError
                    list.__setitem__(self, index, value)
                return
            self._spill("setitem")
        list.__setitem__(self, index, value)

    def _spilling(name: str) -> Any:  # noqa: N805 - builds the methods below
        """A list method that first gives the folded rows back to the list, so it acts
        on upstream's whole list (upstream calls none of these on the chunks)."""
        method = getattr(list, name)

        def spill_first(self: RowChunks, *args: Any) -> Any:
            if self._rows is not None:
                self._spill("list_op")
            return method(self, *args)

        spill_first.__name__ = name
        return spill_first

    clear = _spilling("clear")
    pop = _spilling("pop")
    insert = _spilling("insert")
    remove = _spilling("remove")
    reverse = _spilling("reverse")
    sort = _spilling("sort")
    __delitem__ = _spilling("__delitem__")
    __imul__ = _spilling("__imul__")
    del _spilling

    def finished(self) -> Any:
        """The folded rows as the finished output's own array: exactly their bytes.

        Handed out in the mapping, shrunk to their size (mremap: no copy); from then on
        the mapping takes no more rows (a later chunk spills). A copy of them where the
        kernel refuses the shrink (``shrink``), past ``MAX_HANDED_OUT``
        (``mappings_held``), while a view of them is alive (``view_alive``), or once
        handed out (a second finish)."""
        rows = self._rows
        assert rows is not None and not len(self)
        if self._handed or not self._size:
            return self.array().copy()
        if len(_HANDED_OUT) >= MAX_HANDED_OUT:  # each is a kernel mapping: keep a margin
            COUNTERS.add_fallback("mappings_held")
            return self.array().copy()
        try:
            rows.resize(self._size)
        except BufferError:  # a view of the rows is alive: they cannot be shrunk
            COUNTERS.add_fallback("view_alive")
            return self.array().copy()
        except (OSError, SystemError):  # ENOMEM at vm.max_map_count; no mremap here
            COUNTERS.add_fallback("shrink")
            return self.array().copy()  # the mapping is as it was: rows and size
        self._handed = True
        _IN_FLIGHT.discard(rows)
        _HANDED_OUT.add(rows)
        return self.array()

    def array(self) -> Any:
        """The folded rows as one array (a view of the mapping)."""
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
            chunks._spill("revert")
        else:  # its chunks are upstream's list already: no more folds
            chunks._fold_at = _NEVER


def live_note() -> str:
    """What the patch has done in this process (``prime-r3 status``, the log)."""
    c = COUNTERS.snapshot()
    why = ", ".join(f"{k} {v}" for k, v in sorted(c["fallback"].items()))
    return (
        f"finished outputs from a mapping {c['fast']}, short ones by upstream's "
        f"concatenation {c['short']}; mappings in flight "
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
        chunks = getattr(instance, "routed_experts_chunks", None)
        if type(chunks) is RowChunks and chunks.gathered:
            finish_reason = args[1] if len(args) > 1 else kwargs.get("finish_reason")
            if finish_reason is not None:  # upstream concatenates: leave it nothing
                chunks.fold()
        output = wrapped(*args, **kwargs)
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
        elif (
            type(chunks) is RowChunks
            and chunks._fold_at != _NEVER
            and output.finish_reason is not None
            and output.routed_experts is not None
        ):  # never folded (under FOLD chunks or MAPPED_FROM): upstream's concatenation
            with COUNTERS._lock:
                COUNTERS.short += 1
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
