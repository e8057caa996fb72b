"""An import hook that rolls a patch back never leaves it half-applied.

The patch ``spanning`` has a target in a module imported at apply
(``tests.fake_upstream:Store.put``, installed then) and one in a module imported later
(``tests.fake_lazy_upstream:step``, installed by the post-import hook). Between apply
and that import another tool wraps our layer on ``Store.put`` (it holds ours and calls
it), and the lazy module arrives with its target changed or wrapped by someone else, so
the hook must roll the patch back. Removing our ``Store.put`` layer would drop the other
tool's layer; before, the hook then left it installed and working, and status said
``applied``: the patch ran on one target and not the other.

What a user expects, checked here for wrapt and plain (``Calling.PLAIN``) layers and
every kind of foreign layer in ``fake_layers``: afterwards no target of the patch does
its work; status and apply say it is skipped, naming the module and the cause and that
our layer stays as a pass-through under the other one; ``is_object_patched`` is False
for that layer and ``get_original`` still gives upstream's object; revert reports it
kept while the other layer sits on it and removes it once that layer has gone; apply
then behaves as on a clean process. Every test here fails before the fix unless its
docstring says it guards behaviour that was kept.
"""

from __future__ import annotations

import gc
import logging
import types
from collections.abc import Callable
from typing import Any

import pytest
import wrapt

import prime_r3
from prime_r3 import layer, state
from prime_r3.spec import Calling, PatchSpec, Target
from tests import fake_layers, fake_upstream
from tests.fake_specs import fp as _fp
from tests.fake_specs import spec as _spec
from tests.test_deferred import _fp as _file_fp
from tests.test_deferred import _unimport

MOD = "tests.fake_upstream"
PUT = f"{MOD}:Store.put"
LAZY = "tests.fake_lazy_upstream"
STEP = f"{LAZY}:step"
KINDS = [Calling.WRAPT, Calling.PLAIN]


def _put_factory(change: Callable[[int], int], calling: Calling) -> Any:
    """A ``make_wrapper`` of either kind on ``Store.put`` that changes the result."""
    if calling is Calling.WRAPT:
        return lambda params: (
            lambda wrapped, instance, args, kwargs: change(wrapped(*args, **kwargs))
        )

    def plain_factory(params):  # noqa: ANN001, ANN202
        def make(inner):  # noqa: ANN001, ANN202
            def put(self, x):  # noqa: ANN001, ANN202
                return change(inner(self, x))

            return put

        return make

    return plain_factory


def _put_target(change: Callable[[int], int], calling: Calling) -> Target:
    factory = _put_factory(change, calling)
    return Target(MOD, "Store.put", _fp(fake_upstream.Store.put), factory, calling=calling)


def _spanning(calling: Calling, **kw: Any) -> PatchSpec:
    """``Store.put`` + 100 (loaded at apply) and ``step`` + 1000 (imported later)."""
    step = Target(
        LAZY,
        "step",
        _file_fp("fake_lazy_upstream.py", "step"),
        lambda params: lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs) + 1000,
    )
    return _spec("spanning", _put_target(lambda r: r + 100, calling), step, **kw)


def _live() -> Any:
    return vars(fake_upstream.Store)["put"]


def _put(x: int = 1) -> int:
    return fake_upstream.Store().put(x)


@pytest.fixture
def world(reverted: pytest.MonkeyPatch):  # noqa: ANN201
    """The lazy module not imported; upstream's Store.put checked back by identity."""
    _unimport()
    original = _live()
    yield types.SimpleNamespace(
        set=lambda *specs: reverted.setattr(layer, "registry", lambda: specs),
        patch=reverted,
        original=original,
    )
    _FOREIGN_HOOKS.clear()  # their import hooks stay registered with wrapt, inactive
    layer.revert()
    fake_upstream.Store.put = original  # a foreign layer a failed test left leaves
    layer.revert()
    _unimport()
    assert _live() is original
    for name in ("spanning", "other"):
        assert state.active_wrappers(name) is None and state.inert_layers(name) == {}


#: The foreign import hooks active in the running test (wrapt cannot unregister one).
_FOREIGN_HOOKS: set[object] = set()


def _wrap_step_on_import() -> None:
    """Another tool's import hook (registered before ours) wraps ``step``."""

    def other_layer(mod: Any) -> None:
        if other_layer in _FOREIGN_HOOKS:
            mod.step = fake_layers.with_functools_wraps(mod.step)

    _FOREIGN_HOOKS.add(other_layer)
    wrapt.register_post_import_hook(other_layer, LAZY)


