"""store_growth: grow the aux-output store instead of failing when nothing can be evicted.

In vLLM 0.31-0.32, when the keys referenced by running requests (plus the batch being
put) outnumber the store's slots, ``put`` raises ``BlockObjectStoreError`` on the
writer thread and the engine dies. An RL run at 100% KV cache hits this. vLLM 0.33
grows the arena instead; we do the same on 0.31-0.32.

Semantics, mirroring 0.33 (``BlockObjectStore.put`` there):

* capacity grows to ``max(objects needed, 2 * current)``: amortised doubling;
* the arena is a new anonymous ``mmap`` with the used prefix copied over (untouched
  pages still cost no RSS), and ``num_slots`` follows it;
* one warning per growth.

One deliberate difference: 0.33 first evicts every evictable key, then grows. We grow
without evicting anything ("keeps every key"). In 0.33 the scheduler holds the keys
of KV-cached blocks as references, so an unreferenced key is garbage there; 0.32 has
no such retention and an unreferenced key may still back a prefix-cache hit.

How: the upstream ``put`` reads ``self._arena`` into a local before evicting, so the
arena cannot be swapped inside ``_evict_to_fit`` (and ``mmap.resize`` on a shared
anonymous map SIGBUSes on access past the old end in CPython 3.11). We wrap ``put``:
when it raises for lack of room, upstream has already applied retain/release, moved
the batch's existing keys to the end and dropped its new keys. We undo the reference
counts (exact, from the arguments), grow, and run ``put`` again. The second run moves
the batch and terminal keys to the end in the same order a single run on a bigger
store would, and evicts nothing, so the result is exactly that single run's.
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
