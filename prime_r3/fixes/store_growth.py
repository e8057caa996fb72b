"""store_growth: grow the aux-output store instead of failing when nothing can be evicted.

In vLLM 0.31-0.32, when the keys referenced by running requests (plus the batch being
put) outnumber the store's slots, ``put`` raises ``BlockObjectStoreError`` on the
writer thread and the engine dies (an RL run at 100% KV cache hits this). vLLM 0.33
grows the arena instead: skipped there as fixed upstream.

Replaces ``BlockObjectStore.put`` (anchor: the whole class; the retry relies on
``_retain``, ``_release`` and ``_evict_to_fit`` exactly as they are). The common put is
upstream's call, with the same arguments, and its result. When it raises
``BlockObjectStoreError`` (only ``_evict_to_fit`` raises it inside ``put``, after
upstream iterated the objects, the retains and the releases to the end, applied
retain/release, moved the batch's existing keys to the end and dropped its new keys):
the reference counts are undone exactly (from the arguments), the arena grows
(``grow``), and upstream's ``put`` runs again with what the first run consumed.

Growth mirrors 0.33's ``put``: capacity ``max(objects needed, 2 * current)``; a new
anonymous ``mmap`` with the used prefix copied (untouched pages cost no RSS; the arena
is swapped between the two runs because upstream's ``put`` holds ``self._arena`` in a
local, and ``mmap.resize`` of a shared anonymous map SIGBUSes past the old end in
CPython 3.11); ``num_slots`` follows; one warning per growth. One deliberate difference:
0.33 first evicts every evictable key, then grows; this grows without evicting (in 0.33
an unreferenced key is garbage because the scheduler holds cached blocks' keys as
references; in 0.31/0.32 it may still back a prefix-cache hit).

Falls back to upstream alone when: the call is not on an instance, or not upstream's
calling convention (one positional argument; keywords ``retain_keys``/``release_keys``
only); the error is not for lack of room (``needed <= num_slots``) or the store is
closed (``_arena is None``): the error is re-raised as upstream raised it. Arguments
are consumed as upstream consumes them (``_replayable``): lists and tuples as is, any
other iterable through a recording generator, so a closed store consumes nothing and
an iterator that raises leaves upstream's partial state.

Why the result equals upstream's on a big enough store: the second run moves the batch
and terminal keys to the end in the order one run on a bigger store would, and evicts
nothing, so keys, payloads, references and LRU order are that single run's.
"""

from __future__ import annotations

import logging
import mmap
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from prime_r3.fixes.aux_output import BLOCK_OBJECT_STORE, STORE_MODULE
from prime_r3.spec import PatchSpec, Process, Target, WrapperFn

logger = logging.getLogger("vllm.prime_r3")

# Verified source fingerprint (scripts/fingerprint.py); store.py is byte-identical in
# vLLM 0.31.0 and 0.32.0. The class is anchored too: the retry relies on _retain,
# _release and _evict_to_fit exactly as they are (see fixes/aux_output.py).
PUT = frozenset({"0e9f9d631d2c0d61"})


def grown_capacity(store: Any, needed: int) -> int:
    """Slots after one growth: enough for ``needed`` and at least double (as vLLM 0.33)."""
    return max(needed, 2 * store.num_slots)


def grow(store: Any, num_slots: int) -> None:
    """Replace the arena with a larger anonymous mmap holding the same slot contents."""
    old = store._arena
    nbytes = num_slots * store.object_nbytes
    grown = mmap.mmap(-1, nbytes)
    used = min(store._next_slot * store.object_nbytes, len(old))  # never-used slots are zero
    with memoryview(old) as view, view[:used] as prefix:  # no temporary copy
        grown[:used] = prefix
    logger.warning(
        "prime_r3 store_growth: aux-output store is full of referenced objects; "
        "growing it from %d to %d objects (%d to %d bytes) instead of failing",
        store.num_slots,
        num_slots,
        len(old),
        nbytes,
    )
    store._arena = grown
    store.num_slots = num_slots


def _undo_references(store: Any, retains: Iterable[str], releases: Iterable[str]) -> None:
    """Restore reference counts to before a put whose retain and release both completed."""
    delta = Counter(releases)
    delta.subtract(Counter(retains))
    references = store._references
    for key, change in delta.items():
        count = references.get(key, 0) + change
        if count > 0:
            references[key] = count
        else:
            references.pop(key, None)


def _replayable(items: Any) -> tuple[Any, list[Any] | tuple[Any, ...]]:
    """``items`` as upstream will iterate it, and what it yielded, for a second run.

    Upstream iterates each argument once, at its own point in ``put`` (after the
    closed-store check, retains before releases). A tuple or list is passed as is; any
    other iterable is passed as a generator that records what upstream takes from it,
    so it is consumed exactly when and as far as upstream consumes it (a closed store
    consumes nothing; an iterator that raises leaves upstream's partial state).
    """
    if isinstance(items, tuple | list):
        return items, items
    seen: list[Any] = []

    def recording() -> Any:
        for item in items:
            seen.append(item)
            yield item

    return recording(), seen


def _put(params: Mapping[str, Any]) -> WrapperFn:
    from vllm.distributed.aux_output_connector.store import BlockObjectStoreError

    def put_or_grow(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        if instance is None or len(args) != 1 or not set(kwargs) <= {"retain_keys", "release_keys"}:
            return wrapped(*args, **kwargs)  # not upstream's calling convention: no opinion
        objects, objects_seen = _replayable(args[0])
        passed = {name: _replayable(keys) for name, keys in kwargs.items()}
        try:
            return wrapped(objects, **{name: first for name, (first, _) in passed.items()})
        except BlockObjectStoreError:
            # Only _evict_to_fit raises this inside put, after upstream iterated the
            # objects, the retains and the releases to the end.
            lru = instance._lru
            needed = len(lru) + len({obj.key for obj in objects_seen}.difference(lru))
            if needed <= instance.num_slots or instance._arena is None:
                raise
            seen = {name: again for name, (_, again) in passed.items()}
            _undo_references(instance, seen.get("retain_keys", ()), seen.get("release_keys", ()))
            grow(instance, grown_capacity(instance, needed))
        return wrapped(objects_seen, **seen)

    return put_or_grow


SPEC = PatchSpec(
    name="store_growth",
    summary="aux-output store: double the arena instead of raising when every slot is held",
    vllm_range=">=0.31,<0.34",
    fixed_upstream_in="0.33",
    processes=frozenset({Process.WORKER}),
    targets=(Target(STORE_MODULE, "BlockObjectStore.put", PUT, _put),),
    anchors=(BLOCK_OBJECT_STORE,),
    notes=(
        "vLLM 0.33 grows to max(needed, 2x) with a new anonymous mmap instead of raising "
        "(after evicting what it can); we grow without evicting, see module docstring."
    ),
)
