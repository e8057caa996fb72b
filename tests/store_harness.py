"""Random operation sequences run on upstream's BlockObjectStore and on the patched one.

The reference is the real upstream class with the original methods prime_r3 saved,
bound on the instance (instance attributes shadow the patched class attributes), so
both stores are instances of the same class in the same process.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import pytest
import torch
import wrapt
from vllm.distributed.aux_output_connector import store as store_mod

import prime_r3

STORE = "vllm.distributed.aux_output_connector.store"
NO_ROOM = "cannot retain the requested batch"
#: Methods any store patch may wrap; the reference store binds upstream's for all of them.
WRAPPED = ("__init__", "put", "_evict_to_fit")


def upstream(name: str) -> Any:
    """Upstream's ``BlockObjectStore.<name>``, as the layer saved it (or as it still is)."""
    try:
        function = prime_r3.get_original(STORE, f"BlockObjectStore.{name}")
    except KeyError:  # never patched in this process
        function = store_mod.BlockObjectStore.__dict__[name]
    assert not isinstance(function, wrapt.ObjectProxy), name
    return function


def upstream_store(max_bytes: int, object_nbytes: int) -> Any:
    """A BlockObjectStore that runs only upstream code, whatever is patched on the class."""
    cls = store_mod.BlockObjectStore
    store = cls.__new__(cls)
    upstream("__init__")(store, max_bytes=max_bytes, object_nbytes=object_nbytes)
    for name in WRAPPED[1:]:
        setattr(store, name, MethodType(upstream(name), store))
    return store


@dataclass
class Snapshot:
    """An upstream store's full state, to rebuild it at another capacity."""

    lru: OrderedDict[str, int]
    references: dict[str, int]
    free_slots: list[int]
    next_slot: int
    arena: bytes

    @classmethod
    def of(cls, store: Any) -> Snapshot:
        return cls(
            OrderedDict(store._lru),
            dict(store._references),
            list(store._free_slots),
            store._next_slot,
            bytes(store._arena[:]),
        )

    def restore(self, num_slots: int, object_nbytes: int) -> Any:
        """An upstream store in this state with ``num_slots`` slots."""
        store = upstream_store(num_slots * object_nbytes, object_nbytes)
        store._lru = OrderedDict(self.lru)
        store._references = dict(self.references)
        store._free_slots = list(self.free_slots)
        store._next_slot = self.next_slot
        store._arena[: len(self.arena)] = self.arena
        return store


@dataclass(frozen=True)
class Op:
    kind: str  # "put" or "get"
    objects: tuple[Any, ...] = ()
    retain: tuple[str, ...] = ()
    release: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()

    def run(self, store: Any) -> tuple[str, Any]:
        """Apply to ``store``; the outcome is ("ok", result) or ("error", (type, message))."""
        try:
            if self.kind == "put":
                result = store.put(
                    list(self.objects),
                    retain_keys=iter(self.retain),  # one-shot iterables, as upstream allows
                    release_keys=iter(self.release),
                )
            else:
                result = store.get_concatenated(list(self.keys))
        except (store_mod.BlockObjectStoreError, KeyError, RuntimeError) as error:
            return "error", (type(error).__name__, str(error))
        return "ok", result

    def new_keys(self, store: Any) -> int:
        return len({obj.key for obj in self.objects}.difference(key_to_slot(store)))


