"""Parity scenarios for patches/: run once on the overlay, once on the patched vLLM tree.

    python -m tests.diffs_scenarios overlay OUT.pickle --site SITE
    python -m tests.diffs_scenarios diffs OUT.pickle --site SITE --patched DIR

``overlay``: the installed vLLM with every applicable prime_r3 patch applied.
``diffs``: ``PRIME_R3=0`` and ``DIR/vllm`` (the installed vLLM with the release's diffs
applied) first on ``sys.path``. Each scenario drives vLLM's real code through the
project's own parity harnesses (``tests/store_harness.py``, the helpers of
``tests/test_packed_outputs.py``, ``tests/test_engine_gc.py`` and
``tests/test_store_patches.py``) and returns plain data; ``tests/test_upstream_diffs.py``
compares the two runs. The results are pickled to OUT.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import inspect
import os
import pickle
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

STORE_FILE = "vllm/distributed/aux_output_connector/store.py"
STORE_SEEDS = range(120)
STORE_OPS = 300
GC_VALUES = [
    "50000,20,100",
    "0,10,10",
    " 5, 6 ,7",
    "50_000,20,100",
    "1,2",
    "1,2,3,4",
    "-1,2,3",
    "a,b,c",
    "2147483647,1,1",
    "2147483648,1,1",
    "",
]


class Context:
    """Which run this is and how to reconfigure a patch in it."""

    def __init__(self, mode: str, site: Path, applicable: list[str]) -> None:
        self.mode = mode
        self.site = site
        self.applicable = applicable

    @property
    def overlay(self) -> bool:
        return self.mode == "overlay"

    def reconfigure(self, name: str, env: dict[str, str | None]) -> None:
        """Set environment variables and, on the overlay, re-apply ``name`` to read them."""
        import prime_r3

        if self.overlay:
            prime_r3.revert([name])
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if self.overlay:
            prime_r3.apply([name], log=False)


# -- store_eviction + store_growth: the randomised harness -------------------------------


def _release_store_module(site: Path) -> Any:
    """The release's own store.py, loaded from the installed tree under a private name."""
    from vllm.distributed.aux_output_connector import store as store_mod

    spec = importlib.util.spec_from_file_location("diffs_release_store", site / STORE_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    # Its functions raise and build through these names: share the tree's classes, so
    # the harness (which catches store_mod.BlockObjectStoreError) sees one error type.
    module.BlockObjectStoreError = store_mod.BlockObjectStoreError
    module.BlockObject = store_mod.BlockObject
    return module


def _use_release_store_as_reference(ctx: Context) -> None:
    """On the patched tree, the harness's reference store runs the release's code.

    ``store_harness.upstream_store`` binds ``upstream(name)`` for the methods a store
    patch may change (``WRAPPED``) and keeps the class's others; those must be the
    release's unchanged, which is checked here, source against source.
    """
    from vllm.distributed.aux_output_connector import store as store_mod

    from tests import store_harness

    release = _release_store_module(ctx.site).BlockObjectStore
    for name, value in vars(release).items():
        if inspect.isfunction(value) and name not in store_harness.WRAPPED:
            patched = vars(store_mod.BlockObjectStore)[name]
            assert inspect.getsource(value) == inspect.getsource(patched), name
    store_harness.upstream = lambda name: vars(release)[name]


def scenario_store_sequences(ctx: Context) -> dict[str, Any]:
    from tests import store_harness

    if not ctx.overlay:
        _use_release_store_as_reference(ctx)
    per_seed = [store_harness.run_sequence(seed, STORE_OPS, growth=True) for seed in STORE_SEEDS]
    return {"per_seed": per_seed}


def scenario_store_pile_up(ctx: Context) -> dict[str, Any]:
    """The whole LRU, referenced keys' positions included, through a pile-up and a pass."""
    from vllm.distributed.aux_output_connector import store as store_mod

    from tests.test_store_patches import _full_store, _objects

    store = _full_store(1000, 800)
    states = []
    for step in range(60):
        store.put([store_mod.BlockObject(f"n{step}.{i}", b"n") for i in range(5)])
        if step in (0, 40, 41, 59):
            states.append(list(store._lru.items()))
    store.put(_objects("x", "y", nbytes=1), release_keys=["r3", "r7"])
    store.put(_objects("z", "r7", nbytes=1))
    states.append(list(store._lru.items()))
    return {"states": states, "references": dict(store._references)}


# -- store_headroom (with growth and eviction on the connector's store) ------------------


class _CapturerStandIn:
    """What the connector's constructor reads of its capturer (row shape and dtype).

    The sizing comparison builds the connector the same way in both arms (overlay and
    patched tree); the real capturer and TP group are exercised by test_store_patches'
    two-rank gloo world, which is too slow to run once per factor here.
    """

    shape_per_token = (4, 2)
    output_dtype_name = "uint8"

    def __init__(self, **kwargs: Any) -> None:
        pass


def _build_store(max_bytes: int | None, num_blocks: int) -> Any:
    """The real AuxOutputWorkerConnector built on CPU (GPU pieces stubbed); its store."""
    from vllm.config.aux_output import AuxOutputConfig
    from vllm.distributed.aux_output_connector import worker

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(worker, "RoutedExpertsCapturer", _CapturerStandIn)
    monkeypatch.setattr(worker, "bind_routed_experts_capturer", lambda model, capturer: None)
    monkeypatch.setattr(worker, "get_tp_group", lambda: SimpleNamespace(is_first_rank=True))
    monkeypatch.setattr(worker, "resolve_kv_cache_block_sizes", lambda kv, cfg: (32, 16))
    monkeypatch.setattr(worker, "RoutedExpertsBuffer", lambda *args: object())
    try:
        vllm_config = SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_batched_tokens=64, max_num_seqs=4),
            max_concurrent_batches=1,
            aux_output_config=AuxOutputConfig(max_bytes=max_bytes),
        )
        connector = worker.get_aux_output_connector(
            None, vllm_config, SimpleNamespace(num_blocks=num_blocks)
        )
    finally:
        monkeypatch.undo()
    background = connector._store
    connector._store = None  # the caller owns (and closes) the background store now
    return background


