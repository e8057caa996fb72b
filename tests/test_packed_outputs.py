"""packed_outputs: every consumer sees the same routed-expert rows as with upstream's dict.

The oracle is always vLLM's own code on upstream's own dict: the real
``AuxOutputSchedulerConnector.take_output`` (rows bytes, dtype, shape, or the exact
exception), after no transport, plain pickle, the real ``MessageQueue`` between two
processes, Ray's real zero-copy detach, and the real ``process_output`` path.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import functools  # noqa: E402
import gc  # noqa: E402
import multiprocessing  # noqa: E402
import operator  # noqa: E402
import pickle  # noqa: E402
import pickletools  # noqa: E402
from collections.abc import Callable, Iterator, Mapping  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from vllm.distributed.aux_output_connector import worker as aux_worker  # noqa: E402
from vllm.distributed.aux_output_connector.connector import (  # noqa: E402
    AuxOutputConnectorMetadata,
    AuxOutputSchedulerConnector,
    AuxRequestOutput,
    PackedBlockHashes,
)
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue  # noqa: E402

import prime_r3  # noqa: E402
from prime_r3.fixes import packed_outputs  # noqa: E402
from prime_r3.packed import FORMAT_VERSION, READS_MARK, PackedAuxOutputs  # noqa: E402
from tests import batched_harness as harness  # noqa: E402

BLOCK = 4
LAYERS_TOPK = (3, 2)


@contextmanager
def _overlay_off() -> Iterator[None]:
    """vLLM loads its general plugins (prime_r3) while building a config: keep them off."""
    saved = os.environ.get("PRIME_R3")
    os.environ["PRIME_R3"] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["PRIME_R3"]
        else:
            os.environ["PRIME_R3"] = saved


@functools.cache
def real_vllm() -> SimpleNamespace:
    """vLLM's real config, KV layout and Scheduler (built as EngineCore builds it, via the
    bench's offline setup): 3 MoE layers x top-2 over 300 experts (uint16 rows), KV
    block size 4. Its ``aux_output_connector`` is the real scheduler connector, made by
    the Scheduler with its real constructor (0.33's takes the KV cache manager)."""
    from prime_r3.bench import vllm_setup
    from prime_r3.bench.workload import BenchConfig

    cfg = BenchConfig(
        concurrency=8, layers=LAYERS_TOPK[0], topk=LAYERS_TOPK[1], experts=300,
        block_size=BLOCK, prefix_len=8, problem_len=8, max_tokens=32,
        max_num_batched_tokens=256, kv_blocks=64,
    )  # fmt: skip
    with _overlay_off():
        vllm_config = vllm_setup.build_vllm_config(cfg, r3=True)
        kv_cache_config = vllm_setup.build_kv_cache_config(cfg)
        scheduler = vllm_setup.build_scheduler(vllm_config, kv_cache_config)
    assert type(scheduler.aux_output_connector) is AuxOutputSchedulerConnector
    return SimpleNamespace(
        vllm_config=vllm_config, kv_cache_config=kv_cache_config, scheduler=scheduler
    )


def real_take_output() -> Callable[..., Any]:
    """The real ``take_output``, bound to the real Scheduler's connector."""
    return real_vllm().scheduler.aux_output_connector.take_output


def TAKE(request: Any, output: Any) -> Any:  # noqa: N802 - reads as the consumer
    return real_take_output()(request, output)


SHAPES = [(46, 8), (4, 2), (3,), (2, 0)]


class Req:
    """What take_output reads from a vllm Request: request_id, num_tokens, is_finished()."""

    __slots__ = ("request_id", "num_tokens", "finished")

    def __init__(self, request_id: str, num_tokens: int, finished: bool = False) -> None:
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.finished = finished

    def is_finished(self) -> bool:
        return self.finished


def make_step(
    rng: np.random.Generator, n: int, dtype: Any = np.uint8, shape: tuple[int, ...] = (46, 8)
) -> tuple[dict[str, AuxRequestOutput], list[Req]]:
    """An upstream-shaped step output and the requests the scheduler will look up.

    Rows are mostly views of one snapshot (the fast path), some read-only (rows
    materialized from the store's bytes) or private copies (buffer.read); lengths are
    decode rows, zero-length rows and prefill chunks. Requests cover every branch of
    take_output: accepted rows, None, and both assertion failures, plus missing ids.
    """
    high = 256 if np.dtype(dtype) == np.uint8 else 512
    kinds = rng.choice(3, size=n, p=[0.6, 0.15, 0.25])
    lengths = np.where(kinds == 0, 1, np.where(kinds == 1, 0, rng.integers(2, 40, size=n)))
    snapshot = rng.integers(0, high, size=(int(lengths.sum()), *shape), dtype=dtype)
    bounds = np.concatenate(([0], np.cumsum(lengths)))
    outputs: dict[str, AuxRequestOutput] = {}
    requests = []
    for i in rng.permutation(n).tolist():
        rows = snapshot[bounds[i] : bounds[i + 1]]
        source = rng.random()
        if source < 0.1:
            rows = np.frombuffer(rows.tobytes(), dtype=dtype).reshape(rows.shape)
        elif source < 0.2:
            rows = rows.copy()
        token_start: Any = int(rng.integers(0, 20_000))
        if rng.random() < 0.5:  # upstream mixes Python ints and numpy scalars
            token_start = np.int64(token_start)
        request_id = f"req-{i}-{rng.integers(1 << 30)}"
        outputs[request_id] = AuxRequestOutput(token_start, rows)
        case = rng.random()
        if case < 0.8:
            local_end = int(rng.integers(0, len(rows) + 1))
        elif case < 0.9:
            local_end = -int(rng.integers(1, 3))
        else:
            local_end = len(rows) + int(rng.integers(1, 3))
        requests.append(Req(request_id, int(token_start) + 1 + local_end, rng.random() < 0.3))
    requests += [Req(f"missing-{k}", 5) for k in range(2)]
    return outputs, requests


def outcome(request: Req, output: Any) -> tuple[Any, ...]:
    try:
        rows = TAKE(request, output)
    except Exception as error:  # noqa: BLE001 - the failure itself is compared
        return ("raise", type(error), str(error))
    if rows is None:
        return ("none",)
    return ("rows", rows.dtype.str, rows.shape, rows.tobytes())


def writable(request: Req, output: Any) -> bool | None:
    try:
        rows = TAKE(request, output)
    except AssertionError:
        return None
    return None if rows is None else bool(rows.flags.writeable)


def assert_parity(expected: Any, got: Any, requests: list[Req]) -> None:
    for request in requests:
        assert outcome(request, got) == outcome(request, expected), request.request_id


def assert_writable_where_upstream_is(expected: Any, got: Any, requests: list[Req]) -> None:
    for request in requests:
        if writable(request, expected):
            assert writable(request, got), request.request_id


STEPS = [  # (seed, requests, dtype, per-token shape)
    (0, 0, np.uint8, (46, 8)),
    (1, 1, np.uint8, (46, 8)),
    (2, 37, np.uint16, (4, 2)),
    (3, 400, np.uint8, (46, 8)),
    (4, 150, np.uint16, (3,)),
    (5, 60, np.uint8, (2, 0)),
    (6, 2000, np.uint8, (46, 8)),
    (7, 2000, np.uint16, (46, 8)),
]


@pytest.mark.parametrize(("seed", "n", "dtype", "shape"), STEPS)
def test_take_output_parity_direct_and_pickled(seed: int, n: int, dtype: Any, shape: Any) -> None:
    outputs, requests = make_step(np.random.default_rng(seed), n, dtype, shape)
    packed = PackedAuxOutputs.pack(outputs)
    assert_parity(outputs, packed, requests)
    for protocol in (4, 5):
        upstream = pickle.loads(pickle.dumps(outputs, protocol=protocol))
        received = pickle.loads(pickle.dumps(packed, protocol=protocol))
        assert isinstance(received, PackedAuxOutputs)
        assert_parity(upstream, received, requests)
        assert_parity(outputs, received, requests)
        assert_writable_where_upstream_is(upstream, received, requests)


def real_requests(stubs: list[Req]) -> list[Any]:
    """vLLM Request objects with the stubs' ids, token counts and finished state (what
    ``take_output`` reads), checked to expose what the stubs do."""
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    params = SamplingParams(max_tokens=4)
    requests = []
    for stub in stubs:
        if stub.num_tokens < 1:
            continue
        request = Request(stub.request_id, list(range(stub.num_tokens)), params, None)
        if stub.finished:
            request.status = RequestStatus.FINISHED_STOPPED
        assert request.num_tokens == stub.num_tokens and request.is_finished() == stub.finished
        requests.append(request)
    return requests


def test_parity_with_real_vllm_requests() -> None:
    """The stub reads what a real Request exposes; check with real ones on one step."""
    outputs, stubs = make_step(np.random.default_rng(9), 80)
    requests = real_requests(stubs)
    packed = pickle.loads(pickle.dumps(PackedAuxOutputs.pack(outputs), protocol=5))
    assert_parity(outputs, packed, requests)
    assert {outcome(r, outputs)[0] for r in requests} == {"rows", "none", "raise"}


def test_mapping_behaves_like_the_dict() -> None:
    outputs, _ = make_step(np.random.default_rng(11), 50, np.uint16, (4, 2))
    packed = PackedAuxOutputs.pack(outputs)
    assert isinstance(packed, Mapping) and len(packed) == len(outputs)
    assert list(packed) == list(outputs) and list(packed.keys()) == list(outputs.keys())
    # Writer side: the dict holds upstream's own values (the packed form is for pickling).
    for (key, value), (ref_key, ref) in zip(packed.items(), outputs.items(), strict=True):
        assert key == ref_key and value is ref
    received = pickle.loads(pickle.dumps(packed, protocol=5))
    for (key, value), (ref_key, ref) in zip(received.items(), outputs.items(), strict=True):
        assert key == ref_key and type(value) is AuxRequestOutput
        assert value.token_start == ref.token_start and type(value.token_start) is int
        assert value.rows.dtype == ref.rows.dtype and np.array_equal(value.rows, ref.rows)
    first = next(iter(outputs))
    for got in (packed, received):
        assert got[first] is got.get(first)  # built once, so attribute updates stick
        assert got.get("nope") is None and got.get("nope", 3) == 3 and "nope" not in got
        with pytest.raises(KeyError) as packed_error:
            got["nope"]
        with pytest.raises(KeyError) as dict_error:
            outputs["nope"]
        assert packed_error.value.args == dict_error.value.args


def test_pickle_size_does_not_grow_objects_per_request() -> None:
    """Pickled alone, 3 or 2000 requests differ only in the id list's items (one string
    each): no per-request array, value object or integer."""

    sized = {"BININT1": "INT", "BININT2": "INT", "BININT": "INT", "BINUNICODE": "STR"}
    sized |= {"SHORT_BINUNICODE": "STR", "SHORT_BINBYTES": "BYTES", "BINBYTES": "BYTES"}
    id_list = {"STR", "MEMOIZE", "MARK", "APPENDS"}  # the ids, batched into the list

    def opcodes(n: int) -> list[str]:
        outputs, _ = make_step(np.random.default_rng(n), n)
        data = pickle.dumps(PackedAuxOutputs.pack(outputs), protocol=5)
        ops = (op.name for op, _, _ in pickletools.genops(data) if op.name != "FRAME")
        return [sized.get(name, name) for name in ops]

    big = opcodes(2000)
    assert [op for op in opcodes(3) if op not in id_list] == [op for op in big if op not in id_list]
    assert big.count("STR") < 2000 + 20
    assert len([op for op in big if op not in id_list]) < 60


def _model_runner_output(outputs: Mapping[str, Any], aux: Any) -> Any:
    """A decode step's ``ModelRunnerOutput`` as the V2 runner builds it: ``req_ids`` hold
    the same ``str`` objects the aux output is keyed by (``PendingAuxOutput.request_ids``
    is ``list(input_batch.req_ids)``, ``req_ids=input_batch.req_ids``)."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(outputs)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=[[i] for i in range(len(req_ids))],
        aux_output_connector_output=aux,
    )


@pytest.mark.parametrize("n", [3, 2000])
def test_ids_inside_the_model_runner_output_are_memo_references(n: int) -> None:
    """Sent as on the real path (inside ``ModelRunnerOutput``, through the real
    ``MessageQueue``), a packed step's ids cost one memo reference each: no id string is
    written again, and the received step's ids are the received ``req_ids``' own
    objects (nothing to split, hash or compare anew in EngineCore)."""
    outputs, requests = make_step(np.random.default_rng(n), n)
    without = pickle.dumps(_model_runner_output(outputs, None), protocol=5)
    data = pickle.dumps(_model_runner_output(outputs, PackedAuxOutputs.pack(outputs)), protocol=5)
    for request_id in list(outputs)[:50]:
        assert data.count(request_id.encode()) == without.count(request_id.encode()) == 1

    def strings(stream: bytes) -> int:
        return sum(isinstance(arg, str) for _, arg, _ in pickletools.genops(stream))

    assert strings(data) - strings(without) < 20  # module and class names, not per request
    writer = MessageQueue(1, 1)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    writer.wait_until_ready()
    reader.wait_until_ready()
    writer.enqueue(_model_runner_output(outputs, PackedAuxOutputs.pack(outputs)))
    received = reader.dequeue()
    step = received.aux_output_connector_output
    assert type(step) is PackedAuxOutputs and list(step) == list(outputs)
    assert all(map(operator.is_, step, received.req_ids))
    assert_parity(outputs, step, requests)
    outputs, _ = make_step(np.random.default_rng(0), 50)
    assert len(list(pickletools.genops(pickle.dumps(outputs, protocol=5)))) > 50 * 10


def test_batched_commit_builds_the_step_with_the_same_id_objects() -> None:
    """``batched_commit._packed`` (the fast path's builder) keeps the step's own id
    objects too: inside the ``ModelRunnerOutput`` no id string is written twice."""
    from prime_r3.fixes.batched_commit import _packed

    n = 300
    snapshot = np.random.default_rng(1).integers(0, 256, size=(n, 46, 8), dtype=np.uint8)
    ids = [f"chatcmpl-{i:06d}" for i in range(n)]
    starts = np.arange(n, dtype=np.int64) + 100
    built = _packed(PackedAuxOutputs, ids, starts, snapshot, list(range(n)), np.arange(n), [], [])
    assert all(map(operator.is_, built, ids))
    outputs = dict.fromkeys(ids)
    data = pickle.dumps(_model_runner_output(outputs, built), protocol=5)
    assert all(data.count(request_id.encode()) == 1 for request_id in ids)
    received = pickle.loads(data)
    assert all(map(operator.is_, received.aux_output_connector_output, received.req_ids))
    for i, request_id in enumerate(ids):
        value = received.aux_output_connector_output[request_id]
        assert value.token_start == 100 + i and np.array_equal(value.rows, snapshot[i : i + 1])


def test_a_format_1_step_with_joined_ids_is_still_read() -> None:
    """Format-1 writers before the shared ids sent the ids joined by ``"\\x00"`` (same
    format version, so the handshake lets them through): read as before."""
    from prime_r3 import packed

    rows = np.arange(3 * 4, dtype=np.uint16).reshape(3, 2, 2)
    ints = np.array([5, 9, 0, 2, 3], dtype=np.int64).tobytes()  # starts, then offsets
    step = packed._rebuild(
        FORMAT_VERSION, 2, "a\x00b", ints, bytearray(rows.tobytes()), rows.dtype, (2, 2)
    )
    assert list(step) == ["a", "b"]
    assert step["a"].token_start == 5 and np.array_equal(step["a"].rows, rows[:2])
    assert step["b"].token_start == 9 and np.array_equal(step["b"].rows, rows[2:])


def test_unpacked_fallback_and_validation() -> None:
    """Content that cannot share one rows array pickles as upstream's plain dict."""
    rows = np.zeros((2, 3), np.uint8)
    mixed = {"a": AuxRequestOutput(0, rows), "b": AuxRequestOutput(0, rows.astype(np.uint16))}
    shapes = {"a": AuxRequestOutput(0, rows), "b": AuxRequestOutput(0, rows.T)}
    for outputs in (mixed, shapes):
        packed = PackedAuxOutputs.pack(outputs)  # type: ignore[arg-type]
        assert dict(packed) == outputs
        received = pickle.loads(pickle.dumps(packed, protocol=5))
        assert type(received) is dict and list(received) == list(outputs)
        for key, value in received.items():
            assert np.array_equal(value.rows, outputs[key].rows)
            assert value.rows.dtype == outputs[key].rows.dtype
    # Ids are pickled as the keys themselves: a key of any type round-trips packed.
    non_str = {1: AuxRequestOutput(0, rows)}
    received = pickle.loads(pickle.dumps(PackedAuxOutputs.pack(non_str), protocol=5))  # type: ignore[arg-type]
    assert type(received) is PackedAuxOutputs and list(received) == [1]
    assert np.array_equal(received[1].rows, rows) and received[1].token_start == 0  # type: ignore[index]
    with pytest.raises(ValueError):
        PackedAuxOutputs.from_arrays(["a"], [0], [0, 3], rows)
    wrapper = packed_outputs._pack_step_output({})
    declared = AuxOutputConnectorMetadata(0, {}, {}, ())
    setattr(declared, READS_MARK, FORMAT_VERSION)
    worker = SimpleNamespace(_step_metadata=declared)
    assert wrapper(lambda: None, worker, (), {}) is None  # no output: None goes on
    packed = wrapper(lambda: {"a": AuxRequestOutput(0, rows)}, worker, (), {})
    assert isinstance(packed, PackedAuxOutputs)
    undeclared = SimpleNamespace(_step_metadata=AuxOutputConnectorMetadata(0, {}, {}, ()))
    assert type(wrapper(lambda: {"a": AuxRequestOutput(0, rows)}, undeclared, (), {})) is dict


def test_ids_containing_the_separator_survive() -> None:
    rows = np.arange(12, dtype=np.uint8).reshape(4, 3)
    outputs = {"a\x00b": AuxRequestOutput(1, rows[:2]), "": AuxRequestOutput(2, rows[2:])}
    received = pickle.loads(pickle.dumps(PackedAuxOutputs.pack(outputs), protocol=5))
    assert list(received) == list(outputs)
    assert_parity(outputs, received, [Req("a\x00b", 4), Req("", 5), Req("b", 1)])


def test_empty_step_and_no_output_behave_as_upstream() -> None:
    requests = [Req("r0", 3), Req("r1", 1, finished=True)]
    empty = PackedAuxOutputs.pack({})
    for received in (empty, pickle.loads(pickle.dumps(empty, protocol=5))):
        assert_parity({}, received, requests)
        assert not received and len(received) == 0 and list(received) == []
    assert_parity(None, None, requests)  # worker had no output: the wrapper passes None on


def test_readonly_transport_buffers_are_copied_once_and_writable() -> None:
    """Ray and zmq hand over read-only buffers; rows must not alias them and stay writable."""
    outputs, requests = make_step(np.random.default_rng(21), 300)
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(PackedAuxOutputs.pack(outputs), protocol=5, buffer_callback=buffers.append)
    sources = [bytearray(b.raw()) for b in buffers]
    received = pickle.loads(data, buffers=[memoryview(s).toreadonly() for s in sources])
    assert received.rows.flags.writeable
    before = [outcome(r, received) for r in requests]
    for source in sources:
        source[:] = bytes(len(source))
    assert [outcome(r, received) for r in requests] == before
    assert_parity(outputs, received, requests)


def test_ray_zero_copy_detach_keeps_parity() -> None:
    """vLLM's real detach (Ray executor) iterates values() and reassigns rows."""
    ray_utils = pytest.importorskip("vllm.v1.executor.ray_utils")
    detach = getattr(ray_utils, "detach_zero_copy_from_model_runner_output", None)
    if detach is None:  # 0.31 and 0.32 have it; 0.33 removed it
        import vllm
        from packaging.version import Version

        assert Version(vllm.__version__) >= Version("0.33"), vllm.__version__
        pytest.skip(f"vLLM {vllm.__version__} has no Ray zero-copy detach")
    from vllm.v1.outputs import ModelRunnerOutput

    outputs, requests = make_step(np.random.default_rng(31), 200)

    def ray_like(obj: Any) -> Any:  # out-of-band buffers come back read-only
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
        return pickle.loads(data, buffers=[bytes(b.raw()) for b in buffers])

    upstream = ModelRunnerOutput([], {}, aux_output_connector_output=ray_like(outputs))
    packed = PackedAuxOutputs.pack(outputs)
    ours = ModelRunnerOutput([], {}, aux_output_connector_output=ray_like(packed))
    detach(upstream)
    detach(ours)
    assert isinstance(ours.aux_output_connector_output, PackedAuxOutputs)
    assert_parity(upstream.aux_output_connector_output, ours.aux_output_connector_output, requests)
    assert_writable_where_upstream_is(
        upstream.aux_output_connector_output, ours.aux_output_connector_output, requests
    )


# -- the real MessageQueue between two processes ---------------------------------------


def _mq_reader(handle: Any, conn: Any) -> None:
    queue = MessageQueue.create_from_handle(handle, 0)
    queue.wait_until_ready()
    while (requests := conn.recv()) is not None:
        upstream, packed = queue.dequeue(), queue.dequeue()
        conn.send(
            (
                isinstance(packed, PackedAuxOutputs),  # unfilled until the first lookup
                [outcome(r, upstream) for r in requests],
                [outcome(r, packed) for r in requests],
                [(writable(r, upstream), writable(r, packed)) for r in requests],
            )
        )


@pytest.mark.parametrize("max_chunk_bytes", [24 << 20, 256 << 10], ids=["shm", "overflow"])
def test_message_queue_round_trip_between_processes(max_chunk_bytes: int) -> None:
    ctx = multiprocessing.get_context("fork")
    conn, child_conn = ctx.Pipe()
    process = ctx.Process(target=lambda: _mq_reader(child_conn.recv(), child_conn), daemon=True)
    process.start()  # forked before this process creates any zmq context
    queue = MessageQueue(1, 1, max_chunk_bytes=max_chunk_bytes)
    try:
        conn.send(queue.export_handle())
        queue.wait_until_ready()
        steps = [(40, 0, np.uint8), (41, 3, np.uint16), (42, 400, np.uint8), (43, 2000, np.uint8)]
        for seed, n, dtype in steps:
            outputs, requests = make_step(np.random.default_rng(seed), n, dtype)
            queue.enqueue(outputs)
            queue.enqueue(PackedAuxOutputs.pack(outputs))
            conn.send(requests)
            assert conn.poll(60), "reader process did not answer"
            is_packed, upstream, packed, flags = conn.recv()
            assert is_packed
            assert packed == upstream
            assert packed == [outcome(r, outputs) for r in requests]
            assert all(ours for theirs, ours in flags if theirs), "lost writability"
    finally:
        conn.send(None)
        process.join(30)
        del queue
        gc.collect()
    assert process.exitcode == 0


# -- the real worker path: AuxOutputWorkerConnector.process_output ----------------------


def _connector() -> aux_worker.AuxOutputWorkerConnector:
    """The output rank's real connector, built by its real constructor (store and buffer
    sized from the real config), with the bench's CPU capturer in place of the GPU one."""
    from prime_r3.bench import vllm_setup

    real = real_vllm()
    return vllm_setup.build_worker_connector(real.vllm_config, real.kv_cache_config)


def _hashes(*names: str) -> PackedBlockHashes:
    return PackedBlockHashes(b"".join(n.encode().ljust(8, b"_") for n in names), 8)


def _run_worker_steps(seed: int, declared: bool = True) -> list[tuple[Any, list[Req]]]:
    """Five steps through the real connector: prefix-cache hits whose rows come from the
    store (read-only, and store + tail), chunked prefill, decode, rejected speculative
    tokens, a step with no sampled token, and a finished request torn down."""
    rng = np.random.default_rng(seed)
    connector = _connector()
    steps = [
        # (emit starts, new block hashes, finished, [(id, token_start, scheduled,
        #  sampled, rejected)]); block size 4, A's 10-token prompt shares 2 blocks
        ({"A": 0}, {"A": _hashes("a0", "a1")}, (), [("A", 0, 10, 1, 0)]),
        (
            {"A": 10, "B": 0, "C": 0},
            {"B": _hashes("a0", "a1", "b2"), "C": _hashes("a0", "a1", "c2")},
            (),
            [("A", 10, 1, 1, 0), ("B", 8, 4, 1, 0), ("C", 8, 5, 1, 0)],
        ),
        (
            {"A": 11, "B": 12, "C": 13},
            {},
            (),
            [("A", 11, 3, 1, 2), ("B", 12, 1, 1, 0), ("C", 13, 1, 1, 0)],
        ),
        ({"B": 13, "C": 14}, {}, ("A",), [("B", 13, 1, 0, 0), ("C", 14, 1, 1, 0)]),
        ({"B": 13}, {}, (), [("B", 14, 2, 2, 1)]),
    ]
    results = []
    for emit_starts, hashes, finished, batch in steps:
        metadata = AuxOutputConnectorMetadata(0, emit_starts, hashes, finished)
        if declared:  # EngineCore said it reads packed steps (see test_packed_handshake)
            setattr(metadata, READS_MARK, FORMAT_VERSION)
        connector.begin_step(metadata)
        sizes = [scheduled for _, _, scheduled, _, _ in batch]
        rows = rng.integers(0, 300, (sum(sizes), *LAYERS_TOPK), dtype=np.uint16)
        # The connector's own prepare_output and enqueue_cpu_copy (whatever form its
        # request state has: upstream's objects or the diffs' arrays), handed the rows.
        connector._capturer = harness._Capturer(rows)
        pending = connector.prepare_output(
            harness._InputBatch(
                req_ids=[rid for rid, *_ in batch],
                query_start_loc_np=np.concatenate(([0], np.cumsum(sizes))).astype(np.int32),
                num_computed_tokens_np=np.array([start for _, start, *_ in batch], np.int32),
            )
        )
        pending.enqueue_cpu_copy(
            np.array([s for *_, s, _ in batch]), np.array([r for *_, r in batch])
        )
        output = pending.process_output()
        # Every scheduled request, accepted-rows ends 0..all, and one that never ran.
        takes = [Req("Z", 3)]
        for rid, *_ in batch:
            if rid in output:
                item = output[rid]
                for cut in (0, 1, len(item.rows)):
                    takes.append(Req(rid, int(item.token_start) + cut + 1))
            else:
                takes.append(Req(rid, 20))
        results.append((output, takes))
    return results


def test_worker_process_output_parity_with_patch_applied(reverted: pytest.MonkeyPatch) -> None:
    upstream = _run_worker_steps(seed=5)
    assert all(type(output) is dict for output, _ in upstream)
    # The scenario reaches the store paths: B's rows are the store's bytes (read-only),
    # C's are store bytes plus the buffered tail, B's last are read from the tail.
    assert len(upstream[1][0]["B"].rows) == 12 and not upstream[1][0]["B"].rows.flags.writeable
    assert len(upstream[1][0]["C"].rows) == 13 and upstream[1][0]["C"].token_start == 0
    assert "B" not in upstream[3][0] and upstream[4][0]["B"].token_start == 13

    report = prime_r3.apply(["packed_outputs"], log=False)
    assert report.outcome("packed_outputs").state == "applied", report.summary()
    patched = _run_worker_steps(seed=5)
    prime_r3.revert(["packed_outputs"])
    assert type(_run_worker_steps(seed=5)[0][0]) is dict  # reverted: upstream again

    assert len(patched) == len(upstream)
    for (theirs, requests), (ours, _) in zip(upstream, patched, strict=True):
        assert isinstance(ours, PackedAuxOutputs)
        assert list(ours) == list(theirs)
        assert_parity(theirs, ours, requests)
        received = pickle.loads(pickle.dumps(ours, protocol=5))
        assert_parity(pickle.loads(pickle.dumps(theirs, protocol=5)), received, requests)
        assert_writable_where_upstream_is(theirs, received, requests)


def test_packed_form_does_not_alias_the_step_snapshot() -> None:
    """Uniproc executor: nothing is pickled or copied, and the scheduler reads upstream's
    own values (views of the snapshot, exactly as upstream). Pickling, like upstream's,
    reads the rows when it runs; the packed form is a private copy."""
    snapshot = np.arange(24, dtype=np.uint8).reshape(8, 3)
    outputs = {"a": AuxRequestOutput(0, snapshot[2:5])}
    packed = PackedAuxOutputs.pack(outputs)
    assert TAKE(Req("a", 4), packed).base is TAKE(Req("a", 4), outputs).base
    assert not np.shares_memory(packed.rows, snapshot)
    snapshot[3] = 0
    received = pickle.loads(pickle.dumps(packed, protocol=5))
    upstream = pickle.loads(pickle.dumps(outputs, protocol=5))
    assert received["a"].rows.tolist() == upstream["a"].rows.tolist() == snapshot[2:5].tolist()
    assert not np.shares_memory(received["a"].rows, snapshot)


def test_worker_steps_take_both_the_gather_and_the_concatenate(
    reverted: pytest.MonkeyPatch,
) -> None:
    """The real worker steps reach every pack path, each agreeing with upstream above."""
    from prime_r3 import packed as packed_module

    paths: list[str] = []
    gather = packed_module._gather_rows

    def recording(step: Any, *args: Any) -> Any:
        rows = gather(step, *args)
        paths.append("concatenate" if rows is None else "gather")
        return rows

    reverted.setattr(packed_module, "_gather_rows", recording)
    upstream = _run_worker_steps(seed=5)
    report = prime_r3.apply(["packed_outputs"], log=False)
    assert report.outcome("packed_outputs").state == "applied", report.summary()
    patched = _run_worker_steps(seed=5)
    prime_r3.revert(["packed_outputs"])
    assert paths == []  # nothing is packed until the step is pickled
    sent = [pickle.loads(pickle.dumps(ours, protocol=5)) for ours, _ in patched]
    # 0: one prefill; 1: B and C from the store; 2: A's rejected tail leaves a gap;
    # 3: B emits nothing (a subsequence of the batch); 4: B read back from the buffer.
    assert paths == ["gather", "concatenate", "gather", "gather", "concatenate"]
    for (theirs, requests), (ours, _), received in zip(upstream, patched, sent, strict=True):
        assert_parity(theirs, ours, requests)
        assert_parity(theirs, received, requests)
        concatenated = PackedAuxOutputs.pack(theirs)
        assert np.array_equal(ours.rows, concatenated.rows)
        assert np.array_equal(ours.offsets, concatenated.offsets)


def _commit_like_step(
    rng: np.random.Generator, batch: int, source_kind: str
) -> tuple[dict[str, AuxRequestOutput], Any, list[Req]]:
    """A step shaped as _commit_output returns it, from a numpy or a torch-backed snapshot.

    Requests in batch order emit ``routed_experts[start:end - rejected][cut:]`` (some
    emit nothing); optionally a few materialized copies follow, as upstream appends them.
    """
    import torch

    from prime_r3.packed import StepRows

    sizes = np.where(rng.random(batch) < 0.7, 1, rng.integers(2, 30, size=batch))
    query_start_loc = np.concatenate(([0], np.cumsum(sizes))).astype(np.int32)
    rejected = np.where(rng.random(batch) < 0.2, rng.integers(0, sizes + 1), 0)
    snapshot = rng.integers(0, 256, size=(int(sizes.sum()), 46, 8), dtype=np.uint8)
    if source_kind == "torch":
        snapshot = torch.from_numpy(snapshot).clone().numpy()  # base: a Tensor, as D2H
    request_ids = [f"r{j}" for j in range(batch)]
    outputs: dict[str, AuxRequestOutput] = {}
    for j, request_id in enumerate(request_ids):
        if rng.random() < 0.15:
            continue  # no sampled token this step
        start, end = int(query_start_loc[j]), int(query_start_loc[j + 1])
        rows = snapshot[start : end - int(rejected[j])]
        cut = int(rng.integers(0, len(rows) + 1)) if rng.random() < 0.3 else 0
        outputs[request_id] = AuxRequestOutput(np.int32(100 * j + cut), rows[cut:])
    if source_kind == "mixed":
        for j in rng.choice(batch, size=3, replace=False).tolist():
            outputs.pop(request_ids[j], None)
            outputs[request_ids[j]] = AuxRequestOutput(7, snapshot[:2].copy())
    step = StepRows(snapshot, request_ids, query_start_loc, rejected)
    requests = [Req(rid, int(out.token_start) + 1 + len(out.rows)) for rid, out in outputs.items()]
    return outputs, step, requests


@pytest.mark.parametrize("source_kind", ["numpy", "torch", "mixed"])
@pytest.mark.parametrize("seed", range(6))
def test_gather_agrees_with_concatenate(seed: int, source_kind: str) -> None:
    from prime_r3 import packed as packed_module

    rng = np.random.default_rng(seed)
    outputs, step, requests = _commit_like_step(rng, int(rng.integers(1, 300)), source_kind)
    reference = PackedAuxOutputs.pack(outputs)
    rows_list = [output.rows for output in outputs.values()]
    lengths = np.diff(reference.offsets)
    gathered = packed_module._gather_rows(
        step, list(outputs), rows_list, lengths, reference.offsets
    )
    assert (gathered is None) == (source_kind == "mixed")  # copies: concatenate instead
    ours = PackedAuxOutputs.pack(outputs, step)
    for name in ("rows", "offsets", "token_starts"):
        assert np.array_equal(getattr(ours, name), getattr(reference, name))
    # ... and both are the plain loop over upstream's dict (packed.pack_reference).
    plain = packed_module.pack_reference(outputs)
    assert ours.packed().ids == plain.ids == list(outputs)
    for got, expected in zip(ours.packed()[1:], plain[1:], strict=True):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert got.tobytes() == expected.tobytes()
    assert ours.rows.flags.owndata and not np.shares_memory(ours.rows, step.routed_experts)
    assert_parity(outputs, ours, requests)
    assert_parity(outputs, pickle.loads(pickle.dumps(ours, protocol=5)), requests)


def test_gather_refuses_rows_it_cannot_place() -> None:
    """Views it cannot vouch for, or a step that does not fit, fall back to concatenate."""
    from prime_r3 import packed as packed_module
    from prime_r3.packed import StepRows

    source = np.arange(10 * 3, dtype=np.uint8).reshape(10, 3).copy()  # owns its data
    qsl, none_rejected = np.array([0, 4, 10]), np.zeros(2, dtype=np.int64)
    fits = {"a": AuxRequestOutput(0, source[2:4]), "b": AuxRequestOutput(4, source[4:10])}
    cases = {
        "fits": (fits, StepRows(source, ["a", "b"], qsl, none_rejected)),
        "other array": (fits, StepRows(source.copy(), ["a", "b"], qsl, none_rejected)),
        "a view": (fits, StepRows(source[:], ["a", "b"], qsl, none_rejected)),
        "out of order": (
            {"b": fits["b"], "a": fits["a"]},
            StepRows(source, ["a", "b"], qsl, none_rejected),
        ),
        "unknown id": (fits, StepRows(source, ["a", "c"], qsl, none_rejected)),
        "too long": (
            {"a": AuxRequestOutput(0, source[0:4]), "b": fits["b"]},
            StepRows(source, ["a", "b"], qsl, np.array([1, 0])),
        ),
        "bad shapes": (fits, StepRows(source, ["a", "b"], qsl[:2], none_rejected)),
        "not an array": (fits, StepRows(source.tolist(), ["a", "b"], qsl, none_rejected)),
    }
    for name, (outputs, step) in cases.items():
        reference = PackedAuxOutputs.pack(outputs)
        rows_list = [output.rows for output in outputs.values()]
        lengths, offsets = np.diff(reference.offsets), reference.offsets
        try:
            direct = packed_module._gather_rows(step, list(outputs), rows_list, lengths, offsets)
        except (TypeError, ValueError, IndexError):
            direct = None  # pack catches these and concatenates
        assert (direct is not None) == (name == "fits"), name
        gathered = PackedAuxOutputs.pack(outputs, step)
        assert np.array_equal(gathered.rows, reference.rows), name
        assert_parity(
            outputs, gathered, [Req(r, 5) for r in outputs] + [Req(r, 9) for r in outputs]
        )


def test_lookups_are_dict_lookups_on_every_side() -> None:
    """Writer side and reader side are plain filled dicts (dict's own ``in`` / ``[]``);
    only ``_trusted`` (arrays from a writer that never had a dict) fills on first read."""
    outputs, requests = make_step(np.random.default_rng(3), 100)
    written = PackedAuxOutputs.pack(outputs)
    received = pickle.loads(pickle.dumps(written, protocol=5))
    for packed in (written, received):
        assert type(packed) is PackedAuxOutputs and dict.__len__(packed) == 100
        assert type(packed).__contains__ is dict.__contains__
        assert type(packed).__getitem__ is dict.__getitem__
        assert_parity(outputs, packed, requests)
    trusted = PackedAuxOutputs._trusted(
        list(written), written.token_starts, written.offsets, written.rows
    )
    assert type(trusted) is not PackedAuxOutputs and isinstance(trusted, PackedAuxOutputs)
    assert len(trusted) == 100 and list(trusted) == list(outputs)  # no fill needed
    assert dict.__len__(trusted) == 0
    assert next(iter(outputs)) in trusted  # the first read fills every value
    assert type(trusted) is PackedAuxOutputs and dict.__len__(trusted) == 100
    assert all(value.rows.flags.owndata for value in trusted.values())
    assert_parity(outputs, trusted, requests)