def _import_lazy(caplog: pytest.LogCaptureFixture) -> types.ModuleType:
    with caplog.at_level(logging.WARNING, logger="vllm.prime_r3"):
        from tests import fake_lazy_upstream as mod
    return mod


def _assert_pass_through(ours: Any, original: Any) -> None:
    """``ours`` is still our object, calls exactly upstream's, and is recorded as such."""
    assert not prime_r3.is_object_patched(ours) and state.is_inert(ours)
    assert state.inner_of(ours) is original and state.unwrap_ours(ours) is original
    assert state.wrapped_by(ours) == ()
    assert layer.get_original(MOD, "Store.put") is original
    store = fake_upstream.Store()
    assert ours.__get__(store, fake_upstream.Store)(3) == 6  # bound, as vLLM calls it
    assert ours(store, x=4) == 8  # keyword arguments reach upstream's as given


@pytest.mark.parametrize("how", sorted(fake_layers.FUNCTION_LAYERS))
@pytest.mark.parametrize("calling", KINDS, ids=lambda c: c.value)
def test_a_layer_under_a_foreign_one_becomes_a_pass_through(world, caplog, calling, how) -> None:  # noqa: ANN001
    """Before: ``Store.put`` kept adding 100 and status said ``applied``."""
    world.set(_spanning(calling))
    _wrap_step_on_import()
    assert layer.apply().outcome("spanning").state == layer.PENDING
    assert _put(1) == 102  # Store.put installed at apply
    ours = _live()
    theirs = fake_layers.FUNCTION_LAYERS[how](ours)
    fake_upstream.Store.put = theirs  # not monkeypatch: its undo would put ours back
    assert _put(1) == 102

    mod = _import_lazy(caplog)

    # No target does the patch's work any more; their layers stay, exactly.
    assert _put(1) == 2 and mod.step(1) == 2
    assert _live() is theirs and not prime_r3.is_object_patched(mod.step)
    _assert_pass_through(ours, world.original)
    assert state.active_wrappers("spanning") is None
    assert state.inert_layers("spanning") == {PUT: ours}
    # Logged and reported: the module, the cause, and the pass-through left under theirs.
    log = next(r.getMessage() for r in caplog.records if "spanning skipped" in r.getMessage())
    assert log.startswith(f"prime_r3: spanning skipped on import of {LAZY}: target {STEP} is not")
    assert f"at {PUT} a layer that is not prime_r3's sits on ours" in log
    assert "pass-through that calls exactly what it wrapped" in log
    status = layer.status().outcome("spanning")
    assert status.state == layer.SKIPPED
    assert status.reason.startswith(f"on import of {LAZY}: target {STEP} is not upstream's")
    assert f"at {PUT} a layer that is not prime_r3's sits on ours" in status.reason
    assert "skipped: spanning (on import of" in layer.status().summary()
    # apply: the same skip (idempotent), and an error for a patch asked for by name.
    assert layer.apply().outcome("spanning") == status
    with pytest.raises(prime_r3.PatchNotApplied, match=f"spanning: on import of {LAZY}"):
        layer.apply(["spanning"])
    # revert: kept while their layer holds ours (idempotent), nothing changed.
    for _ in range(2):
        outcome = layer.revert().outcome("spanning")
        assert outcome.state == layer.KEPT and outcome.reason == status.reason
    assert _live() is theirs and _put(1) == 2 and state.is_inert(ours)

    fake_upstream.Store.put = ours  # they leave, putting back what they found
    assert _put(1) == 2  # still a pass-through, until prime_r3 is asked again
    # status reports what apply would find (it removes the pass-through first), and
    # changes nothing. Before: it still said a layer not prime_r3's sat on ours.
    now = layer.status().outcome("spanning")
    assert now.state == layer.SKIPPED and "sits on ours" not in now.reason, now
    assert now.reason.startswith(f"target {STEP} is not upstream's plain object")
    assert _live() is ours and state.inert_layers("spanning") == {PUT: ours}
    assert layer.revert().outcome("spanning").state == layer.REVERTED
    assert _live() is world.original and not state.is_inert(ours)
    assert state.inert_layers("spanning") == {} and state.inert_reason("spanning") is None
    assert layer.revert().outcome("spanning").state == layer.NOT_ACTIVE
    # Re-apply: as on a clean process, skipped by the live guard of the wrapped step.
    outcome = layer.apply().outcome("spanning")
    assert outcome.state == layer.SKIPPED
    assert outcome.reason.startswith(f"target {STEP} is not upstream's plain object")
    assert _live() is world.original and _put(1) == 2


