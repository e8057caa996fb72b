"""store_headroom: build the output worker's aux-output store at 2x vLLM's KV-derived size.

vLLM 0.31-0.32 size the routed-experts ``BlockObjectStore`` to exactly the KV cache
(``num_blocks * hashes per block * bytes per block``). At 100% KV the rows referenced
by running requests plus the batch being published can exceed that, and ``put``
raises on the writer thread (the engine dies); below that, a store with no slack is
always full, so every put evicts. vLLM 0.33 still sizes it at 1x but grows on demand
and keeps referenced keys out of the LRU: skipped there as fixed upstream.

Replaces ``AuxOutputWorkerConnector.__init__`` and ``BlockObjectStore.__init__``. The
connector wrapper reads nothing: it keeps the ``vllm_config`` argument in a ContextVar
(per thread, never on vLLM's modules) for the duration of upstream's ``__init__`` and
resets it when that returns. The store wrapper, inside that context, builds the store
with ``max_bytes`` = ``headroom_slots(max_bytes // object_nbytes, factor) *
object_nbytes`` (``PRIME_R3_STORE_HEADROOM_FACTOR``, default 2, at most ``MAX_FACTOR``)
and logs the capacity once. Upstream reads ``aux_output_config.max_bytes`` only on the
TP output rank, just before it builds the store, so the store wrapper reads it there,
after upstream has: on other ranks (which build no store) nothing of the config is
touched, and a config upstream accepts is accepted with the overlay too.

Falls back to upstream's own call, unchanged, when: no connector is being built (anyone
else constructing a store); the connector's call is not upstream's keyword-only one
(no ``vllm_config`` keyword); the context already built its one store; arguments are
positional; ``max_bytes`` or ``object_nbytes`` is not an ``int``; ``object_nbytes <= 0``
or ``max_bytes < object_nbytes`` (upstream rejects it with its own error). With an
explicit ``aux_output_config.max_bytes`` (a memory budget) the store is upstream's size,
logged as "no headroom added" (``store_growth`` still keeps it from failing). Any other
keyword goes through as given, so upstream rejects it as it would.

Why the result equals upstream's except in size: the store is upstream's class built by
upstream's ``__init__``, with only ``max_bytes`` changed; the arena is an anonymous
mmap, so only written slots cost RSS (at most factor x KV tokens x MoE layers x top-k x
itemsize on the output worker): the headroom is address space until used.
"""

from __future__ import annotations

import contextvars
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prime_r3.config import parse_float_in_range
from prime_r3.fixes.aux_output import STORE_MODULE, WORKER_MODULE
from prime_r3.spec import Param, PatchSpec, Process, Target, WrapperFn

logger = logging.getLogger("vllm.prime_r3")

DEFAULT_FACTOR = 2.0
#: Upper bound of the factor. The store only ever needs the rows of blocks the KV cache
#: holds plus those of the batches being published (a bit over 1x; 2x covers it, and
#: ``store_growth`` handles the rest): slots beyond that are never read, because a row
#: is only wanted again on a KV prefix-cache hit. 8 leaves 4x the default for anyone
#: experimenting. Above it the factor only buys address space: the arena is one
#: anonymous mmap of ``max_bytes * factor`` (a production-sized KV store of ~450k slots
#: of 16 x 46 x 8 bytes is ~2.6 GB at 1x, ~21 GB at 8x), and Linux's default overcommit
#: heuristic refuses a single mapping larger than RAM + swap, so a large factor would
#: surface as an mmap error in the output worker after the model loaded (1e9 asks for
#: exabytes), instead of a clear error when the environment is parsed.
MAX_FACTOR = 8.0

# Verified source fingerprints (scripts/fingerprint.py); store.py and worker.py are
# byte-identical in vLLM 0.31.0 and 0.32.0.
CONNECTOR_INIT = frozenset({"2c471ba2e608bd4c"})
STORE_INIT = frozenset({"1b818a0cd8d9cf4d"})


