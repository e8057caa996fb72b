"""Patched BlockObjectStore vs upstream's, on seeded random operation sequences.

Per release: on vLLM 0.31.0 and 0.32.0 the store patches apply and must match the real
upstream class (restored by the layer) op by op. On 0.33.0 they skip as fixed upstream
(asserted with that reason); there the same sequences check 0.33's own store: victims
are never referenced keys, and a store full of referenced keys grows instead of raising.
Through vLLM's writer thread the same holds.
A failure names the seed and op index; rerun one with ``run_sequence(seed, 300, ...)``.
"""

from __future__ import annotations

import pytest

import prime_r3
from prime_r3.fixes import store_eviction
from tests.store_harness import (
    NO_ROOM,
    Op,
    Sequence,
    Snapshot,
    apply_or_expect_fixed_upstream,
    assert_same_state,
    installed_release,
    run_sequence,
    run_upstream_properties,
    store_fixed_upstream,
    store_mod,
    upstream_store,
)

SEEDS = range(300)
NUM_OPS = 300

COMBINATIONS = {
    "eviction": ["store_eviction"],
    "growth": ["store_growth"],
    "all_store_patches": ["store_eviction", "store_headroom", "store_growth"],
}


@pytest.fixture
def patched(request: pytest.FixtureRequest, reverted: pytest.MonkeyPatch):  # noqa: ANN201
    """Apply ``request.param``; yields the names in force (on 0.33 the fixed-upstream
    store patches are asserted to skip)."""
    names = list(request.param)
    if not apply_or_expect_fixed_upstream(names):
        pytest.skip(
            f"vLLM {installed_release()}: {', '.join(names)} skip as fixed upstream (asserted); "
            "upstream's own store is checked by test_upstream_store_properties"
        )
    yield names
    prime_r3.revert()


@pytest.mark.parametrize("patched", COMBINATIONS.values(), ids=COMBINATIONS.keys(), indirect=True)
def test_random_sequences_match_upstream(patched: list[str], reverted: pytest.MonkeyPatch) -> None:
    growth = "store_growth" in patched
    moved: list[int] = []
    rotate = store_eviction.rotate_referenced
    reverted.setattr(store_eviction, "rotate_referenced", lambda *a: moved.append(rotate(*a)))
    totals = {"ops": 0, "no_room": 0, "grown": 0}
    for seed in SEEDS:
        for key, value in run_sequence(seed, NUM_OPS, growth=growth).items():
            totals[key] += value
    # The sequences must reach the interesting paths, or the comparison proves little.
    assert totals["ops"] > len(SEEDS) * NUM_OPS * 0.5
    assert totals["no_room"] > 100
    assert totals["grown"] == (totals["no_room"] if growth else 0)
    if "store_eviction" in patched:
        assert sum(1 for n in moved if n) > 1000  # referenced keys were really rotated


def test_upstream_store_properties() -> None:
    """The real upstream class of the installed release, no patch: what it guarantees."""
    totals = {"ops": 0, "no_room": 0, "grown": 0, "evicted": 0}
    for seed in SEEDS:
        for key, value in run_upstream_properties(seed, NUM_OPS).items():
            totals[key] += value
    assert totals["ops"] > len(SEEDS) * NUM_OPS * 0.5
    assert totals["evicted"] > 1000  # eviction was exercised, with referenced keys around
    if store_fixed_upstream():  # 0.33: grows where 0.31/0.32 raise
        assert totals["no_room"] == 0 and totals["grown"] > 100
    else:  # 0.31/0.32: the overflow store_growth exists for
        assert totals["no_room"] > 100 and totals["grown"] == 0


def test_reference_store_runs_upstream_code_while_patched(reverted: pytest.MonkeyPatch) -> None:
    """The harness is only meaningful if the reference bypasses every wrapper."""
    if not apply_or_expect_fixed_upstream(["store_eviction", "store_growth"]):
        pytest.skip(f"vLLM {installed_release()}: nothing is patched (skip asserted)")
    reference = upstream_store(4, 1)
    for name in ("put", "_evict_to_fit"):
        assert not prime_r3.is_object_patched(getattr(reference, name).__func__)
        assert prime_r3.is_object_patched(store_mod.BlockObjectStore.__dict__[name])
    # Upstream raises where the patched class grows.
    op = Op("put", tuple(store_mod.BlockObject(f"k{i}", b"x") for i in range(5)), ("k0",) * 5)
    assert op.run(reference)[0] == "error"
    patched = store_mod.BlockObjectStore(max_bytes=4, object_nbytes=1)
    assert op.run(patched) == ("ok", None) and patched.num_slots == 8


def _sync(background: store_mod.BackgroundBlockObjectStore) -> None:
    background.get_concatenated([])  # joins the writer's queue


@pytest.mark.parametrize(
    "patched",
    [["store_eviction"], COMBINATIONS["all_store_patches"]],
    ids=["eviction", "all_store_patches"],
    indirect=True,
)
def test_background_writer_matches_upstream(patched: list[str]) -> None:
    """Puts go through the writer thread while the main thread keeps generating ops;
    the first writer error (no room on 0.31/0.32 without store_growth) must surface as
    upstream's, with its cause."""
    growth = "store_growth" in patched
    failures = ops = 0
    for seed in range(40):
        # Without growth the first no-room error ends a sequence: retain less to run longer.
        seq = Sequence(seed, allow_bad_release=False, retain_rate=0.6 if growth else 0.2)
        reference = upstream_store(seq.max_bytes, seq.object_nbytes)
        inner = store_mod.BlockObjectStore(max_bytes=seq.max_bytes, object_nbytes=seq.object_nbytes)
        background = store_mod.BackgroundBlockObjectStore(inner, max_pending_batches=4)
        failed = False
        try:
            for index in range(NUM_OPS):
                where = f"seed={seed} op={index}"
                op = seq.next_op(reference)
                if growth and op.kind == "put":
                    reference = _grow_reference_if_needed(reference, op)
                expected = op.run(reference)
                got = op.run(background)
                ops += 1
                if expected[0] == "error" and op.kind == "put":
                    assert not growth, f"{where}: {expected}"
                    # The writer fails asynchronously; the next call reports the cause.
                    with pytest.raises(store_mod.BlockObjectStoreError) as caught:
                        _sync(background)
                    cause = caught.value.__cause__
                    assert (type(cause).__name__, str(cause)) == expected[1], where
                    failures += 1
                    failed = True
                    break
                assert got == expected, f"{where}: upstream {expected}, writer {got}"
                if op.kind == "get":
                    assert_same_state(reference, inner, where)
            else:
                _sync(background)
                assert_same_state(reference, inner, f"seed={seed} end")
        finally:
            if failed:  # close() re-raises the writer error checked above
                with pytest.raises(store_mod.BlockObjectStoreError):
                    background.close()
            else:
                background.close()
    assert ops > 2000
    # The no-room path through the writer was exercised where upstream has one (0.33 grows).
    assert growth or failures > 0 or store_fixed_upstream()


def _grow_reference_if_needed(reference, op: Op):  # noqa: ANN001, ANN202
    """Swap in an upstream store of the grown capacity where upstream would raise."""
    before = Snapshot.of(reference)
    needed = len(reference._lru) + op.new_keys(reference)
    outcome = op.run(reference)
    if outcome[0] == "error" and NO_ROOM in outcome[1][1]:
        grown = max(needed, 2 * reference.num_slots)
    else:
        grown = reference.num_slots
    return before.restore(grown, reference.object_nbytes)
