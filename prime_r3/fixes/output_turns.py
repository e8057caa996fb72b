"""output_turns: the API server's output path gives the event loop a turn per slice of backlog.

What it replaces. Two places of ``vllm.v1.engine.core_client`` that work off a backlog of
engine steps in one turn of the API server's event loop:

* ``AsyncMPClient.get_output_async``, which ``AsyncLLM``'s output handler
  (``_run_output_handler``'s ``output_handler`` task) awaits once per engine step; the DP
  clients (``DPAsyncMPClient``, ``DPLBAsyncMPClient``) inherit it. ``await
  outputs_queue.get()`` (an ``asyncio.Queue``, made in ``AsyncMPClient.__init__``)
  returns at once while a step is queued, and the handler's ``process_outputs`` of at
  most ``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE`` outputs (128 by default) never yields: a
  handler k steps behind works all k off in one turn (it may suspend in between only to
  send aborts for stop strings).
* ``AsyncMPClient._ensure_output_queue_task``, which makes the client's socket task
  (``process_outputs_socket``: receive, decode, queue, per step). pyzmq's
  ``recv_multipart`` on a socket with a message already waiting returns a done future,
  so awaiting it does not suspend: a socket task behind the engine receives and decodes
  every waiting step in one turn.

Meanwhile no other task, timer or connection runs (``/health``, the serving coroutines
sending responses, new requests). With R3 a step costs more (each output's rows, and a
request's first output carries its prompt's), so backlogs are longer.

The fast case, R3 on in this client (``vllm_config.aux_output_config.
enable_return_routed_experts``; a config without it counts as R3 off, so no wrapper
raises where upstream's call would not). Each of the two tasks works off a backlog for a
*slice* of wall time (``PRIME_R3_OUTPUT_TURNS_SLICE_MS``, default 100 ms; 0: a turn before
every waiting step) since it last waited or turned, then gives the loop one turn. Within
a slice a task runs as upstream's does, so a stream's collector still merges the steps of
a slice into one chunk, as upstream's merges a whole backlog (a turn before every step
made streamed responses many more, smaller chunks, and the API server fell further
behind):

* the handler asks for a step and one is already queued: within the slice, upstream's
  ``get_output_async`` (``within``); past it, one ``await asyncio.sleep(0)`` (a turn of
  the loop), then upstream's call (``turns``). Only the handler takes from the queue, so
  the step is still there and upstream's call returns it at once. The queue empty or not
  made yet: upstream's call, which waits for the next step and so gives the loop its turn
  anyway (``waited``); a slice starts at the next step found queued. The slice's start
  is kept per queue in a weak mapping (nothing is written to the client; ``revert``
  clears it);
* upstream makes the socket task: just before, the client's output socket gets its own
  ``recv_multipart`` (an attribute of that socket object; the closure looks the method
  up on it for every receive). While the previous receive's future was pending (or
  there was none), it returns the future of the socket class's method, called with the
  same arguments, as is, and a slice starts. Once a receive found its message already
  waiting (its future was done), the next call within the slice does the same
  (``socket_within``); past the slice it returns a task (a Future too: awaitable,
  cancellable, with done callbacks) that gives the loop a turn (``asyncio.sleep(0)``;
  with the task's own start and the caller's resumption, three passes of the loop where
  the diff's inline ``sleep(0)`` takes one), starts a slice, then receives the same way
  and returns that result (``socket_turns``). It holds the socket by a weak reference
  only. A socket whose own ``__dict__`` already has a ``recv_multipart`` (someone
  else's), that has no ``__dict__``, whose class has no ``recv_multipart`` method, or
  that cannot be weakly referenced or hashed, is left as found (``socket_foreign``); if
  upstream's call raises (e.g. called with no running loop), the attribute is removed
  again, so a later call starts afresh.

Otherwise upstream's calls unchanged: R3 off (the handler's calls count ``r3_off``; the
socket gets no attribute), or a socket task already made (a client made before the
patch was applied keeps upstream's socket task). ``revert`` removes the attribute from
every socket that still has this patch's function (the socket task's next receive is the
class's method again). ``live_note`` says in ``status`` and the log which of these this
process has seen.

Why the result equals upstream's. Neither wrapper takes, reorders or catches anything:
every message is received by the socket class's own method with the caller's arguments
(one receive outstanding at a time: the socket task is the socket's one reader), every
step reaches the queue and the handler in the same order as the same object, and
an error (``EngineDeadError``; a closed socket, which vLLM's shutdown closes and cancels
the task in the same callback) raises where upstream's does. A turn comes before a
receive or a ``get``, so a cancellation during it leaves the message in the socket or
the step in the queue, as a cancellation of upstream's waiting call does; one that lands
after the turn's task received but before the socket task resumed drops that message,
as upstream's does for a message that arrived while it waited (only the client's
shutdown, which closes the socket in the same callback, and the loop's own teardown
cancel these tasks). What changes is when they run: once a slice of
working off a backlog is used up, the tasks and callbacks that were ready run once. A
streamed response behind the engine may then get a backlog's tokens in a few more chunks
than upstream's (one per slice at most; its collector merges the steps that arrived
before it ran); the content is the same. An engine's death queued behind a
backlog reaches the client a few turns later than upstream's would; a request added
meanwhile gets ``EngineDeadError`` from the handler's propagation instead of from
``add_request``'s check.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from prime_r3.config import parse_float_in_range
from prime_r3.counts import Counts
from prime_r3.spec import Anchor, Param, PatchSpec, Process, Target, WrapperFn

_CLIENT = "vllm.v1.engine.core_client"
_ASYNC_LLM = "vllm.v1.engine.async_llm"

COUNTERS = Counts(
    "turns", "within", "waited", "r3_off", "socket_turns", "socket_within", "socket_foreign"
)

#: Default of ``PRIME_R3_OUTPUT_TURNS_SLICE_MS``: the work a task does off a backlog
#: before it gives the loop a turn.
DEFAULT_SLICE_MS = 100.0
MAX_SLICE_MS = 1000.0

#: The clock the slices are measured with (a module attribute, so tests can set it).
_clock = time.monotonic


def live_note() -> str:
    """What the patch has done in this process (``prime-r3 status``, the log)."""
    c = COUNTERS.snapshot()
    sockets = f"socket turns {c['socket_turns']} (receives within a slice {c['socket_within']})"
    if c["socket_foreign"]:
        sockets += f", sockets left as found {c['socket_foreign']}"
    if not (c["turns"] or c["within"] or c["waited"] or c["r3_off"]):
        return f"no output handler has asked for a step in this process yet; {sockets}"
    if c["r3_off"] and not (c["turns"] or c["within"] or c["waited"]):
        return f"R3 is off in this client: upstream's calls ({c['r3_off']})"
    return (
        f"turns given {c['turns']}, steps taken within a slice {c['within']}, calls that "
        f"waited {c['waited']}, R3 off {c['r3_off']}; " + sockets
    )


def _output_task(params: Mapping[str, Any]) -> WrapperFn:
    slice_s = params["slice_ms"] / 1000

    def socket_turns(wrapped: Any, client: Any, args: Any, kwargs: Any) -> Any:
        return _socket_turns(wrapped, client, args, kwargs, slice_s)

    return socket_turns


#: Each output socket given a ``recv_multipart`` -> that function (``revert`` removes it).
_TURNING: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _socket_turns(
    wrapped: Any, client: Any, args: Any, kwargs: Any, slice_s: float = DEFAULT_SLICE_MS / 1000
) -> Any:
    """The wrapper of ``_ensure_output_queue_task`` (wrapt's ``wrapped, instance, args,
    kwargs``): with R3 on, before upstream makes the socket task, the client's output
    socket gets ``_turning_recv``; then upstream's call, whatever it returns or raises."""
    resources = client.resources
    sock = resources.output_socket
    if resources.output_queue_task is not None or sock is None or not _r3_on(client):
        return wrapped(*args, **kwargs)  # no task to make, or R3 off: upstream's call
    own = getattr(sock, "__dict__", None)
    recv = None
    if (
        own is not None
        and "recv_multipart" not in own
        and callable(getattr(type(sock), "recv_multipart", None))
    ):
        with contextlib.suppress(TypeError):  # not weakly referenceable or not hashable
            recv = _turning_recv(sock, slice_s)
    if recv is None:  # not ours to wrap: upstream's socket task, the socket as found
        COUNTERS.socket_foreign += 1
        return wrapped(*args, **kwargs)
    own["recv_multipart"] = recv
    try:
        return wrapped(*args, **kwargs)
    except BaseException:  # no task made (e.g. called with no running loop)
        if own.get("recv_multipart") is recv:
            del own["recv_multipart"]
        raise


