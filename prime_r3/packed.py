"""One object per step for the routed-expert rows the output worker sends to EngineCore.

Upstream returns ``dict[request_id, AuxRequestOutput]`` from the output worker each
step. Pickling that emits one array per running request and EngineCore rebuilds them
one object at a time, on both halves of the step's critical path, so the cost grows
with requests per step rather than bytes. ``PackedAuxOutputs`` is that same dict whose
*pickled form* is one contiguous rows array plus per-request token starts and row
offsets: three payloads (request ids, one int64 array, the rows) whatever the request
count. The ids are pickled as a list of the very ``str`` objects the dict is keyed by:
on the real path those are ``ModelRunnerOutput.req_ids``' own objects (the worker's
``PendingAuxOutput.request_ids`` is ``list(input_batch.req_ids)``, and the output is
``req_ids=input_batch.req_ids``), pickled first in the same stream, so each id goes as
a memo reference (a few bytes) and is unpickled as the received ``req_ids``' object:
no string built, joined, split or hashed again on either side.

What every consumer sees is upstream's dict:

* Writer side (``pack``): the dict holds upstream's own ``AuxRequestOutput`` values
  and is packed only when pickled, from its content at that moment (as upstream's
  dict is pickled from its values at that moment). Without a pickle hop (uniproc
  executor) nothing is copied and the scheduler reads upstream's values, so rows
  and memory are upstream's.
* Reader side (unpickling): the dict is filled at once, every request's rows a
  private array that owns its memory (one copy out of the step's buffer, as
  upstream's unpickling makes one array per request). A row chunk kept by the
  frontend (``OutputProcessor`` keeps every chunk until the request finishes) pins
  that request's rows only, never the step: an in-process frontend keeps no more
  alive than upstream does. Where ``batched_take`` wraps the scheduler's
  ``take_output``, the step stays *unfilled* instead (its rows in one array of
  memory nobody else writes) until its first take, which splits it (``_split``):
  every request's rows copied into an array of its own and the packed rows dropped,
  so from then on the step holds its rows once, as upstream's dict does, and takes
  hand out those arrays (or views of them, as upstream slices its per-request
  arrays). Any other dict read fills it first (see ``_Unfilled``), reusing a split
  step's arrays.
* Generic consumers (msgspec / vLLM's ``MsgpackEncoder``, ``dataclasses.asdict``,
  ``copy``, ``deepcopy``, ``==``, ``pop``/``del``/``update``) act on the dict's
  content exactly as on upstream's dict; a later pickle carries the mutated content
  (upstream's plain dict form if it no longer packs).
* ``_trusted`` (arrays straight from a writer that never had a dict, or a received
  step read by ``batched_take``) makes an *unfilled* instance: its Python-level
  accessors fill it on first use; C-level readers that bypass them (msgspec) see an
  empty dict until then, so such an object is for pickling or the scheduler only
  (EngineCore declares the packed format only to vLLM's own
  ``Scheduler.update_from_output``: see ``prime_r3.fixes.packed_outputs``).

Versioning: the pickled form starts with ``FORMAT_VERSION``; a reader with another
version raises ``PackedFormatError`` naming both. The handshake (see
``prime_r3.fixes.packed_outputs``) makes a worker pack only for an EngineCore that
declared, in the step's connector metadata (``READS_MARK``), the format it reads.

Why this module is long: the packed step must be upstream's dict to every reader, so
each way a dict is read or changed (the mapping methods, ``copy``, ``pickle``, ``==``,
msgspec) is a rule here, on both the filled and the unfilled form, besides the pickled
format and its reader.
"""

from __future__ import annotations

import copy
import logging
import operator
import pickle
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "FORMAT_VERSION",
    "READS_MARK",
    "PackedAuxOutputs",
    "PackedFormatError",
    "StepRows",
    "reader_declared",
]

#: Version of the pickled form; a reader refuses any other (``PackedFormatError``).
FORMAT_VERSION = 1
#: Attribute EngineCore sets on a step's ``AuxOutputConnectorMetadata`` to the format
#: it reads (a plain int, so any worker unpickles it); workers pack only when it
#: equals their ``FORMAT_VERSION``.
READS_MARK = "prime_r3_packed_format"

