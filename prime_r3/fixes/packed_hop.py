"""packed_hop: EngineCore sends a step's routed experts to its client as one array.

What it replaces. With R3 nearly every ``EngineCoreOutput`` of a step carries a small
routed-experts array; EngineCore's output thread (``process_output_sockets``) then runs
``MsgpackEncoder``'s ndarray hook once per output and sends each array as a ZMQ frame
of its own, and the client's output loop (``SyncMPClient``'s thread,
``AsyncMPClient``'s task, which is the API server's event loop) decodes them one by
one. Here the output thread packs the step's arrays into ``(counts, rows)`` (rows per
output, -1 for none; the rows concatenated) and the client gives every output an array
of its own back right after decoding: the rule and, but for ``engine_index``, the
wire form of ``patches/*/02-packed_outputs.patch`` (``pack_routed_experts`` /
``unpack_routed_experts``), which carries this patch's upstream form.

The fast case: a step whose outputs carry at least two plain ndarrays of one dtype and
per-token shape, each under 8 KiB, goes as ``PackedEngineCoreOutputs``: upstream's
``EngineCoreOutputs`` fields, then ``packed_routed_experts``, encoded by the thread's
own encoder (``encode_into``) as one more array element. Arrays of 8 KiB or more (a
prefill's rows) stay on their outputs and go as upstream's frames. The outputs' arrays
are put back once the step is encoded, so the step object is as upstream left it.
Fallbacks, each counted (``COUNTERS``): a step with nothing to pack (fewer than two
such arrays, mixed dtypes or shapes) is encoded by upstream's ``encode_into`` as it is
(``as_is``); so is every step while not every client of the engine has declared it
reads the packed form (``undeclared``).

The handshake (who may receive it). The client declares, once, per engine: at the end
of ``SyncMPClient.__init__`` / ``AsyncMPClient.__init__`` it sends each engine in
``core_engines`` the declaration ``(client_index, call_id, "prime_r3_packed_hop",
(FORMAT_VERSION,))`` on its input socket, as ``call_utility`` sends a utility call but
with the request type ``WAKEUP``, after ``MPClient.__init__`` gave the client a decoder
that reads both forms (``ReadingDecoder``). EngineCore answers it in
``_handle_client_request`` as it answers a utility call (``_invoke_utility_method``;
the reply travels back in order on the output stream) and records the client's index;
its output thread packs only while **every** client socket it was started with
(``output_paths``, one per API server) has declared. (It also takes the declaration as
a utility call ``prime_r3_packed_hop``, which clients of earlier builds of this patch
send.) So: a client without prime_r3,
with ``PRIME_R3=0``, with this patch not selected in ``PRIME_R3_PATCHES``, or with a
changed ``MPClient`` never declares, and its engine sends upstream's bytes to every
client (a mixed deployment falls back to upstream).

Why ``WAKEUP``: an engine without this patch must ignore the declaration without a
word. Upstream's input thread (``process_input_sockets``, 0.31-0.33) decodes any request
that is neither ``ADD`` nor ``UTILITY`` with its generic decoder and queues it; its
``_handle_client_request`` returns at once for ``WAKEUP`` (the value its own shutdown
signal handler queues, with ``None``, to wake an idle busy loop), so such an engine
logs nothing, answers nothing, and sends upstream's messages, which the declared
client's decoder reads with upstream's own decoder. The cost: the client cannot tell
such an engine from one whose answer is still on its way, so that declaration's state
stays ``sent`` (its future waits in ``utility_results``, one per engine, and never
resolves) and the client logs nothing about it. A declaration that fails on an engine
with this patch (another ``FORMAT_VERSION``, an engine shutting down) is answered with a
failure: the client counts it ``declined`` and logs at INFO that the engine sends
upstream's messages. The decision is made per message in the output thread from the
engine's record, so it holds for every client whatever the order of declarations and
steps.

The wire form. A packed step is upstream's ``EngineCoreOutputs`` array with
``engine_index`` as a 1-tuple and one element more (the packed pair). The tuple is
there for a decoder that never declared (a client whose decoder was replaced after
``MPClient.__init__``, a tool on the socket): upstream's decoder ignores an array
element beyond its fields, so it would read the step as outputs without rows; with an
array where it wants an int it raises ``ValidationError`` (at ``$[0]``) instead, which
the client's output loop hands to ``get_output``. ``FORMAT_VERSION`` 2 is this form.

Reading. ``ReadingDecoder.decode`` looks at the first byte of the message: upstream's
``EngineCoreOutputs`` is a msgpack array of at most its field count (``omit_defaults``
drops trailing defaults), a packed step has one element more. Upstream's messages go
to the client's own upstream decoder, unchanged; a packed one is decoded as
``PackedEngineCoreOutputs``, rebuilt as upstream's ``EngineCoreOutputs`` (same field
objects; its ``__post_init__`` is a no-op for a decoded timestamp) and every output
gets an array of its own (a copy: a kept output pins its own rows, never the step's).
What differs from upstream's array: upstream's is a view of the ZMQ frame that carried
it (``OWNDATA`` False, ``base`` the array over the frame), this one owns its data
(``OWNDATA`` True, ``base`` None); type, dtype, shape, bytes, ``WRITEABLE`` (True in
both) and C-contiguity are upstream's.
Counts that do not describe the rows raise a ``ValueError`` naming "packed routed
experts", which the output loop hands to ``get_output`` as it does a message it cannot
decode.

Counts (``COUNTERS``, ``prime_r3.counts.Counts``): plain increments by the thread
doing the work; ``live_note`` and ``snapshot()`` read copies, never the live dicts.

Revert. Reverting in EngineCore makes its encoder upstream's for every client (a
declared client reads those with upstream's decoder). Reverting in a client stops new
clients from declaring; a client that declared keeps its reading decoder (its engine
may already have packed steps in flight to it), so it never drops rows.

Why this module is long: both ends of the hop are here (EngineCore's: the record of
declared clients, the packing in the output thread, the answer to the declaration; the
client's: the declaration, the reading decoder), and the reader must give every output
upstream's array and refuse a malformed step by name.
"""