def _turning_recv(sock: Any, slice_s: float) -> Callable[..., Any]:
    """``sock.recv_multipart`` for the socket task: the future of the socket class's
    method (looked up on the socket's class at each call) as is, or, once the task has
    used up its slice receiving messages that were already waiting, a task that gives the
    loop one turn, then receives."""
    ref, behind, since = weakref.ref(sock), False, 0.0

    def receive(*args: Any, **kwargs: Any) -> Any:
        nonlocal behind
        socket = ref()  # alive: the socket task's closure holds it
        future = type(socket).recv_multipart(socket, *args, **kwargs)
        behind = isinstance(future, asyncio.Future) and future.done()
        return future

    async def after_a_turn(*args: Any, **kwargs: Any) -> Any:
        nonlocal since
        await asyncio.sleep(0)
        since = _clock()
        return await receive(*args, **kwargs)

    def recv_multipart(*args: Any, **kwargs: Any) -> Any:
        nonlocal since
        if not behind:  # the previous receive waited (or none yet): a slice starts
            since = _clock()
            return receive(*args, **kwargs)
        if _clock() - since < slice_s:
            COUNTERS.socket_within += 1
            return receive(*args, **kwargs)
        COUNTERS.socket_turns += 1
        return asyncio.ensure_future(after_a_turn(*args, **kwargs))

    _TURNING[sock] = recv_multipart
    return recv_multipart


