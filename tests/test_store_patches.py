"""store_eviction, store_headroom, store_growth: behaviour beyond parity, and composition."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import pathlib
from typing import Any

import pytest

import prime_r3
from prime_r3 import config, layer
from prime_r3.fixes import store_eviction, store_growth
from prime_r3.fixes.aux_output import STORE_MODULE
from prime_r3.patches import REGISTRY
from tests.store_harness import (
    EXPLICIT_MAX_BYTES,
    Built,
    Scenario,
    apply_or_expect_fixed_upstream,
    build_on_tp_ranks,
    fixed_upstream_reason,
    key_to_slot,
    store_fixed_upstream,
    store_mod,
    upstream_store,
)

STORE_PATCHES = ["store_eviction", "store_headroom", "store_growth"]
LOGGER = "vllm.prime_r3"


def _objects(*keys: str, nbytes: int = 4) -> list[Any]:
    return [store_mod.BlockObject(k, k.encode().ljust(nbytes, b".")[:nbytes]) for k in keys]


def _targets(names: list[str]) -> dict[tuple[Any, str], Any]:
    """(owner, attribute) -> current raw object, for every target of the named patches."""
    from prime_r3 import guards

    found = {}
    for spec in REGISTRY:
        if spec.name in names:
            for target in spec.targets:
                resolved = guards.resolve(target)
                assert not isinstance(resolved, str), resolved
                found[resolved.owner, resolved.name] = resolved.raw
    return found


# -- composition ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "names",
    [list(c) for n in (1, 2, 3) for c in itertools.combinations(STORE_PATCHES, n)],
    ids=lambda names: "+".join(n.removeprefix("store_") for n in names),
)
def test_any_subset_applies_and_reverts_to_the_originals(
    names: list[str], reverted: pytest.MonkeyPatch
) -> None:
    """0.31/0.32: any subset applies and reverts to the originals; 0.33: all skip, untouched."""
    from vllm.distributed.aux_output_connector import worker  # noqa: F401 - all targets live

    originals = _targets(STORE_PATCHES)
    wanted = set(_targets(names))
    applied = apply_or_expect_fixed_upstream(names)
    for (owner, attr), original in originals.items():
        current = owner.__dict__[attr]
        if applied and (owner, attr) in wanted:
            assert prime_r3.is_object_patched(current) and current.__wrapped__ is original
        else:
            assert current is original
    # A store still works with this subset in place (or with none, on 0.33).
    store = store_mod.BlockObjectStore(max_bytes=8, object_nbytes=4)
    store.put(_objects("a", "b"))
    store.put(_objects("c"))  # evicts "a"
    assert store.get_concatenated(["c", "b"]) == b"c...b..."
    assert "a" not in key_to_slot(store)
    prime_r3.revert()
    for (owner, attr), original in originals.items():
        assert owner.__dict__[attr] is original


@pytest.mark.parametrize(
    "spec", [s for s in REGISTRY if s.name in STORE_PATCHES], ids=lambda s: s.name
)
def test_the_guard_sees_each_releases_store_source(spec: Any, reverted: pytest.MonkeyPatch) -> None:
    """0.31/0.32: every target verifies, and a changed one skips the patch.

    0.33: besides the version rule, the source guard alone would skip every store patch:
    each has a target or anchor in 0.33's rewritten store.py that no longer verifies.
    """
    from prime_r3 import guards

    reasons = [guards.check(item) for item in (*spec.targets, *spec.anchors)]
    if store_fixed_upstream():
        changed = [r for r in reasons if r is not None]
        assert changed and all(r.startswith("target source changed: ") for r in changed)
        assert all(STORE_MODULE in r for r in changed)
        return
    assert reasons == [None] * len(reasons)
    stale = dataclasses.replace(
        spec,
        targets=tuple(
            dataclasses.replace(t, fingerprints=frozenset({"0" * 16})) for t in spec.targets
        ),
    )
    reverted.setattr(layer, "registry", lambda: (stale,))
    before = _targets([spec.name])
    with pytest.raises(prime_r3.PatchNotApplied, match="target source changed"):
        prime_r3.apply(names=[spec.name], log=False)
    assert _targets([spec.name]) == before


# -- store_eviction ------------------------------------------------------------------


def _full_store(num_slots: int, referenced: int) -> Any:
    """A full store whose first ``referenced`` keys are retained (the pile-up upstream hits)."""
    store = store_mod.BlockObjectStore(max_bytes=num_slots, object_nbytes=1)
    keys = [f"r{i}" for i in range(referenced)]
    store.put([store_mod.BlockObject(k, b"r") for k in keys], retain_keys=keys)
    store.put([store_mod.BlockObject(f"u{i}", b"u") for i in range(num_slots - referenced)])
    assert len(key_to_slot(store)) == num_slots
    return store


def test_rotated_keys_are_not_rescanned_every_put(reverted: pytest.MonkeyPatch) -> None:
    """0.31/0.32: the rotation runs once per pass; 0.33: referenced keys never sit in the LRU."""
    applied = apply_or_expect_fixed_upstream(["store_eviction"])
    store = _full_store(1000, 800)
    moved: list[int] = []
    rotate = store_eviction.rotate_referenced
    reverted.setattr(store_eviction, "rotate_referenced", lambda *a: moved.append(rotate(*a)))
    for step in range(60):
        store.put([store_mod.BlockObject(f"n{step}.{i}", b"n") for i in range(5)])
        if not applied:  # upstream's scan window holds no referenced key, ever
            assert store._references.keys().isdisjoint(store._lru)
    assert all(f"r{i}" in key_to_slot(store) for i in range(800))
    if not applied:
        assert moved == []
        return
    # The first put moves the 800 referenced keys behind everything evictable: the 200
    # old keys and its own 5. Only once those 205 are evicted (41 puts of 5) does the
    # eviction front reach the referenced keys again: once per pass, not once per put.
    passes = (200 + 5) // 5
    expected = [0] * 60
    expected[0] = expected[passes] = 800
    assert moved == expected


def test_eviction_victims_match_upstream_on_a_pile_up(reverted: pytest.MonkeyPatch) -> None:
    """0.31/0.32: the patched store evicts upstream's victims; 0.33: never a referenced key."""
    reference = upstream_store(50, 1)
    applied = apply_or_expect_fixed_upstream(["store_eviction"])
    patched = store_mod.BlockObjectStore(max_bytes=50, object_nbytes=1)
    for store in (reference, patched):
        keys = [f"r{i}" for i in range(30)]
        store.put([store_mod.BlockObject(k, b"r") for k in keys], retain_keys=keys)
        store.put([store_mod.BlockObject(f"u{i}", b"u") for i in range(20)])
        store.put(_objects("x", "y", nbytes=1), release_keys=["r3", "r7"])
        store.put(_objects("z", "r7", nbytes=1))
    stored = key_to_slot(patched)
    assert stored.items() == key_to_slot(reference).items()  # same keys in the same slots
    assert all(f"r{i}" in stored for i in range(30) if i not in (3, 7))  # still referenced
    # Every release evicts the oldest unreferenced keys: u0, u1 for x and y, u2 for z
    # (0.33 drops r7, unreferenced and re-put, from its slot and stores it again).
    assert {f"u{i}" for i in range(20)} - set(stored) == {"u0", "u1", "u2"}
    if not applied:
        return
    assert [k for k in reference._lru if k not in reference._references] == [
        k for k in patched._lru if k not in patched._references
    ]


