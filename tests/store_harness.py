"""Random operation sequences run on upstream's BlockObjectStore and on the patched one.

The reference is the real upstream class with the original methods prime_r3 saved,
bound on the instance (instance attributes shadow the patched class attributes), so
both stores are instances of the same class in the same process.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

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
        return len({obj.key for obj in self.objects}.difference(store._lru))


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
            stored = list(reference._lru)
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
