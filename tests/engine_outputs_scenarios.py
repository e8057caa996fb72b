"""EngineCoreOutputs through vLLM's real EngineCore output thread, a real ZMQ socket and
the real ``SyncMPClient`` output thread, as ``vllm serve`` sends every step to its client.

    python -m tests.engine_outputs_scenarios OUT.pickle   # with the vLLM tree to test first
                                                           # on PYTHONPATH

Run once on the installed vLLM and once on a tree patched with ``patches/`` (02 packs a
step's routed experts into one array on that hop); ``tests/test_engine_outputs_diff.py``
compares what the client got, field by field, and the bytes on the wire.

The EngineCore half is ``EngineCoreProc.process_output_sockets`` itself, run in a thread
on an object holding only the ``output_queue`` it reads. The client half is
``SyncMPClient.__init__``'s own output thread: the client is built with
``MPClient.__init__`` replaced (for the duration of the construction only) by one that
sets the attributes that thread reads (its context, decoder, socket and background
resources) and starts no engine. ``get_output`` is the real one.
"""

from __future__ import annotations

import os
import pickle
import queue
import sys
import tempfile
import threading
import time
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import zmq

SHAPE = (46, 8)


def scenarios() -> list[tuple[str, list[dict[str, Any]]]]:
    """Each scenario: a name and its outputs' constructor arguments, in order."""
    rng = np.random.default_rng(7)

    def rows(n: int, dtype: Any = np.uint8, shape: tuple[int, ...] = SHAPE) -> np.ndarray:
        return rng.integers(0, 120, (n, *shape), dtype=dtype)

    def out(i: int, routed: np.ndarray | None, **extra: Any) -> dict[str, Any]:
        return {
            "request_id": f"req-{i}",
            "new_token_ids": [i, i + 1][: 1 + i % 2],
            "routed_experts": routed,
            **extra,
        }

    decode = [out(i, rows(1)) for i in range(400)]
    mixed = [
        out(0, rows(1)),
        out(1, None),
        out(2, rows(0)),
        out(3, rows(37)),
        out(4, rows(1), finish_reason=1, stop_reason="stop"),
        out(5, None, kv_transfer_params={"a": 1}),
        out(6, rows(16)[:5]),  # a view, as take_output returns for part of a request's rows
        out(7, rows(3)),
    ]
    wide = [out(i, rows(1 + i % 3, np.uint16)) for i in range(40)]
    dtypes = [out(0, rows(2)), out(1, rows(2, np.uint16)), out(2, rows(1))]
    shapes = [out(0, rows(2)), out(1, rows(2, shape=(46, 4))), out(2, rows(1))]
    single = [out(0, rows(3)), out(1, None), out(2, None)]
    large = [out(i, rows(1200)) for i in range(3)]  # above MessageQueue-size buffers
    # A prefill's rows (8 KiB or more: 23 rows x 368 B) among decode rows: only the
    # small ones are packed, the prefill's go as upstream sends them.
    prefill = [out(0, rows(1)), out(1, rows(23)), out(2, rows(22)), out(3, rows(1))]
    prefill += [out(4, rows(4000)), out(5, None), out(6, rows(1))]
    return [
        ("decode_400", decode),
        ("mixed", mixed),
        ("uint16", wide),
        ("mixed_dtypes", dtypes),
        ("mixed_shapes", shapes),
        ("one_with_rows", single),
        ("none", [out(i, None) for i in range(5)]),
        ("empty", []),
        ("large", large),
        ("prefill", prefill),
    ]