@dataclass
class Sequence:
    """Random store geometry and an op generator that reads the reference's state."""

    seed: int
    rng: random.Random = field(init=False)
    num_slots: int = field(init=False)
    object_nbytes: int = field(init=False)
    max_bytes: int = field(init=False)
    pool: list[str] = field(init=False)
    allow_bad_release: bool = True
    #: Chance that a put retains its batch's keys (vLLM does, for running requests).
    retain_rate: float = 0.6

    def __post_init__(self) -> None:
        rng = self.rng = random.Random(self.seed)
        self.num_slots = rng.choice([1, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64])
        self.object_nbytes = rng.randint(1, 6)
        self.max_bytes = self.num_slots * self.object_nbytes + rng.randrange(self.object_nbytes)
        self.pool = [f"k{i}" for i in range(2 * self.num_slots + 4)]

    def _payload(self) -> bytes:
        return self.rng.randbytes(self.object_nbytes)

    def next_op(self, reference: Any) -> Op:
        rng = self.rng
        roll = rng.random()
        if roll < 0.25:
            stored = list(key_to_slot(reference))
            keys = rng.choices(stored, k=rng.randint(0, min(4, len(stored)))) if stored else []
            if rng.random() < 0.05:
                keys.insert(rng.randint(0, len(keys)), rng.choice(self.pool))  # maybe missing
            return Op("get", keys=tuple(keys))
        # Batches run from empty to larger than the store; keys repeat across batches.
        size = rng.choice([0, 1, 1, 2, 3, 5, rng.randint(0, self.num_slots + 3)])
        keys = [rng.choice(self.pool) for _ in range(size)]
        if size and rng.random() < 0.1:
            keys.append(rng.choice(keys))  # duplicate key inside one batch
        objects = tuple(store_mod.BlockObject(key, self._payload()) for key in keys)
        retain = []
        if rng.random() < self.retain_rate:
            retain = [k for k in dict.fromkeys(keys) if rng.random() < 0.8]
        retain += [rng.choice(self.pool) for _ in range(rng.choice([0, 0, 1, 2]))]
        release = self._releases(reference, retain, keys)
        return Op("put", objects, tuple(retain), tuple(release))

    def _releases(self, reference: Any, retain: list[str], batch: list[str]) -> list[str]:
        rng = self.rng
        held = dict(reference._references)
        for key in retain:
            held[key] = held.get(key, 0) + 1
        release = []
        if held and rng.random() < 0.7:
            candidates = list(held)
            # Prefer keys in this batch sometimes: released and re-put in one call.
            if batch and rng.random() < 0.3:
                candidates = [k for k in dict.fromkeys(batch) if k in held] or candidates
            for key in rng.sample(candidates, k=rng.randint(1, min(6, len(candidates)))):
                release += [key] * rng.randint(1, held[key])
        if self.allow_bad_release and rng.random() < 0.0003:
            release.append(rng.choice(self.pool) + "-unheld")  # caller bug: KeyError
        return release


def key_to_slot(store: Any) -> dict[str, int]:
    """Every stored key and its slot: ``_lru`` in 0.31/0.32; ``_slots`` in 0.33, whose
    ``_lru`` holds only the unreferenced (evictable) keys."""
    return store._slots if store_fixed_upstream() else store._lru


def unreferenced_order(store: Any) -> list[str]:
    return [key for key in store._lru if key not in store._references]


def assert_same_state(reference: Any, patched: Any, where: str, *, order: bool = True) -> None:
    """Everything eviction can observe, and the payload bytes behind every key."""
    assert reference._lru.items() == patched._lru.items(), f"{where}: key -> slot differs"
    assert reference._references == patched._references, f"{where}: references differ"
    assert reference.num_slots == patched.num_slots, f"{where}: capacity differs"
    assert reference._free_slots == patched._free_slots, f"{where}: free slots differ"
    assert reference._next_slot == patched._next_slot, f"{where}: next slot differs"
    assert reference._arena[:] == patched._arena[:], f"{where}: arena bytes differ"
    if order:
        assert unreferenced_order(reference) == unreferenced_order(patched), (
            f"{where}: order of unreferenced keys differs"
        )


def run_sequence(seed: int, num_ops: int, *, growth: bool) -> dict[str, int]:
    """Run one seeded sequence on both stores, comparing after every op.

    With ``growth``, where upstream raises for lack of room the patched store must
    grow to max(needed, 2x) and then match an upstream store of that capacity.
    """
    seq = Sequence(seed)
    nbytes = seq.object_nbytes
    reference = upstream_store(seq.max_bytes, nbytes)
    patched = store_mod.BlockObjectStore(max_bytes=seq.max_bytes, object_nbytes=nbytes)
    counts = {"ops": 0, "no_room": 0, "grown": 0}
    for index in range(num_ops):
        where = f"seed={seed} op={index}"
        op = seq.next_op(reference)
        needed = len(reference._lru) + op.new_keys(reference)
        # Upstream can run out of room only when the put has to evict.
        may_grow = growth and op.kind == "put" and needed > reference.num_slots
        before = Snapshot.of(reference) if may_grow else None
        held_before = set(reference._references)
        expected = op.run(reference)
        got = op.run(patched)
        counts["ops"] += 1
        no_room = expected[0] == "error" and NO_ROOM in expected[1][1]
        counts["no_room"] += no_room
        if no_room and growth:
            assert before is not None
            assert got == ("ok", None), f"{where}: patched store did not grow: {got}"
            grown = max(needed, 2 * reference.num_slots)  # a failed put keeps num_slots
            assert patched.num_slots == grown, f"{where}: grew to {patched.num_slots}"
            assert len(patched._arena) == grown * nbytes, f"{where}: arena size"
            reference = before.restore(grown, nbytes)
            expected = op.run(reference)
            assert expected == ("ok", None), f"{where}: bigger upstream store failed: {expected}"
            counts["grown"] += 1
        assert got == expected, f"{where}: outcome differs: upstream {expected}, patched {got}"
        if expected[0] == "error" and expected[1][0] == "KeyError":
            # Over-release part-way through put: keys released earlier in that call keep
            # their old position, which the rotation may have changed. vLLM's writer
            # treats the error as fatal, so the sequence ends here.
            dropped = held_before - set(reference._references)
            assert_same_state(reference, patched, where, order=False)
            assert [k for k in unreferenced_order(reference) if k not in dropped] == [
                k for k in unreferenced_order(patched) if k not in dropped
            ], f"{where}: order of unreferenced keys differs"
            break
        assert_same_state(reference, patched, where)
    return counts