logger = logging.getLogger("vllm.prime_r3")
_SEPARATOR = "\x00"  # format 1 writers before the shared ids joined them with it
_token_start = operator.attrgetter("token_start")
_rows = operator.attrgetter("rows")
_base = operator.attrgetter("base")
_third = operator.itemgetter(2)
_new = object.__new__
_copy = np.ndarray.copy


def reader_declared(metadata: Any) -> bool:
    """Whether a step's ``AuxOutputConnectorMetadata`` says EngineCore reads this format.

    Every writer of ``PackedAuxOutputs`` (the ``process_output`` wrapper, or any code
    that builds one from arrays) sends a packed step only when this is true, and
    upstream's dict otherwise.
    """
    return getattr(metadata, READS_MARK, None) == FORMAT_VERSION


class StepRows(NamedTuple):
    """Where a step's common-case output rows come from: the ``PendingAuxOutput`` fields.

    ``_commit_output`` (an anchor of the patch) returns, for a request at batch position
    ``j`` that emits from this step's capture, ``routed_experts[start:end - rejected]``
    cut at the front, where ``start, end = query_start_loc[j], query_start_loc[j + 1]``
    and ``rejected = num_rejected[j]``: a view of ``routed_experts`` ending at
    ``end - rejected``. Its other rows are copies or the store's bytes, never such views.
    """

    routed_experts: np.ndarray
    request_ids: Sequence[str]
    query_start_loc: np.ndarray
    num_rejected: np.ndarray


class PackedFormatError(RuntimeError):
    """A packed step written in a format this process does not read."""


class _Packed(NamedTuple):
    """A step's packed form: what the pickled payload carries."""

    ids: list[str]
    starts: np.ndarray
    offsets: np.ndarray  # request i's rows are rows[offsets[i]:offsets[i + 1]]
    rows: np.ndarray  # None in a step _Unfilled._split split (its index holds the rows)


#: A split unfilled step's index (``_Unfilled._split``): request id -> (token start,
#: row count, rows), the first two Python ints, ``rows`` the request's rows in an array
#: that owns its memory (``len(rows) == count``), in the step's request order.
_Places = dict[Any, tuple[int, int, np.ndarray]]


