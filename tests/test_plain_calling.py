"""``Calling.PLAIN`` targets: a plain function installed as is, with every registry
guarantee a wrapt wrapper has.

Fake patches on ``tests.fake_upstream:Store.put`` (upstream: ``2x``) change the result
so the nesting shows: ``inner`` adds 1, ``outer`` multiplies by 10, so ``(2x + 1) * 10``
comes back only when ``outer`` wraps ``inner``. Each is built either as a wrapt wrapper
or as a plain function; every combination goes through the whole layer lifecycle.

Every test here fails before ``Calling`` existed (``Target`` took no ``calling``).
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import wrapt

import prime_r3
from prime_r3 import layer, state
from prime_r3.spec import Anchor, Calling, PatchSpec, Target
from tests import fake_layers, fake_upstream
from tests.fake_specs import fp as _fp
from tests.fake_specs import spec as _spec

MOD = "tests.fake_upstream"
PUT = f"{MOD}:Store.put"
LAZY = "tests.fake_lazy_upstream"
#: (patch, whether the call reached it with the Store instance as ``self``/instance).
CALLS: list[tuple[str, bool]] = []


def _factory(name: str, change: Callable[[int], int], calling: Calling) -> Any:
    """A patch's ``make_wrapper`` of either kind: records the call, changes the result."""
    if calling is Calling.WRAPT:

        def wrapt_factory(params):  # noqa: ANN001, ANN202
            def wrapper(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
                CALLS.append((name, isinstance(instance, fake_upstream.Store)))
                return change(wrapped(*args, **kwargs))

            return wrapper

        return wrapt_factory

    def plain_factory(params):  # noqa: ANN001, ANN202
        def make(inner):  # noqa: ANN001, ANN202
            def put(self, x):  # noqa: ANN001, ANN202
                CALLS.append((name, isinstance(self, fake_upstream.Store)))
                return change(inner(self, x))

            return put

        return make

    return plain_factory


def _put_target(name: str, change: Callable[[int], int], calling: Calling) -> Target:
    factory = _factory(name, change, calling)
    return Target(MOD, "Store.put", _fp(fake_upstream.Store.put), factory, calling=calling)


def _specs(inner: Calling, outer: Calling) -> tuple[PatchSpec, PatchSpec]:
    return (
        _spec("inner", _put_target("inner", lambda r: r + 1, inner)),
        _spec("outer", _put_target("outer", lambda r: r * 10, outer)),
    )


KINDS = [
    pytest.param(Calling.PLAIN, Calling.WRAPT, id="plain-inside-wrapt"),
    pytest.param(Calling.WRAPT, Calling.PLAIN, id="wrapt-inside-plain"),
    pytest.param(Calling.PLAIN, Calling.PLAIN, id="plain-inside-plain"),
]


@pytest.fixture
def registry(reverted: pytest.MonkeyPatch):  # noqa: ANN201
    """``registry.set(specs)`` sets the fake registry; upstream's objects are checked
    back by identity after the test."""
    originals = dict(vars(fake_upstream.Store))
    CALLS.clear()
    yield types.SimpleNamespace(
        set=lambda specs: reverted.setattr(layer, "registry", lambda: specs)
    )
    layer.revert()
    assert vars(fake_upstream.Store)["put"] is originals["put"]
    assert vars(fake_upstream.Store)["get"] is originals["get"]


def _put(x: int = 1) -> tuple[int, list[tuple[str, bool]]]:
    CALLS.clear()
    result = fake_upstream.Store().put(x)
    return result, list(CALLS)


def _live() -> Any:
    return vars(fake_upstream.Store)["put"]


def _kind(obj: Any) -> Calling:
    if isinstance(obj, wrapt.FunctionWrapper):
        return Calling.WRAPT
    assert type(obj) is types.FunctionType, type(obj)
    return Calling.PLAIN


def _assert_stacked(original: Any, inner: Calling, outer: Calling) -> None:
    """Live: outer's layer around inner's around upstream's, each of its declared kind,
    every record and query consistent, and the call nests in registry order."""
    top = _live()
    middle = state.inner_of(top)
    assert state.inner_of(middle) is original and state.inner_of(original) is original
    assert (_kind(top), _kind(middle)) == (outer, inner)
    assert state.active_wrappers("outer") == {PUT: top}
    assert state.active_wrappers("inner") == {PUT: middle}
    assert layer.is_object_patched(top) and layer.is_object_patched(middle)
    assert not layer.is_object_patched(original)
    assert layer.get_original(MOD, "Store.put") is original
    assert state.wrapped_by(top) == ("outer", "inner")
    assert state.layers(top) == ([("outer", top), ("inner", middle)], original)
    assert state.unwrap_ours(top) is original
    # Both layers see the Store instance, whatever the kinds around them.
    assert _put(1) == ((2 + 1) * 10, [("outer", True), ("inner", True)])


# -- one plain patch ------------------------------------------------------------------


def test_a_plain_target_is_installed_as_the_function_itself(registry) -> None:  # noqa: ANN001
    """apply, status, get_original, is_object_patched, idempotent apply, revert identity,
    apply after revert: as for a wrapt wrapper, but the class holds a plain function."""
    plain = _spec("plain", _put_target("plain", lambda r: r + 1, Calling.PLAIN))
    registry.set((plain,))
    original = _live()
    assert layer.status().outcome("plain").state == layer.WOULD_APPLY
    assert layer.apply().outcome("plain").state == layer.APPLIED
    ours = _live()
    assert type(ours) is types.FunctionType and ours is not original
    assert ours.__qualname__ == original.__qualname__ == "Store.put"  # upstream's names
    assert ours.__wrapped__ is original  # for introspection (inspect.unwrap, signature)
    assert state.inner_of(ours) is original and state.unwrap_ours(ours) is original
    assert state.wrapped_by(ours) == ("plain",)
    assert layer.is_object_patched(ours) and not layer.is_object_patched(original)
    assert layer.get_original(MOD, "Store.put") is original
    assert _put(1) == (3, [("plain", True)])
    assert fake_upstream.Store.put(fake_upstream.Store(), 1) == 3  # through the class too
    assert layer.status().outcome("plain").state == layer.APPLIED
    assert layer.apply().outcome("plain").state == layer.ALREADY
    assert _live() is ours and _put(1)[0] == 3  # not wrapped twice
    assert layer.revert().outcome("plain").state == layer.REVERTED
    assert _live() is original and _put(1) == (2, [])
    assert not layer.is_object_patched(ours) and state.active_wrappers("plain") is None
    assert layer.revert().outcome("plain").state == layer.NOT_ACTIVE
    layer.apply()
    assert _live() is not ours and _put(1) == (3, [("plain", True)])  # a fresh function


def test_calling_must_be_a_calling_member() -> None:
    with pytest.raises(ValueError) as raised:
        Target(MOD, "Store.put", frozenset(), lambda p: None, calling="plain")  # type: ignore[arg-type]
    message = str(raised.value)
    assert f"{MOD}:Store.put" in message and "calling='plain'" in message
    assert "Calling.WRAPT, Calling.PLAIN" in message


@pytest.mark.parametrize("loaded", [True, False], ids=["loaded", "from-file"])
def test_plain_needs_a_plain_function_target(registry, loaded: bool) -> None:  # noqa: ANN001
    """A staticmethod cannot take a plain function in its place. The guards say so, so
    status() and apply() agree, with the reason: from the live object in a loaded
    module, from the decorators in the file of one not imported yet."""
    from tests.test_deferred import _fp as file_fp
    from tests.test_deferred import _unimport

    def factory(params):  # noqa: ANN001, ANN202
        return lambda inner: lambda x: inner(x)

    if loaded:
        module, fp = MOD, _fp(fake_upstream.Tools.scale)
    else:
        _unimport()
        module, fp = LAZY, file_fp("fake_lazy_upstream.py", "Tools.scale")
    target = Target(module, "Tools.scale", fp, factory, calling=Calling.PLAIN)
    registry.set((_spec("static", target),))
    why = f"target {module}:Tools.scale: calling=plain needs upstream's plain function, found"
    would = layer.status().outcome("static")
    assert would.state == layer.SKIPPED and would.reason == f"{why} staticmethod"
    did = layer.apply().outcome("static")
    assert (did.state, did.reason) == (would.state, would.reason)
    assert state.active_wrappers("static") is None
    if loaded:
        assert isinstance(vars(fake_upstream.Tools)["scale"], staticmethod)
    else:
        assert LAZY not in sys.modules  # refused from the file: nothing imported, no hook
        _unimport()


def test_a_factory_that_returns_no_plain_function_is_rolled_back(registry) -> None:  # noqa: ANN001
    def factory(params):  # noqa: ANN001, ANN202
        return lambda inner: functools.partial(inner)

    target = Target(MOD, "Store.put", _fp(fake_upstream.Store.put), factory, calling=Calling.PLAIN)
    registry.set((_spec("bad", target),))
    original = _live()
    outcome = layer.apply().outcome("bad")
    assert outcome.state == layer.SKIPPED and "must return a new plain function" in outcome.reason
    assert _live() is original and state.active_wrappers("bad") is None


def _plain_style(params):  # noqa: ANN001, ANN202
    return _factory("p", lambda r: r + 1, Calling.PLAIN)(params)


def _wrapt_style(params):  # noqa: ANN001, ANN202
    return _factory("p", lambda r: r + 1, Calling.WRAPT)(params)


@pytest.mark.parametrize(
    ("factory", "calling", "wants"),
    [
        (_plain_style, Calling.WRAPT, "a wrapt wrapper (wrapped, instance, args, kwargs)"),
        (_wrapt_style, Calling.PLAIN, "a PlainFactory taking the callable it wraps"),
    ],
    ids=["plain-factory-declared-wrapt", "wrapt-wrapper-declared-plain"],
)
def test_a_wrapper_of_the_other_kind_is_refused_at_apply(registry, factory, calling, wants) -> None:  # noqa: ANN001
    """A plain factory on a Target that forgot ``calling=Calling.PLAIN`` would install
    (wrapt calls it only when the target is called) and raise inside vLLM's loop."""
    registry.set(
        (
            _spec(
                "p",
                Target(MOD, "Store.put", _fp(fake_upstream.Store.put), factory, calling=calling),
            ),
        )
    )
    original = _live()
    outcome = layer.apply().outcome("p")
    assert outcome.state == layer.SKIPPED and "rolled back" in outcome.reason
    assert f"calling={calling.value} needs make_wrapper to return {wants}" in outcome.reason
    assert _live() is original and state.active_wrappers("p") is None
    assert _put(1) == (original(fake_upstream.Store(), 1), [])


def _renamed(inner):  # noqa: ANN001, ANN202
    def put(self, value):  # noqa: ANN001, ANN202
        return inner(self, value)

    return put


def _defaulted(inner):  # noqa: ANN001, ANN202
    def put(self, x=1):  # noqa: ANN001, ANN202
        return inner(self, x)

    return put


def _variadic(inner):  # noqa: ANN001, ANN202
    def put(self, *args):  # noqa: ANN001, ANN202
        return inner(self, *args)

    return put


def _keyword_only(inner):  # noqa: ANN001, ANN202
    def put(self, *, x):  # noqa: ANN001, ANN202
        return inner(self, x)

    return put


def _wraps_hides_it(inner):  # noqa: ANN001, ANN202
    @functools.wraps(inner)  # its signature then looks like upstream's
    def put(self, value):  # noqa: ANN001, ANN202
        return inner(self, value)

    return put


@pytest.mark.parametrize("make", [_renamed, _defaulted, _variadic, _keyword_only, _wraps_hides_it])
def test_a_plain_function_with_other_parameters_is_refused(registry, make) -> None:  # noqa: ANN001
    """Names, kinds and defaults must be upstream's: ``put(x=1)`` is how vLLM calls."""
    target = Target(
        MOD, "Store.put", _fp(fake_upstream.Store.put), lambda p: make, calling=Calling.PLAIN
    )
    registry.set((_spec("p", target),))
    original = _live()
    outcome = layer.apply().outcome("p")
    assert outcome.state == layer.SKIPPED and "rolled back" in outcome.reason
    assert "the Calling.PLAIN function's parameters" in outcome.reason
    assert str(inspect.signature(original)) in outcome.reason
    assert _live() is original and state.active_wrappers("p") is None


def test_a_factory_returning_an_object_prime_r3_records_is_refused(registry) -> None:  # noqa: ANN001
    """Returning upstream's function (or any layer of ours) as the new layer would make
    one object two things in the records: refused, the stack kept as it was."""
    registry.set(_specs(Calling.PLAIN, Calling.PLAIN))
    original = _live()
    layer.apply(["inner"])
    ours = _live()
    for returned in (original, ours):
        spec = _spec(
            "outer",
            Target(
                MOD,
                "Store.put",
                _fp(original),
                lambda p, r=returned: lambda inner: r,
                calling=Calling.PLAIN,
            ),
        )
        registry.set((_specs(Calling.PLAIN, Calling.PLAIN)[0], spec))
        outcome = layer.apply().outcome("outer")
        assert outcome.state == layer.SKIPPED and "already records" in outcome.reason
        assert _live() is ours and state.wrapped_by(ours) == ("inner",)
        assert state.inner_of(ours) is original and state.active_wrappers("outer") is None


@pytest.mark.parametrize(("inner", "outer"), KINDS)
def test_upstreams_function_attributes_stay_visible(registry, inner, outer) -> None:  # noqa: ANN001
    """A marker upstream's function carries (``__isabstractmethod__``, torch's dynamo
    flags, ``__deprecated__``) is seen through every layer, as through a wrapt proxy;
    ``__wrapped__`` still names the layer's inner object, and the records are
    unchanged."""
    original = _live()
    registry.set(_specs(inner, outer))
    original.marker = "upstream's"
    try:
        layer.apply()
        top = _live()
        middle = state.inner_of(top)
        assert top.marker == middle.marker == "upstream's"
        assert top.__wrapped__ is middle and middle.__wrapped__ is original
        _assert_stacked(original, inner, outer)
    finally:
        del original.marker


# -- stacked with other patches on the same target ---------------------------------------


@pytest.mark.parametrize(("inner", "outer"), KINDS)
@pytest.mark.parametrize("order", [("inner", "outer"), ("outer", "inner")])
def test_stacks_in_registry_order_whatever_the_kinds(registry, inner, outer, order) -> None:  # noqa: ANN001
    registry.set(_specs(inner, outer))
    original = _live()
    notes = {
        "inner": "Store.put stacked inside outer",
        "outer": "Store.put stacked outside inner",
    }
    assert {o.name: o.reason for o in layer.status().outcomes} == notes
    for name in order:
        assert layer.apply([name]).outcome(name).state == layer.APPLIED
    _assert_stacked(original, inner, outer)
    assert {o.name: (o.state, o.reason) for o in layer.status().outcomes} == {
        n: (layer.APPLIED, note) for n, note in notes.items()
    }
    report = layer.apply(["inner", "outer"])
    assert [o.state for o in report.outcomes] == [layer.ALREADY, layer.ALREADY]
    _assert_stacked(original, inner, outer)


@pytest.mark.parametrize(("inner", "outer"), KINDS)
@pytest.mark.parametrize("first", ["inner", "outer"])
def test_reverting_either_leaves_the_other_exact(registry, inner, outer, first) -> None:  # noqa: ANN001
    registry.set(_specs(inner, outer))
    original = _live()
    layer.apply()
    top = _live()
    middle = state.inner_of(top)
    assert layer.revert([first]).outcome(first).state == layer.REVERTED
    remaining = "outer" if first == "inner" else "inner"
    wrapper = _live()
    assert state.inner_of(wrapper) is original and state.wrapped_by(wrapper) == (remaining,)
    assert state.active_wrappers(remaining) == {PUT: wrapper}
    assert state.active_wrappers(first) is None
    assert _kind(wrapper) == (outer if remaining == "outer" else inner)
    if first == "outer":  # the inner layer is untouched, the very same object
        assert wrapper is middle and _put(1) == (3, [("inner", True)])
    else:  # outer's layer was rebuilt around upstream's object
        assert wrapper is not top and _put(1) == (20, [("outer", True)])
    assert not layer.is_object_patched(top if first == "outer" else middle)
    assert layer.status().outcome(remaining).reason == ""
    layer.apply([first])  # apply after revert puts it back in its place
    _assert_stacked(original, inner, outer)
    layer.revert([remaining])
    layer.revert([first])
    assert _live() is original and _put(1) == (2, [])
    assert state.active_wrappers("inner") is None and state.active_wrappers("outer") is None


def test_a_plain_layer_that_cannot_be_rebuilt_keeps_the_stack_as_it_is(registry) -> None:  # noqa: ANN001
    """Reverting ``inner`` must rebuild ``outer``'s plain function around upstream's; if
    its factory fails then, nothing changes and ``inner`` is reported kept."""
    builds = []
    plain = _factory("outer", lambda r: r * 10, Calling.PLAIN)

    def once(params):  # noqa: ANN001, ANN202
        make = plain(params)

        def build(inner):  # noqa: ANN001, ANN202
            builds.append(inner)
            if len(builds) > 1:
                raise RuntimeError("no second build")
            return make(inner)

        return build

    outer = _spec(
        "outer", Target(MOD, "Store.put", _fp(fake_upstream.Store.put), once, calling=Calling.PLAIN)
    )
    inner = _spec("inner", _put_target("inner", lambda r: r + 1, Calling.WRAPT))
    registry.set((inner, outer))
    original = _live()
    layer.apply()
    top = _live()
    outcome = layer.revert(["inner"]).outcome("inner")
    assert outcome.state == layer.KEPT and "no second build" in outcome.reason
    assert _live() is top and state.wrapped_by(top) == ("outer", "inner")
    _assert_stacked(original, Calling.WRAPT, Calling.PLAIN)
    assert layer.revert(["outer"]).outcome("outer").state == layer.REVERTED
    assert layer.revert(["inner"]).outcome("inner").state == layer.REVERTED
    assert _live() is original


# -- other layers: recognised by identity, never taken for ours --------------------------


@pytest.mark.parametrize("how", sorted(fake_layers.FUNCTION_LAYERS))
def test_a_foreign_layer_over_a_plain_one_skips_the_next_patch(registry, how: str) -> None:  # noqa: ANN001
    registry.set(_specs(Calling.PLAIN, Calling.WRAPT))
    layer.apply(["inner"])
    ours = _live()
    theirs = fake_layers.FUNCTION_LAYERS[how](ours)
    fake_upstream.Store.put = theirs  # not monkeypatch: its undo would put ours back
    try:
        assert not layer.is_object_patched(theirs) and state.wrapped_by(theirs) == ()
        outcome = layer.apply().outcome("outer")
        assert outcome.state == layer.SKIPPED
        assert outcome.reason.startswith(f"target {PUT} is not upstream's plain object")
        assert _live() is theirs and state.active_wrappers("outer") is None
        assert layer.revert(["inner"]).outcome("inner").state == layer.KEPT
    finally:
        fake_upstream.Store.put = ours  # they leave first


def _clone(function: types.FunctionType) -> types.FunctionType:
    """A foreign function that copies everything ours carries: code, closure, globals,
    names, ``__dict__`` (so ``__wrapped__``) and defaults. Only identity tells it apart."""
    clone = types.FunctionType(
        function.__code__,
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    clone.__dict__.update(function.__dict__)
    clone.__qualname__ = function.__qualname__
    clone.__module__ = function.__module__
    return clone


def test_a_foreign_function_carrying_our_attributes_is_not_ours(registry) -> None:  # noqa: ANN001
    registry.set(_specs(Calling.PLAIN, Calling.WRAPT))
    original = _live()
    layer.apply(["inner"])
    ours = _live()
    theirs = _clone(ours)
    assert theirs.__wrapped__ is original and theirs.__code__ is ours.__code__
    assert not layer.is_object_patched(theirs)
    assert state.wrapped_by(theirs) == () and state.inner_of(theirs) is theirs
    assert state.unwrap_ours(theirs) is theirs  # not upstream's: compared by identity
    fake_upstream.Store.put = theirs
    try:
        outcome = layer.apply().outcome("outer")
        assert outcome.state == layer.SKIPPED
        assert outcome.reason.startswith(f"target {PUT} is not upstream's plain object")
        assert layer.revert(["inner"]).outcome("inner").state == layer.KEPT
    finally:
        fake_upstream.Store.put = ours


def test_what_a_plain_layer_calls_is_recorded_not_read_from_its_attributes(registry) -> None:  # noqa: ANN001
    """Re-pointing ``__wrapped__`` of our plain function changes nothing it calls, so
    the records still say upstream's object is under it: guards, anchors and revert
    follow what the function calls."""
    registry.set(_specs(Calling.PLAIN, Calling.WRAPT))
    original = _live()
    layer.apply(["inner"])
    ours = _live()
    ours.__wrapped__ = fake_layers.with_wrapt(original)  # someone re-points the attribute
    assert state.unwrap_ours(ours) is original and _put(1) == (3, [("inner", True)])
    anchored = _spec(
        "anchored",
        Target(MOD, "helper", _fp(fake_upstream.helper), _factory("h", lambda r: r, Calling.WRAPT)),
        anchors=(Anchor(MOD, "Store", _fp(fake_upstream.Store)),),
    )
    registry.set((*_specs(Calling.PLAIN, Calling.WRAPT), anchored))
    # The anchored class's put is ours: transparent for the anchor, by identity.
    assert layer.apply(["anchored", "outer"]).applied == ["outer", "anchored"]
    _assert_stacked(original, Calling.PLAIN, Calling.WRAPT)
    layer.revert()
    assert _live() is original


def test_an_anchor_sees_through_a_plain_layer_but_not_a_foreign_clone(registry) -> None:  # noqa: ANN001
    anchored = _spec(
        "anchored",
        Target(MOD, "helper", _fp(fake_upstream.helper), _factory("h", lambda r: r, Calling.WRAPT)),
        anchors=(Anchor(MOD, "Store", _fp(fake_upstream.Store)),),
    )
    registry.set((*_specs(Calling.PLAIN, Calling.WRAPT), anchored))
    layer.apply(["inner"])
    ours = _live()
    fake_upstream.Store.put = _clone(ours)
    try:
        outcome = layer.apply().outcome("anchored")
        assert outcome.state == layer.SKIPPED and "anchor" in outcome.reason
    finally:
        fake_upstream.Store.put = ours
    assert layer.apply().outcome("anchored").state == layer.APPLIED


# -- targets in modules imported after apply() ---------------------------------------


@pytest.mark.parametrize(("inner", "outer"), KINDS)
def test_pending_imports_install_plain_layers_in_registry_order(
    reverted: pytest.MonkeyPatch,
    inner: Calling,
    outer: Calling,
) -> None:
    """The deferred-import hook installs a plain layer like a wrapt one, stacked."""
    from tests.test_deferred import _fp as file_fp
    from tests.test_deferred import _unimport

    def make(name: str, change: Callable[[int], int], calling: Calling) -> Any:
        if calling is Calling.WRAPT:
            return lambda params: (
                lambda wrapped, instance, args, kwargs: change(wrapped(*args, **kwargs))
            )

        def factory(params):  # noqa: ANN001, ANN202
            def build(inner_call):  # noqa: ANN001, ANN202
                def step(x):  # noqa: ANN001, ANN202
                    return change(inner_call(x))

                return step

            return build

        return factory

    fp = file_fp("fake_lazy_upstream.py", "step")
    specs = (
        _spec("inner", Target(LAZY, "step", fp, make("inner", lambda r: r + 1, inner), inner)),
        _spec("outer", Target(LAZY, "step", fp, make("outer", lambda r: r * 10, outer), outer)),
    )
    _unimport()
    reverted.setattr(layer, "registry", lambda: specs)
    try:
        for name in ("outer", "inner"):
            assert layer.apply([name]).outcome(name).state == layer.PENDING
        assert LAZY not in sys.modules
        from tests import fake_lazy_upstream as mod

        original = layer.get_original(LAZY, "step")
        assert mod.step(1) == (2 + 1) * 10
        assert state.wrapped_by(mod.step) == ("outer", "inner")
        assert state.unwrap_ours(mod.step) is original
        assert (_kind(mod.step), _kind(state.inner_of(mod.step))) == (outer, inner)
        assert {o.state for o in layer.status().outcomes} == {layer.APPLIED}
        layer.revert(["inner"])
        assert mod.step(1) == 20 and state.wrapped_by(mod.step) == ("outer",)
        layer.revert(["outer"])
        assert mod.step is original
        assert prime_r3.apply(["inner"], log=False).outcome("inner").state == layer.APPLIED
        assert mod.step(1) == 3 and _kind(mod.step) == inner
    finally:
        layer.revert()
        _unimport()