from __future__ import annotations

import itertools
import logging
import operator
import threading
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from prime_r3.counts import Counts
from prime_r3.spec import Anchor, Calling, PatchSpec, Process, Target, WrapperFn

logger = logging.getLogger("vllm.prime_r3")

_CORE = "vllm.v1.engine.core"
_CLIENT = "vllm.v1.engine.core_client"
_SERIAL = "vllm.v1.serial_utils"
_ENGINE = "vllm.v1.engine"

#: The method name of the declaration a client sends to say it reads the packed form.
METHOD = "prime_r3_packed_hop"
#: The packed form this build writes and reads (the declaration's one argument). 2:
#: ``engine_index`` goes as a 1-tuple, so that upstream's decoder refuses a packed step.
FORMAT_VERSION = 2
#: Rows per output from which an array goes as upstream's frame (as 02's rule).
_LARGE_BYTES = 8192


#: This process's record of the hop, EngineCore side (``packed_steps``, and
#: ``upstream_steps`` by reason) and client side (``read_packed``, ``read_upstream``, and
#: each engine's ``declarations``: sent / acknowledged / declined).
COUNTERS = Counts(
    "packed_steps",
    "read_packed",
    "read_upstream",
    tallies=("upstream_steps",),
    records=("declarations",),
)


class _EngineRecord:
    """One EngineCoreProc's declared clients (weakly keyed by the engine)."""

    def __init__(self) -> None:
        self.declared: set[int] = set()
        self.clients: int | None = None  # len(output_paths), once the thread started
        self.ready = False
        self.logged = False

    def update(self) -> None:
        clients = self.clients
        ready = clients is not None and all(i in self.declared for i in range(clients))
        if ready and not self.ready:
            logger.info(
                "prime_r3 packed_hop: all %d client(s) of this EngineCore declared they "
                "read packed steps: routed experts go as one array per step",
                clients,
            )
        if not ready and clients is not None and self.declared and not self.logged:
            self.logged = True
            logger.info(
                "prime_r3 packed_hop: %d of %d client(s) of this EngineCore declared they "
                "read packed steps; every client gets upstream's messages until all have",
                len(self.declared),
                clients,
            )
        self.ready = ready


_records: weakref.WeakKeyDictionary[Any, _EngineRecord] = weakref.WeakKeyDictionary()
_records_lock = threading.Lock()
#: The output thread's engine record (set by the process_output_sockets wrapper).
_thread = threading.local()


