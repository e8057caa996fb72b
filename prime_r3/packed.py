"""One object per step for the routed-expert rows the output worker sends to EngineCore.

Upstream returns ``dict[request_id, AuxRequestOutput]`` from the output worker each
step. Pickling that emits one array per running request and EngineCore rebuilds them
one object at a time, on both halves of the step's critical path, so the cost grows
with requests per step rather than bytes. ``PackedAuxOutputs`` carries the same data
as one contiguous rows array plus per-request token starts and row offsets. It pickles
as three payloads (request ids, one int64 array, the rows) and answers the scheduler's
``in`` / ``[]`` lookups with real ``AuxRequestOutput`` values whose rows are views.

Lookups: ``PackedAuxOutputs`` is a read-only ``dict``. It arrives empty, as an instance
of a private subclass whose Python-level accessors fill it with every value on first
use (one pass, cheaper than building values one lookup at a time) and then switch the
object to ``PackedAuxOutputs`` itself, whose ``in`` and ``[]`` are dict's own C code:
the scheduler's per-request lookups then cost what they cost on upstream's dict. The
worker, which only pickles the object, never builds the values.

Writability: after unpickling, the rows live in a buffer this object owns and can
write (a read-only buffer, as plain ``bytes``, Ray or zmq hand over, is copied once
per step), so every row view is writable, as upstream's rows are after vLLM's
MessageQueue, and never aliases a transport buffer that gets reused.
"""

from __future__ import annotations

import operator
import pickle
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple, NoReturn

import numpy as np
from vllm.distributed.aux_output_connector.connector import AuxRequestOutput

__all__ = ["PackedAuxOutputs", "StepRows"]

_SEPARATOR = "\x00"
_token_start = operator.attrgetter("token_start")
_rows = operator.attrgetter("rows")
_base = operator.attrgetter("base")
_new = object.__new__


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