class _RaisingContainer:
    """A ``protected`` argument whose membership test fails (never upstream's own call)."""

    def __contains__(self, key: object) -> bool:
        raise TypeError(f"cannot test {key!r}")


def test_eviction_leaves_state_as_upstream_when_protected_raises(
    reverted: pytest.MonkeyPatch,
) -> None:
    """A protected argument upstream fails on: the same error and no reordering first."""
    reference = upstream_store(6, 1)
    applied = apply_or_expect_fixed_upstream(["store_eviction"])
    patched = store_mod.BlockObjectStore(max_bytes=6, object_nbytes=1)
    outcomes = []
    for store in (reference, patched):
        keys = ["r0", "r1", "r2"]
        store.put(_objects(*keys, nbytes=1), retain_keys=keys)
        store.put(_objects("u0", "u1", "u2", nbytes=1))
        key_to_slot(store)["extra"] = -1  # one over capacity, as mid-put
        with pytest.raises(TypeError) as error:
            store._evict_to_fit(_RaisingContainer())
        outcomes.append((str(error.value), list(store._lru)))
    assert outcomes[0] == outcomes[1]
    assert prime_r3.is_object_patched(store_mod.BlockObjectStore.__dict__["_evict_to_fit"]) == (
        applied
    )


# -- store_growth --------------------------------------------------------------------