def _record(engine: Any) -> _EngineRecord:
    with _records_lock:
        record = _records.get(engine)
        if record is None:
            record = _records[engine] = _EngineRecord()
        return record


def live_note() -> str:
    """What the hop does in this process now (``prime-r3 status``, the log)."""
    c = COUNTERS.snapshot()  # never iterate the live dicts another thread writes
    parts = []
    with _records_lock:
        records = list(_records.values())
    for record in records:
        parts.append(
            f"EngineCore: {len(record.declared)} of "
            f"{'?' if record.clients is None else record.clients} client(s) declared, "
            + ("packing" if record.ready else "sending upstream's messages to all")
        )
    if c["packed_steps"] or c["upstream_steps"]:
        why = ", ".join(f"{k} {v}" for k, v in sorted(c["upstream_steps"].items()))
        parts.append(f"sent {c['packed_steps']} packed step(s), upstream's: {why or 'none'}")
    if c["declarations"]:
        states = sorted(c["declarations"].items())
        parts.append("client: " + ", ".join(f"{k} {v}" for k, v in states))
        parts.append(f"read {c['read_packed']} packed step(s), {c['read_upstream']} upstream's")
    if not parts:
        return (
            "in this process no EngineCore output thread or multiprocess client has "
            "started, so nothing is packed here (worker processes, in-process engines "
            "and LLM's InprocClient never do)"
        )
    return "; ".join(parts)


# -- the packed form ---------------------------------------------------------------------

_types: dict[str, Any] = {}


def _packed_type() -> Any:
    """``PackedEngineCoreOutputs``: upstream's fields, then ``packed_routed_experts``
    (02's field, appended last: one array element more on the wire), with
    ``engine_index`` as a 1-tuple (a msgpack array where upstream's decoder wants an
    int: it raises ``ValidationError`` on a packed step instead of ignoring the extra
    element and handing out outputs without their rows)."""
    found = _types.get("packed")
    if found is not None:
        return found
    import msgspec
    import numpy as np
    from vllm.v1.engine import EngineCoreOutputs

    packed_type = msgspec.defstruct(
        "PackedEngineCoreOutputs",
        [
            ("engine_index", tuple[int], (0,)),  # same position: a subclass keeps it
            ("packed_routed_experts", tuple[np.ndarray, np.ndarray] | None, None),
        ],
        bases=(EngineCoreOutputs,),
        module=__name__,
    )
    # EngineCoreOutputs (an anchor) has engine_index first and at most 14 fields: the
    # packed step is a msgpack fixarray, whose first byte the reader dispatches on.
    fields = EngineCoreOutputs.__struct_fields__
    _types.update(packed=packed_type, head=0x90 + len(fields) + 1, fields=fields)
    return packed_type


_ROUTED = "routed_experts"
_get_routed = operator.attrgetter(_ROUTED)
_get_dtype = operator.attrgetter("dtype")
_get_shape = operator.attrgetter("shape")
#: Runs a C-level ``map`` for its effect, keeping none of its results.
_consume = deque(maxlen=0).extend


