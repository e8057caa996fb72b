"""store_arena: the store's arena is a private mapping; nothing observable differs.

Per release: store_arena applies on vLLM 0.31.0, 0.32.0 and 0.33.0 (BlockObjectStore's
``__init__`` is verified on each: 0.33 adds the ``_slots`` map, and builds its arena the
same way). On every release the patched store must match the real upstream class
(upstream's own ``__init__``/``put``/``_evict_to_fit`` bound on a reference instance) op
by op on the seeded sequences of tests/store_harness.py: puts with duplicate keys,
retains, releases, evictions, overflow errors (0.31/0.32; 0.33 grows instead),
over-release ``KeyError``s, gets of missing keys, and after ``close`` the closed-store
errors. On 0.31/0.32 also stacked with store_eviction, store_headroom (same target) and
store_growth (whose growth makes a new, shared, arena). Through vLLM's writer thread
(``BackgroundBlockObjectStore``) it is compared with upstream by
tests/test_store_parity.py::test_background_writer_matches_upstream, with every other
store patch; this file keeps what is store_arena's own: the mapping.
"""

from __future__ import annotations

import ctypes
import mmap
import re

import pytest

import prime_r3
from prime_r3 import layer
from prime_r3.fixes import store_arena
from tests.store_harness import (
    Op,
    installed_release,
    key_to_slot,
    run_sequence,
    store_fixed_upstream,
    store_mod,
    upstream_store,
)

SEEDS = range(120)
NUM_OPS = 200
STORE_PATCHES = ["store_eviction", "store_headroom", "store_growth"]


def mapping_of(arena: mmap.mmap) -> str:
    """The permission field of ``arena``'s line in /proc/self/maps (e.g. ``rw-p``)."""
    view = (ctypes.c_char * 1).from_buffer(arena)
    try:
        address = ctypes.addressof(view)
    finally:
        del view  # releases the export, so the arena can still be closed
    with open("/proc/self/maps") as maps:
        for line in maps:
            low, high, perms = re.match(r"([0-9a-f]+)-([0-9a-f]+) (\S+)", line).groups()
            if int(low, 16) <= address < int(high, 16):
                return perms
    raise AssertionError(f"arena at {address:#x} not in /proc/self/maps")


def vm_flags_of(arena: mmap.mmap) -> set[str]:
    """The ``VmFlags`` of ``arena``'s mapping in /proc/self/smaps (e.g. ``nh``: no THP)."""
    view = (ctypes.c_char * 1).from_buffer(arena)
    try:
        address = ctypes.addressof(view)
    finally:
        del view
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    raise AssertionError(f"arena at {address:#x} has no VmFlags in /proc/self/smaps")


def test_private_arena_never_uses_huge_pages_as_upstreams_shmem_does_not(
    reverted: pytest.MonkeyPatch,
) -> None:
    """A private mapping would get transparent huge pages under THP ``always``; the
    arena is advised off them (``nh``), so it stays on 4 KiB pages like upstream's."""
    prime_r3.apply(names=["store_arena"], log=False)
    store = store_mod.BlockObjectStore(max_bytes=1024 * 4096, object_nbytes=4096)
    try:
        assert mapping_of(store._arena) == "rw-p"
        assert "nh" in vm_flags_of(store._arena)
    finally:
        store.close()


def test_applies_on_every_supported_release(reverted: pytest.MonkeyPatch) -> None:
    report = prime_r3.apply(names=["store_arena"], log=False)
    assert report.outcome("store_arena").state == layer.APPLIED, (installed_release(), report)


def test_arena_is_private_and_zeroed_and_upstream_is_shared(reverted: pytest.MonkeyPatch) -> None:
    """Fails without the patch: upstream's arena is a shared mapping (``rw-s``)."""
    upstream = store_mod.BlockObjectStore(max_bytes=10 * 4096 + 5, object_nbytes=4096)
    assert mapping_of(upstream._arena) == "rw-s"  # what the patch exists to change
    prime_r3.apply(names=["store_arena"], log=False)
    store = store_mod.BlockObjectStore(max_bytes=10 * 4096 + 5, object_nbytes=4096)
    assert mapping_of(store._arena) == "rw-p"
    assert store.num_slots == upstream.num_slots == 10
    assert len(store._arena) == len(upstream._arena) == 10 * 4096
    assert store._arena[:] == upstream._arena[:] == bytes(10 * 4096)
    assert not store._arena.closed and not upstream._arena.closed
    # Upstream's rejections are unchanged (raised by upstream's __init__, before ours).
    for kwargs, message in (
        ({"max_bytes": 10, "object_nbytes": 0}, "object size must be positive"),
        ({"max_bytes": 3, "object_nbytes": 4}, "must fit at least one object"),
    ):
        with pytest.raises(ValueError, match=message):
            store_mod.BlockObjectStore(**kwargs)
    store.close()
    assert store._arena is None
    prime_r3.revert()
    again = store_mod.BlockObjectStore(max_bytes=4096, object_nbytes=4096)
    assert mapping_of(again._arena) == "rw-s"  # revert restores upstream's construction


