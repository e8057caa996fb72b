"""Per-step cost of the routed-experts step output: upstream dict vs PackedAuxOutputs.

    .venv/bin/python scripts/bench_packing.py [--steps N] [--requests 400,1000,2000]

Each step is what ``AuxOutputWorkerConnector._commit_output`` returns: one
``AuxRequestOutput`` per request whose rows are views of the step's snapshot
(46 MoE layers x top-8, uint8). Two mixes: ``decode`` (one row per request) and
``prefill`` (an 8192-token step: a quarter of the requests carry prefill chunks).

transport  = pack (packed arm only, given the step's ``StepRows`` as the patched
             ``process_output`` gives it; the copy into one array happens while
             pickling) + pickle + unpickle, using
             MessageQueue's pickler (protocol 5, out-of-band buffers >= 1 MiB,
             received into bytearrays as ``dequeue`` does)
full path  = transport + one real ``AuxOutputSchedulerConnector.take_output`` per
             request, as the scheduler calls it (packed: unpickling builds every
             value, each request's rows copied into an array of its own so a kept
             chunk pins only that request, so transport includes that)
mq x-proc  = the real vLLM ``MessageQueue``: enqueue in this process, dequeue (and
             take_output) in a forked reader process, one step at a time

step path = issue 10's comparison at ``--step-requests`` (default 400,1000) decode
             requests, every arm in the same run, round-robin, medians over rounds:
             transport = upstream: pickle + unpickle of the dict (MessageQueue's
             pickling); prime: building the packed form from the step's arrays (the
             real ``batched_commit._packed``, what the batched path runs instead of
             building one ``AuxRequestOutput`` per request) + pickle + unpickle
             (``filled``: without batched_take, unpickling fills the step;
             ``lazy``: with batched_take, it does not). take = one ``take_output``
             per request as the scheduler calls it (bound on each call): upstream's
             on the dict / on the filled step, batched_take's on the lazy step.
             ``lazy`` is batched_take as registered (a plain function,
             ``Calling.PLAIN``); ``lazy wrapt`` the same body installed as a wrapt
             wrapper, to show what wrapt's per-call binding costs. Then
             ``take_output alone``: only the N calls on a lazy step whose lookup is
             already built, plain vs wrapt alternating per step. The transport
             there is the R3 payload pickled *alone*.
in context = the same decode step as it really travels: ``(ResponseStatus.SUCCESS,
             ModelRunnerOutput)`` (vLLM's constructor, the step's req_ids) through
             vLLM's real ``MessageQueue.enqueue`` + ``dequeue`` in one process, with no
             R3 output / upstream's dict / the packed step built in the region; R3's
             increment = arm - none per round, median of rounds (``bench_in_context``).

Times are medians over steps, in ms of the timing thread's CPU time by default
(``--clock cpu``: robust when other processes share the cores, as wall time is not);
``--clock wall`` measures wall time. The cyclic GC is paused inside timed regions
(collections are a separate, GC-threshold matter). Ratios are dict / packed.
"""

from __future__ import annotations

import argparse
import copyreg
import functools
import gc
import io
import multiprocessing as mp
import operator
import os
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.distributed.aux_output_connector.connector import (  # noqa: E402
    AuxOutputSchedulerConnector,
    AuxRequestOutput,
)
from vllm.distributed.device_communicators import shm_broadcast  # noqa: E402
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue  # noqa: E402

from prime_r3.packed import PackedAuxOutputs, StepRows  # noqa: E402

SHAPE = (46, 8)
PREFILL_BUDGET = 8192
INLINE_LIMIT = 1024 * 1024  # MessageQueue.enqueue inlines buffers below 1 MiB
CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
_clock = CLOCKS["cpu"]  # set by --clock; the forked reader inherits it


class FakeRequest:
    """The three things take_output reads from a vllm Request."""

    __slots__ = ("request_id", "num_tokens")

    def __init__(self, request_id: str, num_tokens: int) -> None:
        self.request_id = request_id
        self.num_tokens = num_tokens

    def is_finished(self) -> bool:
        return False