# -- AuxOutputWorkerConnector on real tensor-parallel ranks ----------------------------
#
# vLLM decides the output rank with ``get_tp_group().is_first_rank`` inside
# AuxOutputWorkerConnector.__init__: only TP rank 0 reads ``aux_output_config`` and
# builds the store. To exercise both ranks for real, two spawned processes form a gloo
# world of 2 with vLLM's own init_distributed_environment / initialize_model_parallel
# (TP=2, inside set_current_vllm_config as vLLM's workers do), and build the connector
# with its real constructor: real VllmConfig (from EngineArgs), real
# RoutedExpertsCapturer (CPU buffer), real bind_routed_experts_capturer, real KV config,
# real store and buffer. Only the model is a one-router stand-in.

TP_SIZE = 2
BASE_BLOCKS = 10


@dataclass(frozen=True)
class Scenario:
    """One connector construction, run on every TP rank."""

    name: str
    patches: tuple[str, ...] = ()
    #: "real": the real AuxOutputConfig (reads recorded); "no_max_bytes": the same
    #: config without a ``max_bytes`` attribute; "explicit": max_bytes set by the user.
    aux: str = "real"
    env: tuple[tuple[str, str], ...] = ()
    num_blocks: int = BASE_BLOCKS
    #: After building, publish this many times the store's slots (+3) as referenced.
    overflow: bool = False


@dataclass(frozen=True)
class Built:
    """What one rank observed for one scenario (plain data, sent back to the test)."""

    rank: int
    is_first_rank: bool
    applied: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]
    error: tuple[str, str] | None
    reads: tuple[str, ...]
    num_slots: int | None = None
    object_nbytes: int | None = None
    arena_bytes: int | None = None
    logs: tuple[str, ...] = ()
    #: With ``overflow``: (outcome, slots after, payloads read back intact).
    overflow: tuple[str, int, bool] | None = None


EXPLICIT_MAX_BYTES = 7 * 1024


class AuxConfigRecorder:
    """The real AuxOutputConfig behind a recorder of every attribute read on it.

    ``hide`` names attributes that read as missing, for a config without them.
    """

    def __init__(self, real: Any, hide: tuple[str, ...] = ()) -> None:
        object.__setattr__(self, "_state", (real, hide, []))

    def __getattribute__(self, name: str) -> Any:
        real, hide, reads = object.__getattribute__(self, "_state")
        reads.append(name)
        if name in hide:
            raise AttributeError(f"{type(real).__name__!r} object has no attribute {name!r}")
        return getattr(real, name)

    @staticmethod
    def reads(recorder: AuxConfigRecorder) -> list[str]:
        return object.__getattribute__(recorder, "_state")[2]