def test_store_not_fresh_after_init_keeps_its_arena(reverted: pytest.MonkeyPatch) -> None:
    """An ``__init__`` below ours that already stored something: the arena is kept."""
    init = store_arena._store_init({})
    upstream_init = store_mod.BlockObjectStore.__init__  # nothing applied: upstream's

    def init_then_put(*args: object, **kwargs: int) -> None:
        upstream_init(*args, **kwargs)
        args[0].put([store_mod.BlockObject("k", b"abcd")])

    store = store_mod.BlockObjectStore.__new__(store_mod.BlockObjectStore)
    init(init_then_put, store, (store,), {"max_bytes": 8, "object_nbytes": 4})
    assert mapping_of(store._arena) == "rw-s" and store._arena[:4] == b"abcd"
    fresh = store_mod.BlockObjectStore.__new__(store_mod.BlockObjectStore)
    init(upstream_init, fresh, (fresh,), {"max_bytes": 8, "object_nbytes": 4})
    assert mapping_of(fresh._arena) == "rw-p" and store_arena.fresh(fresh)


def _apply(names: list[str]) -> bool:
    """Apply ``names``; where the store patches are fixed upstream (0.33), store_arena only."""
    if store_fixed_upstream():
        prime_r3.apply(names=["store_arena"], log=False)
        return False
    prime_r3.apply(names=names, log=False)
    return "store_growth" in names


@pytest.mark.parametrize("names", [["store_arena"], [*STORE_PATCHES, "store_arena"]])
def test_random_sequences_match_upstream(names: list[str], reverted: pytest.MonkeyPatch) -> None:
    growth = _apply(names)
    totals = {"ops": 0, "no_room": 0, "grown": 0}
    for seed in SEEDS:
        for key, value in run_sequence(seed, NUM_OPS, growth=growth).items():
            totals[key] += value
    assert totals["ops"] > len(SEEDS) * NUM_OPS * 0.9
    # The sequences reach what they exist for (on 0.33 overflow grows, never raises).
    assert totals["no_room"] > 0 or store_fixed_upstream(), totals
    assert totals["grown"] > 0 or not growth, totals


def test_slots_and_closed_store_errors_match_upstream(reverted: pytest.MonkeyPatch) -> None:
    """Key -> slot (0.33's ``_slots``), payloads read back, and errors once closed."""
    prime_r3.apply(names=["store_arena"], log=False)
    reference = upstream_store(5 * 3, 3)
    patched = store_mod.BlockObjectStore(max_bytes=5 * 3, object_nbytes=3)
    assert mapping_of(patched._arena) == "rw-p" and mapping_of(reference._arena) == "rw-s"
    block = store_mod.BlockObject
    ops = [
        Op("put", (block("a", b"aaa"), block("b", b"bbb"), block("a", b"AAA")), ("a",)),
        Op("put", tuple(block(k, k.encode() * 3) for k in "cdefg"), (), ("a",)),
        Op("get", keys=("g", "e", "f")),
        Op("get", keys=("a",)),  # evicted
        Op("put", (block("h", b"hhh"),), ("h", "h"), ("h",)),
        Op("get", keys=("h", "g")),
    ]
    for index, op in enumerate(ops):
        expected, got = op.run(reference), op.run(patched)
        assert got == expected, f"op {index}: upstream {expected}, patched {got}"
        assert key_to_slot(patched) == key_to_slot(reference), f"op {index}"
        assert list(patched._lru) == list(reference._lru), f"op {index}"
        assert patched._arena[:] == reference._arena[:], f"op {index}"
    reference.close()
    patched.close()
    for op in (Op("put", (block("z", b"zzz"),)), Op("get", keys=("h",))):
        expected, got = op.run(reference), op.run(patched)
        assert expected == ("error", ("RuntimeError", "auxiliary output store is closed"))
        assert got == expected


