"""store_eviction, store_headroom, store_growth: behaviour beyond parity, and composition."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from types import SimpleNamespace
from typing import Any

import pytest

import prime_r3
from prime_r3 import config, layer
from prime_r3.fixes import store_eviction, store_growth
from prime_r3.patches import REGISTRY
from tests.store_harness import store_mod, upstream_store

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
    originals = _targets(STORE_PATCHES)
    wanted = set(_targets(names))
    report = prime_r3.apply(names=names, log=False)
    assert report.applied == names
    for (owner, attr), original in originals.items():
        current = owner.__dict__[attr]
        if (owner, attr) in wanted:
            assert prime_r3.is_object_patched(current) and current.__wrapped__ is original
        else:
            assert current is original
    assert {n for n in STORE_PATCHES if n not in names}.isdisjoint(report.applied)
    # A store still works with this subset in place.
    store = store_mod.BlockObjectStore(max_bytes=8, object_nbytes=4)
    store.put(_objects("a", "b"))
    store.put(_objects("c"))  # evicts "a"
    assert store.get_concatenated(["c", "b"]) == b"c...b..." and "a" not in store._lru
    prime_r3.revert()
    for (owner, attr), original in originals.items():
        assert owner.__dict__[attr] is original


def test_a_changed_target_source_skips_the_patch(reverted: pytest.MonkeyPatch) -> None:
    spec = store_eviction.SPEC
    stale = dataclasses.replace(
        spec,
        targets=tuple(
            dataclasses.replace(t, fingerprints=frozenset({"0" * 16})) for t in spec.targets
        ),
    )
    reverted.setattr(layer, "registry", lambda: (stale,))
    before = store_mod.BlockObjectStore.__dict__["_evict_to_fit"]
    with pytest.raises(prime_r3.PatchNotApplied, match="target source changed"):
        prime_r3.apply(names=["store_eviction"], log=False)
    assert store_mod.BlockObjectStore.__dict__["_evict_to_fit"] is before


# -- store_eviction ------------------------------------------------------------------


def _full_store(num_slots: int, referenced: int) -> Any:
    """A full store whose first ``referenced`` keys are retained (the pile-up upstream hits)."""
    store = store_mod.BlockObjectStore(max_bytes=num_slots, object_nbytes=1)
    keys = [f"r{i}" for i in range(referenced)]
    store.put([store_mod.BlockObject(k, b"r") for k in keys], retain_keys=keys)
    store.put([store_mod.BlockObject(f"u{i}", b"u") for i in range(num_slots - referenced)])
    assert len(store._lru) == num_slots
    return store


def test_rotated_keys_are_not_rescanned_every_put(reverted: pytest.MonkeyPatch) -> None:
    prime_r3.apply(names=["store_eviction"], log=False)
    store = _full_store(1000, 800)
    moved: list[int] = []
    rotate = store_eviction.rotate_referenced
    reverted.setattr(store_eviction, "rotate_referenced", lambda *a: moved.append(rotate(*a)))
    for step in range(60):
        store.put([store_mod.BlockObject(f"n{step}.{i}", b"n") for i in range(5)])
    # The first put moves the 800 referenced keys behind everything evictable: the 200
    # old keys and its own 5. Only once those 205 are evicted (41 puts of 5) does the
    # eviction front reach the referenced keys again: once per pass, not once per put.
    passes = (200 + 5) // 5
    expected = [0] * 60
    expected[0] = expected[passes] = 800
    assert moved == expected
    assert all(f"r{i}" in store._lru for i in range(800))


def test_eviction_victims_match_upstream_on_a_pile_up(reverted: pytest.MonkeyPatch) -> None:
    reference = upstream_store(50, 1)
    prime_r3.apply(names=["store_eviction"], log=False)
    patched = store_mod.BlockObjectStore(max_bytes=50, object_nbytes=1)
    for store in (reference, patched):
        keys = [f"r{i}" for i in range(30)]
        store.put([store_mod.BlockObject(k, b"r") for k in keys], retain_keys=keys)
        store.put([store_mod.BlockObject(f"u{i}", b"u") for i in range(20)])
        store.put(_objects("x", "y", nbytes=1), release_keys=["r3", "r7"])
        store.put(_objects("z", "r7", nbytes=1))
    assert reference._lru.items() == patched._lru.items()  # same keys in the same slots
    assert {f"u{i}" for i in range(20)} - set(patched._lru) == {"u0", "u1", "u2"}
    assert [k for k in reference._lru if k not in reference._references] == [
        k for k in patched._lru if k not in patched._references
    ]


# -- store_growth --------------------------------------------------------------------


def test_growth_keeps_every_key_and_warns_once_per_growth(
    reverted: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    reference = upstream_store(4 * 4, 4)
    prime_r3.apply(names=["store_growth"], log=False)
    store = store_mod.BlockObjectStore(max_bytes=4 * 4, object_nbytes=4)
    held = [f"h{i}" for i in range(5)]
    for s in (reference, store):
        s.put(_objects("free"))
    with pytest.raises(store_mod.BlockObjectStoreError, match="cannot retain"):
        reference.put(_objects(*held), retain_keys=held)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        store.put(_objects(*held), retain_keys=held)  # 6 keys, 1 evictable: grows to 8
        assert store.num_slots == 8 and len(store._arena) == 32
        more = [f"m{i}" for i in range(7)]
        store.put(_objects(*more), retain_keys=more)  # 13 keys, 1 evictable: grows to 16
        assert store.num_slots == 16
    growths = [r for r in caplog.records if "store_growth" in r.getMessage()]
    assert len(growths) == 2
    for key in ["free", *held, *more]:
        assert store.get_concatenated([key]) == _objects(key)[0].payload
    assert store._references == {k: 1 for k in held + more}


def test_growth_keeps_the_writer_thread_alive(reverted: pytest.MonkeyPatch) -> None:
    def overflow(background: Any) -> None:
        keys = [f"k{i}" for i in range(9)]
        background.put(_objects(*keys), retain_keys=keys)
        assert background.get_concatenated(["k8"]) == _objects("k8")[0].payload

    upstream = store_mod.BackgroundBlockObjectStore(upstream_store(16, 4), max_pending_batches=2)
    with pytest.raises(store_mod.BlockObjectStoreError, match="publication failed"):
        overflow(upstream)
    with pytest.raises(store_mod.BlockObjectStoreError):
        upstream.close()
    prime_r3.apply(names=["store_growth"], log=False)
    grown = store_mod.BackgroundBlockObjectStore(
        store_mod.BlockObjectStore(max_bytes=16, object_nbytes=4), max_pending_batches=2
    )
    overflow(grown)
    grown.close()


def test_growth_undoes_references_exactly() -> None:
    store = upstream_store(8, 1)
    store._retain(["a", "a", "b"])
    before = dict(store._references)
    retains, releases = ("a", "c", "c", "b"), ("a", "a", "b", "b", "c")
    store._retain(retains)  # what a put did before _evict_to_fit raised
    store._release(releases)
    store_growth._undo_references(store, retains, releases)
    assert store._references == before


# -- store_headroom ------------------------------------------------------------------


class _FakeCapturer:
    shape_per_token = (4, 2)
    output_dtype_name = "uint8"

    def __init__(self, **kwargs: Any) -> None:
        pass


@pytest.fixture
def connector_factory(reverted: pytest.MonkeyPatch):  # noqa: ANN201
    """Build the real AuxOutputWorkerConnector on CPU, with the GPU pieces stubbed."""
    from vllm.config.aux_output import AuxOutputConfig
    from vllm.distributed.aux_output_connector import worker

    reverted.setattr(worker, "RoutedExpertsCapturer", _FakeCapturer)
    reverted.setattr(worker, "bind_routed_experts_capturer", lambda model, capturer: None)
    reverted.setattr(worker, "get_tp_group", lambda: SimpleNamespace(is_first_rank=True))
    reverted.setattr(worker, "resolve_kv_cache_block_sizes", lambda kv, cfg: (32, 16))
    reverted.setattr(worker, "RoutedExpertsBuffer", lambda *args: object())
    built = []

    def build(max_bytes: int | None = None, num_blocks: int = 10) -> Any:
        vllm_config = SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_batched_tokens=64, max_num_seqs=4),
            max_concurrent_batches=1,
            aux_output_config=AuxOutputConfig(max_bytes=max_bytes),
        )
        connector = worker.get_aux_output_connector(
            None, vllm_config, SimpleNamespace(num_blocks=num_blocks)
        )
        built.append(connector)
        return connector._store._store

    yield reverted, build
    for connector in built:
        connector.close()


def test_headroom_doubles_the_kv_derived_store(
    connector_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    _, build = connector_factory
    upstream = build()  # 10 blocks x 2 hashes per block, 16 tokens x 8 B per object
    prime_r3.apply(names=["store_headroom"], log=False)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        store = build()
    assert store.object_nbytes == upstream.object_nbytes
    assert store.num_slots == 2 * upstream.num_slots
    assert len(store._arena) == 2 * len(upstream._arena)
    logs = [r.getMessage() for r in caplog.records if "store_headroom" in r.getMessage()]
    assert len(logs) == 1
    assert f"{store.num_slots} objects" in logs[0] and f"{len(store._arena)} bytes" in logs[0]
    # Stores built outside the connector keep upstream's size.
    assert store_mod.BlockObjectStore(max_bytes=64, object_nbytes=8).num_slots == 8


def test_headroom_factor_from_the_environment(connector_factory: Any) -> None:
    env, build = connector_factory
    upstream = build(num_blocks=7)
    env.setenv("PRIME_R3_STORE_HEADROOM_FACTOR", "1.5")
    prime_r3.apply(names=["store_headroom"], log=False)
    assert build(num_blocks=7).num_slots == int(upstream.num_slots * 1.5)


def test_headroom_keeps_an_explicit_max_bytes(
    connector_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    _, build = connector_factory
    upstream = build(max_bytes=1000)
    prime_r3.apply(names=["store_headroom"], log=False)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        store = build(max_bytes=1000)
    assert store.num_slots == upstream.num_slots
    assert any("set explicitly" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("value", ["0.5", "inf", "two", "nan"])
def test_headroom_factor_rejects_bad_values(value: str, reverted: pytest.MonkeyPatch) -> None:
    reverted.setenv("PRIME_R3_STORE_HEADROOM_FACTOR", value)
    with pytest.raises(config.ConfigError, match="PRIME_R3_STORE_HEADROOM_FACTOR"):
        prime_r3.apply(names=["store_headroom"], log=False)


def test_all_three_on_the_connector_store(connector_factory: Any) -> None:
    """Headroom sizes it, eviction keeps puts cheap, growth saves it at overflow."""
    _, build = connector_factory
    upstream_slots = build(num_blocks=2).num_slots
    prime_r3.apply(names=STORE_PATCHES, log=False)
    store = build(num_blocks=2)
    assert store.num_slots == 2 * upstream_slots
    background = store_mod.BackgroundBlockObjectStore(store, max_pending_batches=2)
    nbytes = store.object_nbytes
    keys = [f"k{i}" for i in range(2 * upstream_slots + 3)]
    objects = [store_mod.BlockObject(k, bytes([i]) * nbytes) for i, k in enumerate(keys)]
    background.put(objects, retain_keys=keys)
    assert background.get_concatenated(keys[::-1]) == b"".join(o.payload for o in objects[::-1])
    assert store.num_slots == 4 * upstream_slots
    background.close()