def scenario_headroom(ctx: Context) -> dict[str, Any]:
    from vllm.distributed.aux_output_connector import store as store_mod

    factor_var = (
        "PRIME_R3_STORE_HEADROOM_FACTOR" if ctx.overlay else "VLLM_AUX_OUTPUT_STORE_HEADROOM"
    )
    sizes = {}
    for factor in (None, "1.5", "1", "3.7", "8"):
        ctx.reconfigure("store_headroom", {factor_var: factor})
        for max_bytes, num_blocks in ((None, 10), (None, 7), (1000, 10), (None, 1)):
            background = _build_store(max_bytes, num_blocks)
            store = background._store
            sizes[(factor, max_bytes, num_blocks)] = (
                store.num_slots,
                store.object_nbytes,
                len(store._arena),
            )
            background.close()
    rejected = {}
    for value in ("0.5", "inf", "two", "nan", "0.999", "8.001", "1e9"):
        try:
            ctx.reconfigure("store_headroom", {factor_var: value})
            _build_store(None, 10).close()
        except ValueError as error:  # ConfigError is a ValueError
            rejected[value] = factor_var in str(error)
        else:
            rejected[value] = False
    ctx.reconfigure("store_headroom", {factor_var: None})
    # All three on the connector's store, through the writer thread: sized with
    # headroom, then every slot retained and more put (growth), then read back.
    background = _build_store(None, 2)
    store = background._store
    slots = store.num_slots
    keys = [f"k{i}" for i in range(2 * slots + 3)]
    objects = [
        store_mod.BlockObject(k, bytes([i]) * store.object_nbytes) for i, k in enumerate(keys)
    ]
    background.put(objects, retain_keys=keys)
    payload = background.get_concatenated(keys[::-1])
    grown = (slots, store.num_slots, len(store._arena), payload)
    background.close()
    return {"sizes": sizes, "rejected": rejected, "grown": grown}


# -- packed_outputs -----------------------------------------------------------------------


def retained_nbytes(rows: np.ndarray) -> int:
    """Bytes a returned rows array keeps alive: its root buffer's size."""
    base: Any = rows
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if isinstance(base, np.ndarray):
        return int(base.nbytes)
    return memoryview(base).nbytes


