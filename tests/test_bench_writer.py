"""scripts/bench_writer.py's batched write loop keeps upstream's store state exactly.

The script's replay prices a batched write loop (``candidate_put``: slots allocated in
one go, one copy when they are consecutive) against upstream's ``put``; its figures say
what a parity-keeping batch would save only if that loop is one. So: random put/get/
retain/release/eviction sequences (tests/store_harness.py's generator) on the real
upstream store and on an upstream store whose ``put`` is the candidate, the full state
compared after every call. ``bound_put`` (a price, not a patch: it writes no payload)
must still do upstream's bookkeeping: every key, slot, reference and the LRU order.

vLLM 0.31.0 and 0.32.0 (byte-identical store.py) are compared; on 0.33.0 the script's
loops do not model ``put`` (0.33 adds the ``_slots`` map and arena growth), the replay is
skipped there by the script itself, and so are these tests.
"""

from __future__ import annotations

import pathlib
import runpy
from types import MethodType
from typing import Any

import pytest
from vllm.distributed.aux_output_connector import store as store_mod

from tests.store_harness import (
    Sequence,
    assert_same_state,
    store_fixed_upstream,
    upstream_store,
)

MODELLED = pytest.mark.skipif(
    store_fixed_upstream(),
    reason="vLLM 0.33's put (the _slots map, growth) is not what bench_writer's loops model",
)

SCRIPT = pathlib.Path(__file__).parents[1] / "scripts" / "bench_writer.py"


@pytest.fixture(scope="module")
def script() -> dict[str, Any]:
    return runpy.run_path(str(SCRIPT))


def _run(script: dict[str, Any], name: str, seed: int, ops: int, *, payloads: bool) -> int:
    seq = Sequence(seed)
    reference = upstream_store(seq.max_bytes, seq.object_nbytes)
    other = upstream_store(seq.max_bytes, seq.object_nbytes)
    other.put = MethodType(script[name], other)
    errors = 0
    for index in range(ops):
        where = f"{name} seed={seed} op={index}"
        op = seq.next_op(reference)
        expected, got = op.run(reference), op.run(other)
        if not payloads and op.kind == "get" and expected[0] == "ok":
            expected, got = expected[0], got[0]  # the bound writes no payload
        assert got == expected, f"{where}: upstream {expected}, script {got}"
        errors += expected[0] == "error"
        if payloads:
            assert_same_state(reference, other, where, order=True)
        else:
            other_arena, other._arena = other._arena, reference._arena
            try:
                assert_same_state(reference, other, where, order=True)
            finally:
                other._arena = other_arena
        if expected[0] == "error" and expected[1][0] == "KeyError":
            break  # an over-release: vLLM's writer stops there, so do we
    return errors


@MODELLED
def test_the_batched_write_loop_keeps_upstreams_store_state(script: dict[str, Any]) -> None:
    errors = sum(_run(script, "candidate_put", seed, 200, payloads=True) for seed in range(300))
    assert errors > 0  # the no-room and closed/over-release errors were exercised


@MODELLED
def test_the_bound_does_upstreams_bookkeeping_without_the_payloads(script: dict[str, Any]) -> None:
    for seed in range(150):
        _run(script, "bound_put", seed, 200, payloads=False)


def test_the_script_replays_only_where_its_loops_model_put(script: dict[str, Any]) -> None:
    """The script replays on 0.31.0/0.32.0's store and skips 0.33.0's (``_slots``): a real
    store, built by the real constructor of the installed release."""
    store = store_mod.BlockObjectStore(max_bytes=64, object_nbytes=8)
    try:
        assert script["replay_models"](store) is not store_fixed_upstream()
    finally:
        store.close()