def test_a_kernel_that_refuses_the_advice_keeps_upstreams_arena(
    reverted: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A kernel built without THP answers ``MADV_NOHUGEPAGE`` with ``EINVAL``; here an
    advice no kernel knows gets the same real ``EINVAL``. The store must still be built
    (upstream's shared arena, its own size and contents), with one warning naming the
    error: before, the ``OSError`` escaped ``BlockObjectStore.__init__`` and the worker's
    connector (the engine) failed to start."""
    prime_r3.apply(names=["store_arena"], log=False)
    reverted.setattr(store_arena, "_NO_HUGE_PAGES", 0x7FFF)
    reverted.setattr(store_arena, "_refused", False, raising=False)
    with caplog.at_level("WARNING", logger="vllm.prime_r3"):
        stores = [
            store_mod.BlockObjectStore(max_bytes=8 * 4096, object_nbytes=4096) for _ in range(2)
        ]
    for store in stores:
        assert mapping_of(store._arena) == "rw-s"  # upstream's kind, still open
        assert len(store._arena) == 8 * 4096 and store._arena[:] == bytes(8 * 4096)
        store.put([store_mod.BlockObject("k", b"x" * 4096)])
        assert store.get_concatenated(["k"]) == b"x" * 4096
        store.close()
    refused = [r for r in caplog.records if "refused the private arena" in r.getMessage()]
    assert len(refused) == 1 and "Invalid argument" in refused[0].getMessage()


def _arena_kb(pid: int, arena: mmap.mmap) -> dict[str, int]:
    """The kB fields (``Rss``, ``Pss``, ...) of ``arena``'s mapping in ``pid``'s smaps."""
    view = (ctypes.c_char * 1).from_buffer(arena)
    try:
        address = ctypes.addressof(view)
    finally:
        del view
    inside, fields = False, {}
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
            elif inside and line.rstrip().endswith(" kB"):
                name, value = line.split(":", 1)
                fields[name] = int(value.split()[0])
    return fields


def _memory_across_fork(store: object) -> tuple[int, int]:
    """Touch every page of the store's arena, fork a child that lives on, rewrite every
    page (the writer thread reusing slots), and return (parent, child) ``Pss`` in kB of
    the arena's mapping: the memory each process keeps alive for it."""
    import os

    arena = store._arena  # type: ignore[attr-defined]
    arena[:] = b"\x01" * len(arena)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child only waits, then leaves at once
        os.read(read_end, 1)
        os._exit(0)
    try:
        arena[:] = b"\x02" * len(arena)
        return _arena_kb(os.getpid(), arena)["Pss"], _arena_kb(child, arena).get("Pss", 0)
    finally:
        os.write(write_end, b"x")
        os.waitpid(child, 0)
        os.close(read_end)
        os.close(write_end)


def test_a_fork_keeps_no_more_of_the_arena_alive_than_upstreams(
    reverted: pytest.MonkeyPatch,
) -> None:
    """An in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, uniproc executor)
    builds the store in the user's process, which may fork afterwards (``multiprocessing``
    workers, a ``DataLoader``). Upstream's shared arena stays one copy; a private one
    would become copy-on-write, the writer's rewrites copying every touched page and the
    child keeping the old ones (2x the touched arena: failed before, child Pss 2048 kB
    of 2048). Wiped on fork, the child holds none of it."""
    pages = 512
    upstream = store_mod.BlockObjectStore(max_bytes=pages * 4096, object_nbytes=4096)
    assert mapping_of(upstream._arena) == "rw-s"
    prime_r3.apply(names=["store_arena"], log=False)
    store = store_mod.BlockObjectStore(max_bytes=pages * 4096, object_nbytes=4096)
    assert mapping_of(store._arena) == "rw-p"
    try:
        parent, child = _memory_across_fork(upstream)
        assert parent == pages * 4 and child == 0  # what upstream keeps: one copy
        parent, child = _memory_across_fork(store)
        assert parent == pages * 4, parent
        assert child == 0, f"the forked child keeps {child} kB of the private arena"
        assert "wf" in vm_flags_of(store._arena)  # wiped on fork
    finally:
        upstream.close()
        store.close()