def _describe(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return (
            "ndarray",
            value.dtype.str,
            value.shape,
            value.tobytes(),
            bool(value.flags.writeable),
            bool(value.flags.c_contiguous),
        )
    if isinstance(value, msgspec.Struct):
        return (
            type(value).__name__,
            {k: _describe(v) for k, v in msgspec.structs.asdict(value).items()},
        )
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if isinstance(value, dict):
        return {k: _describe(v) for k, v in value.items()}
    if isinstance(value, set):
        return sorted(value)
    return value


def _pinned(value: np.ndarray | None) -> int | None:
    """Bytes a client array keeps alive: the whole buffer at the root of its bases (a
    decoded array is a view of a received frame; one the client copied owns its data)."""
    if value is None:
        return None
    base: Any = value
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return base.nbytes if isinstance(base, np.ndarray) else memoryview(base).nbytes


def malformed_pairs() -> list[tuple[str, int, np.ndarray, np.ndarray]]:
    """Packed pairs no EngineCore of this build sends (a peer of another layout, a bug):
    a name, the step's number of outputs, the counts and the rows."""
    rows = np.arange(3 * SHAPE[0] * SHAPE[1], dtype=np.uint8).reshape(3, *SHAPE)
    return [
        ("fewer_counts_than_outputs", 3, np.array([1, 2], np.int64), rows),
        ("counts_beyond_the_rows", 2, np.array([2, 2], np.int64), rows),
        ("counts_short_of_the_rows", 2, np.array([1, 1], np.int64), rows),
        ("a_count_below_minus_one", 2, np.array([-2, 3], np.int64), rows),
        ("rows_without_outputs", 0, np.array([], np.int64), rows),
        ("float_counts", 2, np.array([1.0, 2.0]), rows),
        ("two_dimensional_counts", 2, np.array([[1], [2]], np.int64), rows),
        ("zero_dimensional_rows", 2, np.array([1, 1], np.int64), np.array(7, np.uint8)),
    ]


def unpack_malformed() -> dict[str, Any] | None:
    """Each malformed pair through vLLM's real encoder and decoder, then the client's
    unpack: the exception it raises (the client's output loop hands it to get_output), or
    what the outputs got. None where the tree has no packed form."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    if not hasattr(EngineCoreOutputs, "unpack_routed_experts"):
        return None
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    result: dict[str, Any] = {}
    for name, num_outputs, counts, rows in malformed_pairs():
        sent = EngineCoreOutputs(
            outputs=[EngineCoreOutput(f"req-{i}", [i]) for i in range(num_outputs)],
            packed_routed_experts=(counts, rows),  # type: ignore[call-arg]
        )
        got = decoder.decode(encoder.encode(sent))
        try:
            got.unpack_routed_experts()
        except Exception as e:  # noqa: BLE001 - recorded for the test to judge
            result[name] = (type(e).__name__, str(e))
        else:
            result[name] = ("no error", _describe(got.outputs))
    return result


def _client(path: str) -> Any:
    """A real SyncMPClient whose output thread reads ``path``; no engine started."""
    from vllm.v1.engine import EngineCoreOutputs, core_client
    from vllm.v1.serial_utils import MsgpackDecoder

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        self.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=1))
        self.ctx = zmq.Context()
        self.resources = core_client.BackgroundResources(ctx=self.ctx)
        socket = self.ctx.socket(zmq.PULL)
        socket.bind(path)
        self.resources.output_socket = socket
        self.decoder = MsgpackDecoder(EngineCoreOutputs)
        self.utility_results = {}

    original = core_client.MPClient.__init__
    core_client.MPClient.__init__ = init  # type: ignore[method-assign]
    try:
        return core_client.SyncMPClient(None, None, False)  # type: ignore[arg-type]
    finally:
        core_client.MPClient.__init__ = original  # type: ignore[method-assign]


def run() -> dict[str, Any]:
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.serial_utils import MsgpackEncoder

    path = f"ipc://{tempfile.mkdtemp()}/out"
    client = _client(path)
    # Wire bytes, as the real thread hands them to zmq (the same encoder, each message).
    wire: list[list[bytes]] = []
    encode_into = MsgpackEncoder.encode_into

    def recording(self: Any, obj: Any, buf: bytearray) -> Any:
        buffers = encode_into(self, obj, buf)
        wire.append([bytes(b) for b in buffers])
        return buffers

    MsgpackEncoder.encode_into = recording  # type: ignore[method-assign]
    # What process_output_sockets reads of its EngineCoreProc: the queue, and the
    # (static) sender it calls through self.
    engine = SimpleNamespace(
        output_queue=queue.Queue(),
        _send_msg_tracking_payload=EngineCoreProc._send_msg_tracking_payload,
    )
    thread = threading.Thread(
        target=EngineCoreProc.process_output_sockets,
        args=(engine, [path], None, 0),
        daemon=True,
    )
    thread.start()
    result: dict[str, Any] = {}
    for name, specs in scenarios():
        sent = EngineCoreOutputs(
            outputs=[EngineCoreOutput(**spec) for spec in specs], timestamp=1.0
        )
        wire.clear()
        engine.output_queue.put_nowait((0, sent))
        deadline = time.monotonic() + 30
        while client.outputs_queue.empty():
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the EngineCore output thread sent nothing")
            time.sleep(0.001)
        got = client.get_output()
        result[name] = {
            "outputs": _describe(got),
            "wire": list(wire),
            "packed_left": getattr(got, "packed_routed_experts", None) is not None,
            "pinned": [_pinned(output.routed_experts) for output in got.outputs],
        }
    engine.output_queue.put_nowait(EngineCoreProc.ENGINE_CORE_DEAD)
    thread.join(timeout=30)
    MsgpackEncoder.encode_into = encode_into  # type: ignore[method-assign]
    return result


def main() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    result = {"scenarios": run(), "malformed": unpack_malformed()}
    with open(sys.argv[1], "wb") as f:
        pickle.dump(result, f)
    print("ok", len(result["scenarios"]))


if __name__ == "__main__":
    main()