@pytest.mark.parametrize("calling", KINDS, ids=lambda c: c.value)
def test_apply_removes_the_pass_through_once_the_other_layer_left(world, caplog, calling) -> None:  # noqa: ANN001
    """The lazy module arrives with a changed source; after the other tool leaves,
    apply (no revert first) takes our pass-through off and applies the patch whole if
    the module is fine again (here: the test's fingerprint made to match)."""
    spec = _spanning(calling)
    real_check = layer._check
    world.patch.setattr(layer, "_check", lambda spec, version: None)  # apply-time file check
    world.set(_spanning_with_step_fp(calling, frozenset({"0" * 16})))
    layer.apply()
    world.patch.setattr(layer, "_check", real_check)
    ours = _live()
    fake_upstream.Store.put = theirs = fake_layers.with_wrapt(ours)
    mod = _import_lazy(caplog)
    assert "target source changed" in layer.status().outcome("spanning").reason
    assert _put(1) == 2 and mod.step(1) == 2 and state.is_inert(ours)
    assert theirs.__wrapped__ is ours
    fake_upstream.Store.put = ours  # they leave
    world.set(spec)  # the source is verified again
    assert layer.apply().outcome("spanning").state == layer.APPLIED
    assert _put(1) == 102 and mod.step(1) == 1002
    assert _live() is not ours and not state.is_inert(ours)
    assert state.unwrap_ours(_live()) is world.original


def _spanning_with_step_fp(calling: Calling, fp: frozenset[str]) -> PatchSpec:
    base = _spanning(calling)
    put, step = base.targets
    return _spec("spanning", put, Target(LAZY, "step", fp, step.make_wrapper))


@pytest.mark.parametrize("place", ["outside", "inside"])
@pytest.mark.parametrize("calling", KINDS, ids=lambda c: c.value)
def test_a_pass_through_in_a_stack_leaves_the_other_patch_exact(
    world, caplog, calling, place
) -> None:  # noqa: ANN001
    """Another prime_r3 patch (``other``, x10, wrapt) shares Store.put, ``place``: on
    which side of ours (registry order); the foreign layer sits on the whole stack.
    ``other`` keeps working around or inside the pass-through, and when the foreign
    layer leaves, removing the pass-through rebuilds (or keeps) ``other``'s layer
    exactly."""
    spanning = _spanning(calling)
    other = _spec("other", _put_target(lambda r: r * 10, Calling.WRAPT))
    # Registry order decides the nesting: the earlier patch is innermost.
    world.set(*((spanning, other) if place == "outside" else (other, spanning)))
    _wrap_step_on_import()
    layer.apply()
    expected = (2 + 100) * 10 if place == "outside" else 2 * 10 + 100
    assert _put(1) == expected
    top = _live()
    ours = state.active_wrappers("spanning")[PUT]
    fake_upstream.Store.put = fake_layers.with_functools_wraps(top)
    _import_lazy(caplog)
    assert _put(1) == 20  # only ``other``'s work is left
    inside = state.inner_of(ours)  # other's layer (place "inside"), or upstream's
    assert state.is_inert(ours) and state.unwrap_ours(inside) is world.original
    assert layer.status().outcome("other").state == layer.APPLIED
    assert layer.status().outcome("spanning").state == layer.SKIPPED
    fake_upstream.Store.put = top  # the foreign layer leaves
    assert _put(1) == 20
    # A revert of spanning alone removes its pass-through; ``other`` stays in force.
    assert layer.revert(["spanning"]).outcome("spanning").state == layer.REVERTED
    live = _live()
    assert state.wrapped_by(live) == ("other",) and state.layers(live)[1] is world.original
    assert state.active_wrappers("other") == {PUT: live} and _put(1) == 20
    if place == "outside":  # other's layer was outside the pass-through: rebuilt
        assert live is not top and inside is world.original
    else:  # other's layer was inside it: untouched
        assert live is inside
    assert layer.revert(["other"]).outcome("other").state == layer.REVERTED
    assert _live() is world.original


CONSUMER = "tests.fake_lazy_consumer"
CONSUME = f"{CONSUMER}:consume"