class PackedAuxOutputs(dict[str, "AuxRequestOutput"]):
    """Upstream's ``request_id -> AuxRequestOutput`` dict that pickles as one rows array.

    See the module docstring for what each side holds. The dict's content is the
    truth, and the packed form is made from it each time it is pickled (so anything
    a consumer changed before the hop is what is sent, as with upstream's dict). Only
    an unfilled instance (``_trusted``) holds a packed form (``_packed``) instead.
    """

    __slots__ = ("_packed", "_step", "_index")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Same arguments as ``dict``: generic code (``dataclasses.asdict``) rebuilds
        a dict through its type. Such an instance packs itself when pickled."""
        self._packed: _Packed | None = None
        self._step: StepRows | None = None
        self._index: _Places | None = None
        dict.__init__(self, *args, **kwargs)

    @classmethod
    def _trusted(
        cls,
        ids: list[str],
        starts: np.ndarray,
        offsets: np.ndarray,
        rows: np.ndarray,
    ) -> PackedAuxOutputs:
        """An unfilled instance over already-packed arrays: values are built on first
        access (each request's rows copied out, owning its memory)."""
        self = dict.__new__(_Unfilled)
        self._packed = _Packed(ids, starts, offsets, rows)
        self._step = None
        self._index = None
        return self

    @classmethod
    def from_arrays(
        cls,
        request_ids: Sequence[str],
        token_starts: Sequence[int] | np.ndarray,
        offsets: Sequence[int] | np.ndarray,
        rows: np.ndarray,
    ) -> PackedAuxOutputs:
        """Validate and wrap already-packed data (filled: values own their rows)."""
        ids = list(request_ids)
        starts = np.asarray(token_starts, dtype=np.int64)
        bounds = np.asarray(offsets, dtype=np.int64)
        rows = np.ascontiguousarray(rows)
        n = len(ids)
        if not all(isinstance(i, str) for i in ids):
            raise TypeError("request ids must be str")
        if len(set(ids)) != n:
            raise ValueError("request ids must be unique")
        if starts.shape != (n,) or bounds.shape != (n + 1,):
            raise ValueError(f"need {n} token starts and {n + 1} offsets")
        if rows.ndim == 0 or rows.dtype.hasobject:
            raise TypeError(f"rows must be a numeric array of rows, got {rows.dtype}")
        if bounds[0] != 0 or bounds[-1] != len(rows) or np.any(np.diff(bounds) < 0):
            raise ValueError("offsets must rise from 0 to the number of rows")
        self = cls._trusted(ids, starts, bounds, rows)
        self._fill()
        return self

    @classmethod
    def pack(
        cls, outputs: Mapping[str, AuxRequestOutput], step: StepRows | None = None
    ) -> PackedAuxOutputs:
        """Upstream's step outputs as a dict that packs itself when pickled.

        The dict holds ``outputs``' own values, so without a pickle hop (uniproc
        executor) nothing is copied and readers see upstream's objects. Pickling
        packs the content of that moment (``_pack``); ``step`` (the worker's
        ``PendingAuxOutput`` fields) lets it copy a step whose rows are all views of
        ``step.routed_experts`` with one slice or gather.

        Content that cannot share one rows array (never seen from upstream's worker)
        pickles as upstream's plain dict, with one warning per process.
        """
        self = dict.__new__(PackedAuxOutputs)
        self._packed = None
        self._step = step
        self._index = None
        dict.update(self, outputs)
        return self

    def packed(self) -> _Packed:
        """The packed form of the current content (made now unless unfilled).

        A split step (``_Unfilled._split``) no longer holds its packed rows: it is
        filled from its per-request arrays and packed from them, as a filled dict is.
        """
        packed = self._packed
        if packed is not None:
            if packed.rows is not None:
                return packed
            self._fill()
        return _pack(list(dict.keys(self)), list(dict.values(self)), self._step)

    # -- filling (reader side) -----------------------------------------------------

    def _fill(self) -> None:
        """Build every value in one pass, then become a plain (C-speed) instance.

        Each request's rows are an array that owns its memory, so a kept row chunk
        pins that request's rows only (as with upstream's per-request arrays): copied
        out of the step's buffer (dropped here), or, on a step ``_Unfilled._split``
        already split, that split's arrays, not copied again. Those are the arrays
        (or the bases of the views) ``batched_take`` handed out, as upstream's results
        are views of its dict's arrays, and the step never holds a row twice.
        ``AuxRequestOutput`` is a plain dataclass (an anchor of the patch): setting its
        two fields directly is what its ``__init__`` does; the objects are made and
        their fields set by C-level ``map``s (no Python loop per request).
        """
        packed = self._packed
        assert packed is not None
        ids, starts, offsets, rows = packed
        n = len(ids)
        if len(starts) != n or len(offsets) != n + 1:
            raise ValueError(f"packed step: {n} ids, {len(starts)} starts, {len(offsets)} offsets")
        if rows is None:  # split: the index holds every request's array
            # Looked up by id, not read in the index's order: a step whose ids repeat
            # (not from this writer) has fewer index entries than ids, and the values
            # must still pair with their ids as in an unsplit fill (the last one wins).
            arrays: Any = map(_third, map(self._index.__getitem__, ids))  # type: ignore[union-attr]
        else:
            arrays = _split_rows(rows, offsets)
        values = list(map(_new, repeat(AuxRequestOutput, n)))
        deque(map(setattr, values, repeat("token_start"), starts.tolist()), maxlen=0)
        deque(map(setattr, values, repeat("rows"), arrays), maxlen=0)
        dict.update(self, zip(ids, values, strict=True))
        self._packed = None
        self._index = None
        self.__class__ = PackedAuxOutputs

    # -- dict behaviour beyond lookups ---------------------------------------------

    def _mutator(name: str) -> Any:  # type: ignore[misc]  # noqa: N805 - class-body helper
        """``dict.<name>``, after an unfilled instance made its content real."""
        method = getattr(dict, name)

        def mutate(self: PackedAuxOutputs, *args: Any, **kwargs: Any) -> Any:
            if type(self) is _Unfilled:
                self._fill()
            return method(self, *args, **kwargs)

        mutate.__name__ = mutate.__qualname__ = name
        return mutate

    __setitem__ = _mutator("__setitem__")
    __delitem__ = _mutator("__delitem__")
    __ior__ = _mutator("__ior__")
    clear = _mutator("clear")
    pop = _mutator("pop")
    popitem = _mutator("popitem")
    setdefault = _mutator("setdefault")
    update = _mutator("update")
    del _mutator

    def __copy__(self) -> PackedAuxOutputs:
        """Shallow, as ``copy.copy`` of upstream's dict: the same value objects."""
        return PackedAuxOutputs.pack(self, self._step)

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedAuxOutputs:
        """As ``copy.deepcopy`` of upstream's dict: new values, new rows arrays."""
        new = PackedAuxOutputs()
        memo[id(self)] = new
        for key, value in self.items():
            dict.__setitem__(new, copy.deepcopy(key, memo), copy.deepcopy(value, memo))
        return new

    # -- packed views ------------------------------------------------------------

    @property
    def rows(self) -> np.ndarray:
        """All requests' rows, in request order (request i is ``offsets[i]:offsets[i+1]``)."""
        return self.packed().rows

    @property
    def token_starts(self) -> np.ndarray:
        return self.packed().starts

    @property
    def offsets(self) -> np.ndarray:
        return self.packed().offsets

    # -- pickling ------------------------------------------------------------------

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, tuple[Any, ...]]:
        """``FORMAT_VERSION`` then three payloads: ids, int64 starts+offsets, rows.

        The ids go as a list of the dict's own key objects (see the module docstring:
        memo references inside a ``ModelRunnerOutput``). Readers of format 1 take any
        sequence of ids here, or the ``_SEPARATOR``-joined string older writers sent.

        With protocol 5 the rows go as a ``PickleBuffer``, so vLLM's MessageQueue
        sends a large step out of band without copying it into the pickle stream.
        Content that cannot be packed (a consumer stored other values) pickles as
        upstream's plain dict.
        """
        try:
            ids, starts, offsets, rows = self.packed()
        except (TypeError, ValueError, AttributeError) as error:
            _warn_unpacked(error)
            return dict, (dict(self),)
        ints = np.concatenate((starts, offsets)).tobytes()
        payload: Any = pickle.PickleBuffer(rows) if protocol >= 5 else rows.tobytes()
        fields = (len(ids), ids, ints, payload, rows.dtype, rows.shape[1:])
        return _rebuild, (FORMAT_VERSION, *fields)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.__reduce_ex__(2)