def pack(outputs: Any) -> tuple[Any, list[Any], list[Any]] | None:
    """``outputs`` as a ``PackedEngineCoreOutputs``, with the outputs whose arrays it
    took and those arrays (``restore`` puts them back after encoding), or None: nothing
    to pack (02's ``pack_routed_experts`` rule). Each pass over the outputs is one
    C-level map: at a decode step of 1000 outputs a Python loop per pass would cost
    more than the frames it saves."""
    import numpy as np

    outs = outputs.outputs
    arrays = list(map(_get_routed, outs))
    kinds = set(map(type, arrays))
    if kinds == {np.ndarray}:  # every output has an array (a decode step's common case)
        fast = _pack_alike(arrays, np)
        if fast is not None:
            return _packed(outputs, outs, arrays, *fast)
        taken_outs, present = outs, arrays
    elif kinds == {np.ndarray, type(None)}:
        taken_outs = [o for o, a in zip(outs, arrays, strict=True) if a is not None]
        present = list(map(_get_routed, taken_outs))
    else:  # no rows, or something else than plain ndarrays
        return None
    if len(present) < 2 or present[0].dtype.kind in "OV":  # the encoder pickles those
        return None
    try:
        lens = list(map(len, present))  # TypeError for a 0-d array
        first = present[0]
        row_nbytes = first.itemsize * int(np.prod(first.shape[1:]))
        max_rows = -(-_LARGE_BYTES // max(row_nbytes, 1))
        if max(lens) >= max_rows:  # a prefill's rows keep their own frames
            keep = [n < max_rows for n in lens]
            taken_outs = [o for o, k in zip(taken_outs, keep, strict=True) if k]
            present = [a for a, k in zip(present, keep, strict=True) if k]
            lens = [n for n in lens if n < max_rows]
            if len(present) < 2:
                return None
        rows = np.concatenate(present, casting="no")
    except (TypeError, ValueError):  # dtypes, per-token shapes, 0-d arrays
        return None
    if taken_outs is outs:
        counts = np.array(lens, dtype=np.int64)
    else:
        places = {id(o): n for o, n in zip(taken_outs, lens, strict=True)}
        counts = np.array([places.get(id(o), -1) for o in outs], dtype=np.int64)
    return _packed(outputs, taken_outs, present, counts, rows)


def _packed(outputs: Any, taken_outs: list[Any], present: list[Any], counts: Any, rows: Any) -> Any:
    # The packed struct first: whatever raises here leaves every output its array.
    cls = _packed_type()
    values = [getattr(outputs, name) for name in _types["fields"]]
    values[0] = (values[0],)  # engine_index, as the packed form writes it
    packed = cls(*values, (counts, rows))
    n = len(taken_outs)
    _consume(map(setattr, taken_outs, itertools.repeat(_ROUTED, n), itertools.repeat(None, n)))
    return packed, taken_outs, present


def _pack_alike(arrays: list[Any], np: Any) -> tuple[Any, Any] | None:
    """``(counts, rows)`` when the outputs' plain ndarrays (``pack`` checked the class)
    are all of one shape and dtype and under 8 KiB (a decode step's, one row each),
    else None (``pack``'s general way).

    One dtype is checked by identity (numpy hands every array of a builtin dtype the
    same descriptor object; equal but distinct descriptors go the general way), one
    shape by equality, each a C-level ``map`` that stops at the first mismatch. The
    arrays' bytes are joined rather than concatenated by numpy: C-contiguous arrays'
    bytes laid end to end are their concatenation along the first axis, and
    ``bytes.join`` reads each array's buffer without numpy's per-array dispatch. A
    non-contiguous array exports no simple buffer: None then, and numpy concatenates."""
    if len(arrays) < 2:
        return None
    first = arrays[0]
    dtype, shape = first.dtype, first.shape
    if not shape or dtype.kind in "OV" or first.nbytes >= _LARGE_BYTES:
        return None
    n = len(arrays)
    if not all(map(operator.is_, map(_get_dtype, arrays), itertools.repeat(dtype, n))):
        return None
    if not all(map(operator.eq, map(_get_shape, arrays), itertools.repeat(shape, n))):
        return None
    try:
        data = b"".join(arrays)
    except (BufferError, TypeError, ValueError):
        return None
    rows = np.frombuffer(data, dtype).reshape(len(arrays) * shape[0], *shape[1:])
    return np.full(len(arrays), shape[0], dtype=np.int64), rows


def restore(taken_outs: list[Any], arrays: list[Any]) -> None:
    """Put back the arrays ``pack`` took off their outputs."""
    _consume(map(setattr, taken_outs, itertools.repeat(_ROUTED, len(arrays)), arrays))


def unpack(got: Any) -> Any:
    """Upstream's ``EngineCoreOutputs`` for a decoded ``PackedEngineCoreOutputs``, every
    output with an array of its own (02's ``unpack_routed_experts``)."""
    import numpy as np
    from vllm.v1.engine import EngineCoreOutputs

    packed = got.packed_routed_experts
    values = [getattr(got, name) for name in _types["fields"]]
    (values[0],) = values[0]  # engine_index, a 1-tuple in the packed form
    result = EngineCoreOutputs(*values)
    if packed is None:  # ``pack`` always sends the pair: a foreign sender's step
        raise ValueError("packed routed experts missing from a packed step")
    counts, rows = packed
    outputs = result.outputs
    if counts.ndim != 1 or counts.dtype.kind not in "iu" or not rows.ndim:
        raise ValueError(
            "packed routed experts need 1-d integer counts and rows, got "
            f"counts {counts.dtype} {counts.shape} and rows {rows.shape}"
        )
    if len(counts) != len(outputs):
        raise ValueError(
            f"packed routed experts cover {len(counts)} outputs, the step has {len(outputs)}"
        )
    if len(rows) == len(outputs) and bool((counts == 1).all()):
        # A decode step, one row each: iterating the array makes the views.
        views = rows.reshape(len(rows), 1, *rows.shape[1:])
        copies = map(np.ndarray.copy, views)  # each output its own array
        _consume(map(setattr, outputs, itertools.repeat(_ROUTED, len(rows)), copies))
        return result
    if len(counts) and int(counts.min()) < -1:
        raise ValueError(
            f"packed routed experts have a count of {int(counts.min())} "
            "(rows per output, -1 for none)"
        )
    ends = np.cumsum(np.maximum(counts, 0)).tolist()
    total = ends[-1] if ends else 0
    if total != len(rows):
        raise ValueError(
            f"packed routed experts hold {len(rows)} rows, their counts sum to {total}"
        )
    for output, count, end in zip(outputs, counts.tolist(), ends, strict=True):
        if count >= 0:
            output.routed_experts = rows[end - count : end].copy()
    return result


def reading_decoder(upstream: Any) -> Any:
    """A decoder for a client's output loop that reads upstream's messages with
    ``upstream`` (the client's own decoder) and packed steps as upstream's type."""
    from vllm.v1.serial_utils import MsgpackDecoder

    cls = _types.get("reader")
    if cls is None:

        class ReadingDecoder(MsgpackDecoder):  # type: ignore[misc]
            """Reads upstream's ``EngineCoreOutputs`` and the packed step."""

            def __init__(self, upstream: Any) -> None:
                super().__init__(_packed_type())
                self.upstream = upstream
                self.head = _types["head"]

            def decode(self, bufs: Any) -> Any:
                first = bufs if isinstance(bufs, (bytes, bytearray, memoryview)) else bufs[0]
                view = memoryview(first)
                if not view.nbytes or view.cast("B")[0] != self.head:
                    COUNTERS.read_upstream += 1
                    return self.upstream.decode(bufs)
                COUNTERS.read_packed += 1
                return unpack(super().decode(bufs))

        cls = _types["reader"] = ReadingDecoder
    return cls(upstream)


# -- EngineCore ----------------------------------------------------------------------------


def _output_thread(params: Mapping[str, Any]) -> WrapperFn:
    def process_output_sockets(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        # Called on the engine (vLLM's thread target is the bound method), or through
        # the class with the engine first.
        engine, rest = (args[0], args[1:]) if instance is None else (instance, args)
        output_paths = rest[0] if rest else kwargs["output_paths"]
        record = _record(engine)
        with _records_lock:
            record.clients = len(output_paths)
            record.update()
        _thread.record = record
        try:
            return wrapped(*args, **kwargs)
        finally:
            _thread.record = None

    return process_output_sockets


def _encode_into(params: Mapping[str, Any]) -> Callable[[Callable[..., Any]], Any]:
    from vllm.v1.engine import EngineCoreOutputs

    counters = COUNTERS
    local = _thread

    def make(upstream: Callable[..., Any]) -> Callable[..., Any]:
        def encode_into(self, obj, buf):  # noqa: ANN001, ANN202 - upstream's signature
            record = getattr(local, "record", None)
            if record is None or type(obj) is not EngineCoreOutputs:
                return upstream(self, obj, buf)
            if not record.ready:
                counters.add("upstream_steps", "undeclared")
                return upstream(self, obj, buf)
            packed = pack(obj)
            if packed is None:
                counters.add("upstream_steps", "as_is")
                return upstream(self, obj, buf)
            message, taken_outs, arrays = packed
            try:
                buffers = upstream(self, message, buf)
            finally:
                restore(taken_outs, arrays)
            counters.packed_steps += 1
            return buffers

        return encode_into

    return make


def _is_declaration(request: Any) -> bool:
    """Whether a request's payload is a declaration: ``(client_index, call_id, METHOD,
    (FORMAT_VERSION,))``, decoded by the input thread's generic decoder (a list)."""
    return type(request) in (list, tuple) and len(request) == 4 and request[2] == METHOD


def _receive_declaration(params: Mapping[str, Any]) -> Callable[[Callable[..., Any]], Any]:
    from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequestType, UtilityOutput

    wakeup = EngineCoreRequestType.WAKEUP
    utility = EngineCoreRequestType.UTILITY

    def declared(engine: Any, client_idx: int, args: Any) -> int:
        version = args[0] if args else None
        if version != FORMAT_VERSION:
            raise ValueError(
                f"prime_r3 packed_hop: the client reads format {version!r}, this "
                f"EngineCore writes {FORMAT_VERSION}; it sends upstream's messages"
            )
        record = _record(engine)
        with _records_lock:
            record.declared.add(int(client_idx))
            record.update()
        return FORMAT_VERSION

    def make(upstream: Callable[..., Any]) -> Callable[..., Any]:
        def _handle_client_request(self, request_type, request):  # noqa: ANN001, ANN202
            # The declaration comes as WAKEUP (what upstream's own shutdown signal puts
            # on the queue with None); as a utility call from a client of an earlier
            # build of this patch. Anything else is upstream's to handle.
            if request_type is wakeup:
                if not _is_declaration(request):
                    return upstream(self, request_type, request)
            elif request_type is not utility or request[2] != METHOD:
                return upstream(self, request_type, request)
            client_idx, call_id, method_name, args = request
            if self._reject_utility_in_shutdown(client_idx, call_id, method_name):
                return None
            output = UtilityOutput(call_id)
            queue = self.output_queue
            self._invoke_utility_method(
                method_name,
                lambda: declared(self, client_idx, args),
                output,
                lambda out: queue.put_nowait((client_idx, EngineCoreOutputs(utility_output=out))),
            )
            return None

        return _handle_client_request

    return make


# -- client --------------------------------------------------------------------------------


def _install_reader(params: Mapping[str, Any]) -> WrapperFn:
    def mp_client_init(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        wrapped(*args, **kwargs)
        # Read by the output loop (SyncMPClient's thread, AsyncMPClient's task) when
        # it starts, after this returns.
        instance.decoder = reading_decoder(instance.decoder)

    return mp_client_init


def _declare(client: Any, client_index: int) -> None:
    """Send each engine of ``client`` the declaration, as ``call_utility`` sends a call
    but as a WAKEUP request, which an engine without this patch drops silently."""
    import zmq
    from vllm.v1.engine import EngineCoreRequestType

    if type(getattr(client, "decoder", None)) is not _types.get("reader"):
        return  # MPClient.__init__ ran without our reader (e.g. reverted since)
    socket = zmq.Socket.shadow(client.input_socket)
    for engine in client.core_engines:
        name = f"engine {int.from_bytes(engine, 'little')}"
        call_id = uuid.uuid1().int >> 64
        future: Future[Any] = Future()
        client.utility_results[call_id] = future

        def done(future: Future[Any], name: str = name) -> None:
            error = future.exception()
            if error is None:
                COUNTERS.declarations[name] = "acknowledged"
            else:
                COUNTERS.declarations[name] = f"declined ({error})"
                logger.info(
                    "prime_r3 packed_hop: %s does not send packed steps (%s): it sends "
                    "upstream's messages, which this client reads as they are",
                    name,
                    error,
                )

        future.add_done_callback(done)
        COUNTERS.declarations[name] = "sent"
        request = (client_index, call_id, METHOD, (FORMAT_VERSION,))
        message = (engine, EngineCoreRequestType.WAKEUP.value, *client.encoder.encode(request))
        socket.send_multipart(message, copy=False)


def _declare_sync(params: Mapping[str, Any]) -> WrapperFn:
    def sync_client_init(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        wrapped(*args, **kwargs)
        _declare(instance, 0)  # SyncMPClient's utility calls and outputs use index 0

    return sync_client_init


def _declare_async(params: Mapping[str, Any]) -> WrapperFn:
    def async_client_init(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        wrapped(*args, **kwargs)
        _declare(instance, instance.client_index)

    return async_client_init


# Verified source fingerprints (scripts/fingerprint.py) for vLLM 0.31.0, 0.32.0, 0.33.0.
_OUTPUT_SOCKETS = frozenset({"a69953ded025a959"})
_ENCODE_INTO = frozenset({"11926ecf81af7e0f"})
_HANDLE_CLIENT_REQUEST = frozenset({"199cda971217582a", "b17e69a65db9a14b"})
_MP_CLIENT_INIT = frozenset({"98c2a573712d4712", "225b1e6926d7fd6a", "2cae2de6aef32192"})
_SYNC_CLIENT_INIT = frozenset({"6d510860e94827d2"})
_ASYNC_CLIENT_INIT = frozenset({"4cf2df710885934f"})
_ENGINE_CORE_OUTPUTS = frozenset({"15a4eb06a8704c90", "aaece7e29d769f9f"})
_ENGINE_CORE_OUTPUT = frozenset({"b5c8ed51350c497c", "e4a7621f240a911b"})

SPEC = PatchSpec(
    name="packed_hop",
    summary="EngineCore sends a step's routed experts to a client that declared it reads "
    "them packed as one array, not one frame per request",
    vllm_range=">=0.31,<0.34",
    # Packed in EngineCore's output thread; declared and read by the client (the API
    # server, or LLM's SyncMPClient process).
    processes=frozenset({Process.API_SERVER, Process.ENGINE_CORE}),
    targets=(
        # The output thread: its engine's record (clients, declarations) for encode_into.
        Target(_CORE, "EngineCoreProc.process_output_sockets", _OUTPUT_SOCKETS, _output_thread),
        Target(
            _SERIAL,
            "MsgpackEncoder.encode_into",
            _ENCODE_INTO,
            _encode_into,
            calling=Calling.PLAIN,  # every message of every encoder: no wrapt binding
        ),
        Target(
            _CORE,
            "EngineCoreProc._handle_client_request",
            _HANDLE_CLIENT_REQUEST,
            _receive_declaration,
            calling=Calling.PLAIN,  # every client request
        ),
        Target(_CLIENT, "MPClient.__init__", _MP_CLIENT_INIT, _install_reader),
        Target(_CLIENT, "SyncMPClient.__init__", _SYNC_CLIENT_INIT, _declare_sync),
        Target(_CLIENT, "AsyncMPClient.__init__", _ASYNC_CLIENT_INIT, _declare_async),
    ),
    anchors=(
        # The packed type appends one field to these fields; outputs carry routed_experts.
        Anchor(_ENGINE, "EngineCoreOutputs", _ENGINE_CORE_OUTPUTS),
        Anchor(_ENGINE, "EngineCoreOutput", _ENGINE_CORE_OUTPUT),
        Anchor(_ENGINE, "UtilityOutput", frozenset({"3c30d608f9313946"})),
        # ndarrays as (dtype, shape, inline bytes or frame index), decoded by decode.
        Anchor(_SERIAL, "MsgpackEncoder._encode_ndarray", frozenset({"7e1fc947faa6600c"})),
        Anchor(_SERIAL, "MsgpackDecoder.decode", frozenset({"7c2c28a580e20a05"})),
        # The declaration's reply, built as upstream builds a utility call's.
        Anchor(_CORE, "EngineCoreProc._invoke_utility_method", frozenset({"270e7fd31dd5a4d1"})),
        Anchor(
            _CORE,
            "EngineCoreProc._reject_utility_in_shutdown",
            frozenset({"3d11922c11330085"}),
        ),
        # The client's output loops read self.decoder when they start and hand utility
        # replies to _process_utility_output (a concurrent Future's set_result).
        Anchor(_CLIENT, "AsyncMPClient._ensure_output_queue_task", frozenset({"16518c3a7c906b5b"})),
        Anchor(_CLIENT, "_process_utility_output", frozenset({"2565205ba75accf8"})),
        # The declaration is sent as call_utility sends one.
        Anchor(_CLIENT, "SyncMPClient._send_input", frozenset({"6e5ff1088c82ccfc"})),
    ),
    live_note=live_note,
    # Upstream form: 02's EngineCoreOutputs.pack_routed_experts / unpack_routed_experts
    # (both ends patched, so no handshake).
    diff_in="packed_outputs",
)