def test_status_names_only_the_pass_throughs_that_stay(world, caplog) -> None:  # noqa: ANN001
    """The patch spans Store.put (loaded at apply), ``consume`` (a lazy module imported
    first, installed by its hook) and ``step`` (imported last, wrapped by another tool:
    rollback). Other layers sat on Store.put and consume, so both stay as
    pass-throughs. Once consume's other layer has left, apply removes that one: status
    (and revert) must then name Store.put only. Before: they kept naming consume, whose
    pass-through was gone (the reason was written once, at the rollback)."""
    consume = Target(
        CONSUMER,
        "consume",
        _file_fp("fake_lazy_consumer.py", "consume"),
        lambda params: lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs) + 7,
    )
    put, step = _spanning(Calling.PLAIN).targets
    world.set(_spec("spanning", put, consume, step))
    _wrap_step_on_import()
    assert layer.apply().outcome("spanning").state == layer.PENDING
    from tests import fake_lazy_consumer as consumer

    assert consumer.consume(1) == 17
    ours_consume, ours_put = consumer.consume, _live()
    consumer.consume = fake_layers.with_wrapt(ours_consume)
    fake_upstream.Store.put = fake_layers.with_functools_wraps(ours_put)
    mod = _import_lazy(caplog)
    assert consumer.consume(1) == 10 and _put(1) == 2 and mod.step(1) == 2
    assert set(state.inert_layers("spanning")) == {PUT, CONSUME}
    reason = layer.status().outcome("spanning").reason
    assert f"at {CONSUME}, {PUT} a layer that is not prime_r3's sits on ours" in reason

    consumer.consume = ours_consume  # consume's other layer leaves
    assert layer.apply().outcome("spanning").state == layer.SKIPPED  # Store.put's stays
    assert consumer.consume is ours_consume.__wrapped__  # upstream's again
    assert set(state.inert_layers("spanning")) == {PUT}
    status = layer.status().outcome("spanning")
    assert status.state == layer.SKIPPED
    assert status.reason.startswith(f"on import of {LAZY}: target {STEP} is not upstream's")
    assert f"at {PUT} a layer that is not prime_r3's sits on ours" in status.reason
    assert CONSUME not in status.reason
    assert layer.revert().outcome("spanning") == layer.Outcome(
        "spanning", layer.KEPT, status.reason, status.vllm_range, status.processes
    )
    fake_upstream.Store.put = ours_put  # Store.put's other layer leaves
    assert layer.revert().outcome("spanning").state == layer.REVERTED
    assert _live() is world.original and state.inert_layers("spanning") == {}


def test_an_exception_in_the_hook_also_leaves_no_target_working(world, caplog) -> None:  # noqa: ANN001
    """The ``except Exception`` branch of the hook (here: building what to guard
    raises) takes the same rollback. Before: Store.put kept its layer working and
    status said ``applied``."""
    world.set(_spanning(Calling.WRAPT))
    layer.apply()
    ours = _live()
    fake_upstream.Store.put = fake_layers.with_wrapt(ours)

    def broken(*args: Any) -> Any:
        raise RuntimeError("guard inputs unreadable")

    world.patch.setattr(layer, "_unit_items", broken)
    mod = _import_lazy(caplog)
    assert "spanning skipped on import of" in caplog.text
    assert _put(1) == 2 and mod.step(1) == 2 and state.is_inert(ours)
    outcome = layer.status().outcome("spanning")
    assert outcome.state == layer.SKIPPED
    assert outcome.reason.startswith(f"on import of {LAZY}: RuntimeError: guard inputs")


def test_a_failing_on_revert_in_the_hook_neither_breaks_the_import_nor_lies(
    world,  # noqa: ANN001
    caplog,  # noqa: ANN001
) -> None:
    """Before: the hook's rollback raised out of the import hook (vLLM's import
    failed) and left the records saying the patch was in force."""
    calls = []

    def on_revert() -> None:
        calls.append("on_revert")
        raise RuntimeError("cannot undo")

    world.set(_spanning(Calling.WRAPT, on_revert=on_revert))
    _wrap_step_on_import()
    layer.apply()
    mod = _import_lazy(caplog)  # must not raise
    assert calls == ["on_revert"]
    assert "on_revert failed: RuntimeError: cannot undo" in caplog.text
    assert _live() is world.original and mod.step(1) == 2
    assert state.active_wrappers("spanning") is None
    assert layer.status().outcome("spanning").state == layer.SKIPPED