def packed_helpers() -> Any:
    """``tests/test_packed_outputs.py`` (make_step, outcome, TAKE, _run_worker_steps).

    It binds ``TAKE = AuxOutputSchedulerConnector().take_output`` at import. From vLLM
    0.33 the constructor needs a KV cache manager, which ``take_output`` never reads,
    so there the import runs with a constructor that sets nothing (restored at once).
    """
    if "tests.test_packed_outputs" in sys.modules:
        return sys.modules["tests.test_packed_outputs"]
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    needs_args = len(inspect.signature(AuxOutputSchedulerConnector.__init__).parameters) > 1
    monkeypatch = pytest.MonkeyPatch()
    if needs_args:
        monkeypatch.setattr(AuxOutputSchedulerConnector, "__init__", lambda self: None)
    try:
        import tests.test_packed_outputs as module
    finally:
        monkeypatch.undo()
    return module


def _take_report(output: Any, requests: list[Any]) -> list[tuple[Any, ...]]:
    """take_output's outcome per request, and what its rows keep alive and allow."""
    helpers = packed_helpers()
    report = []
    for request in requests:
        try:
            rows = helpers.TAKE(request, output)
        except AssertionError:
            rows = None
        kept = None if rows is None else (retained_nbytes(rows), bool(rows.flags.writeable))
        report.append((helpers.outcome(request, output), kept))
    return report


def _worker_steps(ctx: Context) -> list[dict[str, Any]]:
    import pickle as pickle_mod

    steps = []
    for seed in (5, 6, 7):
        for output, requests in packed_helpers()._run_worker_steps(seed):
            ids = list(output) if ctx.overlay else list(output.request_ids)
            received = pickle_mod.loads(pickle_mod.dumps(output, protocol=5))
            steps.append(
                {
                    "type": type(output).__module__ + "." + type(output).__qualname__,
                    "ids": ids,
                    "direct": _take_report(output, requests),
                    "pickled": _take_report(received, requests),
                }
            )
    return steps


def scenario_packed_worker(ctx: Context) -> dict[str, Any]:
    """The real process_output -> take_output, in process and after pickling."""
    import prime_r3

    result: dict[str, Any] = {"steps": _worker_steps(ctx)}
    if ctx.overlay:  # upstream's own numbers, for the memory comparison
        prime_r3.revert(["packed_outputs"])
        try:
            result["upstream"] = _worker_steps(ctx)
        finally:
            prime_r3.apply(["packed_outputs"], log=False)
    return result


def _pack(ctx: Context, outputs: dict[str, Any], dtype: Any, shape: tuple[int, ...]) -> Any:
    if ctx.overlay:
        from prime_r3.packed import PackedAuxOutputs

        return PackedAuxOutputs.pack(outputs)
    from vllm.distributed.aux_output_connector.connector import PackedAuxOutputs

    return PackedAuxOutputs.pack(outputs, np.dtype(dtype), shape)


MQ_STEPS = [(40, 0, np.uint8), (41, 3, np.uint16), (42, 400, np.uint8), (43, 2000, np.uint8)]


def _mq_reader(conn: Any) -> None:
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    queue = MessageQueue.create_from_handle(conn.recv(), 0)
    queue.wait_until_ready()
    while (requests := conn.recv()) is not None:
        received = queue.dequeue()
        conn.send(_take_report(received.aux_output_connector_output, requests))


def scenario_packed_message_queue(ctx: Context) -> dict[str, Any]:
    """Packed steps inside ModelRunnerOutput through vLLM's real MessageQueue."""
    import multiprocessing

    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    from vllm.v1.outputs import ModelRunnerOutput

    make_step = packed_helpers().make_step
    reports = []
    process_ctx = multiprocessing.get_context("fork")
    for max_chunk_bytes in (24 << 20, 256 << 10):  # in shared memory, and overflowing it
        conn, child_conn = process_ctx.Pipe()
        process = process_ctx.Process(target=_mq_reader, args=(child_conn,), daemon=True)
        process.start()
        queue = MessageQueue(1, 1, max_chunk_bytes=max_chunk_bytes)
        try:
            conn.send(queue.export_handle())
            queue.wait_until_ready()
            steps = []
            for seed, n, dtype in MQ_STEPS:
                outputs, requests = make_step(np.random.default_rng(seed), n, dtype)
                steps.append((_pack(ctx, outputs, dtype, (46, 8)), requests))
            # And what the real process_output returned, as the executor sends it.
            steps += packed_helpers()._run_worker_steps(5)
            for packed, requests in steps:
                queue.enqueue(ModelRunnerOutput([], {}, aux_output_connector_output=packed))
                conn.send(requests)
                assert conn.poll(120), "reader process did not answer"
                reports.append(conn.recv())
        finally:
            conn.send(None)
            process.join(60)
            del queue
            gc.collect()
        assert process.exitcode == 0
    return {"reports": reports}


