"""store_eviction: keep referenced keys away from the front of the aux-output store's LRU.

vLLM 0.31-0.32 size ``BlockObjectStore`` to the KV cache, so under load the store is
full and every ``put`` evicts. ``_evict_to_fit`` walks the LRU from the front and
skips keys that running requests still reference; those keys are never moved while
they are referenced, so they pile up at the front and every put rescans all of them
(hundreds of thousands of keys, tens of ms per put, on the writer thread that holds
the GIL against the step loop). vLLM 0.33 takes referenced keys out of the LRU
(``_retain`` pops them): skipped there as fixed upstream.

Replaces ``BlockObjectStore._evict_to_fit`` (anchor: the whole class, see
``aux_output``). Before upstream's ``_evict_to_fit`` runs on a store over capacity,
``rotate_referenced`` walks the window upstream is about to walk (from the front until
``excess`` evictable keys are seen) and moves the referenced keys found there to the
end; then upstream runs unchanged. The leading run of referenced keys is found and
moved at C speed (``takewhile``/``map``); only the rest of the window is walked in
Python.

Falls back to upstream alone (nothing moved) when: the call is not on an instance;
``protected`` is not a ``set``/``frozenset`` (upstream's ``put`` always passes a set;
anything else, whose ``in`` might raise part-way, must not have reordering precede an
error upstream raises on its own); the store is not over capacity. When every key is
referenced, the whole LRU is moved to the end in its own order (the same order) and
upstream decides what to raise.

Why the victims are upstream's exactly:

* a referenced key cannot be a victim, wherever it sits;
* the relative order of unreferenced keys (the only order eviction reads) is kept, and
  an unreferenced protected key stays where it is;
* a key becomes unreferenced only in ``put``'s release step, which moves it to the
  end anyway, so its earlier position is forgotten.

The one exception is a caller bug: a ``put`` whose ``release_keys`` over-releases a key
raises ``KeyError`` part-way, and keys released earlier in that call keep whatever
position they had; vLLM's writer thread treats any store error as fatal.

Cost: moved keys sit behind every key that is evictable now, so each is moved once per
pass of the eviction front through the LRU instead of scanned on every put. The typical
put scans about ``excess`` keys whatever the number of live keys; amortised, a put
moves ``batch * live / (slots - live)`` keys, at most ``batch`` once store_headroom
keeps live keys under half the slots.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from itertools import takewhile
from typing import Any

from prime_r3.fixes.aux_output import BLOCK_OBJECT_STORE, STORE_MODULE
from prime_r3.spec import PatchSpec, Process, Target, WrapperFn

# Verified source fingerprint (scripts/fingerprint.py); store.py is byte-identical in
# vLLM 0.31.0 and 0.32.0. The whole class is anchored too (see fixes/aux_output.py).
EVICT_TO_FIT = frozenset({"f4e1e98c82cada46"})


def rotate_referenced(store: Any, protected: set[str] | frozenset[str]) -> int:
    """Move the referenced keys in upstream's eviction window to the LRU's end.

    Returns how many keys moved. Does nothing unless the store is over capacity.
    """
    lru = store._lru
    excess = len(lru) - store.num_slots
    if excess <= 0:
        return 0
    references = store._references
    move_to_end = lru.move_to_end
    # The pile-up at the front, at C speed (this is the bulk of every pass).
    moved = list(takewhile(references.__contains__, lru))
    deque(map(move_to_end, moved), maxlen=0)
    pile_up = len(moved)
    if pile_up == len(lru):
        return pile_up  # every key is referenced: nothing to evict, upstream decides
    victims = 0
    for key in lru:
        if key in references:
            # Referenced, possibly also protected: position is irrelevant until release.
            moved.append(key)
        elif key not in protected:
            victims += 1
            if victims == excess:
                break
        # An unreferenced protected key stays put: its order among unreferenced keys counts.
    for key in moved[pile_up:]:
        move_to_end(key)
    return len(moved)


def _evict_to_fit(params: Mapping[str, Any]) -> WrapperFn:
    def rotate_then_evict(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        if instance is not None:
            protected = args[0] if args else kwargs.get("protected")
            # Upstream's put always passes a set. Anything else (whose ``in`` might
            # raise part-way) goes to upstream untouched, so no reordering precedes
            # an exception upstream would raise on its own.
            if isinstance(protected, set | frozenset):
                rotate_referenced(instance, protected)
        return wrapped(*args, **kwargs)

    return rotate_then_evict


SPEC = PatchSpec(
    name="store_eviction",
    summary="aux-output store: move referenced keys off the LRU front before upstream eviction",
    vllm_range=">=0.31,<0.34",
    fixed_upstream_in="0.33",
    processes=frozenset({Process.WORKER}),
    targets=(Target(STORE_MODULE, "BlockObjectStore._evict_to_fit", EVICT_TO_FIT, _evict_to_fit),),
    anchors=(BLOCK_OBJECT_STORE,),
    notes=(
        "Victims identical to upstream. vLLM 0.33 keeps referenced keys out of the LRU "
        "(_retain pops them, _evict_to_fit scans only unreferenced keys)."
    ),
)