class _Router(torch.nn.Module):
    """The one MoE router the real bind_routed_experts_capturer binds to."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_id = 0
        self.capture_fn = None


def _build_on_rank(scenario: Scenario, rank: int, vllm_config: Any) -> Built:
    import logging
    import os

    from vllm.distributed.aux_output_connector import worker
    from vllm.distributed.parallel_state import get_tp_group

    from prime_r3.bench.vllm_setup import build_kv_cache_config
    from prime_r3.bench.workload import BenchConfig

    prime_r3.revert()
    for var in [v for v in os.environ if v.startswith("PRIME_R3")]:
        del os.environ[var]
    os.environ.update(dict(scenario.env))
    applied: tuple[str, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()
    if scenario.patches:
        try:
            report = prime_r3.apply(names=list(scenario.patches), log=False)
        except prime_r3.PatchNotApplied as error:
            report = error.report
        applied = tuple(report.applied)
        skipped = tuple((o.name, o.reason) for o in report.outcomes if o.name in report.skipped)
    real_aux = original_aux = vllm_config.aux_output_config
    if scenario.aux == "explicit":
        real_aux = dataclasses.replace(real_aux, max_bytes=EXPLICIT_MAX_BYTES)
    recorder = AuxConfigRecorder(real_aux, ("max_bytes",) if scenario.aux == "no_max_bytes" else ())
    object.__setattr__(vllm_config, "aux_output_config", recorder)
    logs: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("vllm.prime_r3")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    kv_cache_config = build_kv_cache_config(BenchConfig(kv_blocks=scenario.num_blocks))
    connector = None
    try:
        connector = worker.AuxOutputWorkerConnector(
            vllm_config=vllm_config, model=_Router(), kv_cache_config=kv_cache_config
        )
        error = None
    except Exception as caught:  # noqa: BLE001 - compared with upstream's by the test
        error = (type(caught).__name__, str(caught))
    finally:
        object.__setattr__(vllm_config, "aux_output_config", original_aux)
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    reads = tuple(AuxConfigRecorder.reads(recorder))
    built = Built(
        rank, get_tp_group().is_first_rank, applied, skipped, error, reads, logs=tuple(logs)
    )
    if connector is not None and connector._store is not None:
        store = connector._store._store
        built = dataclasses.replace(
            built,
            num_slots=store.num_slots,
            object_nbytes=store.object_nbytes,
            arena_bytes=len(store._arena),
        )
        if scenario.overflow:
            built = dataclasses.replace(built, overflow=_overflow(connector._store, store))
    if connector is not None:
        try:
            connector.close()
        except store_mod.BlockObjectStoreError:  # the writer failed in _overflow: reported
            assert built.overflow is not None and built.overflow[0].startswith("error")
    prime_r3.revert()
    return built


def _overflow(background: Any, store: Any) -> tuple[str, int, bool]:
    """Publish more referenced objects than the store holds, through its writer thread."""
    nbytes = store.object_nbytes
    keys = [f"k{i}" for i in range(store.num_slots + 3)]
    objects = [store_mod.BlockObject(k, bytes([i % 251]) * nbytes) for i, k in enumerate(keys)]
    try:
        background.put(objects, retain_keys=keys)
        intact = background.get_concatenated(keys[::-1]) == b"".join(
            o.payload for o in objects[::-1]
        )
    except store_mod.BlockObjectStoreError as error:
        return f"error: {error.__cause__}", store.num_slots, False
    return "ok", store.num_slots, intact


def _rank_main(rank: int, port: int, scenarios: list[Scenario], results: Any) -> None:
    """One TP rank: join the gloo world the way vLLM's workers do, then build each scenario."""
    import os
    import tempfile
    import traceback
    from datetime import timedelta

    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    os.environ["PRIME_R3"] = "0"  # vLLM's plugin loader must not apply anything by itself
    try:
        from vllm.config import set_current_vllm_config
        from vllm.distributed import parallel_state
        from vllm.engine.arg_utils import EngineArgs

        from prime_r3.bench.vllm_setup import write_model_dir
        from prime_r3.bench.workload import BenchConfig

        # The model directory only holds the config vLLM reads while building its
        # config: removed right after, so the ranks leave nothing in the temp dir.
        with tempfile.TemporaryDirectory(prefix="prime_r3_tp_") as directory:
            vllm_config = EngineArgs(
                model=write_model_dir(BenchConfig(layers=4, topk=2, experts=8), directory),
                skip_tokenizer_init=True,
                load_format="dummy",
                dtype="bfloat16",
                tensor_parallel_size=TP_SIZE,
                distributed_executor_backend="mp",
                max_model_len=1024,
                max_num_seqs=8,
                max_num_batched_tokens=256,
            ).create_engine_config()
        vllm_config.aux_output_config.enable_return_routed_experts = True
        with set_current_vllm_config(vllm_config):
            parallel_state.init_distributed_environment(
                world_size=TP_SIZE,
                rank=rank,
                distributed_init_method=f"tcp://127.0.0.1:{port}",
                local_rank=rank,
                backend="gloo",
                timeout=timedelta(seconds=120),
            )
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP_SIZE)
        try:
            for scenario in scenarios:
                results.put((scenario.name, _build_on_rank(scenario, rank, vllm_config)))
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put(("crash", f"rank {rank}: {traceback.format_exc()}"))
    results.put(("done", rank))