def scenario_ray_detach(ctx: Context) -> dict[str, Any]:
    """vLLM's Ray zero-copy detach (0.31, 0.32) on a packed step with read-only buffers."""
    try:
        from vllm.v1.executor import ray_utils
    except ImportError as error:
        return {"skipped": f"vllm.v1.executor.ray_utils: {error}"}
    detach = getattr(ray_utils, "detach_zero_copy_from_model_runner_output", None)
    if detach is None:
        return {"skipped": "this vLLM has no Ray zero-copy detach"}
    from vllm.v1.outputs import ModelRunnerOutput

    outputs, requests = packed_helpers().make_step(np.random.default_rng(31), 200)
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(_pack(ctx, outputs, np.uint8, (46, 8)), 5, buffer_callback=buffers.append)
    # Out-of-band buffers come back read-only, as Ray hands them over.
    received = pickle.loads(data, buffers=[bytes(b.raw()) for b in buffers])
    output = ModelRunnerOutput([], {}, aux_output_connector_output=received)
    detach(output)
    return {"report": _take_report(output.aux_output_connector_output, requests)}


CONNECTOR_FILE = "vllm/distributed/aux_output_connector/connector.py"
TAKE_MEMORY_N = 400


def _release_take_output(site: Path) -> Callable[..., Any]:
    """The release's own ``take_output`` (the installed connector.py, loaded under a
    private name): upstream's reader of upstream's dict, on the overlay and on the
    patched tree alike. It reads nothing from ``self``."""
    name = "diffs_release_connector"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, site / CONNECTOR_FILE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    cls = module.AuxOutputSchedulerConnector
    return vars(cls)["take_output"].__get__(object.__new__(cls))


def scenario_packed_take_memory(ctx: Context) -> dict[str, Any]:
    """A received step taken request by request (vLLM's real MessageQueue, and a Ray-like
    protocol-5 hop): the rows against the release's take_output on upstream's dict,
    what each result pins, and what the step holds after the first, middle and last
    take (tests/test_packed_memory.py's measure: every distinct buffer it reaches)."""
    from tests.test_packed_memory import (
        SHAPE,
        _mq_hop,
        _nbytes,
        _ray_like,
        _root,
        held_bytes,
        taken_step,
    )

    upstream_take = _release_take_output(ctx.site)
    take = packed_helpers().TAKE
    runs = {}
    for hop in ("mq", "ray"):
        for kind in ("decode", "mixed"):
            outputs, requests, row_bytes = taken_step(kind, TAKE_MEMORY_N)
            send, close = _mq_hop() if hop == "mq" else (_ray_like, lambda: None)
            try:
                theirs = send(outputs)
                ours = send(_pack(ctx, outputs, np.uint8, SHAPE))
            finally:
                close()
            assert type(theirs) is dict
            results, held, kept, kept_upstream = [], [], [], []
            for k, request in enumerate(requests):
                rows, expected = take(request, ours), upstream_take(request, theirs)
                kept.append(rows)
                kept_upstream.append(expected)
                results.append(
                    (
                        rows.tobytes() == expected.tobytes(),
                        rows.shape == expected.shape,
                        rows.dtype == expected.dtype,
                        "array" if rows.base is None else "view",
                        _nbytes(_root(rows)),
                        _nbytes(_root(expected)),
                        bool(rows.flags.writeable),
                    )
                )
                if k in (0, len(requests) // 2, len(requests) - 1):
                    held.append(held_bytes(ours))
            packed_rows = ours._packed.rows if ctx.overlay else ours.rows
            # A taken (split) step pickled again carries the same rows.
            again = pickle.loads(pickle.dumps(ours, protocol=5))
            repickled = [
                take(request, again).tobytes() == rows.tobytes()
                for request, rows in zip(requests, kept, strict=True)
            ]
            runs[(hop, kind)] = {
                "results": results,
                "held": held,
                "upstream_held": held_bytes(theirs),
                # The step and every result kept (as the scheduler keeps them): the
                # rows once, shared by the step and the results, as upstream's.
                "with_results": held_bytes([ours, kept]),
                "upstream_with_results": held_bytes([theirs, kept_upstream]),
                "row_bytes": row_bytes,
                "packed_rows_dropped": packed_rows is None,
                "repickled_same_rows": all(repickled),
            }
    return runs


# -- engine_gc ----------------------------------------------------------------------------


def _source_segment(function: Callable[..., Any], first: str, stop: str) -> str:
    """The statements of ``function`` from the line ``first`` up to (not incl.) ``stop``."""
    lines = textwrap.dedent(inspect.getsource(function)).splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == first)
    end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == stop)
    return textwrap.dedent("\n".join(lines[start:end]))


