"""One object per step for the routed-expert rows the output worker sends to EngineCore.

Upstream returns ``dict[request_id, AuxRequestOutput]`` from the output worker each
step. Pickling that emits one array per running request and EngineCore rebuilds them
one object at a time, on both halves of the step's critical path, so the cost grows
with requests per step rather than bytes. ``PackedAuxOutputs`` carries the same data
as one contiguous rows array plus per-request token starts and row offsets. It pickles
as three payloads (request ids, one int64 array, the rows) and answers the scheduler's
``in`` / ``[]`` lookups with real ``AuxRequestOutput`` values whose rows are views.

Writability: after unpickling, the rows live in a buffer this object owns and can
write (a read-only buffer, as plain ``bytes``, Ray or zmq hand over, is copied once
per step), so every row view is writable, as upstream's rows are after vLLM's
MessageQueue, and never aliases a transport buffer that gets reused.
"""

from __future__ import annotations

import operator
import pickle
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from vllm.distributed.aux_output_connector.connector import AuxRequestOutput

__all__ = ["PackedAuxOutputs"]

_SEPARATOR = "\x00"
_token_start = operator.attrgetter("token_start")
_rows = operator.attrgetter("rows")
_new = object.__new__


class PackedAuxOutputs(Mapping[str, AuxRequestOutput]):
    """Read-only ``request_id -> AuxRequestOutput`` mapping backed by one rows array.

    Values are built on first access and cached, so repeated lookups (and attribute
    updates such as Ray's zero-copy detach) see the same object, as with a dict.
    """

    __slots__ = ("_ids", "_joined_ids", "_starts", "_offsets", "_rows", "_items", "_bounds")

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
        # Built on first lookup: id -> position, replaced by the value once built.
        self._items: dict[str, int | AuxRequestOutput] | None = None
        self._bounds: tuple[list[int], list[int]] = ([], [])

    @classmethod
    def _trusted(
        cls,
        ids: list[str],
        joined_ids: str | None,
        starts: np.ndarray,
        offsets: np.ndarray,
        rows: np.ndarray,
    ) -> PackedAuxOutputs:
        self = cls.__new__(cls)
        self._init(ids, joined_ids, starts, offsets, rows)
        return self

    @classmethod
    def pack(cls, outputs: Mapping[str, AuxRequestOutput]) -> PackedAuxOutputs:
        """Copy one step's outputs into a single rows array, keeping dict order.

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
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, rows_list), dtype=np.int64, count=n), out=offsets[1:])
        # casting="no" refuses mixed dtypes; mismatched per-token shapes raise too.
        rows = np.concatenate(rows_list, axis=0, dtype=first.dtype, casting="no")
        if joined.count(_SEPARATOR) != n - 1:
            joined = None  # an id contains the separator: pickle the id list instead
        return cls._trusted(ids, joined, starts, offsets, rows)

    # -- Mapping -------------------------------------------------------------------

    def _build_items(self) -> dict[str, int | AuxRequestOutput]:
        ids = self._ids
        items: dict[str, int | AuxRequestOutput] = dict(zip(ids, range(len(ids)), strict=True))
        self._bounds = (self._starts.tolist(), self._offsets.tolist())
        self._items = items
        return items

    def __getitem__(self, request_id: str) -> AuxRequestOutput:
        items = self._items
        if items is None:
            items = self._build_items()
        entry = items[request_id]  # KeyError(request_id), as a dict raises
        if type(entry) is not int:
            return entry
        starts, offsets = self._bounds
        # AuxRequestOutput is a plain dataclass (an anchor of the patch): setting its
        # two fields directly is what its __init__ does, at a third of the cost.
        item = _new(AuxRequestOutput)
        item.token_start = starts[entry]
        item.rows = self._rows[offsets[entry] : offsets[entry + 1]]
        items[request_id] = item
        return item

    def __contains__(self, request_id: object) -> bool:
        items = self._items
        if items is None:
            items = self._build_items()
        return request_id in items

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

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
        ids: str | tuple[str, ...] = self._joined_ids
        if ids is None:
            ids = tuple(self._ids)
        ints = np.concatenate((self._starts, self._offsets)).tobytes()
        rows = self._rows
        payload: Any = pickle.PickleBuffer(rows) if protocol >= 5 else rows.tobytes()
        return _rebuild, (len(self._ids), ids, ints, payload, rows.dtype, rows.shape[1:])

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.__reduce_ex__(2)


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
