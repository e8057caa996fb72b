"""Several patches on one target: nested in registry order, each revert exact.

Two fake patches wrap ``tests.fake_upstream:Store.put``: ``inner`` (first in the
registry) and ``outer``. Each wrapper records its call and changes the result in a
way that shows the nesting: ``inner`` adds 1, ``outer`` multiplies by 10, so upstream's
``2x`` comes back as ``(2x + 1) * 10`` only when ``outer`` wraps ``inner``.

Every test here fails on the code before stacking (which skipped a patch whose target
another prime_r3 patch already wrapped), except the ones marked as guarding behaviour
that was kept: a foreign layer anywhere in the chain still skips the patch.
"""

from __future__ import annotations

import sys

import pytest
import wrapt

import prime_r3
from prime_r3 import fingerprint, layer, state
from prime_r3.spec import PatchSpec, Target
from tests import fake_layers, fake_upstream
from tests.fake_specs import fp as _fp
from tests.fake_specs import spec as _spec

MOD = "tests.fake_upstream"
PUT = f"{MOD}:Store.put"
CALLS: list[str] = []


def _recording(name: str, change):  # noqa: ANN001, ANN202
    def factory(params):  # noqa: ANN001, ANN202
        def wrapper(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
            CALLS.append(name)
            return change(wrapped(*args, **kwargs))

        return wrapper

    return factory


def _target(attr: str, factory) -> Target:  # noqa: ANN001
    obj = fake_upstream
    for part in attr.split("."):
        obj = getattr(obj, part)
    return Target(MOD, attr, _fp(obj), factory)


INNER = _spec("inner", _target("Store.put", _recording("inner", lambda r: r + 1)))
OUTER = _spec("outer", _target("Store.put", _recording("outer", lambda r: r * 10)))


@pytest.fixture
def stack(reverted: pytest.MonkeyPatch):  # noqa: ANN201
    """Registry (inner, outer); upstream's objects checked back by identity after."""
    reverted.setattr(layer, "registry", lambda: (INNER, OUTER))
    originals = dict(vars(fake_upstream.Store))
    CALLS.clear()
    yield reverted
    layer.revert()
    assert vars(fake_upstream.Store)["put"] is originals["put"]
    assert vars(fake_upstream.Store)["get"] is originals["get"]


def _put(x: int = 1) -> tuple[int, list[str]]:
    CALLS.clear()
    result = fake_upstream.Store().put(x)
    return result, list(CALLS)


def _chain() -> list[object]:
    """The live object at Store.put and everything under it, outermost first."""
    obj, chain = vars(fake_upstream.Store)["put"], []
    while True:
        chain.append(obj)
        if not isinstance(obj, wrapt.FunctionWrapper):
            return chain
        obj = obj.__wrapped__


def _assert_stacked(original: object) -> None:
    top, middle, bottom = _chain()
    assert bottom is original and layer.get_original(MOD, "Store.put") is original
    assert state.active_wrappers("outer") == {PUT: top}
    assert state.active_wrappers("inner") == {PUT: middle}
    assert layer.is_object_patched(top) and layer.is_object_patched(middle)
    assert not layer.is_object_patched(original)
    assert state.wrapped_by(top) == ("outer", "inner")
    assert state.unwrap_ours(top) is original
    assert _put(1) == ((2 + 1) * 10, ["outer", "inner"])


@pytest.mark.parametrize("order", [("inner", "outer"), ("outer", "inner")])
def test_either_apply_order_nests_in_registry_order(stack, order) -> None:  # noqa: ANN001
    """Before: the second apply raised PatchNotApplied (target not upstream's plain object)."""
    original = vars(fake_upstream.Store)["put"]
    for name in order:
        assert layer.apply([name]).outcome(name).state == layer.APPLIED
    _assert_stacked(original)
    report = layer.apply(["inner", "outer"])  # idempotent
    assert [o.state for o in report.outcomes] == [layer.ALREADY, layer.ALREADY]
    _assert_stacked(original)


def test_apply_all_stacks_and_status_says_so(stack, capsys) -> None:  # noqa: ANN001
    """Before: status said ``outer`` skipped once ``inner`` was in force."""
    from prime_r3 import cli

    notes = {
        "inner": "Store.put stacked inside outer",
        "outer": "Store.put stacked outside inner",
    }
    status = layer.status()
    assert {o.name: (o.state, o.reason) for o in status.outcomes} == {
        n: (layer.WOULD_APPLY, note) for n, note in notes.items()
    }
    assert cli.main(["status"]) == 0
    lines = capsys.readouterr().out.splitlines()
    line = next(ln for ln in lines if ln.strip().startswith("outer "))
    assert line.endswith("would apply (Store.put stacked outside inner)"), line
    original = vars(fake_upstream.Store)["put"]
    assert layer.apply().applied == ["inner", "outer"]
    _assert_stacked(original)
    status = layer.status()
    assert {o.name: (o.state, o.reason) for o in status.outcomes} == {
        n: (layer.APPLIED, note) for n, note in notes.items()
    }


@pytest.mark.parametrize("first", ["inner", "outer"])
def test_reverting_one_leaves_the_other_exact(stack, first: str) -> None:  # noqa: ANN001
    """Before: the stack could not be built, so neither revert could be exercised."""
    original = vars(fake_upstream.Store)["put"]
    layer.apply()
    top, middle, _ = _chain()
    assert layer.revert([first]).outcome(first).state == layer.REVERTED
    assert layer.revert([first]).outcome(first).state == layer.NOT_ACTIVE  # idempotent
    remaining = "outer" if first == "inner" else "inner"
    assert layer.status().outcome(remaining).reason == ""  # alone on Store.put now
    wrapper, bottom = _chain()
    assert bottom is original
    assert state.active_wrappers(remaining) == {PUT: wrapper}
    assert state.active_wrappers(first) is None
    if first == "outer":  # the inner wrapper is untouched, the very same object
        assert wrapper is middle and _put(1) == (3, ["inner"])
    else:  # outer's wrapper was rebuilt around upstream's object, same function
        assert wrapper is not top and _put(1) == (20, ["outer"])
    assert not layer.is_object_patched(top if first == "outer" else middle)
    layer.apply([first])  # apply after revert puts it back in its place
    _assert_stacked(original)
    layer.revert([remaining])
    layer.revert([first])
    assert vars(fake_upstream.Store)["put"] is original and _put(1) == (2, [])
    assert state.active_wrappers("inner") is None and state.active_wrappers("outer") is None


def test_revert_all_restores_upstream_identity_and_reapply_works(stack) -> None:  # noqa: ANN001
    original = vars(fake_upstream.Store)["put"]
    layer.apply()
    report = layer.revert()
    assert [o.state for o in report.outcomes] == [layer.REVERTED, layer.REVERTED]
    assert vars(fake_upstream.Store)["put"] is original
    layer.apply(["outer"])
    layer.apply(["inner"])
    _assert_stacked(original)


# -- other layers: never stacked through, never half-applied (kept behaviour) --------


@pytest.mark.parametrize("how", sorted(fake_layers.FUNCTION_LAYERS))
def test_a_foreign_layer_over_ours_skips_the_next_patch(stack, how: str) -> None:  # noqa: ANN001
    """Kept behaviour (passed before too): another layer on top of ours is not stacked on."""
    layer.apply(["inner"])
    ours = vars(fake_upstream.Store)["put"]
    theirs = fake_layers.FUNCTION_LAYERS[how](ours)
    fake_upstream.Store.put = theirs  # not monkeypatch: its undo would put ours back
    try:
        outcome = layer.apply().outcome("outer")
        assert outcome.state == layer.SKIPPED
        assert outcome.reason.startswith(f"target {PUT} is not upstream's plain object")
        assert vars(fake_upstream.Store)["put"] is theirs
        assert state.active_wrappers("outer") is None
        # Reverting ours would drop their layer too: kept.
        assert layer.revert(["inner"]).outcome("inner").state == layer.KEPT
    finally:
        fake_upstream.Store.put = ours  # they leave first


def test_a_foreign_layer_between_ours_skips_and_reverts_only_what_it_can(stack) -> None:  # noqa: ANN001
    """A layer slipped between two of ours (here by re-pointing ``__wrapped__``): a
    third patch is skipped naming it, the inner patch is kept, the outer one reverts.

    Before: the third patch was skipped too, but for a different reason (any wrapper of
    ours counted as foreign); this checks the new reason and the partial revert.
    """
    third = _spec("third", _target("Store.put", _recording("third", lambda r: r - 5)))
    stack.setattr(layer, "registry", lambda: (INNER, OUTER, third))
    original = vars(fake_upstream.Store)["put"]
    layer.apply(["inner", "outer"])
    top, middle, _ = _chain()
    theirs = fake_layers.with_wrapt(middle)
    top.__wrapped__ = theirs
    try:
        outcome = layer.apply().outcome("third")
        assert outcome.state == layer.SKIPPED
        assert "a layer that is not prime_r3's sits under the wrappers of outer" in outcome.reason
        assert vars(fake_upstream.Store)["put"] is top
        assert layer.revert(["inner"]).outcome("inner").state == layer.KEPT
        assert layer.revert(["outer"]).outcome("outer").state == layer.REVERTED
        assert vars(fake_upstream.Store)["put"] is theirs  # their layer stays, exactly
    finally:
        fake_upstream.Store.put = middle  # they leave
    assert layer.revert(["inner"]).outcome("inner").state == layer.REVERTED
    assert vars(fake_upstream.Store)["put"] is original


def test_a_multi_target_patch_failing_inside_a_stack_is_rolled_back_exactly(stack) -> None:  # noqa: ANN001
    """``early`` goes inside ``outer`` on Store.put (rebuilding outer's wrapper), then its
    Store.get wrapper fails to build: everything is as before, records included.

    Before: ``early`` was skipped by the guard before anything was built.
    """

    def broken(params):  # noqa: ANN001, ANN202
        raise RuntimeError("cannot build wrapper")

    early = _spec(
        "early",
        _target("Store.put", _recording("early", lambda r: r)),
        _target("Store.get", broken),
    )
    stack.setattr(layer, "registry", lambda: (early, INNER, OUTER))
    layer.apply(["inner", "outer"])
    before = (vars(fake_upstream.Store)["put"], vars(fake_upstream.Store)["get"])
    records = (state.active_wrappers("inner"), state.active_wrappers("outer"))
    with pytest.raises(prime_r3.PatchNotApplied) as raised:
        layer.apply(["early"])
    outcome = raised.value.report.outcome("early")
    assert outcome.state == layer.SKIPPED and "rolled back" in outcome.reason
    assert "cannot build wrapper" in outcome.reason
    assert (vars(fake_upstream.Store)["put"], vars(fake_upstream.Store)["get"]) == before
    assert (state.active_wrappers("inner"), state.active_wrappers("outer")) == records
    assert state.active_wrappers("early") is None
    assert _put(1) == (30, ["outer", "inner"])


# -- targets in modules imported after apply() ---------------------------------------

LAZY = "tests.fake_lazy_upstream"


def _lazy_specs() -> tuple[PatchSpec, PatchSpec]:
    from tests.test_deferred import _fp

    fp = _fp("fake_lazy_upstream.py", "step")
    return (
        _spec("inner", Target(LAZY, "step", fp, _recording("inner", lambda r: r + 1))),
        _spec("outer", Target(LAZY, "step", fp, _recording("outer", lambda r: r * 10))),
    )


@pytest.fixture
def lazy_stack(reverted: pytest.MonkeyPatch):  # noqa: ANN201
    from tests.test_deferred import _unimport

    _unimport()
    specs = _lazy_specs()
    reverted.setattr(layer, "registry", lambda: specs)
    CALLS.clear()
    yield reverted
    layer.revert()
    _unimport()


@pytest.mark.parametrize("order", [("inner", "outer"), ("outer", "inner")])
def test_pending_imports_stack_in_registry_order(lazy_stack, order) -> None:  # noqa: ANN001
    """Both hooks fire on one import, in apply order; the nesting is the registry's.

    Before: the second hook found the first one's wrapper, logged a skip and rolled back.
    """
    for name in order:
        assert layer.apply([name]).outcome(name).state == layer.PENDING
    assert LAZY not in sys.modules
    from tests import fake_lazy_upstream as mod

    original = layer.get_original(LAZY, "step")
    CALLS.clear()
    assert mod.step(1) == (2 + 1) * 10 and CALLS == ["outer", "inner"]
    assert state.wrapped_by(mod.step) == ("outer", "inner")
    assert state.unwrap_ours(mod.step) is original
    assert {o.state for o in layer.status().outcomes} == {layer.APPLIED}
    layer.revert(["inner"])
    assert mod.step(1) == 20 and state.wrapped_by(mod.step) == ("outer",)
    layer.revert(["outer"])
    assert mod.step is original


def test_a_pending_patch_stacks_on_one_installed_before_the_import(lazy_stack) -> None:  # noqa: ANN001
    """``outer`` installed with the module; ``inner`` applied after, goes inside it."""
    from tests import fake_lazy_upstream as mod

    layer.apply(["outer"])
    layer.apply(["inner"])
    CALLS.clear()
    assert mod.step(1) == 30 and CALLS == ["outer", "inner"]
    assert prime_r3.is_object_patched(mod.step)


# -- the real vLLM target packed_outputs wraps in EngineCore -------------------------

CONNECTOR = "vllm.distributed.aux_output_connector.connector"
WORKER = "vllm.distributed.aux_output_connector.worker"


def _real_spec(name: str, attr: str, module: str = CONNECTOR) -> PatchSpec:
    """A test-only patch on a real connector method (never in the registry): records
    each call and marks the result, so the test sees it ran and on which side."""
    import importlib

    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)

    def factory(params):  # noqa: ANN001, ANN202
        def wrapper(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
            CALLS.append(name)
            result = wrapped(*args, **kwargs)
            from prime_r3.packed import READS_MARK

            # What the inner patches did is visible here when this one is outside them.
            seen = getattr(result, READS_MARK, None) if result is not None else None
            CALLS.append(f"{name} saw {seen}")
            return result

        return wrapper

    return _spec(name, Target(module, attr, frozenset({fingerprint.of_object(obj)}), factory))


@pytest.mark.parametrize("place", ["before", "after"])
def test_a_second_patch_on_build_connector_meta_stacks_with_packed_outputs(
    reverted: pytest.MonkeyPatch, place: str
) -> None:
    """Real scheduler connector: the metadata still carries packed_outputs' declaration
    and the test patch ran, on the side of packed_outputs its registry place says.

    Before: the test patch was skipped (packed_outputs' wrapper is not upstream's plain
    object), so PatchNotApplied was raised.
    """
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector
    from vllm.v1.core.sched.output import SchedulerOutput

    from prime_r3.packed import FORMAT_VERSION, READS_MARK
    from prime_r3.patches import REGISTRY
    from tests.test_packed_outputs import real_vllm

    probe = _real_spec("probe", "AuxOutputSchedulerConnector.build_connector_meta")
    packed = next(s for s in REGISTRY if s.name == "packed_outputs")
    registry = (probe, packed) if place == "before" else (packed, probe)
    reverted.setattr(layer, "registry", lambda: registry)
    connector = real_vllm().scheduler.aux_output_connector
    empty = SchedulerOutput.make_empty()
    original = vars(AuxOutputSchedulerConnector)["build_connector_meta"]

    def step() -> tuple[int | None, list[str]]:
        CALLS.clear()
        return getattr(connector.build_connector_meta(empty, {}), READS_MARK, None), list(CALLS)

    layer.apply(["packed_outputs", "probe"], log=False)
    # "before": probe is inside packed_outputs and sees upstream's bare metadata.
    seen = FORMAT_VERSION if place == "after" else None
    assert step() == (FORMAT_VERSION, ["probe", f"probe saw {seen}"])
    live = vars(AuxOutputSchedulerConnector)["build_connector_meta"]
    expected = ("probe", "packed_outputs") if place == "after" else ("packed_outputs", "probe")
    assert state.wrapped_by(live) == expected and state.unwrap_ours(live) is original
    assert layer.status().outcome("probe").state == layer.APPLIED
    layer.revert(["packed_outputs"])
    assert step() == (None, ["probe", "probe saw None"])
    layer.apply(["packed_outputs"], log=False)
    layer.revert(["probe"])
    assert step() == (FORMAT_VERSION, [])
    layer.revert(["packed_outputs"])
    assert vars(AuxOutputSchedulerConnector)["build_connector_meta"] is original
    assert step() == (None, [])


def test_a_prime_r3_patch_on_take_output_keeps_the_packed_declaration(
    reverted: pytest.MonkeyPatch,
) -> None:
    """packed_outputs declares while take_output is upstream's under our own wrappers,
    and still withholds it for another layer on top of them.

    Before: ``type(instance).take_output is upstream_take_output`` failed on any wrapper
    of take_output, ours too, so the declaration was withheld.
    """
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector
    from vllm.v1.core.sched.output import SchedulerOutput

    from prime_r3.packed import FORMAT_VERSION, READS_MARK
    from prime_r3.patches import REGISTRY
    from tests.test_packed_outputs import real_vllm

    probe = _real_spec("probe", "AuxOutputSchedulerConnector.take_output")
    packed = next(s for s in REGISTRY if s.name == "packed_outputs")
    reverted.setattr(layer, "registry", lambda: (probe, packed))  # probe: before packed
    connector = real_vllm().scheduler.aux_output_connector
    empty = SchedulerOutput.make_empty()
    layer.apply(["probe", "packed_outputs"], log=False)
    assert layer.is_object_patched(vars(AuxOutputSchedulerConnector)["take_output"])
    assert getattr(connector.build_connector_meta(empty, {}), READS_MARK) == FORMAT_VERSION
    ours = vars(AuxOutputSchedulerConnector)["take_output"]
    # Not monkeypatch: its undo, after the fixture's revert, would put ours back.
    AuxOutputSchedulerConnector.take_output = fake_layers.with_functools_wraps(ours)
    try:
        assert not hasattr(connector.build_connector_meta(empty, {}), READS_MARK)
    finally:
        AuxOutputSchedulerConnector.take_output = ours
    assert getattr(connector.build_connector_meta(empty, {}), READS_MARK) == FORMAT_VERSION


def test_batched_commit_packs_only_while_packed_outputs_wraps_process_output(
    reverted: pytest.MonkeyPatch,
) -> None:
    """Another patch on process_output does not make packed_outputs look in force.

    Before: any wrapper of ours on process_output counted, so with packed_outputs
    reverted and the test patch left, the fast path would still have packed.
    """
    from types import SimpleNamespace

    from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector

    from prime_r3.fixes.batched_commit import _packing_in_force
    from prime_r3.packed import FORMAT_VERSION, READS_MARK
    from prime_r3.patches import REGISTRY

    probe = _real_spec("probe", "AuxOutputWorkerConnector.process_output", WORKER)
    packed = next(s for s in REGISTRY if s.name == "packed_outputs")
    reverted.setattr(layer, "registry", lambda: (packed, probe))
    connector = object.__new__(AuxOutputWorkerConnector)  # only its class is looked at
    connector._step_metadata = SimpleNamespace(**{READS_MARK: FORMAT_VERSION})
    assert not _packing_in_force(connector)
    layer.apply(["packed_outputs", "probe"], log=False)
    assert _packing_in_force(connector)
    layer.revert(["packed_outputs"])
    assert layer.is_object_patched(vars(AuxOutputWorkerConnector)["process_output"])
    assert not _packing_in_force(connector)
    layer.apply(["packed_outputs"], log=False)
    layer.revert(["probe"])
    assert _packing_in_force(connector)