class PackedAuxOutputs(dict[str, AuxRequestOutput]):
    """Read-only ``request_id -> AuxRequestOutput`` dict backed by one rows array.

    Values are built once, all together, on first access (see the module docstring),
    so repeated lookups (and attribute updates such as Ray's zero-copy detach) see the
    same object, as with upstream's dict.
    """

    __slots__ = ("_ids", "_joined_ids", "_starts", "_offsets", "_rows")

    def __init__(
        self,
        request_ids: Sequence[str],
        token_starts: Sequence[int] | np.ndarray,
        offsets: Sequence[int] | np.ndarray,
        rows: np.ndarray,
    ) -> None:
        """Validate and wrap already-packed data (``pack`` builds it from a dict)."""
        ids = list(request_ids)
        starts = np.asarray(token_starts, dtype=np.int64)
        bounds = np.asarray(offsets, dtype=np.int64)
        rows = np.ascontiguousarray(rows)
        n = len(ids)
        if len(set(ids)) != n:
            raise ValueError("request ids must be unique")
        if starts.shape != (n,) or bounds.shape != (n + 1,):
            raise ValueError(f"need {n} token starts and {n + 1} offsets")
        if rows.ndim == 0 or rows.dtype.hasobject:
            raise TypeError(f"rows must be a numeric array of rows, got {rows.dtype}")
        if bounds[0] != 0 or bounds[-1] != len(rows) or np.any(np.diff(bounds) < 0):
            raise ValueError("offsets must rise from 0 to the number of rows")
        self._init(ids, None, starts, bounds, rows)
        self._fill()

    def _init(
        self,
        ids: list[str],
        joined_ids: str | None,
        starts: np.ndarray,
        offsets: np.ndarray,
        rows: np.ndarray,
    ) -> None:
        self._ids = ids
        self._joined_ids = joined_ids
        self._starts = starts
        self._offsets = offsets
        self._rows = rows

    @classmethod
    def _trusted(
        cls,
        ids: list[str],
        joined_ids: str | None,
        starts: np.ndarray,
        offsets: np.ndarray,
        rows: np.ndarray,
    ) -> PackedAuxOutputs:
        """An unfilled instance: its values are built on first access."""
        self = dict.__new__(_Unfilled)
        self._init(ids, joined_ids, starts, offsets, rows)
        return self

    @classmethod
    def pack(
        cls, outputs: Mapping[str, AuxRequestOutput], step: StepRows | None = None
    ) -> PackedAuxOutputs:
        """Copy one step's outputs into a single rows array, keeping dict order.

        With ``step`` (the worker's ``PendingAuxOutput`` fields), a step whose rows are
        all views of ``step.routed_experts`` is copied with one slice or gather from it
        instead of concatenating one small array per request (see ``_gather_rows``).

        Raises ``TypeError`` / ``ValueError`` if the rows cannot share one array
        (different dtypes or per-token shapes, non-array rows, non-str ids); the
        caller then keeps the dict. The copy means no row aliases the step's
        snapshot or any buffer the worker reuses.
        """
        ids = list(outputs)
        n = len(ids)
        joined = _SEPARATOR.join(ids)  # TypeError for a non-str id
        if n == 0:
            empty = np.zeros(1, dtype=np.int64)
            return cls._trusted(ids, joined, empty[:0], empty, np.empty(0, dtype=np.uint8))
        values = list(outputs.values())
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
        if joined.count(_SEPARATOR) != n - 1:
            joined = None  # an id contains the separator: pickle the id list instead
        return cls._trusted(ids, joined, starts, offsets, rows)

    # -- filling -------------------------------------------------------------------

    def _fill(self) -> None:
        """Build every value in one pass, then become a plain (C-speed) instance.

        ``AuxRequestOutput`` is a plain dataclass (an anchor of the patch): setting its
        two fields directly is what its ``__init__`` does, at a third of the cost.
        """
        rows = self._rows
        offsets = self._offsets
        n = len(self._ids)
        if int(offsets[-1]) == n and bool((offsets[1:] - offsets[:-1] == 1).all()):
            # Decode step, one row each: numpy's iteration makes the views in C.
            views = list(rows.reshape((n, 1, *rows.shape[1:])))
        else:
            bounds = offsets.tolist()
            views = list(map(rows.__getitem__, map(slice, bounds, bounds[1:])))
        values = []
        append = values.append
        for token_start, view in zip(self._starts.tolist(), views, strict=True):
            item = _new(AuxRequestOutput)
            item.token_start = token_start
            item.rows = view
            append(item)
        dict.update(self, zip(self._ids, values, strict=True))
        self.__class__ = PackedAuxOutputs

    # -- read-only -----------------------------------------------------------------

    def _read_only(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(f"{type(self).__name__} is read-only")

    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({len(self._ids)} requests, "
            f"rows {self._rows.shape} {self._rows.dtype})"
        )

    # -- packed views ------------------------------------------------------------

    @property
    def rows(self) -> np.ndarray:
        """All requests' rows, in request order (request i is ``offsets[i]:offsets[i+1]``)."""
        return self._rows

    @property
    def token_starts(self) -> np.ndarray:
        return self._starts

    @property
    def offsets(self) -> np.ndarray:
        return self._offsets

    # -- pickling ------------------------------------------------------------------

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, tuple[Any, ...]]:
        """Three payloads, whatever the request count: ids, int64 starts+offsets, rows.

        With protocol 5 the rows go as a ``PickleBuffer``, so vLLM's MessageQueue
        sends a large step out of band without copying it into the pickle stream.
        """
        ids: str | tuple[str, ...] | None = self._joined_ids
        if ids is None:
            ids = tuple(self._ids)
        ints = np.concatenate((self._starts, self._offsets)).tobytes()
        rows = self._rows
        payload: Any = pickle.PickleBuffer(rows) if protocol >= 5 else rows.tobytes()
        return _rebuild, (len(self._ids), ids, ints, payload, rows.dtype, rows.shape[1:])

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.__reduce_ex__(2)


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
    """

    __slots__ = ()

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids)


for _name in (
    "__contains__",
    "__getitem__",
    "__reversed__",
    "__eq__",
    "__ne__",
    "__or__",
    "__ror__",
    "get",
    "keys",
    "values",
    "items",
    "copy",
):
    setattr(_Unfilled, _name, _filled(_name))
del _name


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


def _rebuild(
    n: int,
    ids: str | tuple[str, ...],
    ints: bytes,
    payload: Any,
    dtype: np.dtype[Any],
    token_shape: tuple[int, ...],
) -> PackedAuxOutputs:
    """Unpickle: one copy at most per step, and only out of a read-only buffer."""
    if isinstance(ids, str):
        id_list = ids.split(_SEPARATOR) if n else []
        joined: str | None = ids
    else:
        id_list, joined = list(ids), None
    numbers = np.frombuffer(ints, dtype=np.int64)
    starts, offsets = numbers[:n], numbers[n:]
    if memoryview(payload).readonly:
        payload = bytearray(payload)
    rows = np.frombuffer(payload, dtype=np.uint8).view(dtype)
    rows = rows.reshape((int(offsets[-1]), *token_shape))
    return PackedAuxOutputs._trusted(id_list, joined, starts, offsets, rows)