def test_revert_while_pending_with_a_failing_on_revert_cancels_the_hook(world, caplog) -> None:  # noqa: ANN001
    """Before: revert raised after taking Store.put's layer off but before forgetting
    the patch, so the pending hook later installed ``step`` alone: half-applied."""

    def on_revert() -> None:
        raise RuntimeError("cannot undo")

    world.set(_spanning(Calling.WRAPT, on_revert=on_revert))
    layer.apply()
    assert _put(1) == 102
    with caplog.at_level(logging.ERROR, logger="vllm.prime_r3"):
        outcome = layer.revert().outcome("spanning")
    assert outcome.state == layer.REVERTED
    assert outcome.reason == "on_revert failed: RuntimeError: cannot undo"
    assert "spanning on_revert failed" in caplog.text
    assert _live() is world.original
    from tests import fake_lazy_upstream as mod

    assert mod.step(1) == 2 and not prime_r3.is_object_patched(mod.step)
    assert layer.status().outcome("spanning").state == layer.WOULD_APPLY


def test_revert_while_pending_under_a_foreign_layer_keeps_the_patch_whole(world, caplog) -> None:  # noqa: ANN001
    """Kept behaviour (passed before too): revert cannot take Store.put's layer from
    under the other tool's, so the patch stays in force, pending included, and the
    import completes it (not half of it)."""
    world.set(_spanning(Calling.PLAIN))
    layer.apply()
    ours = _live()
    fake_upstream.Store.put = fake_layers.with_functools_wraps(ours)
    assert layer.revert().outcome("spanning").state == layer.KEPT
    assert layer.status().outcome("spanning").state == layer.PENDING
    mod = _import_lazy(caplog)
    assert _put(1) == 102 and mod.step(1) == 1002
    assert layer.status().outcome("spanning").state == layer.APPLIED
    fake_upstream.Store.put = ours  # they leave


def test_a_plain_factory_that_hides_the_callable_is_refused(world) -> None:  # noqa: ANN001
    """A plain function that does not hold the callable it wraps in its own closure
    could not be made a pass-through, so it is refused at apply, before it runs.
    Before: it was installed."""

    def factory(params):  # noqa: ANN001, ANN202
        def make(inner):  # noqa: ANN001, ANN202
            box = {"inner": inner}

            def put(self, x):  # noqa: ANN001, ANN202
                return box["inner"](self, x) + 1

            return put

        return make

    target = Target(MOD, "Store.put", _fp(fake_upstream.Store.put), factory, calling=Calling.PLAIN)
    world.set(_spec("hidden", target))
    outcome = layer.apply().outcome("hidden")
    assert outcome.state == layer.SKIPPED and "rolled back" in outcome.reason
    assert "must call the callable it is given from its own closure" in outcome.reason
    assert _live() is world.original and state.active_wrappers("hidden") is None


def test_the_real_batched_take_can_become_a_pass_through(reverted) -> None:  # noqa: ANN001
    """The registry's plain layer (batched_take, on the installed vLLM's real
    take_output) holds upstream's function in its closure, so it can be made a
    pass-through: it then returns what upstream's take_output returns for the same
    call, raises what it raises, and counts nothing (the patch's work is gone)."""
    import numpy as np
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    from prime_r3.fixes.batched_take import COUNTERS

    upstream = vars(AuxOutputSchedulerConnector)["take_output"]
    assert layer.apply(["batched_take"], log=False).outcome("batched_take").state == (layer.APPLIED)
    ours = vars(AuxOutputSchedulerConnector)["take_output"]
    request = types.SimpleNamespace(request_id="r", num_tokens=3, is_finished=lambda: False)
    output = {"r": types.SimpleNamespace(token_start=0, rows=np.arange(10).reshape(5, 2))}
    code = ours.__code__
    try:
        before = COUNTERS.fallback_requests
        ours(object(), request, output)
        assert COUNTERS.fallback_requests == before + 1  # in force: it counts
        layer._make_pass_through(ours)
        assert ours.__code__ is not code
        got = ours(object(), request, output)
        assert COUNTERS.fallback_requests == before + 1  # a pass-through counts nothing
        want = upstream(object(), request, output)
        assert got.dtype == want.dtype and np.array_equal(got, want)
        with pytest.raises(AssertionError) as ours_error:
            ours(object(), request, {})
        with pytest.raises(AssertionError) as upstream_error:
            upstream(object(), request, {})
        assert str(ours_error.value) == str(upstream_error.value)
    finally:
        ours.__code__ = code
        layer.revert(["batched_take"])
    assert vars(AuxOutputSchedulerConnector)["take_output"] is upstream