def _gc_run(ctx: Context, tag: str) -> list[tuple[str, tuple[int, int, int], int]]:
    """Worker warm-ups, EngineCore's freeze and shutdown, the API server's lifespan."""
    import vllm.entrypoints.launchers.utils.server_utils as server_utils
    import vllm.v1.engine.core as core

    from tests.test_engine_gc import _warm_up

    # Freeze this process's heap for real first, as vLLM does at startup: the full
    # collections in each freeze_gc_heap() below then scan only what came after it
    # (seconds each otherwise). The freezes under test are counted, not performed.
    gc.freeze()
    monkeypatch = pytest.MonkeyPatch()
    freezes: list[int] = []
    monkeypatch.setattr(gc, "freeze", lambda: freezes.append(1))
    monkeypatch.setattr(gc, "unfreeze", lambda: None)
    monkeypatch.setattr(core, "cleanup_dist_env_and_memory", lambda *a, **k: None)
    trace = []

    def record(step: str) -> None:
        trace.append((f"{tag}: {step}", gc.get_threshold(), len(freezes)))

    # What EngineCore.__init__ runs after startup, as written in this tree's source.
    engine_freeze = _source_segment(
        core.EngineCore.__init__, "freeze_gc_heap()", "maybe_attach_gc_debug_callback()"
    )

    async def lifespan() -> None:
        app = SimpleNamespace(state=SimpleNamespace(log_stats=False))
        async with server_utils.lifespan(app):
            record("API server lifespan")

    class EngineStandIn(core.EngineCore):
        """What EngineCore.shutdown reads; shutdown is the real one, called bound."""

        def __init__(self) -> None:
            self.structured_output_manager = SimpleNamespace(clear_backend=lambda: None)
            self.model_executor = None
            self.scheduler = None

    def engine_starts() -> EngineStandIn:
        engine = EngineStandIn()
        exec(compile(engine_freeze, core.__file__, "exec"), vars(core), {"self": engine})
        return engine

    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        _warm_up(monkeypatch)
        record("worker warm-up")
        gc.set_threshold(1234, 5, 6)
        _warm_up(monkeypatch)
        record("worker re-warm-up after the user changed thresholds")
        first = engine_starts()
        record("EngineCore A: __init__ freeze")
        second = engine_starts()
        record("EngineCore B: __init__ freeze")
        first.shutdown()
        record("EngineCore A: shutdown, B still running")
        first.shutdown()
        record("EngineCore A: shutdown again")
        second.shutdown()
        record("EngineCore B: shutdown, the last one")
        _warm_up(monkeypatch)
        record("worker warm-up after the engines shut down")
        third = engine_starts()
        gc.set_threshold(1111, 2, 3)
        third.shutdown()
        record("EngineCore C: shutdown after the user changed thresholds")
        gc.set_threshold(700, 10, 10)
        asyncio.run(lifespan())
    finally:
        monkeypatch.undo()
        gc.set_threshold(*saved)
    return trace


def _gc_reset(ctx: Context) -> None:
    if not ctx.overlay:
        from vllm.utils import gc_utils

        gc_utils.restore_gc_thresholds()  # forget the process's saved thresholds


