"""store_arena: back the aux-output store's arena with a private anonymous mapping.

The writer thread (``vllm-aux-output-writer``) spends a large part of
``BlockObjectStore.put`` in the kernel: the arena fills slot by slot from
``_next_slot`` until the store is full (with store_headroom's 2x, for a long time), so
nearly every block a step writes lands on a page never touched before, and upstream's
``mmap.mmap(-1, size)`` is a *shared* anonymous mapping, whose first touch is a shmem
page fault. A private anonymous page fault is cheaper (figures, and the rejected
``MADV_HUGEPAGE``, in scripts/README.md).

Replaces ``BlockObjectStore.__init__`` (0.31/0.32 and 0.33; the wrapper relies only on
what both do: set ``_arena`` to a fresh ``mmap.mmap(-1, num_slots * object_nbytes)``
and write nothing into it). After upstream (and store_headroom) built the store, its
still untouched arena is replaced by ``private_arena`` of the same length (anonymous,
``MAP_PRIVATE``, advised ``MADV_NOHUGEPAGE`` and ``MADV_WIPEONFORK``) and upstream's is
closed.

Falls back to upstream's arena (the store is always built, as upstream builds it) when:
the call is not on an instance; the platform lacks ``MAP_PRIVATE``, ``MAP_ANONYMOUS`` or
``MADV_WIPEONFORK``; the store is not as upstream's ``__init__`` leaves it (``fresh``:
an ``mmap`` of its full size, nothing stored, allocated or referenced); the kernel
refuses the mapping or either advice (``MADV_NOHUGEPAGE`` is ``EINVAL`` on a kernel
without THP, ``MADV_WIPEONFORK`` before Linux 4.14, ``ENOMEM`` under strict overcommit
where both arenas exist for a moment), logged once per process. Arenas made later by
growth (store_growth's ``grow``, 0.33's own ``put``) are upstream's shared kind.

Why the result equals upstream's: both arenas are zero-filled and never written yet, and
every later read and write goes through the same ``mmap`` object API, so no slot, key,
payload, eviction or error can differ. Memory is the same: pages cost RSS when first
written, and on 4 KiB pages as upstream's shmem is (``MADV_NOHUGEPAGE``, whatever the
machine's THP setting). Private and shared differ only across ``fork``: nothing shares
the arena with another process, and with ``MADV_WIPEONFORK`` a forked child gets zeros
instead of copy-on-write pages, so no page is kept twice (see ``private_arena``).
"""

from __future__ import annotations

import logging
import mmap
import platform
import sys
from collections.abc import Mapping
from typing import Any

from prime_r3.fixes.aux_output import STORE_MODULE
from prime_r3.spec import PatchSpec, Process, Target, WrapperFn

# Verified source fingerprints (scripts/fingerprint.py): BlockObjectStore.__init__ of vLLM
# 0.31.0/0.32.0 (byte-identical) and of 0.33.0 (adds the ``_slots`` map). The wrapper
# relies only on what both do: set ``_arena`` to a fresh ``mmap.mmap(-1, num_slots *
# object_nbytes)`` and write nothing into it.
STORE_INIT = frozenset({"1b818a0cd8d9cf4d", "12d70a733172ed5e"})

logger = logging.getLogger("vllm.prime_r3")

_PRIVATE = getattr(mmap, "MAP_PRIVATE", None)
_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", None)
_NO_HUGE_PAGES = getattr(mmap, "MADV_NOHUGEPAGE", None)
# Python's mmap module does not export MADV_WIPEONFORK (Linux 4.14+); 18 is its value in
# glibc's generic Linux header (asm-generic/mman-common.h) for every architecture vLLM
# runs on (only PA-RISC numbers it otherwise). Elsewhere: no private arena.
_LINUX = sys.platform.startswith("linux") and not platform.machine().startswith("parisc")
_WIPE_ON_FORK = getattr(mmap, "MADV_WIPEONFORK", 18 if _LINUX else None)