def _forget_sockets() -> None:
    """``revert``: every socket's own ``recv_multipart`` removed (its class's again), and
    every handler's slice forgotten."""
    for sock, ours in list(_TURNING.items()):
        own = vars(sock)
        if own.get("recv_multipart") is ours:
            del own["recv_multipart"]
    _TURNING.clear()
    _SINCE.clear()


def _r3_on(client: Any) -> bool:
    """The client's R3 flag; a config without it counts as R3 off."""
    aux = getattr(getattr(client, "vllm_config", None), "aux_output_config", None)
    return bool(getattr(aux, "enable_return_routed_experts", False))


def _get_output_async(params: Mapping[str, Any]) -> WrapperFn:
    slice_s = params["slice_ms"] / 1000

    async def turn_then(wrapped: Any, client: Any, args: Any, kwargs: Any) -> Any:
        return await _turn_then(wrapped, client, args, kwargs, slice_s)

    return turn_then


#: Each client's outputs queue -> when its handler began working off the current backlog
#: (the first step it found queued since it last waited, or the end of its last turn).
_SINCE: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()


async def _turn_then(
    wrapped: Any, client: Any, args: Any, kwargs: Any, slice_s: float = DEFAULT_SLICE_MS / 1000
) -> Any:
    """The wrapper (wrapt's ``wrapped, instance, args, kwargs``), R3 on: a step queued
    and the handler's slice used up: a turn of the loop first; then upstream's call."""
    if not _r3_on(client):
        COUNTERS.r3_off += 1
        return await wrapped(*args, **kwargs)
    queued = client.outputs_queue
    if queued is None or queued.empty():  # upstream's call waits: the loop turns anyway
        COUNTERS.waited += 1
        if queued is not None:
            _SINCE.pop(queued, None)  # the next step found queued starts a slice
        return await wrapped(*args, **kwargs)
    now = _clock()
    if now - _SINCE.setdefault(queued, now) < slice_s:
        COUNTERS.within += 1
        return await wrapped(*args, **kwargs)
    COUNTERS.turns += 1
    await asyncio.sleep(0)
    _SINCE[queued] = _clock()
    return await wrapped(*args, **kwargs)


# Verified source fingerprints (scripts/fingerprint.py) for vLLM 0.31.0, 0.32.0, 0.33.0.
_GET_OUTPUT = frozenset({"f64b1b2c19402fc5"})
_OUTPUT_TASK = frozenset({"16518c3a7c906b5b"})
_CLIENT_INIT = frozenset({"4cf2df710885934f"})
_AUX_CONFIG = frozenset({"7938998b85f0cc7c"})
_OUTPUT_HANDLER = frozenset({"af9f4cc5aa44a56f", "47a49110a9a7fbcd", "add96d65cccf87eb"})

SPEC = PatchSpec(
    name="output_turns",
    summary="API server: socket task and output handler yield to the loop per slice of backlog",
    vllm_range=">=0.31,<0.34",
    processes=frozenset({Process.API_SERVER}),
    targets=(
        Target(_CLIENT, "AsyncMPClient.get_output_async", _GET_OUTPUT, _get_output_async),
        Target(_CLIENT, "AsyncMPClient._ensure_output_queue_task", _OUTPUT_TASK, _output_task),
    ),
    anchors=(
        # outputs_queue (an asyncio.Queue, made in __init__, which also makes the socket
        # task when a loop is running), its one consumer (the handler's loop: a call per
        # step, process_outputs without a yield), and the R3 flag (the config is a
        # pydantic dataclass; the method that hashes the flag names it).
        Anchor(_CLIENT, "AsyncMPClient.__init__", _CLIENT_INIT),
        Anchor(_ASYNC_LLM, "AsyncLLM._run_output_handler", _OUTPUT_HANDLER),
        Anchor("vllm.config.aux_output", "AuxOutputConfig.compute_hash", _AUX_CONFIG),
    ),
    params=(
        Param(
            "slice_ms",
            DEFAULT_SLICE_MS,
            parse_float_in_range(0.0, MAX_SLICE_MS),
            "work the socket task and the output handler each do off a backlog of steps "
            "before giving the event loop a turn (0: a turn before every waiting step)",
            f"a number of milliseconds in 0..{MAX_SLICE_MS:g}, e.g. 100",
        ),
    ),
    notes="Same steps, same order; only when the socket task and the handler run changes.",
    on_revert=_forget_sockets,
    live_note=live_note,
)