def scenario_gc(ctx: Context) -> dict[str, Any]:
    import vllm.v1.engine.core as core

    if ctx.overlay:
        thresholds_var, api_var = "PRIME_R3_ENGINE_GC_THRESHOLDS", "PRIME_R3_ENGINE_GC_API_SERVER"
    else:
        thresholds_var, api_var = "VLLM_GC_THRESHOLDS", "VLLM_GC_THRESHOLDS_API_SERVER"
    trace = _gc_run(ctx, "defaults")
    _gc_reset(ctx)
    ctx.reconfigure("engine_gc", {thresholds_var: "40000,15,90", api_var: "1"})
    trace += _gc_run(ctx, "40000,15,90 and API server")
    _gc_reset(ctx)
    accepted = {}
    for value in GC_VALUES:
        try:
            ctx.reconfigure("engine_gc", {thresholds_var: value, api_var: None})
            if not ctx.overlay:
                from vllm.utils import gc_utils

                saved = gc.get_threshold()
                gc_utils.set_gc_thresholds()
                accepted[value] = (saved, gc.get_threshold())
                gc_utils.restore_gc_thresholds()
                assert gc.get_threshold() == saved
            else:
                accepted[value] = "accepted"
        except ValueError as error:  # ConfigError is a ValueError
            accepted[value] = f"rejected: names the variable: {thresholds_var in str(error)}"
    ctx.reconfigure("engine_gc", {thresholds_var: None, api_var: None})
    segment = _source_segment(
        core.EngineCore.__init__, "freeze_gc_heap()", "maybe_attach_gc_debug_callback()"
    )
    return {"trace": trace, "values": accepted, "engine_core_segment": segment}


# -- the run -------------------------------------------------------------------------------

SCENARIOS: dict[str, tuple[str, Callable[[Context], dict[str, Any]]]] = {
    # scenario -> (the registry patch it exercises, function)
    "store_sequences": ("store_growth", scenario_store_sequences),
    "store_pile_up": ("store_eviction", scenario_store_pile_up),
    "headroom": ("store_headroom", scenario_headroom),
    "packed_worker": ("packed_outputs", scenario_packed_worker),
    "packed_message_queue": ("packed_outputs", scenario_packed_message_queue),
    "ray_detach": ("packed_outputs", scenario_ray_detach),
    "packed_take_memory": ("packed_outputs", scenario_packed_take_memory),
    "gc": ("engine_gc", scenario_gc),
}


def _setup(mode: str, site: Path, patched: Path | None) -> tuple[Context, dict[str, Any]]:
    import importlib.metadata

    import prime_r3
    from prime_r3 import guards
    from prime_r3.patches import REGISTRY

    release = importlib.metadata.version("vllm")
    applicable = [s.name for s in REGISTRY if guards.check_version(s, release) is None]
    import vllm

    meta: dict[str, Any] = {"release": release, "vllm_file": vllm.__file__}
    if mode == "overlay":
        assert os.environ.get("PRIME_R3", "1") not in ("0", "false", "off", "no")
        report = prime_r3.apply(log=False)
        meta["applied"] = sorted(
            o.name for o in report.outcomes if o.state in ("applied", "pending_import")
        )
        assert meta["applied"] == sorted(applicable), report.summary()
        assert Path(vllm.__file__).is_relative_to(site)
    else:
        assert os.environ.get("PRIME_R3") == "0"
        assert patched is not None and Path(vllm.__file__).is_relative_to(patched), vllm.__file__
        meta["applied"] = sorted(
            o.name for o in prime_r3.apply(log=False).outcomes if o.state == "applied"
        )
        assert meta["applied"] == []
        # What the overlay would do here if it were enabled (installed in an image built
        # with the diffs): every patch must skip.
        enabled = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_R3")}
        meta["overlay_if_enabled"] = {
            o.name: (o.state, o.reason) for o in prime_r3.status(enabled).outcomes
        }
    return Context(mode, site, applicable), meta


def main() -> None:
    started = time.perf_counter()
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["overlay", "diffs"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--site", type=Path, required=True)
    parser.add_argument("--patched", type=Path)
    parser.add_argument("--only", nargs="*", help="run these scenarios only (debugging)")
    args = parser.parse_args()
    ctx, meta = _setup(args.mode, args.site.resolve(), args.patched and args.patched.resolve())
    results: dict[str, Any] = {"meta": meta}
    meta["seconds"] = {"setup": round(time.perf_counter() - started, 1)}
    for name, (patch, function) in SCENARIOS.items():
        if args.only and name not in args.only:
            continue
        if patch not in ctx.applicable:
            results[name] = {"not_applicable": patch}
            continue
        began = time.perf_counter()
        results[name] = function(ctx)
        meta["seconds"][name] = round(time.perf_counter() - began, 1)
    args.out.write_bytes(pickle.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
