"""Workers pack a step only for an EngineCore that declared it reads the packed format.

Packing is decided in the worker; reading happens in EngineCore. EngineCore's
``build_connector_meta`` wrapper (applied only where ``packed_outputs`` applied, and
only while the live scheduler connector's ``take_output`` and the scheduler's
``update_from_output`` are upstream's) sets
``READS_MARK = FORMAT_VERSION`` (a plain int) on the step's connector metadata; the
worker's ``process_output`` wrapper packs only when the step's metadata carries the
version it writes. Everything else (no declaration, another version, a metadata
object that takes no attribute) sends upstream's dict.

Two real processes: this one is the output worker (``packed_outputs`` applied, vLLM's
real worker connector); a forked one is EngineCore with vLLM's real ``Scheduler`` in
one of several configurations. Metadata goes EngineCore -> worker and the step output
worker -> EngineCore, each through vLLM's real ``MessageQueue``; EngineCore reads the
output with the real ``take_output``.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import gc  # noqa: E402
import multiprocessing  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from vllm.distributed.aux_output_connector import worker as aux_worker  # noqa: E402
from vllm.distributed.aux_output_connector.connector import (  # noqa: E402
    AuxOutputSchedulerConnector,
)
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue  # noqa: E402

import prime_r3  # noqa: E402
from prime_r3.packed import FORMAT_VERSION, PackedAuxOutputs  # noqa: E402
from tests.test_packed_outputs import Req, _connector, outcome, real_vllm  # noqa: E402

PROMPTS = {"p0": 10, "p1": 7, "p2": 13}  # distinct prompts: no prefix-cache hits


class CustomConnector(AuxOutputSchedulerConnector):
    """A scheduler connector subclass with its own consumer (e.g. another layer's)."""

    def take_output(self, request: Any, output: Any) -> Any:
        return super().take_output(request, output)


def _overriding_scheduler(base: type) -> type:
    """A scheduler class a plugin may configure (``scheduler_cls``): it consumes step
    outputs with its own ``update_from_output``, so it must get upstream's dicts."""

    class OverridingScheduler(base):  # type: ignore[misc, valid-type]
        def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
            return super().update_from_output(scheduler_output, model_runner_output)

    return OverridingScheduler


def _configure_engine_core(mode: str) -> None:
    """Make this (forked) process an EngineCore as the plugin would under ``mode``."""
    prime_r3.revert()
    for var in [v for v in os.environ if v.startswith("PRIME_R3")]:
        del os.environ[var]
    if mode == "no prime_r3":  # not installed on this node: unpickling would fail
        for name in [m for m in sys.modules if m == "prime_r3" or m.startswith("prime_r3.")]:
            del sys.modules[name]
        sys.modules["prime_r3"] = None  # type: ignore[assignment]
        return
    if mode == "PRIME_R3=0":
        os.environ["PRIME_R3"] = "0"
    elif mode == "without packed_outputs":
        os.environ["PRIME_R3_PATCHES"] = "all,-packed_outputs"
    elif mode == "without batched_take":
        os.environ["PRIME_R3_PATCHES"] = "all,-batched_take"
    elif mode == "reads format 2":  # another prime_r3 release, with a newer format
        from prime_r3 import packed

        packed.FORMAT_VERSION = FORMAT_VERSION + 1
    from prime_r3 import plugin

    plugin.load()  # what vLLM's load_general_plugins() calls in EngineCore


def _engine_core(mode: str, conn: Any) -> None:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from prime_r3.bench.loop import _block_hasher  # before prime_r3 may be made absent

    real = real_vllm()  # built before the fork
    scheduler = real.scheduler
    hasher = _block_hasher(real.vllm_config, real.kv_cache_config)
    _configure_engine_core(mode)
    if mode == "custom take_output":
        scheduler.aux_output_connector.__class__ = CustomConnector
    if mode == "custom update_from_output":  # the real scheduler, as that subclass
        scheduler.__class__ = _overriding_scheduler(type(scheduler))
    to_worker = MessageQueue(1, 1)
    conn.send(to_worker.export_handle())
    from_worker = MessageQueue.create_from_handle(conn.recv(), 0)
    to_worker.wait_until_ready()
    from_worker.wait_until_ready()
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    for k, (request_id, length) in enumerate(PROMPTS.items()):
        scheduler.add_request(
            Request(
                request_id,
                [100 * (k + 1) + t for t in range(length)],
                params,
                None,
                block_hasher=hasher,
            )
        )
    scheduler_output = scheduler.schedule()
    to_worker.enqueue(
        (
            scheduler_output.aux_output_connector_metadata,
            dict(scheduler_output.num_scheduled_tokens),
        )
    )
    status, output = from_worker.dequeue(timeout=60)
    take = scheduler.aux_output_connector.take_output
    requests = [scheduler.requests[r] for r in PROMPTS]
    stubs = [Req(r.request_id, r.num_tokens, r.is_finished()) for r in requests]
    seen = []
    for request in requests:
        try:
            rows = take(request, output)
            seen.append(("rows", rows.dtype.str, rows.shape, rows.tobytes()))
        except Exception as error:  # noqa: BLE001
            seen.append(("raise", type(error), str(error)))
    conn.send((type(output).__module__, type(output).__name__, stubs, seen))
    try:  # a step packed by a worker that skipped the handshake
        from_worker.dequeue(timeout=60)
        conn.send(("read", None))
    except Exception as error:  # noqa: BLE001
        conn.send(("raise", f"{type(error).__name__}: {error}"))
    conn.recv()


def _worker_step(metadata: Any, num_scheduled: dict[str, int]) -> Any:
    """One step through the real worker connector: begin_step, snapshot, process_output."""
    connector = _connector()
    connector.begin_step(metadata)
    ids = list(num_scheduled)
    sizes = [num_scheduled[r] for r in ids]
    rng = np.random.default_rng(0)
    shape = connector._capturer.shape_per_token
    pending = aux_worker.PendingAuxOutput(
        connector=connector,
        request_ids=ids,
        token_starts=np.zeros(len(ids), dtype=np.int32),
        query_start_loc=np.concatenate(([0], np.cumsum(sizes))).astype(np.int32),
        routed_experts_gpu=None,  # type: ignore[arg-type]
        routed_experts=rng.integers(0, 300, (sum(sizes), *shape), dtype=np.uint16),
        num_sampled=np.ones(len(ids), dtype=np.int64),
        num_rejected=np.zeros(len(ids), dtype=np.int64),
    )
    with connector._lock:  # the bookkeeping prepare_output does
        connector._pending_outputs.append(pending)
        for request_id in ids:
            connector._requests[request_id].pending_outputs += 1
    return pending.process_output()


MODES = {  # EngineCore configuration -> what the worker must send
    # batched_take wraps take_output: EngineCore still declares (our wrapper of
    # upstream's function reads the packed form) and takes every request by a slice,
    # so the received step is still unfilled after all the takes.
    "patched": PackedAuxOutputs,
    "without batched_take": PackedAuxOutputs,
    "PRIME_R3=0": dict,
    "without packed_outputs": dict,
    "no prime_r3": dict,
    "custom take_output": dict,
    "custom update_from_output": dict,
    "reads format 2": dict,
}


@pytest.mark.parametrize("mode", list(MODES))
def test_worker_packs_only_for_an_engine_core_that_reads_it(
    mode: str, reverted: pytest.MonkeyPatch
) -> None:
    real_vllm()  # build before forking: the child reuses it
    ctx = multiprocessing.get_context("fork")
    conn, child_conn = ctx.Pipe()
    process = ctx.Process(target=_engine_core, args=(mode, child_conn), daemon=True)
    process.start()
    report = prime_r3.apply(["packed_outputs"], log=False)  # this process: the worker
    assert report.outcome("packed_outputs").state == "applied", report.summary()
    to_core = MessageQueue(1, 1)
    try:
        from_core = MessageQueue.create_from_handle(conn.recv(), 0)
        conn.send(to_core.export_handle())
        to_core.wait_until_ready()
        from_core.wait_until_ready()
        metadata, num_scheduled = from_core.dequeue(timeout=60)
        assert list(num_scheduled) == list(PROMPTS)
        output = _worker_step(metadata, num_scheduled)
        expected = MODES[mode]
        assert type(output) is expected, (mode, type(output))
        to_core.enqueue((0, output))
        assert conn.poll(60), "EngineCore process did not answer"
        module, name, stubs, seen = conn.recv()
        received = (expected.__module__, expected.__name__)
        if mode == "patched":  # read by batched_take's slices, never filled
            received = (expected.__module__, "_Unfilled")
        assert (module, name) == received
        upstream = dict(output)  # the worker holds upstream's own values
        assert seen == [outcome(stub, upstream) for stub in stubs]
        assert {s[0] for s in seen} == {"rows"}, seen
        # A worker that packs without the handshake (or runs another version):
        to_core.enqueue((0, PackedAuxOutputs.pack(upstream)))
        assert conn.poll(60), "EngineCore process did not answer"
        result, message = conn.recv()
        if mode == "reads format 2":
            assert result == "raise" and message.startswith("PackedFormatError: "), message
            assert f"format {FORMAT_VERSION}," in message and f"format {FORMAT_VERSION + 1}" in (
                message
            )
        elif mode == "no prime_r3":
            assert result == "raise" and "ModuleNotFoundError" in message  # why we handshake
        else:
            assert result == "read", message
        conn.send(None)
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
        del to_core
        gc.collect()
    assert process.exitcode == 0


def test_declaration_is_a_plain_int_on_the_real_metadata(reverted: pytest.MonkeyPatch) -> None:
    """What crosses the wire: an int attribute on upstream's metadata (no prime_r3 type)."""
    import pickle
    import pickletools

    from vllm.v1.core.sched.output import SchedulerOutput

    from prime_r3.packed import READS_MARK

    connector = real_vllm().scheduler.aux_output_connector
    empty = SchedulerOutput.make_empty() if hasattr(SchedulerOutput, "make_empty") else None
    if empty is None:
        pytest.skip("no SchedulerOutput.make_empty on this release")
    assert not hasattr(connector.build_connector_meta(empty, {}), READS_MARK)
    prime_r3.apply(["packed_outputs"], log=False)
    metadata = connector.build_connector_meta(empty, {})
    assert getattr(metadata, READS_MARK) == FORMAT_VERSION
    data = pickle.dumps(metadata, protocol=5)
    assert b"prime_r3." not in data  # no prime_r3 module is needed to unpickle it
    strings = [arg for op, arg, _ in pickletools.genops(data) if isinstance(arg, str)]
    modules = {arg for arg in strings if "." in arg and arg.split(".")[0].isidentifier()}
    assert modules and all(m.startswith("vllm.") for m in modules), modules
    assert getattr(pickle.loads(data), READS_MARK) == FORMAT_VERSION


def test_a_consumer_replaced_after_apply_withholds_the_declaration(
    reverted: pytest.MonkeyPatch,
) -> None:
    """``functools.wraps`` keeps upstream's name, module and file; identity does not."""
    import functools

    from vllm.v1.core.sched.output import SchedulerOutput

    from prime_r3.packed import READS_MARK

    if not hasattr(SchedulerOutput, "make_empty"):
        pytest.skip("no SchedulerOutput.make_empty on this release")
    connector = real_vllm().scheduler.aux_output_connector
    empty = SchedulerOutput.make_empty()
    prime_r3.apply(["packed_outputs"], log=False)
    assert getattr(connector.build_connector_meta(empty, {}), READS_MARK) == FORMAT_VERSION
    original = AuxOutputSchedulerConnector.take_output

    @functools.wraps(original)
    def layered(self: Any, request: Any, output: Any) -> Any:
        return original(self, request, output)

    reverted.setattr(AuxOutputSchedulerConnector, "take_output", layered)
    assert not hasattr(connector.build_connector_meta(empty, {}), READS_MARK)
    reverted.setattr(AuxOutputSchedulerConnector, "take_output", original)
    reverted.setattr(
        connector, "take_output", functools.partial(original, connector), raising=False
    )
    assert not hasattr(connector.build_connector_meta(empty, {}), READS_MARK)
    reverted.delattr(connector, "take_output")
    assert getattr(connector.build_connector_meta(empty, {}), READS_MARK) == FORMAT_VERSION


@pytest.mark.parametrize("order", [("packed_outputs", "batched_take"), ("batched_take",)])
def test_batched_take_keeps_the_declaration_and_a_foreign_layer_still_stops_it(
    order: tuple[str, ...], reverted: pytest.MonkeyPatch
) -> None:
    """batched_take's wrapper of upstream's take_output reads the packed form, so the
    declaration stays; anything else in its place (another layer's wrapper, even a wrapt
    one around ours, or one made with functools.wraps) still withholds it. Either apply
    order: packed_outputs applied after batched_take finds our wrapper on the class.

    batched_take installs a plain function (``Calling.PLAIN``): a clone of it that
    carries its code, closure, ``__dict__`` and names is still another layer's."""
    import functools

    import wrapt
    from vllm.v1.core.sched.output import SchedulerOutput

    from prime_r3 import state
    from prime_r3.packed import READS_MARK, _reads_lazily
    from tests.test_plain_calling import _clone

    if not hasattr(SchedulerOutput, "make_empty"):
        pytest.skip("no SchedulerOutput.make_empty on this release")
    connector = real_vllm().scheduler.aux_output_connector
    empty = SchedulerOutput.make_empty()
    upstream = AuxOutputSchedulerConnector.__dict__["take_output"]
    for name in order:
        assert prime_r3.apply([name], log=False).outcome(name).state == "applied"
    if order == ("batched_take",):
        assert not hasattr(connector.build_connector_meta(empty, {}), READS_MARK)
        assert prime_r3.apply(["packed_outputs"], log=False).outcome("packed_outputs").state == (
            "applied"
        )
    ours = AuxOutputSchedulerConnector.__dict__["take_output"]
    assert ours is not upstream and state.is_object_patched(ours)
    assert ours.__wrapped__ is upstream
    assert getattr(connector.build_connector_meta(empty, {}), READS_MARK) == FORMAT_VERSION

    def passthrough(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        return wrapped(*args, **kwargs)

    assert _reads_lazily()  # EngineCore reads received steps unfilled for batched_take
    for foreign in (
        wrapt.FunctionWrapper(ours, passthrough),  # another layer on top of ours
        wrapt.FunctionWrapper(upstream, passthrough),  # another layer's, not ours
        functools.wraps(upstream)(lambda self, request, output: upstream(self, request, output)),
        _clone(ours),  # a function that copies all ours carries; only identity differs
    ):
        # Put back by hand (not monkeypatch, which would undo after the fixture's revert
        # and so reinstall our wrapper behind prime_r3's back).
        AuxOutputSchedulerConnector.take_output = foreign
        try:
            assert not hasattr(connector.build_connector_meta(empty, {}), READS_MARK), foreign
            assert not _reads_lazily(), foreign
        finally:
            AuxOutputSchedulerConnector.take_output = ours
    assert getattr(connector.build_connector_meta(empty, {}), READS_MARK) == FORMAT_VERSION
    assert _reads_lazily()