def pack_reference(outputs: Mapping[str, Any]) -> _Packed:
    """The reference form of ``_pack``: upstream's dict walked in order, one request at a
    time: its id, its ``token_start`` as an int64, its row count, and its rows appended
    (``np.concatenate`` of the values' rows). ``_pack``'s gather from ``StepRows`` and its
    column passes give the same arrays (the tests hold them equal)."""
    ids: list[str] = []
    starts: list[int] = []
    offsets = [0]
    pieces: list[np.ndarray] = []
    for request_id, output in outputs.items():
        ids.append(request_id)
        starts.append(int(output.token_start))
        offsets.append(offsets[-1] + len(output.rows))
        pieces.append(output.rows)
    rows = np.concatenate(pieces, axis=0) if pieces else np.empty(0, dtype=np.uint8)
    return _Packed(ids, np.array(starts, np.int64), np.array(offsets, np.int64), rows)


def _pack(ids: list[str], values: list[Any], step: StepRows | None) -> _Packed:
    """Copy a step's rows into one array, keeping dict order.

    Raises ``TypeError`` / ``ValueError`` if the rows cannot share one array
    (different dtypes or per-token shapes, non-array rows). Ids are pickled as they
    are (a list of the keys), so any key upstream's dict could carry round-trips. The copy
    means no packed row aliases the step's snapshot or a buffer the worker reuses.
    """
    n = len(ids)
    if n == 0:
        empty = np.zeros(1, dtype=np.int64)
        return _Packed(ids, empty[:0], empty, np.empty(0, dtype=np.uint8))
    rows_list = list(map(_rows, values))
    first = rows_list[0]
    if type(first) is not np.ndarray or first.ndim == 0 or first.dtype.hasobject:
        raise TypeError(f"cannot pack rows of type {type(first).__name__}")
    starts = np.fromiter(map(_token_start, values), dtype=np.int64, count=n)
    lengths = np.fromiter(map(len, rows_list), dtype=np.int64, count=n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    rows = None
    if step is not None:
        try:
            rows = _gather_rows(step, ids, rows_list, lengths, offsets)
        except (TypeError, ValueError, IndexError):
            rows = None  # a step that does not look like StepRows says: concatenate
    if rows is None:
        # casting="no" refuses mixed dtypes; mismatched per-token shapes raise too.
        rows = np.concatenate(rows_list, axis=0, dtype=first.dtype, casting="no")
    return _Packed(ids, starts, offsets, rows)


_warned = False


def _warn_unpacked(error: Exception) -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning("prime_r3 packed_outputs: sending a step unpacked: %s", error)


def _filled(name: str) -> Any:
    """A dict accessor for ``_Unfilled`` that fills the object, then calls the real one."""

    def accessor(self: PackedAuxOutputs, *args: Any, **kwargs: Any) -> Any:
        self._fill()
        return getattr(self, name)(*args, **kwargs)

    accessor.__name__ = accessor.__qualname__ = name
    return accessor


class _Unfilled(PackedAuxOutputs):
    """A ``PackedAuxOutputs`` whose dict is still empty (see the module docstring).

    Every read of the dict goes through ``_fill`` first, which makes the object a plain
    ``PackedAuxOutputs``; only ``len`` and iteration answer from the packed ids alone.
    ``batched_take`` reads it through ``_split`` instead.
    """

    __slots__ = ()

    def __len__(self) -> int:
        return len(self._packed.ids)  # type: ignore[union-attr]

    def __iter__(self) -> Iterator[str]:
        return iter(self._packed.ids)  # type: ignore[union-attr]

    def _split(self) -> _Places:
        """The step's index for ``batched_take`` (its only caller, at a step's first take):
        every request's rows copied into an array of its own, and the packed rows dropped.

        Why all at once, and why drop them: upstream's received dict holds one array per
        request, and its ``take_output`` returns a view of that array. Keeping the packed
        rows *and* handing out copies held the step's rows twice from the first take
        until the ``ModelRunnerOutput`` died; split, the step holds them once (plus the
        small ids, starts and offsets, for ``len``, iteration and ``_fill``), and each
        result is its request's array or a view of it: it pins that request's rows only,
        never the step, as upstream's does. The copies are made by C-level ``map``s
        (``_split_rows``; on a decode step, one row each, numpy's iteration makes the
        views), cheaper than a slice plus ``.copy()`` per take. The arrays of requests
        that do not emit die with the step, as upstream's dict values do; a later dict
        read fills the step from these arrays (``_fill``), not from new copies. The index
        lives in the ``_index`` slot, which this is the only producer of.
        """
        ids, starts, offsets, rows = self._packed  # type: ignore[misc]
        n = len(ids)
        if len(starts) != n or len(offsets) != n + 1:
            raise ValueError(f"packed step: {n} ids, {len(starts)} starts, {len(offsets)} offsets")
        arrays = _split_rows(rows, offsets)
        counts = (offsets[1:] - offsets[:-1]).tolist()
        places = dict(zip(ids, zip(starts.tolist(), counts, arrays, strict=True), strict=True))
        self._index = places
        self._packed = _Packed(ids, starts, offsets, None)  # type: ignore[arg-type]
        return places


for _name in (
    "__contains__",
    "__getitem__",
    "__reversed__",
    "__eq__",
    "__ne__",
    "__or__",
    "__ror__",
    "__repr__",
    "__copy__",
    "__deepcopy__",
    "get",
    "keys",
    "values",
    "items",
    "copy",
):
    setattr(_Unfilled, _name, _filled(_name))
del _name


def _split_rows(rows: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    """Request i's rows ``rows[offsets[i]:offsets[i + 1]]``, each copied into an array
    that owns its memory (one copy per request, by C-level ``map``s)."""
    n = len(offsets) - 1
    if int(offsets[-1]) == n and bool((offsets[1:] - offsets[:-1] == 1).all()):
        # Decode step, one row each: numpy's iteration makes the views in C.
        views: Any = rows.reshape((n, 1, *rows.shape[1:]))
    else:
        bounds = offsets.tolist()
        views = map(rows.__getitem__, map(slice, bounds, bounds[1:]))
    return list(map(_copy, views))


def _gather_rows(
    step: StepRows,
    ids: list[str],
    rows_list: list[Any],
    lengths: np.ndarray,
    offsets: np.ndarray,
) -> np.ndarray | None:
    """The step's rows copied out of ``step.routed_experts``, or None to concatenate.

    Only when every row is a view of ``routed_experts`` (``row.base is routed_experts``:
    numpy points every slice, and slice of a slice, of an array at it, or at its owner
    if it owns its data) may the gather stand in for the concatenate: by ``StepRows``,
    such a row is the ``len(row)`` rows of ``routed_experts`` that end at its request's
    ``end - rejected``. The positions are checked to lie inside the request's scheduled
    range, and request order to follow the batch order ``_commit_output`` inserts in.
    """
    source = step.routed_experts
    if (
        type(source) is not np.ndarray
        or source.ndim == 0
        or not source.flags.c_contiguous
        or source[:0].base is not source  # rows' base would be another array
    ):
        return None
    first = rows_list[0]
    if first.dtype != source.dtype or first.shape[1:] != source.shape[1:]:
        return None
    try:
        if not all(map(partial(operator.is_, source), map(_base, rows_list))):
            return None  # rows from the store or the buffer: the exception
    except AttributeError:
        return None
    request_ids = list(step.request_ids)
    query_start_loc = np.asarray(step.query_start_loc, dtype=np.int64)
    num_rejected = np.asarray(step.num_rejected, dtype=np.int64)
    batch = len(request_ids)
    if query_start_loc.shape != (batch + 1,) or num_rejected.shape != (batch,):
        return None
    begins = query_start_loc[:-1]
    ends = query_start_loc[1:] - num_rejected
    if ids != request_ids:  # not every request emitted: find each one's batch position
        index = dict(zip(request_ids, range(batch), strict=True))
        try:
            position = np.fromiter(map(index.__getitem__, ids), dtype=np.int64, count=len(ids))
        except KeyError:
            return None
        if len(position) > 1 and not bool((position[1:] > position[:-1]).all()):
            return None
        begins = begins[position]
        ends = ends[position]
    froms = ends - lengths
    if not (bool((froms >= begins).all()) and bool((begins >= 0).all())):
        return None
    if not bool((ends <= len(source)).all()):
        return None
    if bool((froms[1:] == ends[:-1]).all()):  # one contiguous run, e.g. a decode step
        return source[int(froms[0]) : int(ends[-1])].copy()
    index_rows = np.repeat(froms - offsets[:-1], lengths)
    index_rows += np.arange(int(offsets[-1]), dtype=np.int64)
    return source.take(index_rows, axis=0)


def _rebuild(version: Any, *fields: Any) -> PackedAuxOutputs:
    """Unpickle and fill: every request's rows become a private, writable array.

    The version comes first and the rest is taken as ``*fields``, so a step packed by
    another format version fails here with both versions named, not with a
    ``TypeError`` about arguments.
    """
    if len(fields) == 5 and isinstance(fields[0], str | tuple):
        # prime_r3 before the handshake pickled (n, ids, ints, payload, dtype, shape):
        # no version, and its workers pack whatever EngineCore runs. Its ``n`` lands in
        # ``version`` here; name the real cause rather than a format number.
        raise PackedFormatError(
            "prime_r3 packed_outputs: a worker running a prime_r3 from before the packed "
            "format handshake (unversioned packed steps) sent a packed step; this process "
            f"reads format {FORMAT_VERSION} (prime_r3 {_prime_r3_version()}); run the same "
            "prime_r3 in EngineCore and every worker, or set "
            "PRIME_R3_PATCHES=all,-packed_outputs on the workers"
        )
    if version != FORMAT_VERSION or len(fields) != 6:
        raise PackedFormatError(
            f"prime_r3 packed_outputs: a worker sent a step packed in format {version!r}, "
            f"this process reads format {FORMAT_VERSION} (prime_r3 {_prime_r3_version()}); "
            "run the same prime_r3 in EngineCore and every worker, or set "
            "PRIME_R3_PATCHES=all,-packed_outputs on the workers"
        )
    n, ids, ints, payload, dtype, token_shape = fields
    if type(ids) is list:  # this writer's form: the unpickler's own fresh list
        id_list = ids
    elif isinstance(ids, str):  # format 1 as written before the shared ids
        id_list = ids.split(_SEPARATOR) if n else []
    else:
        id_list = list(ids)
    numbers = np.frombuffer(ints, dtype=np.int64)
    starts, offsets = numbers[:n], numbers[n:]
    rows = np.frombuffer(payload, dtype=np.uint8).view(dtype)
    rows = rows.reshape((int(offsets[-1]), *token_shape))
    if not _reads_lazily():
        received = PackedAuxOutputs._trusted(id_list, starts, offsets, rows)
        received._fill()  # copies every request's rows out of the transport buffer
        return received
    # batched_take reads the step without filling it: the step keeps its rows until
    # its first take splits them (_Unfilled._split), so they must be memory nobody
    # else writes. A bytes or
    # bytearray payload is the unpickler's own (in-band) or the fresh copy dequeue
    # made (vLLM 0.32+); any other buffer (vLLM 0.31's view of the reusable ring
    # slot, Ray's or zmq's read-only memory) is copied once, the whole step at a time.
    if type(payload) is not bytes and type(payload) is not bytearray:
        rows = rows.copy()
    return PackedAuxOutputs._trusted(id_list, starts, offsets, rows)


def _reads_lazily() -> bool:
    """Whether this process reads received steps unfilled: ``batched_take`` wraps the
    scheduler connector's ``take_output`` here (our wrapper, checked by identity).

    Otherwise a received step is filled at once, as packed_outputs alone always did:
    then even C-level dict readers (msgspec) see its content.
    """
    from prime_r3 import state

    taker = AuxOutputSchedulerConnector.__dict__.get("take_output")
    ours = state.active_wrappers("batched_take")
    return bool(ours) and any(taker is wrapper for wrapper in ours.values())


def _prime_r3_version() -> str:
    try:
        from prime_r3 import __version__
    except ImportError:  # pragma: no cover - prime_r3 is this package
        return "unknown"
    return __version__


# vLLM's connector module is imported last, on purpose. Importing it runs prime_r3's
# post-import hooks for it when apply() left patches waiting for that import, and those
# patches' factories read this module's names (FORMAT_VERSION, _Unfilled, ...). When
# this module is the first to import the connector (user code, a bench script, or a
# process that unpickles a packed step first), an import at the top would run the hooks
# while none of those names exists yet: the factories would fail and packed_outputs and
# batched_take would roll back. Here every name is already defined when the hooks run;
# the two classes below are read only when a step is built or taken, never at install.
from vllm.distributed.aux_output_connector.connector import (  # noqa: E402
    AuxOutputSchedulerConnector,
    AuxRequestOutput,
)