def make_step(
    n: int, mix: str, rng: np.random.Generator
) -> tuple[dict[str, AuxRequestOutput], list[FakeRequest], StepRows]:
    lengths = np.ones(n, dtype=np.int64)
    if mix == "prefill":
        chunked = rng.choice(n, size=max(1, n // 4), replace=False)
        spare = max(PREFILL_BUDGET - n, len(chunked))
        lengths[chunked] = (
            rng.multinomial(spare - len(chunked), [1 / len(chunked)] * len(chunked)) + 1
        )
    snapshot = rng.integers(0, 256, size=(int(lengths.sum()), *SHAPE), dtype=np.uint8)
    token_starts = rng.integers(0, 16_000, size=n).tolist()
    tags = rng.integers(1 << 32, size=n).tolist()
    outputs: dict[str, AuxRequestOutput] = {}
    requests = []
    start = 0
    for i, (length, token_start, tag) in enumerate(
        zip(lengths.tolist(), token_starts, tags, strict=True)
    ):
        request_id = f"chatcmpl-{i:06d}-{tag:08x}"
        # As _commit_output builds them: views of the step's snapshot.
        outputs[request_id] = AuxRequestOutput(token_start, snapshot[start : start + length])
        requests.append(FakeRequest(request_id, token_start + length + 1))
        start += length
    # What the patched process_output hands pack: the step's PendingAuxOutput fields.
    query_start_loc = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    step = StepRows(snapshot, list(outputs), query_start_loc, np.zeros(n, dtype=np.int64))
    return outputs, requests, step


def mq_dumps(obj: Any) -> list[Any]:
    """MessageQueue.enqueue's pickling: the stream first, then out-of-band buffers."""
    buffers: list[Any] = [b""]

    def oob_callback(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if len(raw) < INLINE_LIMIT:
            return True
        buffers.append(raw)
        return False

    dispatch_table = dict(copyreg.dispatch_table)
    dispatch_table[torch.Tensor] = shm_broadcast._reduce_tensor
    with io.BytesIO() as bio:
        pickler = pickle.Pickler(
            bio, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=oob_callback
        )
        pickler.dispatch_table = dispatch_table
        pickler.dump(obj)
        buffers[0] = bio.getvalue()
    return buffers


def mq_loads(buffers: list[Any]) -> Any:
    """MessageQueue.dequeue's unpickling: out-of-band buffers are copied to bytearrays."""
    return pickle.loads(buffers[0], buffers=[bytearray(b) for b in buffers[1:]])


def real_take_output() -> Callable[..., Any]:
    """vLLM's real ``take_output``.

    0.31/0.32 build the connector with no arguments; 0.33's constructor needs the
    Scheduler's KV cache manager (tens of seconds to build offline), and
    ``take_output`` reads no connector state (its source is a fingerprinted anchor of
    the patch), so there it is called unbound.
    """
    try:
        return AuxOutputSchedulerConnector().take_output
    except TypeError:
        return functools.partial(AuxOutputSchedulerConnector.take_output, None)


def take_all(output: Any, requests: list[FakeRequest], take: Callable[..., Any]) -> int:
    rows = 0
    for request in requests:
        rows += len(take(request, output))
    return rows


Samples = dict[str, list[float]]


def _ms(samples: list[float], stat: Callable[[list[float]], float] = statistics.median) -> float:
    return stat(samples) * 1e3


def _sum(res: Samples, *keys: str) -> list[float]:
    return [sum(values) for values in zip(*(res[k] for k in keys), strict=True)]


def fresh_step(
    n: int, mix: str, seed: int
) -> tuple[dict[str, AuxRequestOutput], list[Any], StepRows]:
    """Build a step right before timing it, as _commit_output does before the send.

    Each arm gets its own identical copy, so neither runs on objects the other arm's
    pickling just pulled into (or evicted from) the CPU caches.
    """
    gc.collect()
    return make_step(n, mix, np.random.default_rng(seed))


def bench_inprocess(n: int, mix: str, steps: int, seed: int) -> Samples:
    take = real_take_output()
    res: Samples = {k: [] for k in ("d_tr", "p_build", "p_tr", "d_take", "p_take")}
    for step in range(steps):
        outputs, requests, _ = fresh_step(n, mix, seed + step)
        gc.disable()
        t0 = _clock()
        received = mq_loads(mq_dumps(outputs))
        t1 = _clock()
        d_rows = take_all(received, requests, take)
        t2 = _clock()
        gc.enable()
        outputs, requests, rows = fresh_step(n, mix, seed + step)
        gc.disable()
        t3 = _clock()
        packed = PackedAuxOutputs.pack(outputs, rows)
        t4 = _clock()
        received_p = mq_loads(mq_dumps(packed))
        t5 = _clock()
        p_rows = take_all(received_p, requests, take)
        t6 = _clock()
        gc.enable()
        assert d_rows == p_rows
        for key, value in zip(res, (t1 - t0, t4 - t3, t5 - t3, t2 - t1, t6 - t5), strict=True):
            res[key].append(value)
    return res


def _reader(handle: Any, conn: Any) -> None:
    queue = MessageQueue.create_from_handle(handle, 0)
    queue.wait_until_ready()
    take = real_take_output()
    while True:
        requests = conn.recv()
        if requests is None:
            return
        gc.collect()
        gc.disable()
        t0 = _clock()
        output = queue.dequeue()
        t1 = _clock()
        rows = take_all(output, requests, take)
        t2 = _clock()
        gc.enable()
        conn.send((t1 - t0, t2 - t1, rows))


def bench_message_queue(
    sizes: list[int], mixes: list[str], steps: int, seed: int
) -> dict[tuple[int, str], Samples]:
    parent, child = mp.get_context("fork").Pipe()
    handle_pipe, handle_child = mp.get_context("fork").Pipe()
    ctx = mp.get_context("fork")

    def reader_main(conn: Any = child, hconn: Any = handle_child) -> None:
        _reader(hconn.recv(), conn)

    process = ctx.Process(target=reader_main, daemon=True)
    process.start()  # forked before any zmq context exists in this process
    queue = MessageQueue(1, 1)
    handle_pipe.send(queue.export_handle())
    queue.wait_until_ready()
    results = {}
    try:
        for n in sizes:
            for mix in mixes:
                res: dict[str, list[float]] = {
                    k: [] for k in ("d_enq", "d_deq", "d_take", "p_enq", "p_deq", "p_take")
                }
                for step in range(steps):
                    for arm in ("d", "p"):
                        outputs, requests, rows = fresh_step(n, mix, seed + step)
                        gc.disable()
                        t0 = _clock()
                        queue.enqueue(
                            outputs if arm == "d" else PackedAuxOutputs.pack(outputs, rows)
                        )
                        enq = _clock() - t0
                        gc.enable()
                        # Sent after enqueue, so the reader's dequeue does not include
                        # waiting (and a spinning reader does not steal the writer's core).
                        parent.send(requests)
                        deq, took, rows = parent.recv()
                        assert rows == sum(len(o.rows) for o in outputs.values())
                        res[f"{arm}_enq"].append(enq)
                        res[f"{arm}_deq"].append(deq)
                        res[f"{arm}_take"].append(took)
                results[(n, mix)] = res
    finally:
        parent.send(None)
        process.join(10)
    return results


def take_each(output: Any, requests: list[FakeRequest], connector: Any) -> int:
    """One take_output per request, looked up on the connector each time (as
    ``Scheduler.update_from_output`` calls ``self.aux_output_connector.take_output``)."""
    rows = 0
    for request in requests:
        rows += len(connector.take_output(request, output))
    return rows


def _connector() -> Any:
    try:
        return AuxOutputSchedulerConnector()
    except TypeError:  # 0.33's constructor needs the scheduler's KV cache manager
        return object.__new__(AuxOutputSchedulerConnector)  # take_output reads no state


def _wrapt_batched_take() -> Any:
    """batched_take's spec with its target as a ``Calling.WRAPT`` wrapper whose body is
    the same as the registry's plain ``take_output`` (same lookup, branches, counters),
    written in wrapt's calling convention: the arm that shows what the binding costs.
    Same patch name, so the packed reader treats it as batched_take (reads lazily)."""
    import dataclasses

    from prime_r3.fixes import batched_take
    from prime_r3.packed import _Unfilled
    from prime_r3.spec import Calling

    counters = batched_take.COUNTERS

    def factory(params: Any) -> Any:
        def take_output(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
            request, output = args
            if type(output) is not _Unfilled:
                counters.fallback("not_packed")
                return wrapped(request, output)
            places = output._index
            if places is None:
                places = output._split()  # the one producer of an unfilled step's index
                counters.steps += 1
                counters.batched_steps += 1
            try:
                place = places.get(request.request_id)
            except TypeError:
                place = None
            if place is None:
                counters.fallback("missing")
                return wrapped(request, output)
            start, count, rows = place
            local_end = request.num_tokens - 1 - start
            if local_end == count:
                counters.fast_requests += 1
                return rows
            if local_end < 0:
                counters.fallback("before_start")
                return wrapped(request, output)
            if local_end > count:
                counters.fallback("beyond_rows")
                return wrapped(request, output)
            counters.fast_requests += 1
            return rows[:local_end]

        return take_output

    (target,) = batched_take.SPEC.targets
    wrapt_target = dataclasses.replace(target, make_wrapper=factory, calling=Calling.WRAPT)
    return dataclasses.replace(batched_take.SPEC, targets=(wrapt_target,))


def _take_registries() -> tuple[Any, Any]:
    """The registry, and a copy with batched_take as ``_wrapt_batched_take``."""
    from prime_r3 import patches

    registry = patches.REGISTRY
    wrapt_registry = tuple(
        _wrapt_batched_take() if spec.name == "batched_take" else spec for spec in registry
    )
    return registry, wrapt_registry


def _install_take(registry: Any, use: Any) -> None:
    """batched_take reverted, then applied from ``use`` (a registry) unless it is None."""
    import prime_r3
    from prime_r3 import patches

    prime_r3.revert(["batched_take"])
    if use is None:
        return
    patches.REGISTRY = use
    try:
        prime_r3.apply(["batched_take"], log=False)
    finally:
        patches.REGISTRY = registry


def _packed_args(outputs: dict[str, Any], rows: Any, n: int) -> tuple[Any, ...]:
    """``batched_commit._packed``'s arguments for a step whose every request is fast,
    prepared outside any timed region (the fast path has them as arrays already)."""
    starts = np.fromiter((o.token_start for o in outputs.values()), np.int64, n)
    return (
        PackedAuxOutputs,
        list(outputs),
        starts,
        rows.routed_experts,
        list(range(n)),
        np.arange(n),
        [],
        [],
    )


def bench_step_path(n: int, rounds: int, steps: int, seed: int) -> Samples:
    """Issue 10's transport and take comparison; arms round-robin within each round.

    ``lazy`` is batched_take as registered (``Calling.PLAIN``); ``lazyw`` the same body
    installed as a wrapt wrapper (``_wrapt_batched_take``), both through the layer.
    """
    import prime_r3
    from prime_r3.fixes.batched_commit import _packed

    registry, wrapt_registry = _take_registries()
    uses = {"up": None, "fill": None, "lazy": registry, "lazyw": wrapt_registry}
    connector = _connector()
    arms = ("up", "fill", "lazy", "lazyw")
    res: Samples = {f"{arm}_{part}": [] for arm in arms for part in ("tr", "take")}
    res["fill_build"] = []
    for _ in range(rounds):
        per_round: Samples = {k: [] for k in res}
        for step in range(steps):
            # Rotated each step: no arm always runs right after the same other arm.
            for arm in arms[step % len(arms) :] + arms[: step % len(arms)]:
                _install_take(registry, uses[arm])
                outputs, requests, rows = fresh_step(n, "decode", seed + step)
                args = _packed_args(outputs, rows, n)
                gc.disable()
                t0 = _clock()
                if arm == "up":
                    received = mq_loads(mq_dumps(outputs))
                else:
                    step_output = _packed(*args)
                    t_build = _clock()
                    received = mq_loads(mq_dumps(step_output))
                t1 = _clock()
                taken = take_each(received, requests, connector)
                t2 = _clock()
                gc.enable()
                assert taken == n
                per_round[f"{arm}_tr"].append(t1 - t0)
                per_round[f"{arm}_take"].append(t2 - t1)
                if arm == "fill":
                    per_round["fill_build"].append(t_build - t0)
                # Freed here, untimed: rebinding them inside the next arm's timed region
                # would charge it this arm's deallocation (a filled step's N objects).
                received = step_output = None
        for key, values in per_round.items():
            if values:
                res[key].append(statistics.median(values))
    prime_r3.revert(["batched_take"])
    return res


def _response_queue() -> tuple[Any, Any]:
    """vLLM's real worker response queue, writer and reader in this process.

    ``MessageQueue(1, 1)`` is what ``WorkerProc`` builds for ``worker_response_mq``
    (0.31-0.33: no tensor arena there); the reader attaches from its handle as
    EngineCore's ``create_from_handle(handle, 0)`` does. Both ends in one thread: each
    step is one ``enqueue`` then one ``dequeue``, so no time is spent waiting.
    """
    writer = MessageQueue(1, 1)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    writer.wait_until_ready()
    reader.wait_until_ready()
    return writer, reader


def _decode_output(outputs: dict[str, Any], seed: int) -> Any:
    """A decode step's ``ModelRunnerOutput`` by vLLM's own constructor: ``req_ids`` the
    step's request ids (the same ``str`` objects the aux output is keyed by, as on the
    real path: ``PendingAuxOutput.request_ids = list(input_batch.req_ids)`` and
    ``ModelRunnerOutput.req_ids = input_batch.req_ids``), ``req_id_to_index`` as the V2
    runner builds it, one sampled token per request (``get_output``'s lists)."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(outputs)
    tokens = np.random.default_rng(seed).integers(0, 150_000, size=len(req_ids)).tolist()
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=[[token] for token in tokens],
    )


def bench_in_context(n: int, rounds: int, steps: int, seed: int) -> Samples:
    """R3's transport increment inside the whole ``ModelRunnerOutput``, as sent.

    Each step sends ``(ResponseStatus.SUCCESS, model_runner_output)`` (what
    ``WorkerProc.enqueue_output`` enqueues) through vLLM's real ``MessageQueue.enqueue``
    and ``dequeue`` (their own pickler, dispatch table, OOB threshold and ring copy).
    Arms, round-robin within a step: ``none`` (``aux_output_connector_output=None``),
    ``up`` (upstream's dict), ``packed`` (``batched_commit._packed`` building the step's
    packed form inside the timed region, then the send; read lazily, batched_take in
    force). The R3 increment of an arm is its median minus ``none``'s, per round.
    Received outputs are checked untimed (every request's rows via ``take_output``).
    """
    from vllm.v1.executor.multiproc_executor import WorkerProc

    import prime_r3
    from prime_r3.fixes.batched_commit import _packed

    registry, _ = _take_registries()
    success = WorkerProc.ResponseStatus.SUCCESS
    writer, reader = _response_queue()
    connector = _connector()
    arms = ("none", "up", "packed")
    res: Samples = {f"{arm}_{part}": [] for arm in arms for part in ("enq", "deq", "all")}
    res["packed_shared"] = []
    _install_take(registry, registry)
    try:
        for _ in range(rounds):
            per_round: Samples = {k: [] for k in res}
            for step in range(steps):
                for arm in arms[step % len(arms) :] + arms[: step % len(arms)]:
                    outputs, requests, rows = fresh_step(n, "decode", seed + step)
                    args = _packed_args(outputs, rows, n)
                    model_output = _decode_output(outputs, seed + step)
                    gc.disable()
                    t0 = _clock()
                    if arm == "up":
                        model_output.aux_output_connector_output = outputs
                    elif arm == "packed":
                        model_output.aux_output_connector_output = _packed(*args)
                    writer.enqueue((success, model_output))
                    t1 = _clock()
                    status, received = reader.dequeue()
                    t2 = _clock()
                    gc.enable()
                    assert status == success and received.req_ids == model_output.req_ids
                    aux = received.aux_output_connector_output
                    if arm == "none":
                        assert aux is None
                    else:
                        assert take_each(aux, requests, connector) == n
                    if arm == "packed":
                        # Are the received step's ids the received req_ids' objects
                        # (pickled as memo references) or new strings?
                        shared = all(map(operator.is_, aux, received.req_ids))
                        per_round["packed_shared"].append(float(shared))
                    per_round[f"{arm}_enq"].append(t1 - t0)
                    per_round[f"{arm}_deq"].append(t2 - t1)
                    per_round[f"{arm}_all"].append(t2 - t0)
                    received = aux = model_output = None  # freed untimed
            for key, values in per_round.items():
                res[key].append(statistics.median(values))
    finally:
        prime_r3.revert(["batched_take"])
        del writer, reader
    return res


def bench_take_only(n: int, rounds: int, steps: int, seed: int) -> Samples:
    """take_output per step alone, on a received lazy step: ``plain`` (batched_take as
    registered) vs ``wrapt`` (the same body as a wrapt wrapper), alternating per step,
    both installed through the layer; each step is split (its index built) before timing."""
    import prime_r3
    from prime_r3.fixes.batched_commit import _packed
    from prime_r3.packed import _Unfilled

    registry, wrapt_registry = _take_registries()
    uses = {"plain": registry, "wrapt": wrapt_registry}
    connector = _connector()
    res: Samples = {"plain": [], "wrapt": []}
    for _ in range(rounds):
        per_round: Samples = {k: [] for k in res}
        for step in range(steps):
            for arm in ("plain", "wrapt") if step % 2 else ("wrapt", "plain"):
                _install_take(registry, uses[arm])
                outputs, requests, rows = fresh_step(n, "decode", seed + step)
                built = _packed(*_packed_args(outputs, rows, n))
                received = mq_loads(mq_dumps(built))
                assert type(received) is _Unfilled
                # Per step, the same in both arms, not timed here: batched_take's index.
                received._split()
                gc.disable()
                t0 = _clock()
                taken = take_each(received, requests, connector)
                t1 = _clock()
                gc.enable()
                assert taken == n and type(received) is _Unfilled
                per_round[arm].append(t1 - t0)
                received = built = None  # freed untimed
        for key, values in per_round.items():
            res[key].append(statistics.median(values))
    prime_r3.revert(["batched_take"])
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="400,1000,2000")
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    parser.add_argument(
        "--step-requests",
        default="400,1000",
        help="comma list of decode request counts for the step path (default 400,1000)",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--only-step-path", action="store_true", help="print only issue 10's comparison"
    )
    args = parser.parse_args(argv)
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        step_sizes = [int(x) for x in args.step_requests.split(",")]
    except ValueError:
        step_sizes = []
    if not step_sizes or min(step_sizes) < 1:
        parser.error(
            f"--step-requests must be a comma list of integers >= 1, got {args.step_requests!r}"
        )
    global _clock
    _clock = CLOCKS[args.clock]
    sizes = [int(x) for x in args.requests.split(",")]
    mixes = ["decode", "prefill"]
    started = time.perf_counter()

    print(f"rows per token {SHAPE} uint8; {args.clock} ms per step, median of {args.steps} steps")
    print("ratio = dict / packed on medians; [min] = the same ratio on per-arm minimums")
    head = (
        f"{'reqs':>5} {'mix':>7} | transport: {'dict':>7} {'packed':>7} {'ratio':>6} {'[min]':>6}"
    )
    head += (
        f" | full: {'dict':>7} {'packed':>7} {'ratio':>6} | take_output: {'dict':>6} {'packed':>6}"
    )

    def row(n: int, mix: str, tr: tuple[list[float], list[float]], r: Samples) -> str:
        (tr_d, tr_p), take_d, take_p = tr, r["d_take"], r["p_take"]
        full_d, full_p = (
            _ms(_sum({"a": tr_d, "b": take_d}, "a", "b")),
            _ms(_sum({"a": tr_p, "b": take_p}, "a", "b")),
        )
        return (
            f"{n:>5} {mix:>7} |            {_ms(tr_d):>7.3f} {_ms(tr_p):>7.3f}"
            f" {_ms(tr_d) / _ms(tr_p):>5.1f}x {min(tr_d) / min(tr_p):>5.1f}x"
            f" |       {full_d:>7.3f} {full_p:>7.3f} {full_d / full_p:>5.1f}x"
            f" |              {_ms(take_d):>6.3f} {_ms(take_p):>6.3f}"
        )

    for n in step_sizes:
        r = bench_step_path(n, args.rounds, args.steps, args.seed)
        print(
            f"\nstep path at {n} decode requests (issue 10), medians of {args.rounds} rounds"
            f" x {args.steps} steps, MessageQueue's pickling in-process:"
        )
        up_tr, up_take = _ms(r["up_tr"]), _ms(r["up_take"])
        print(f"{'arm':<44} {'transport':>9} {'vs up':>6} {'take':>7} {'total':>7} {'vs up':>6}")
        for label, arm in (
            ("upstream dict, upstream take_output", "up"),
            ("prime filled (packed_outputs only)", "fill"),
            ("prime lazy + batched_take (plain function)", "lazy"),
            ("prime lazy + batched_take as wrapt wrapper", "lazyw"),
        ):
            tr, take = _ms(r[f"{arm}_tr"]), _ms(r[f"{arm}_take"])
            total = tr + take
            print(
                f"{label:<44} {tr:>9.3f} {up_tr / tr:>5.1f}x {take:>7.3f} {total:>7.3f}"
                f" {(up_tr + up_take) / total:>5.1f}x"
            )
        print(f"(building the packed form, inside prime transport: {_ms(r['fill_build']):.3f} ms)")
        isolated = up_tr / _ms(r["lazy_tr"])
        c = bench_in_context(n, args.rounds, args.steps, args.seed)
        print(
            f"in context at {n} decode requests: (SUCCESS, ModelRunnerOutput) through vLLM's real"
            f" MessageQueue.enqueue + dequeue (one process), medians of {args.rounds} rounds x"
            f" {args.steps} steps; R3 increment = arm - none (per round):"
        )
        print(f"{'arm':<44} {'enqueue':>9} {'dequeue':>9} {'total':>7} {'R3 incr':>8} {'vs up':>6}")
        increments = {
            arm: _ms([a - b for a, b in zip(c[f"{arm}_all"], c["none_all"], strict=True)])
            for arm in ("up", "packed")
        }
        for label, arm in (
            ("no R3 output (aux None)", "none"),
            ("upstream dict", "up"),
            ("prime packed (built in the region) + lazy", "packed"),
        ):
            line = f"{label:<44} {_ms(c[f'{arm}_enq']):>9.3f} {_ms(c[f'{arm}_deq']):>9.3f}"
            line += f" {_ms(c[f'{arm}_all']):>7.3f}"
            if arm != "none":
                line += f" {increments[arm]:>8.3f} {increments['up'] / increments[arm]:>5.1f}x"
            print(line)
        shared = min(c["packed_shared"]) == 1.0
        print(
            f"R3 transport at {n}: in context {increments['up'] / increments['packed']:.1f}x"
            f" upstream, isolated payload {isolated:.1f}x (the transport column above); packed"
            f" ids {'are' if shared else 'are NOT'} the received req_ids' str objects"
        )
        t = bench_take_only(n, args.rounds, args.steps, args.seed)
        plain, wrapped = _ms(t["plain"]), _ms(t["wrapt"])
        print(
            f"take_output alone, {n} calls on a lazy step (lookup built before timing), "
            f"median of {args.rounds} round medians [min, max]: plain {plain:.3f} ms "
            f"[{_ms(t['plain'], min):.3f}, {_ms(t['plain'], max):.3f}], "
            f"wrapt {wrapped:.3f} ms [{_ms(t['wrapt'], min):.3f}, {_ms(t['wrapt'], max):.3f}]; "
            f"wrapt - plain {wrapped - plain:.3f} ms/step "
            f"({(wrapped - plain) / n * 1e3:.3f} us/call)"
        )
    if args.only_step_path:
        return 0

    print("\nin-process, MessageQueue's pickling: transport = (pack +) pickle + unpickle")
    print(head)
    for n in sizes:
        for mix in mixes:
            r = bench_inprocess(n, mix, args.steps, args.seed)
            print(row(n, mix, (r["d_tr"], r["p_tr"]), r) + f"   (pack {_ms(r['p_build']):.3f})")

    print("\nreal MessageQueue: enqueue (packed: pack + enqueue) here, dequeue + take_output")
    print("in a forked reader process; transport = enqueue + dequeue")
    print(head)
    for (n, mix), r in bench_message_queue(sizes, mixes, args.steps, args.seed).items():
        tr = (_sum(r, "d_enq", "d_deq"), _sum(r, "p_enq", "p_deq"))
        print(row(n, mix, tr, r))
    elapsed, load = time.perf_counter() - started, os.getloadavg()[0]
    print(f"\n(total run {elapsed:.0f} s; 1-min load average {load:.1f} on {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