def build_on_tp_ranks(
    scenarios: list[Scenario], timeout: float = 600
) -> dict[tuple[str, int], Built]:
    """Run every scenario on each rank of a real TP=2 gloo world; (scenario, rank) -> Built."""
    import multiprocessing
    import queue as queue_mod
    import socket
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, port, scenarios, results)) for r in range(TP_SIZE)
    ]
    for proc in procs:
        proc.start()
    built: dict[tuple[str, int], Built] = {}
    done = 0
    deadline = time.monotonic() + timeout
    try:
        while done < TP_SIZE:
            try:
                name, value = results.get(timeout=5)
            except queue_mod.Empty:
                if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                    raise AssertionError(
                        f"TP ranks did not finish: exit codes {[p.exitcode for p in procs]}"
                    ) from None
                continue
            if name == "crash":
                raise AssertionError(value)
            if name == "done":
                done += 1
                continue
            built[name, value.rank] = value
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return built


# -- what each supported release is expected to do ------------------------------------

#: Read in each release's store.py: 0.31.0 and 0.32.0 raise when every slot is
#: referenced and rescan referenced keys on every eviction (the store patches apply);
#: 0.33.0 keeps referenced keys out of the LRU and grows the arena (all three skip).
FIXED_UPSTREAM = {"0.31.0": False, "0.32.0": False, "0.33.0": True}


@functools.cache
def installed_release() -> str:
    """The installed vLLM (read once: the harness asks on every op)."""
    from prime_r3 import guards

    version = guards.installed_vllm_version()
    assert version is not None, "vLLM is not installed"
    return version


def store_fixed_upstream() -> bool:
    """Whether the installed vLLM has the store fixes upstream; unknown releases fail."""
    release = installed_release()
    if release not in FIXED_UPSTREAM:
        raise AssertionError(
            f"no expectation for vLLM {release}: read its aux_output_connector/store.py and "
            f"add it to FIXED_UPSTREAM ({', '.join(FIXED_UPSTREAM)} are known)"
        )
    return FIXED_UPSTREAM[release]


def fixed_upstream_reason() -> str:
    return f"vllm {installed_release()} has this fix upstream (fixed upstream in 0.33)"


def apply_or_expect_fixed_upstream(names: list[str]) -> bool:
    """Apply the named store patches, or, where the release has the fixes upstream,
    check that each skips with that reason and nothing was replaced. True if applied."""
    from prime_r3 import layer

    if not store_fixed_upstream():
        report = prime_r3.apply(names=names, log=False)
        # store_headroom's connector target waits for vLLM to import worker.py.
        assert set(report.names(layer.APPLIED, layer.PENDING)) == set(names), report
        return True
    with pytest.raises(prime_r3.PatchNotApplied) as caught:
        prime_r3.apply(names=names, log=False)
    skipped = {o.name: (o.state, o.reason) for o in caught.value.report.outcomes if o.name in names}
    assert skipped == {n: (layer.SKIPPED, fixed_upstream_reason()) for n in names}
    for attr, value in vars(store_mod.BlockObjectStore).items():
        assert not prime_r3.is_object_patched(value), attr
    return False


def run_upstream_properties(seed: int, num_ops: int) -> dict[str, int]:
    """Upstream's own store on one seeded sequence, checked after every op.

    Every release: a victim is never a referenced key, and the store never holds more
    keys than slots. When every slot is referenced, 0.31/0.32 raise (the failure the
    store patches exist for) and 0.33 grows to max(keys held, 2x), only then.
    """
    grows = store_fixed_upstream()
    seq = Sequence(seed)
    store = upstream_store(seq.max_bytes, seq.object_nbytes)
    counts = {"ops": 0, "no_room": 0, "grown": 0, "evicted": 0}
    for index in range(num_ops):
        where = f"seed={seed} op={index}"
        op = seq.next_op(store)
        before = set(key_to_slot(store))
        slots_before = store.num_slots
        outcome = op.run(store)
        counts["ops"] += 1
        if outcome[0] == "error":
            name, message = outcome[1]
            if name == "KeyError":
                break  # over-release: a caller bug that vLLM's writer treats as fatal
            if NO_ROOM in message:
                assert not grows, f"{where}: this release must grow, it raised: {message}"
                counts["no_room"] += 1
            continue
        after = key_to_slot(store)
        victims = before - set(after)
        counts["evicted"] += len(victims)
        assert victims.isdisjoint(store._references), f"{where}: evicted referenced keys"
        assert len(after) <= store.num_slots, f"{where}: more keys than slots"
        if store.num_slots != slots_before:
            assert grows, f"{where}: capacity changed from {slots_before}"
            counts["grown"] += 1
            assert store.num_slots == max(len(after), 2 * slots_before), where
            assert len(store._arena) == store.num_slots * store.object_nbytes, where
            # Grown only because nothing else could go: every key is held or just put.
            batch = {obj.key for obj in op.objects}
            assert set(after) <= set(store._references) | batch, f"{where}: grew needlessly"
    return counts