@dataclass
class _Sizing:
    """The connector being built (its config, while its ``__init__`` runs); one store."""

    factor: float
    vllm_config: Any
    used: bool = False


_sizing: contextvars.ContextVar[_Sizing | None] = contextvars.ContextVar(
    "prime_r3_store_headroom", default=None
)


def headroom_slots(base_slots: int, factor: float) -> int:
    """Slots for a store vLLM would size at ``base_slots`` (never fewer)."""
    return max(base_slots, math.floor(base_slots * factor))


def _connector_init(params: Mapping[str, Any]) -> WrapperFn:
    factor = params["factor"]

    def init_with_headroom(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        if "vllm_config" not in kwargs:  # not upstream's (keyword-only) call: no opinion
            return wrapped(*args, **kwargs)
        # Read nothing here: upstream reads aux_output_config on the output rank only.
        token = _sizing.set(_Sizing(factor, kwargs["vllm_config"]))
        try:
            return wrapped(*args, **kwargs)
        finally:
            _sizing.reset(token)

    return init_with_headroom


def _store_init(params: Mapping[str, Any]) -> WrapperFn:
    def init_store(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        sizing = _sizing.get()
        max_bytes = kwargs.get("max_bytes")
        object_nbytes = kwargs.get("object_nbytes")
        if (
            sizing is None
            or sizing.used
            or args
            or not isinstance(max_bytes, int)
            or not isinstance(object_nbytes, int)
            or object_nbytes <= 0
            or max_bytes < object_nbytes
        ):
            return wrapped(*args, **kwargs)  # not the connector's store, or upstream rejects it
        sizing.used = True
        base_slots = max_bytes // object_nbytes
        # Upstream read this on this path just before building the store (worker.py).
        explicit_max_bytes = sizing.vllm_config.aux_output_config.max_bytes
        if explicit_max_bytes is not None:
            wrapped(*args, **kwargs)
            logger.info(
                "prime_r3 store_headroom: aux_output_config.max_bytes=%d is set explicitly; "
                "keeping it: %d objects of %d bytes (%d bytes), no headroom added",
                explicit_max_bytes,
                instance.num_slots,
                object_nbytes,
                instance.num_slots * object_nbytes,
            )
            return None
        slots = headroom_slots(base_slots, sizing.factor)
        # Any other keyword goes through as given: upstream rejects it, and so do we.
        wrapped(**{**kwargs, "max_bytes": slots * object_nbytes})
        logger.info(
            "prime_r3 store_headroom: aux-output store holds %d objects of %d bytes "
            "(%d bytes, %gx the %d objects vLLM derives from the KV cache); the arena is "
            "an anonymous mmap, only used slots cost RSS",
            instance.num_slots,
            object_nbytes,
            instance.num_slots * object_nbytes,
            sizing.factor,
            base_slots,
        )
        return None

    return init_store


SPEC = PatchSpec(
    name="store_headroom",
    summary="aux-output store on the output worker sized at 2x vLLM's KV-derived capacity",
    vllm_range=">=0.31,<0.34",
    fixed_upstream_in="0.33",
    processes=frozenset({Process.WORKER}),
    targets=(
        Target(WORKER_MODULE, "AuxOutputWorkerConnector.__init__", CONNECTOR_INIT, _connector_init),
        Target(STORE_MODULE, "BlockObjectStore.__init__", STORE_INIT, _store_init),
    ),
    params=(
        Param(
            "factor",
            DEFAULT_FACTOR,
            parse_float_in_range(1.0, MAX_FACTOR),
            "multiplier on the store size vLLM derives from the KV cache "
            "(ignored when aux_output_config.max_bytes is set)",
            f"a number in 1..{MAX_FACTOR:g}, e.g. 2 or 1.5",
        ),
    ),
    notes=(
        "An explicit aux_output_config.max_bytes is kept as is. vLLM 0.33 keeps 1x sizing "
        "but grows on demand instead of raising, which fixes the overflow this guards against."
    ),
)