def test_growth_keeps_every_key_and_warns_once_per_growth(
    reverted: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """0.31/0.32: upstream raises, the patched store grows; 0.33: upstream grows by itself."""
    reference = upstream_store(4 * 4, 4)
    applied = apply_or_expect_fixed_upstream(["store_growth"])
    store = store_mod.BlockObjectStore(max_bytes=4 * 4, object_nbytes=4)
    held = [f"h{i}" for i in range(5)]
    more = [f"m{i}" for i in range(7)]
    for s in (reference, store):
        s.put(_objects("free"))
    if not applied:
        # 0.33 evicts what it can ("free"), then grows to max(held, 2x): 5 -> 8, 12 -> 16.
        for s in (reference, store):
            s.put(_objects(*held), retain_keys=held)
            assert s.num_slots == 8 and len(s._arena) == 32 and "free" not in s._slots
            s.put(_objects(*more), retain_keys=more)
            assert s.num_slots == 16
            for key in [*held, *more]:
                assert s.get_concatenated([key]) == _objects(key)[0].payload
            assert s._references == {k: 1 for k in held + more}
        return
    with pytest.raises(store_mod.BlockObjectStoreError, match="cannot retain"):
        reference.put(_objects(*held), retain_keys=held)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        store.put(_objects(*held), retain_keys=held)  # 6 keys, 1 evictable: grows to 8
        assert store.num_slots == 8 and len(store._arena) == 32
        store.put(_objects(*more), retain_keys=more)  # 13 keys, 1 evictable: grows to 16
        assert store.num_slots == 16
    growths = [r for r in caplog.records if "store_growth" in r.getMessage()]
    assert len(growths) == 2
    for key in ["free", *held, *more]:
        assert store.get_concatenated([key]) == _objects(key)[0].payload
    assert store._references == {k: 1 for k in held + more}


def test_growth_keeps_the_writer_thread_alive(reverted: pytest.MonkeyPatch) -> None:
    """0.31/0.32: upstream's writer dies on overflow, the patched one lives; 0.33: both live."""

    def overflow(background: Any) -> None:
        keys = [f"k{i}" for i in range(9)]
        background.put(_objects(*keys), retain_keys=keys)
        assert background.get_concatenated(["k8"]) == _objects("k8")[0].payload

    upstream = store_mod.BackgroundBlockObjectStore(upstream_store(16, 4), max_pending_batches=2)
    if store_fixed_upstream():
        overflow(upstream)
        upstream.close()
    else:
        with pytest.raises(store_mod.BlockObjectStoreError, match="publication failed"):
            overflow(upstream)
        with pytest.raises(store_mod.BlockObjectStoreError):
            upstream.close()
    apply_or_expect_fixed_upstream(["store_growth"])
    grown = store_mod.BackgroundBlockObjectStore(
        store_mod.BlockObjectStore(max_bytes=16, object_nbytes=4), max_pending_batches=2
    )
    overflow(grown)
    grown.close()


def test_growth_undoes_references_exactly() -> None:
    """The undo helper against the real _retain/_release of the installed release."""
    store = upstream_store(8, 1)
    store._retain(["a", "a", "b"])
    before = dict(store._references)
    retains, releases = ("a", "c", "c", "b"), ("a", "a", "b", "b", "c")
    store._retain(retains)  # what a put did before _evict_to_fit raised
    store._release(releases)
    store_growth._undo_references(store, retains, releases)
    assert store._references == before


def _keys_then_fail(keys: list[str], consumed: list[str]) -> Any:
    """A one-shot iterable that records what was taken from it, then raises."""
    for key in keys:
        consumed.append(key)
        yield key
    raise ValueError("caller's iterator failed")


@pytest.mark.parametrize("closed", [False, True], ids=["open", "closed"])
def test_growth_consumes_arguments_when_and_as_far_as_upstream(
    closed: bool, reverted: pytest.MonkeyPatch
) -> None:
    """One-shot arguments: same consumption, same exception, same partial state."""
    growth_applies = not store_fixed_upstream()
    if growth_applies:
        prime_r3.apply(names=["store_growth"], log=False)
    results = []
    for store in (upstream_store(16, 4), store_mod.BlockObjectStore(max_bytes=16, object_nbytes=4)):
        store.put(_objects("a", "b"), retain_keys=["a"])
        if closed:
            store.close()
        taken: list[str] = []
        with pytest.raises((ValueError, RuntimeError)) as error:
            store.put(
                iter(_objects("c")),
                retain_keys=_keys_then_fail(["b", "c"], taken),
                release_keys=iter(["a"]),
            )
        results.append((type(error.value), str(error.value), taken, dict(store._references)))
    assert results[0] == results[1]
    assert results[0][2] == ([] if closed else ["b", "c"])
    assert prime_r3.is_object_patched(store_mod.BlockObjectStore.__dict__["put"]) == growth_applies


# -- store_headroom, on the real connector on real TP ranks ----------------------------

HEADROOM = ("store_headroom",)
SCENARIOS = [
    Scenario("upstream"),
    Scenario("upstream_no_max_bytes", aux="no_max_bytes"),
    Scenario("upstream_explicit", aux="explicit"),
    Scenario("upstream_7_blocks", num_blocks=7),
    Scenario("upstream_overflow", overflow=True),
    Scenario("headroom", HEADROOM),
    Scenario("headroom_no_max_bytes", HEADROOM, aux="no_max_bytes"),
    Scenario("headroom_explicit", HEADROOM, aux="explicit"),
    Scenario(
        "headroom_factor_1.5",
        HEADROOM,
        env=(("PRIME_R3_STORE_HEADROOM_FACTOR", "1.5"),),
        num_blocks=7,
    ),
    Scenario(
        "headroom_factor_8",
        HEADROOM,
        env=(("PRIME_R3_STORE_HEADROOM_FACTOR", "8"),),
        num_blocks=7,
    ),
    Scenario("all_overflow", tuple(STORE_PATCHES), overflow=True),
]
OUTPUT_RANK, OTHER_RANK = 0, 1


@pytest.fixture(scope="module")
def tp_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The temp dir the TP ranks get (``TMPDIR``: spawned ranks inherit it)."""
    return tmp_path_factory.mktemp("tp_ranks_tmp")


@pytest.fixture(scope="module")
def tp_ranks(tp_tmpdir: pathlib.Path) -> dict[tuple[str, int], Built]:
    """Every scenario, built once on each rank of a real TP=2 world (about a minute)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TMPDIR", str(tp_tmpdir))
        built = build_on_tp_ranks(SCENARIOS)
    assert set(built) == {(s.name, r) for s in SCENARIOS for r in (OUTPUT_RANK, OTHER_RANK)}
    for (_, rank), result in built.items():
        # vLLM's own parallel state decides the output rank: TP rank 0 only.
        assert result.is_first_rank == (rank == OUTPUT_RANK)
    return built


def test_tp_ranks_leave_no_model_directory_behind(
    tp_ranks: dict[tuple[str, int], Built], tp_tmpdir: pathlib.Path
) -> None:
    """Each rank builds its vLLM config from a temporary model directory; they stayed in
    /tmp (``prime_r3_tp_*``, two per run of this module)."""
    assert tp_ranks
    assert sorted(tp_tmpdir.glob("prime_r3_tp_*")) == []


def _expect_patches(result: Built, names: tuple[str, ...]) -> bool:
    """Per release: applied on 0.31/0.32, skipped as fixed upstream on 0.33. True if applied."""
    if store_fixed_upstream():
        assert result.applied == ()
        assert dict(result.skipped) == {n: fixed_upstream_reason() for n in names}
        return False
    assert result.applied == names and result.skipped == ()
    return True


@pytest.mark.parametrize("aux", ["", "_no_max_bytes", "_explicit"])
@pytest.mark.parametrize("rank", [OUTPUT_RANK, OTHER_RANK])
def test_headroom_reads_and_raises_what_upstream_does_on_every_rank(
    tp_ranks: dict[tuple[str, int], Built], rank: int, aux: str
) -> None:
    """The connector wrapper touches aux_output_config only where upstream does.

    Upstream reads ``aux_output_config.max_bytes`` only on the output rank, right before
    it builds the store; on other ranks it reads nothing of it.
    """
    upstream, patched = tp_ranks[f"upstream{aux}", rank], tp_ranks[f"headroom{aux}", rank]
    _expect_patches(patched, HEADROOM)
    assert patched.error == upstream.error
    assert set(patched.reads) == set(upstream.reads)
    if rank == OTHER_RANK:
        assert upstream.reads == () and upstream.num_slots is None
        assert patched.num_slots is None
    else:
        assert set(upstream.reads) == {"max_bytes"}


def test_non_output_rank_without_max_bytes_builds_as_upstream(
    tp_ranks: dict[tuple[str, int], Built],
) -> None:
    """A config with no max_bytes works upstream on a non-output rank, and must with us."""
    upstream = tp_ranks["upstream_no_max_bytes", OTHER_RANK]
    patched = tp_ranks["headroom_no_max_bytes", OTHER_RANK]
    assert upstream.error is None and upstream.num_slots is None
    assert patched.error is None and patched.num_slots is None
    # On the output rank upstream itself needs it: the same AttributeError, from upstream.
    output = tp_ranks["headroom_no_max_bytes", OUTPUT_RANK]
    assert output.error is not None and output.error[0] == "AttributeError"
    assert output.error == tp_ranks["upstream_no_max_bytes", OUTPUT_RANK].error


def test_headroom_doubles_the_kv_derived_store(tp_ranks: dict[tuple[str, int], Built]) -> None:
    upstream, patched = tp_ranks["upstream", OUTPUT_RANK], tp_ranks["headroom", OUTPUT_RANK]
    assert upstream.error is None and patched.error is None
    assert upstream.num_slots is not None and upstream.arena_bytes is not None
    assert patched.object_nbytes == upstream.object_nbytes
    if not _expect_patches(patched, HEADROOM):  # 0.33: upstream's 1x sizing, no log
        assert patched.num_slots == upstream.num_slots
        assert not [m for m in patched.logs if "store_headroom" in m]
        return
    assert patched.num_slots == 2 * upstream.num_slots
    assert patched.arena_bytes == 2 * upstream.arena_bytes
    logs = [m for m in patched.logs if "store_headroom" in m]
    assert len(logs) == 1
    assert f"{patched.num_slots} objects" in logs[0] and f"{patched.arena_bytes} bytes" in logs[0]


@pytest.mark.parametrize("value", ["1.5", "8"])  # 8: the upper bound is accepted
def test_headroom_factor_from_the_environment(
    tp_ranks: dict[tuple[str, int], Built], value: str
) -> None:
    upstream = tp_ranks["upstream_7_blocks", OUTPUT_RANK]
    patched = tp_ranks[f"headroom_factor_{value}", OUTPUT_RANK]
    assert upstream.num_slots is not None and patched.error is None
    factor = float(value) if _expect_patches(patched, HEADROOM) else 1
    assert patched.num_slots == int(upstream.num_slots * factor)


def test_headroom_keeps_an_explicit_max_bytes(tp_ranks: dict[tuple[str, int], Built]) -> None:
    upstream = tp_ranks["upstream_explicit", OUTPUT_RANK]
    patched = tp_ranks["headroom_explicit", OUTPUT_RANK]
    assert upstream.object_nbytes is not None
    assert upstream.num_slots == EXPLICIT_MAX_BYTES // upstream.object_nbytes
    assert patched.num_slots == upstream.num_slots
    kept_logged = any("set explicitly" in m for m in patched.logs)
    assert kept_logged == _expect_patches(patched, HEADROOM)


def test_all_three_on_the_connector_store(tp_ranks: dict[tuple[str, int], Built]) -> None:
    """Headroom sizes it, growth saves it at overflow (0.33: upstream grows by itself)."""
    upstream = tp_ranks["upstream_overflow", OUTPUT_RANK]
    patched = tp_ranks["all_overflow", OUTPUT_RANK]
    base = tp_ranks["upstream", OUTPUT_RANK].num_slots
    assert base is not None and upstream.overflow is not None and patched.overflow is not None
    if not _expect_patches(patched, tuple(STORE_PATCHES)):
        # 0.33 grows to max(objects held, 2x): base + 3 objects, at least double.
        assert upstream.overflow == ("ok", 2 * base, True)
        assert patched.overflow == upstream.overflow
        return
    outcome, slots, _ = upstream.overflow
    assert outcome.startswith("error: auxiliary output store cannot retain") and slots == base
    # 2x headroom, then 2x + 3 referenced objects: grows to max(needed, 2 * 2x).
    assert patched.overflow == ("ok", 4 * base, True)
    for rank_result in (tp_ranks["all_overflow", OTHER_RANK],):
        assert rank_result.error is None and rank_result.num_slots is None


def test_stores_built_outside_the_connector_keep_upstream_size(
    reverted: pytest.MonkeyPatch,
) -> None:
    reverted.setenv("PRIME_R3_PATCHES", "all")
    prime_r3.apply(log=False)
    assert store_mod.BlockObjectStore(max_bytes=64, object_nbytes=8).num_slots == 8


@pytest.mark.parametrize(
    "value", ["0.5", "0.999", "8.001", "9", "1e9", "inf", "-inf", "two", "nan"]
)
def test_headroom_factor_rejects_bad_values(value: str, reverted: pytest.MonkeyPatch) -> None:
    """At parse time, on every release (0.33 skips the patch but still parses its setting):
    the variable, the value and the valid range, instead of an mmap error much later."""
    reverted.setenv("PRIME_R3_STORE_HEADROOM_FACTOR", value)
    with pytest.raises(config.ConfigError) as info:
        prime_r3.apply(names=["store_headroom"], log=False)
    message = str(info.value)
    assert message.startswith(f"PRIME_R3_STORE_HEADROOM_FACTOR={value!r} is not valid: ")
    assert message.endswith("expected a number in 1..8, e.g. 2 or 1.5")
    assert (
        "is not a number" in message
        if value == "two"
        else "outside the valid range 1..8" in message
    )


@pytest.mark.parametrize("value", ["1", "1.0", " 8 ", "8.0", "7.99"])
def test_headroom_factor_accepts_the_range_boundaries(
    value: str, reverted: pytest.MonkeyPatch
) -> None:
    reverted.setenv("PRIME_R3_STORE_HEADROOM_FACTOR", value)
    assert config.from_env(REGISTRY).params["store_headroom"]["factor"] == float(value)
    apply_or_expect_fixed_upstream(["store_headroom"])  # 0.33: skipped, fixed upstream


def test_headroom_store_wrapper_passes_unknown_keywords_to_upstream(
    reverted: pytest.MonkeyPatch,
) -> None:
    """Inside the connector's context, a keyword upstream rejects is still rejected."""
    from types import SimpleNamespace

    from prime_r3.fixes import store_headroom

    kwargs = {"max_bytes": 64, "object_nbytes": 8, "unknown": 1}
    with pytest.raises(TypeError) as upstream_error:
        store_mod.BlockObjectStore(**kwargs)
    if store_fixed_upstream():
        assert prime_r3.status().outcome("store_headroom").reason == fixed_upstream_reason()
        return
    prime_r3.apply(names=["store_headroom"], log=False)
    config = SimpleNamespace(aux_output_config=SimpleNamespace(max_bytes=None))
    token = store_headroom._sizing.set(store_headroom._Sizing(2.0, config))
    try:
        with pytest.raises(TypeError) as patched_error:
            store_mod.BlockObjectStore(**kwargs)
    finally:
        store_headroom._sizing.reset(token)
    assert str(patched_error.value) == str(upstream_error.value)
