"""The EngineCore -> client hop with real clients, for the overlay's packed_hop.

    python -m tests.hop_scenarios OUT.pickle CASE[,CASE...]   # PRIME_R3* set by the caller

Builds vLLM's real ``SyncMPClient`` and ``AsyncMPClient`` (their real constructors,
``MPClient.__init__`` included, in its externally-managed-engine mode: it binds the
input ROUTER and output PULL sockets at the addresses it is given, and waits for each
engine's ready message) and runs, for each, vLLM's real ``EngineCoreProc``
``process_output_sockets`` in a thread, and the real ``_handle_client_request`` for what
the client sends on its input socket (the handshake's declaration). The engine object
holds only what those two read. Every scenario of ``tests/engine_outputs_scenarios.py``
is sent through the output thread; the client's real output loop (thread or asyncio
task) decodes it and ``get_output`` / ``get_output_async`` return it.

CASE: ``both`` (client and engine in this process, the overlay as the environment
says), ``mixed`` (two client sockets on one engine, only one client declares: a
second, undeclared client connected to the same engine), ``engine_only`` (the client
is built with the overlay reverted: a client without it), ``client_only`` (a client with
the overlay, an EngineCore without it: a mixed install) and ``real_inputs`` (both with
it), each with vLLM's real EngineCore input thread (see ``run_real_inputs``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import queue
import sys
import tempfile
import threading
import time
from typing import Any

import zmq

from tests.engine_outputs_scenarios import _describe, _pinned, malformed_pairs, scenarios

_IDENTITY = (0).to_bytes(2, "little")


class _Engine:
    """What ``process_output_sockets`` and ``_handle_client_request`` read of their
    ``EngineCoreProc`` (a plain class: the overlay keys its record weakly on it)."""

    def __init__(self) -> None:
        from vllm.v1.engine.core import EngineCoreProc

        self.output_queue: queue.Queue[Any] = queue.Queue()
        self._send_msg_tracking_payload = EngineCoreProc._send_msg_tracking_payload
        self._invoke_utility_method = EngineCoreProc._invoke_utility_method
        shutdown = getattr(sys.modules["vllm.v1.engine.core"], "EngineShutdownState", None)
        self.shutdown_state = None if shutdown is None else shutdown.RUNNING

    def _reject_utility_in_shutdown(self, *args: Any) -> bool:
        from vllm.v1.engine.core import EngineCoreProc

        return EngineCoreProc._reject_utility_in_shutdown(self, *args)


def _config() -> Any:
    from types import SimpleNamespace

    parallel = SimpleNamespace(
        enable_elastic_ep=False,
        enable_fault_tolerance=False,
        data_parallel_size=1,
        data_parallel_index=0,
        data_parallel_rank=0,
        data_parallel_size_local=1,
        data_parallel_rank_local=None,
        local_engines_only=False,
    )
    cache = SimpleNamespace(effective_attention_block_size=None)
    return SimpleNamespace(parallel_config=parallel, cache_config=cache, model_config=None)


def _engine_inputs(paths: list[str], engine: _Engine, stop: threading.Event) -> threading.Thread:
    """The engine's input side: a DEALER per client (as ``process_input_sockets``), the
    ready message, then each request handed to the real ``_handle_client_request``
    (as EngineCore's busy loop does)."""
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.serial_utils import MsgpackDecoder

    ctx = zmq.Context()
    sockets = []
    for path in paths:
        socket = ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, _IDENTITY)
        socket.connect(path)
        socket.send(b"")  # an empty ready payload: nothing to sync back
        sockets.append(socket)
    decoder = MsgpackDecoder()

    def run() -> None:
        poller = zmq.Poller()
        for socket in sockets:
            poller.register(socket, zmq.POLLIN)
        while not stop.is_set():
            for socket, _ in poller.poll(50):
                type_frame, *data = socket.recv_multipart(copy=False)
                kind = EngineCoreRequestType(bytes(type_frame.buffer))
                EngineCoreProc._handle_client_request(engine, kind, decoder.decode(data))
        for socket in sockets:
            socket.close(linger=0)
        ctx.term()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _wait_declared(client: Any, timeout: float = 30) -> list[str]:
    """The state of each declaration this client sent (once every reply arrived)."""
    from prime_r3.fixes import packed_hop

    deadline = time.monotonic() + timeout
    while "sent" in packed_hop.COUNTERS.declarations.values():
        if time.monotonic() > deadline:
            raise RuntimeError("no reply to the declaration")
        time.sleep(0.005)
    return sorted(packed_hop.COUNTERS.declarations.values())


