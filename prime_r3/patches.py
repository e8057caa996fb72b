"""The registry: the one place that lists every prime_r3 patch, in apply order.

Each entry is a ``PatchSpec`` declared by its module under ``prime_r3.fixes``.
``tests/test_registry.py`` fails if a fix module declares a patch that is not here.
"""

from __future__ import annotations

from prime_r3.fixes import (
    batched_commit,
    batched_take,
    engine_gc,
    output_turns,
    packed_hop,
    packed_outputs,
    response_b64,
    response_json,
    response_rows,
    store_eviction,
    store_growth,
    store_headroom,
)
from prime_r3.spec import PatchSpec

REGISTRY: tuple[PatchSpec, ...] = (
    engine_gc.SPEC,
    packed_outputs.SPEC,
    store_eviction.SPEC,
    store_headroom.SPEC,
    store_growth.SPEC,
    batched_commit.SPEC,
    batched_take.SPEC,
    packed_hop.SPEC,
    response_rows.SPEC,
    response_b64.SPEC,
    response_json.SPEC,
    output_turns.SPEC,
)


def get(name: str) -> PatchSpec:
    for spec in REGISTRY:
        if spec.name == name:
            return spec
    raise KeyError(f"no patch named {name!r}; known: {', '.join(s.name for s in REGISTRY)}")