def test_building_a_plain_layer_leaves_no_cyclic_garbage() -> None:
    """A plain layer's pass-through code is made at every build (apply, and each
    rebuild when a patch under it comes or goes) and must not leave objects that only
    the cyclic collector frees: engine_gc raises its thresholds and vLLM freezes the
    heap (``gc.freeze``), so such garbage would stay for the process's life. Before:
    each build left a reference cycle (the namespace it was executed in and the
    function made there, 2 objects)."""

    def make(inner):  # noqa: ANN001, ANN202
        def put(self, x):  # noqa: ANN001, ANN202
            return inner(self, x) + 1

        return put

    upstream = vars(fake_upstream.Store)["put"]
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds is kept in gc.garbage
    try:
        built = layer._plain_layer(make, upstream, upstream, True)
        gc.collect()
        # Only what the build made counts (another thread may leave garbage meanwhile).
        left = [o for o in gc.garbage if _made_for_a_pass_through(o)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert left == []
    layer._make_pass_through(built)  # the code it made still works
    assert built(fake_upstream.Store(), 3) == 6


def _made_for_a_pass_through(obj: object) -> bool:
    code = getattr(obj, "__code__", None)
    if isinstance(obj, types.FunctionType) and code is not None:
        return code.co_filename == "<prime_r3 pass-through>"
    return isinstance(obj, dict) and any(
        _made_for_a_pass_through(v) for v in list(obj.values()) if isinstance(v, types.FunctionType)
    )


@pytest.mark.parametrize("how", ["reload", "reimport", "removed"])
def test_a_pass_through_in_a_module_that_was_replaced_is_not_reported(
    world,
    caplog,
    how,  # noqa: ANN001
) -> None:
    """``consume``'s pass-through stays under another layer after the rollback; then its
    module is reloaded (``importlib.reload``: same module object, new functions), or
    re-imported as a new module object, or removed from ``sys.modules``. Neither it nor
    the other layer is in the module now in use, so status, apply and revert must not
    report it there. Before: the record stayed for the life of the process (status and
    apply said skipped, revert kept), the sweep comparing the fresh function with the
    original saved from the old module. The records hold the old module only weakly."""
    import importlib
    import sys
    import weakref

    consume = Target(
        CONSUMER,
        "consume",
        _file_fp("fake_lazy_consumer.py", "consume"),
        lambda params: lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs) + 7,
    )
    step = _spanning(Calling.PLAIN).targets[1]
    world.set(_spec("spanning", consume, step))
    _wrap_step_on_import()
    assert layer.apply().outcome("spanning").state == layer.PENDING
    from tests import fake_lazy_consumer as consumer

    ours = consumer.consume
    consumer.consume = theirs = fake_layers.with_wrapt(ours)
    mod = _import_lazy(caplog)
    assert consumer.consume(1) == 10 and mod.step(1) == 2
    assert state.inert_layers("spanning") == {CONSUME: ours}
    held = layer.status().outcome("spanning")
    assert f"at {CONSUME} a layer that is not prime_r3's sits on ours" in held.reason

    old = weakref.ref(consumer)
    if how == "reload":
        consumer = importlib.reload(consumer)
        assert consumer is old() and consumer.consume is not theirs
    else:
        sys.modules.pop(CONSUMER)  # the consumer only: the wrapped step stays imported
        delattr(sys.modules["tests"], CONSUMER.rsplit(".", 1)[1])
        if how == "reimport":
            from tests import fake_lazy_consumer as consumer

            assert consumer is not old()
        else:
            del consumer
    assert theirs(1) == 10  # whoever still holds the old layers: a pass-through, exactly

    now = layer.status().outcome("spanning")
    assert now.state == layer.SKIPPED and "sits on ours" not in now.reason, now
    if how != "removed":  # as apply would find it: consume fine, step wrapped by another
        assert now.reason.startswith(f"target {STEP} is not upstream's plain object"), now
    assert state.inert_layers("spanning") == {CONSUME: ours}  # status changed nothing
    if how == "reload":
        assert layer.apply().outcome("spanning") == now  # the stale record is dropped
        assert state.inert_layers("spanning") == {}
        assert layer.revert().outcome("spanning").state == layer.NOT_ACTIVE
    else:
        assert layer.revert().outcome("spanning").state == layer.REVERTED
        assert state.inert_layers("spanning") == {}
        del theirs, ours
        gc.collect()
        assert old() is None  # the old module was freed: no record of ours kept it
    if how != "removed":
        assert consumer.consume(1) == 10 and state.unwrap_ours(consumer.consume) is not None