def _send_all(engine: _Engine, get: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackEncoder

    wire: list[list[bytes]] = []
    encode_into = MsgpackEncoder.encode_into

    def recording(self: Any, obj: Any, buf: bytearray) -> Any:
        buffers = encode_into(self, obj, buf)
        wire.append([bytes(b) for b in buffers])
        return buffers

    MsgpackEncoder.encode_into = recording  # type: ignore[method-assign]
    result: dict[str, Any] = {}
    try:
        for name, specs in scenarios():
            if name in skip:
                continue
            sent = EngineCoreOutputs(
                outputs=[EngineCoreOutput(**spec) for spec in specs], timestamp=1.0
            )
            wire.clear()
            engine.output_queue.put_nowait((0, sent))
            got = get()
            result[name] = {
                "outputs": _describe(got),
                "type": type(got).__qualname__,
                "output_types": sorted({type(o).__qualname__ for o in got.outputs}),
                "wire": list(wire),
                "pinned": [_pinned(output.routed_experts) for output in got.outputs],
                "sent_left": _describe(sent),  # the step object after the output thread
            }
    finally:
        MsgpackEncoder.encode_into = encode_into  # type: ignore[method-assign]
    return result


def _start_output_thread(engine: _Engine, paths: list[str]) -> threading.Thread:
    from vllm.v1.engine.core import EngineCoreProc

    thread = threading.Thread(
        target=EngineCoreProc.process_output_sockets, args=(engine, paths, None, 0), daemon=True
    )
    thread.start()
    return thread


def _stop(engine: _Engine, threads: list[threading.Thread], stop: threading.Event) -> None:
    from vllm.v1.engine.core import EngineCoreProc

    engine.output_queue.put_nowait(EngineCoreProc.ENGINE_CORE_DEAD)
    stop.set()
    for thread in threads:
        thread.join(timeout=30)


def _addresses(n: int) -> list[tuple[str, str]]:
    root = tempfile.mkdtemp()
    return [(f"ipc://{root}/in{i}", f"ipc://{root}/out{i}") for i in range(n)]


def _sync_client(addresses: dict[str, str]) -> Any:
    """vLLM's SyncMPClient, built by its own ``__init__`` and ``MPClient.__init__``; the
    latter in its externally-managed mode (SyncMPClient always launches engines, so a
    class between the two in the MRO adds the addresses to its ``super().__init__``)."""
    from vllm.v1.engine import core_client

    class Addresses(core_client.MPClient):
        def __init__(self, **kwargs: Any) -> None:
            core_client.MPClient.__init__(self, client_addresses=addresses, **kwargs)

    class Client(core_client.SyncMPClient, Addresses):
        pass

    return Client(_config(), None, False)


def _sync_getter(client: Any, output_thread: threading.Thread) -> Any:
    def get() -> Any:  # the real get_output, once the output thread has sent something
        deadline = time.monotonic() + 30
        while client.outputs_queue.empty():
            if not output_thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the EngineCore output thread sent nothing (see stderr)")
            time.sleep(0.001)
        return client.get_output()

    return get


class _Records(logging.Handler):
    """Every log record of vLLM's loggers (the overlay's included) while installed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> _Records:
        root = logging.getLogger("vllm")
        self.level = root.level
        root.addHandler(self)
        root.setLevel(logging.INFO)  # the test runs vLLM at ERROR: see INFO and up here
        return self

    def __exit__(self, *exc: object) -> None:
        root = logging.getLogger("vllm")
        root.removeHandler(self)
        root.setLevel(self.level)

    def described(self) -> list[tuple[str, str, str, str | None]]:
        return [
            (
                r.name,
                r.levelname,
                r.getMessage(),
                None if not r.exc_info or r.exc_info[0] is None else r.exc_info[0].__name__,
            )
            for r in self.records
        ]


def _real_engine() -> Any:
    """A real ``EngineCoreProc`` without its ``__init__``: what its input thread
    (``process_input_sockets``), its request handling and its output thread read."""
    import msgspec
    from vllm.v1.engine.core import EngineCoreProc, EngineShutdownState

    engine = EngineCoreProc.__new__(EngineCoreProc)
    engine.input_queue = queue.Queue()
    engine.aborts_queue = queue.Queue()
    engine.output_queue = queue.Queue()
    engine.tensor_ipc_receiver = None
    engine.shutdown_state = EngineShutdownState.RUNNING
    # An empty ready payload (as _engine_inputs sends): nothing to sync back.
    engine._make_ready_response = lambda: msgspec.Raw(b"")
    # A utility method the client calls after declaring (answered in order after it).
    engine.ping = lambda: "pong"
    return engine


def run_real_inputs(engine_overlay: bool) -> dict[str, Any]:
    """A client with the overlay and a real ``EngineCoreProc`` object, with the overlay
    (``engine_overlay``) or without it (a mixed install).

    vLLM's real input thread (``process_input_sockets``) reads the client's socket, and
    what it queues is handed to the engine's ``_handle_client_request`` as the busy loop
    does; then its output thread. The client (vLLM's ``SyncMPClient``) is built with
    ``packed_hop`` applied, so it declares; without ``engine_overlay`` the overlay is
    reverted before the engine handles anything or starts its output thread, so every
    engine-side object is upstream's (the client keeps the reading decoder its
    ``__init__`` installed). Every log record of vLLM's loggers in this process is kept:
    the engine's and the client's."""
    from vllm.v1.engine.core import EngineCoreProc

    from prime_r3 import layer
    from prime_r3.fixes import packed_hop

    ((in0, out0),) = _addresses(1)
    engine, stop = _real_engine(), threading.Event()
    inputs = threading.Thread(
        target=EngineCoreProc.process_input_sockets,
        args=(engine, [in0], None, _IDENTITY, threading.Event()),
        daemon=True,  # upstream's input thread never returns (nor does it in vLLM)
    )

    def busy_loop() -> None:  # _process_input_queue's handling, without the stepping
        while not stop.is_set():
            try:
                request = engine.input_queue.get(timeout=0.05)
            except queue.Empty:
                continue
            engine._handle_client_request(*request)

    with _Records() as records:
        inputs.start()
        client = _sync_client({"input_address": in0, "output_address": out0})
        decoder = type(client.decoder).__name__
        if not engine_overlay:
            layer.revert(["packed_hop"])  # the engine: without the overlay
        try:
            engine_state = layer.status().outcome("packed_hop").state
            threads = [threading.Thread(target=busy_loop, daemon=True)]
            threads[0].start()
            threads.append(_start_output_thread(engine, [out0]))
            answers: list[Any] = []
            call = threading.Thread(target=lambda: answers.append(client.call_utility("ping")))
            call.start()
            call.join(30)  # answered after the declaration: it has been handled by then
            declared = sorted(packed_hop.COUNTERS.declarations.values())
            scenarios_ = _send_all(engine, _sync_getter(client, threads[1]))
            input_thread_alive = inputs.is_alive()
            _stop(engine, threads, stop)
            client.shutdown()
        finally:
            if not engine_overlay:
                layer.apply(names=["packed_hop"])
    return {
        "decoder": decoder,
        "engine_state": engine_state,
        "answers": answers,
        "declared": declared,
        "scenarios": scenarios_,
        "input_thread_alive": input_thread_alive,
        "records": records.described(),
    }


def run_sync(case: str) -> dict[str, Any]:

    from prime_r3 import layer

    (in0, out0), (in1, out1) = _addresses(2)
    clients = [(in0, out0)] if case != "mixed" else [(in0, out0), (in1, out1)]
    engine, stop = _Engine(), threading.Event()
    # The engine connects to the clients' sockets: the clients bind first.
    made: list[Any] = []
    ready = threading.Thread(
        target=lambda: made.append(_engine_inputs([a for a, _ in clients], engine, stop))
    )
    ready.start()
    if case == "engine_only":
        layer.revert(["packed_hop"])  # a client without the overlay ...
    client = _sync_client({"input_address": in0, "output_address": out0})
    if case == "engine_only":  # ... and an engine with it
        layer.apply(names=["packed_hop"])
    other = None
    if case == "mixed":
        # A second client of the same engine, without the overlay (its own socket pair;
        # it never declares).
        ctx = zmq.Context()
        other = (ctx, ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL))
        other[1].bind(in1)
        other[2].bind(out1)
        other[1].recv_multipart()  # the engine's ready message
    ready.join()
    threads = [made[0], _start_output_thread(engine, [b for _, b in clients])]
    declared = _wait_declared(client)
    get = _sync_getter(client, threads[1])
    result = {"declared": declared, "scenarios": _send_all(engine, get)}
    result["status_note"] = layer.status().outcome("packed_hop").reason  # engine alive
    if other is not None:
        # What the undeclared client receives: upstream's frames.
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

        (name, specs) = scenarios()[0]
        sent = EngineCoreOutputs(outputs=[EngineCoreOutput(**s) for s in specs], timestamp=1.0)
        engine.output_queue.put_nowait((1, sent))
        result["other_frames"] = [bytes(f) for f in other[2].recv_multipart()]
        other[1].close(0)
        other[2].close(0)
        other[0].term()
    _stop(engine, threads, stop)
    client.shutdown()
    return result


def run_async() -> dict[str, Any]:
    from vllm.v1.engine import core_client

    ((in0, out0),) = _addresses(1)
    engine, stop = _Engine(), threading.Event()
    made: list[Any] = []
    ready = threading.Thread(target=lambda: made.append(_engine_inputs([in0], engine, stop)))
    ready.start()

    async def main() -> dict[str, Any]:
        client = core_client.AsyncMPClient(
            _config(), None, False, client_addresses={"input_address": in0, "output_address": out0}
        )
        ready.join()
        threads = [made[0], _start_output_thread(engine, [out0])]
        loop = asyncio.get_running_loop()
        declared = await loop.run_in_executor(None, _wait_declared, client)

        def get() -> Any:
            return asyncio.run_coroutine_threadsafe(client.get_output_async(), loop).result(30)

        # AsyncMPClient's loop queues only messages with outputs (or stats): upstream's
        # drops an empty step, so it is not sent here.
        scenarios_ = await loop.run_in_executor(None, _send_all, engine, get, ("empty",))
        _stop(engine, threads, stop)
        client.shutdown()
        return {"declared": declared, "scenarios": scenarios_}

    return asyncio.run(main())


def unpack_malformed() -> dict[str, Any]:
    """Each malformed pair as a packed step through vLLM's real encoder, then the
    overlay's reading decoder: the exception it raises, or what the outputs got."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from prime_r3.fixes import packed_hop

    encoder = MsgpackEncoder()
    decoder = packed_hop.reading_decoder(MsgpackDecoder(EngineCoreOutputs))
    packed = packed_hop._packed_type()
    result: dict[str, Any] = {}
    for name, num_outputs, counts, rows in malformed_pairs():
        outputs = [EngineCoreOutput(f"req-{i}", [i]) for i in range(num_outputs)]
        sent = packed(outputs=outputs, packed_routed_experts=(counts, rows))
        try:
            got = decoder.decode(encoder.encode(sent))
        except Exception as e:  # noqa: BLE001 - recorded for the test to judge
            result[name] = (type(e).__name__, str(e))
        else:
            result[name] = ("no error", _describe(got.outputs))
    return result


def run_case(case: str, state: str) -> dict[str, Any]:
    from prime_r3 import layer
    from prime_r3.fixes import packed_hop

    packed_hop.COUNTERS.reset()
    result: dict[str, Any] = {"state": state}
    if case in ("client_only", "real_inputs"):
        result["sync"] = run_real_inputs(engine_overlay=case == "real_inputs")
        result["counters_sync"] = packed_hop.COUNTERS.snapshot()
        return result
    result["sync"] = run_sync(case)
    result["counters_sync"] = packed_hop.COUNTERS.snapshot()
    result["status_note"] = result["sync"]["status_note"]
    if case == "both":
        packed_hop.COUNTERS.reset()
        result["async"] = run_async()
        result["counters_async"] = packed_hop.COUNTERS.snapshot()
        if state != layer.DISABLED:
            result["malformed"] = unpack_malformed()
    return result


def main() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    out, cases = sys.argv[1], sys.argv[2].split(",")
    from prime_r3 import layer

    state = layer.apply().outcome("packed_hop").state
    result = {case: run_case(case, state) for case in cases}
    with open(out, "wb") as f:
        pickle.dump(result, f)
    print("ok")


if __name__ == "__main__":
    main()