def private_arena(nbytes: int) -> mmap.mmap:
    """A zero-filled anonymous private mapping of ``nbytes`` (upstream's is shared),
    advised never to use transparent huge pages. Raises ``OSError`` (and keeps nothing
    mapped) when the kernel refuses the mapping or either advice.

    Why the advice: upstream's shared arena is shmem, which gets huge pages only where
    ``shmem_enabled`` asks for them (``never`` by default); a private anonymous mapping
    gets them whenever THP is ``always`` (the default of some distributions). Then one
    first touch would make up to 2 MiB resident at once, more than upstream's arena
    holds at that moment, and khugepaged could collapse pages later; both differ from
    upstream only by the setting of the machine. ``MADV_NOHUGEPAGE`` keeps the arena on
    4 KiB pages as upstream's is, whatever the setting (the measured gain is the cheaper
    private fault, not huge pages: see the module docstring). A kernel built without
    THP refuses that advice (``EINVAL``): the caller then keeps upstream's arena.

    Why ``MADV_WIPEONFORK``: across ``fork`` upstream's shared pages stay one copy, while
    a private mapping's touched pages become copy-on-write: each page the writer thread
    rewrites after a fork is copied, and the child keeps the old one for its life (an
    in-process engine's process forking e.g. ``multiprocessing`` workers: up to twice
    the touched arena, plus a copying fault per rewritten page). Wiped on fork, a child
    gets a fresh zero-filled arena instead and the parent's pages stay its own, so no
    more memory is alive than upstream's. No vLLM code reads the arena in another
    process (the writer thread and the step loop of the worker that built it are its
    only users; vLLM's workers build their store after being started), so a child
    reading zeros where upstream's would read the parent's live slots changes nothing
    vLLM does. A kernel older than 4.14 refuses it (``EINVAL``): upstream's arena.
    """
    assert _PRIVATE is not None and _ANONYMOUS is not None  # checked by the wrapper
    assert _WIPE_ON_FORK is not None
    arena = mmap.mmap(-1, nbytes, flags=_PRIVATE | _ANONYMOUS)
    try:
        if _NO_HUGE_PAGES is not None:
            arena.madvise(_NO_HUGE_PAGES)
        arena.madvise(_WIPE_ON_FORK)
    except OSError:
        arena.close()
        raise
    return arena


def _keep_upstreams(error: OSError) -> None:
    """Log once per process that stores keep upstream's arena, and why."""
    global _refused
    if not _refused:
        _refused = True
        logger.warning(
            "prime_r3 store_arena: the kernel refused the private arena (%s); "
            "aux-output stores keep upstream's shared arena",
            error,
        )


_refused = False


def fresh(store: Any) -> bool:
    """Whether ``store`` is as upstream's ``__init__`` leaves it: an arena of its full
    size and nothing stored, allocated or referenced (so nothing was written to it)."""
    arena = getattr(store, "_arena", None)
    return (
        type(arena) is mmap.mmap
        and len(arena) == store.num_slots * store.object_nbytes
        and store._next_slot == 0
        and not store._free_slots
        and not store._lru
        and not store._references
        and not getattr(store, "_slots", None)  # 0.33's key -> slot map
    )


def _store_init(params: Mapping[str, Any]) -> WrapperFn:
    def init_private_arena(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        result = wrapped(*args, **kwargs)
        if (
            instance is None
            or _PRIVATE is None
            or _ANONYMOUS is None
            or _WIPE_ON_FORK is None
            or not fresh(instance)
        ):
            return result  # not upstream's store as __init__ leaves it: no opinion
        shared = instance._arena
        try:
            instance._arena = private_arena(len(shared))
        except OSError as error:  # a kernel without THP refuses the advice: upstream's
            _keep_upstreams(error)
            return result
        shared.close()
        return result

    return init_private_arena


SPEC = PatchSpec(
    name="store_arena",
    summary="aux-output store arena: a private anonymous mapping (cheaper first-touch "
    "page faults on the writer thread than upstream's shared one)",
    vllm_range=">=0.31,<0.34",
    processes=frozenset({Process.WORKER}),
    targets=(Target(STORE_MODULE, "BlockObjectStore.__init__", STORE_INIT, _store_init),),
    notes=(
        "Same slots, keys, bytes and memory; only the mapping's kind differs. Arenas "
        "made by growth stay upstream's shared kind."
    ),
)
