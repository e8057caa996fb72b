"""The patch machinery: idempotent apply, identity-restoring revert, fail-closed guards."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import wrapt

import prime_r3
from prime_r3 import fingerprint, guards, layer, state
from prime_r3.spec import Anchor, Target
from tests import fake_layers, fake_upstream
from tests.fake_specs import fp as _fp
from tests.fake_specs import spec as _spec

MOD = "tests.fake_upstream"


def _add(n: int):  # noqa: ANN202
    def factory(params):  # noqa: ANN001, ANN202
        def wrapper(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
            return wrapped(*args, **kwargs) + n

        return wrapper

    return factory


@pytest.fixture
def fake_registry(reverted: pytest.MonkeyPatch):  # noqa: ANN201
    put = Target(MOD, "Store.put", _fp(fake_upstream.Store.put), _add(100))
    get = Target(MOD, "Store.get", _fp(fake_upstream.Store.get), _add(1000))
    helper = Target(MOD, "helper", _fp(fake_upstream.helper), _add(10))
    specs = (_spec("two_targets", put, get), _spec("one_target", helper))
    reverted.setattr(layer, "registry", lambda: specs)
    originals = (fake_upstream.Store.__dict__["put"], fake_upstream.Store.__dict__["get"])
    original_helper = fake_upstream.helper
    yield reverted, specs
    layer.revert()
    reverted.undo()
    assert fake_upstream.Store.__dict__["put"] is originals[0]
    assert fake_upstream.Store.__dict__["get"] is originals[1]
    assert fake_upstream.helper is original_helper


def test_apply_wraps_with_wrapt_and_keeps_the_original(fake_registry) -> None:  # noqa: ANN001
    original = fake_upstream.Store.__dict__["put"]
    report = layer.apply()
    assert report.applied == ["two_targets", "one_target"]
    assert fake_upstream.Store().put(1) == 102 and fake_upstream.Store().get(1) == 1000
    assert fake_upstream.helper(1) == 12
    current = fake_upstream.Store.__dict__["put"]
    assert isinstance(current, wrapt.FunctionWrapper) and current.__wrapped__ is original
    assert layer.is_object_patched(current) and not layer.is_object_patched(original)
    assert layer.get_original(MOD, "Store.put") is original


def test_apply_twice_is_a_no_op(fake_registry) -> None:  # noqa: ANN001
    layer.apply()
    first = fake_upstream.Store.__dict__["put"]
    report = layer.apply()
    assert [o.state for o in report.outcomes] == [layer.ALREADY, layer.ALREADY]
    assert fake_upstream.Store.__dict__["put"] is first
    assert fake_upstream.Store().put(1) == 102  # not wrapped twice


def test_revert_restores_identity_and_apply_after_revert_works(fake_registry) -> None:  # noqa: ANN001
    originals = dict(fake_upstream.Store.__dict__)
    layer.apply()
    report = layer.revert()
    assert {o.state for o in report.outcomes} == {layer.REVERTED}
    assert fake_upstream.Store.__dict__["put"] is originals["put"]
    assert fake_upstream.Store.__dict__["get"] is originals["get"]
    assert fake_upstream.Store().put(1) == 2
    layer.apply()
    assert fake_upstream.Store().put(1) == 102
    layer.revert()
    assert fake_upstream.Store.__dict__["put"] is originals["put"]
    assert layer.revert().outcomes[0].state == layer.NOT_ACTIVE


def test_revert_only_named_patch(fake_registry) -> None:  # noqa: ANN001
    layer.apply()
    layer.revert(["one_target"])
    assert fake_upstream.helper(1) == 2 and fake_upstream.Store().put(1) == 102


def test_second_target_failure_rolls_back_the_first(fake_registry) -> None:  # noqa: ANN001
    monkeypatch, _ = fake_registry

    def broken(params):  # noqa: ANN001, ANN202
        raise RuntimeError("cannot build wrapper")

    put = Target(MOD, "Store.put", _fp(fake_upstream.Store.put), _add(100))
    get = Target(MOD, "Store.get", _fp(fake_upstream.Store.get), broken)
    specs = (_spec("half", put, get),)
    monkeypatch.setattr(layer, "registry", lambda: specs)
    original = fake_upstream.Store.__dict__["put"]
    report = layer.apply()
    outcome = report.outcome("half")
    assert outcome.state == layer.SKIPPED and "rolled back" in outcome.reason
    assert "cannot build wrapper" in outcome.reason
    assert fake_upstream.Store.__dict__["put"] is original
    assert state.active_wrappers("half") is None


def test_changed_target_source_is_skipped_with_reason_and_untouched(fake_registry) -> None:  # noqa: ANN001
    monkeypatch, specs = fake_registry
    real = fingerprint.read_installed

    def changed(module_name: str) -> fingerprint.ModuleText:
        text = real(module_name)
        if module_name == MOD:
            source = text.source.replace("return x * 2", "return x * 3")
            text = dataclasses.replace(text, source=source)
        return text

    monkeypatch.setattr(fingerprint, "read_installed", changed)
    original = fake_upstream.Store.__dict__["put"]
    report = layer.apply()
    outcome = report.outcome("two_targets")
    assert outcome.state == layer.SKIPPED
    assert outcome.reason.startswith(f"target source changed: {MOD}:Store.put")
    assert fake_upstream.Store.__dict__["put"] is original
    assert report.outcome("one_target").state == layer.APPLIED


def test_changed_anchor_skips(fake_registry) -> None:  # noqa: ANN001
    monkeypatch, specs = fake_registry
    anchor = Anchor(MOD, "Store.get", frozenset({"0000000000000000"}))
    spec = dataclasses.replace(specs[1], anchors=(anchor,))
    monkeypatch.setattr(layer, "registry", lambda: (spec,))
    outcome = layer.apply().outcome("one_target")
    assert outcome.state == layer.SKIPPED and "Store.get" in outcome.reason
    assert not layer.is_object_patched(fake_upstream.helper)


def test_target_replaced_by_someone_else_is_skipped(fake_registry) -> None:  # noqa: ANN001
    monkeypatch, _ = fake_registry

    def other_layer(x: int) -> int:
        return -x

    other_layer.__module__, other_layer.__qualname__ = MOD, "helper"
    original = fake_upstream.helper
    fake_upstream.helper = other_layer
    try:
        outcome = layer.apply().outcome("one_target")
        assert outcome.state == layer.SKIPPED and "another layer" in outcome.reason
        assert fake_upstream.helper is other_layer
    finally:
        fake_upstream.helper = original


def test_revert_keeps_our_layer_when_another_wraps_on_top(fake_registry) -> None:  # noqa: ANN001
    layer.apply(["one_target"])
    ours = fake_upstream.helper
    theirs = wrapt.FunctionWrapper(ours, lambda w, i, a, k: w(*a, **k))
    fake_upstream.helper = theirs
    try:
        outcome = layer.revert(["one_target"]).outcome("one_target")
        assert outcome.state == layer.KEPT and "another layer" in outcome.reason
        assert fake_upstream.helper is theirs and theirs.__wrapped__ is ours
    finally:
        fake_upstream.helper = ours  # they leave first
    assert layer.revert(["one_target"]).outcome("one_target").state == layer.REVERTED


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.30.2", "outside the verified range >=0.31,<0.33"),
        ("0.33.0", "vllm 0.33.0 has this fix upstream (fixed upstream in 0.33)"),
        ("0.34.1", "vllm 0.34.1 has this fix upstream"),
        ("0.32.0+cpu", None),
        ("0.31.1rc1", None),
    ],
)
def test_version_guard(version: str, expected: str | None) -> None:
    spec = _spec("v", vllm_range=">=0.31,<0.33", fixed_upstream_in="0.33")
    reason = guards.check_version(spec, version)
    assert reason == expected if expected is None else expected in reason


def test_version_outside_range_is_skipped_and_untouched(fake_registry) -> None:  # noqa: ANN001
    monkeypatch, _ = fake_registry
    monkeypatch.setattr(guards, "installed_vllm_version", lambda: "0.35.0")
    report = layer.apply()
    assert {o.state for o in report.outcomes} == {layer.SKIPPED}
    assert all("0.35.0 is outside the verified range" in o.reason for o in report.outcomes)
    assert not layer.is_object_patched(fake_upstream.helper)


def test_requested_patch_that_cannot_apply_raises_default_one_is_logged(
    fake_registry,  # noqa: ANN001
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch, _ = fake_registry
    monkeypatch.setattr(guards, "installed_vllm_version", lambda: "0.35.0")
    with caplog.at_level(logging.INFO, logger="vllm.prime_r3"):
        layer.apply()  # default selection: skipped, not raised
    assert "skipped: two_targets (vllm 0.35.0 is outside" in caplog.text
    with pytest.raises(prime_r3.PatchNotApplied, match="one_target: vllm 0.35.0"):
        layer.apply(["one_target"])
    monkeypatch.setenv("PRIME_R3_PATCHES", "one_target")
    with pytest.raises(prime_r3.PatchNotApplied):
        layer.apply()


def test_env_selection_and_off_switch(fake_registry) -> None:  # noqa: ANN001
    monkeypatch, _ = fake_registry
    monkeypatch.setenv("PRIME_R3_PATCHES", "-two_targets")
    report = layer.apply()
    assert report.applied == ["one_target"]
    assert report.outcome("two_targets").state == layer.DISABLED
    layer.revert()
    monkeypatch.setenv("PRIME_R3", "0")
    report = layer.apply()
    assert report.applied == [] and {o.state for o in report.outcomes} == {layer.DISABLED}
    assert not layer.is_object_patched(fake_upstream.helper)


def test_bad_env_raises_before_touching_anything(fake_registry) -> None:  # noqa: ANN001
    monkeypatch, _ = fake_registry
    monkeypatch.setenv("PRIME_R3_PATCHES", "one_target,typo")
    with pytest.raises(prime_r3.ConfigError, match="'typo'"):
        layer.apply()
    assert not layer.is_object_patched(fake_upstream.helper)
    with pytest.raises(prime_r3.ConfigError, match="unknown patch 'typo'"):
        layer.apply(["typo"])


def test_status_changes_nothing(fake_registry) -> None:  # noqa: ANN001
    report = layer.status()
    assert [o.state for o in report.outcomes] == [layer.WOULD_APPLY, layer.WOULD_APPLY]
    assert not layer.is_object_patched(fake_upstream.helper)


# -- anchors are guarded like targets (real vLLM objects) ---------------------------

WORKER = "vllm.distributed.aux_output_connector.worker"
CONNECTOR = "vllm.distributed.aux_output_connector.connector"
#: packed_outputs (range >=0.31,<0.34, not fixed upstream: applies on 0.31, 0.32 and
#: 0.33) anchors a consumer in another module than its target, and a producer in
#: the target's own module.
FUNCTION_ANCHORS = {
    "consumer in another module": (CONNECTOR, "AuxOutputSchedulerConnector", "take_output"),
    "producer in the target module": (WORKER, "AuxOutputWorkerConnector", "_commit_output"),
}


def _process_output_is_upstream() -> bool:
    from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector

    return not layer.is_object_patched(AuxOutputWorkerConnector.__dict__["process_output"])


def _assert_packed_outputs_skips_naming(key: str) -> None:
    with pytest.raises(prime_r3.PatchNotApplied) as raised:
        layer.apply(["packed_outputs"])
    reason = raised.value.report.outcome("packed_outputs").reason
    assert reason.startswith(f"anchor {key} is not upstream's plain object"), reason
    assert _process_output_is_upstream()
    assert layer.status().outcome("packed_outputs").state == layer.SKIPPED


@pytest.mark.parametrize("how", sorted(fake_layers.FUNCTION_LAYERS))
@pytest.mark.parametrize("where", sorted(FUNCTION_ANCHORS))
def test_anchor_replaced_by_another_layer_skips_the_patch(
    reverted: pytest.MonkeyPatch, where: str, how: str
) -> None:
    import importlib

    module, cls_name, name = FUNCTION_ANCHORS[where]
    cls = getattr(importlib.import_module(module), cls_name)
    original = cls.__dict__[name]
    reverted.setattr(cls, name, fake_layers.FUNCTION_LAYERS[how](original))
    _assert_packed_outputs_skips_naming(f"{module}:{cls_name}.{name}")
    reverted.setattr(cls, name, original)  # the other layer leaves: the patch applies
    assert layer.apply(["packed_outputs"]).outcome("packed_outputs").state == layer.APPLIED


@pytest.mark.parametrize("how", sorted(fake_layers.FUNCTION_LAYERS))
def test_a_function_wrapped_where_upstream_looks_it_up_skips_the_patch(
    reverted: pytest.MonkeyPatch, how: str
) -> None:
    """worker.py calls materialize_routed_experts through its own `from ... import` name:
    a layer there, not at the definition, must be seen too (found by review)."""
    import importlib

    worker = importlib.import_module(WORKER)
    original = worker.materialize_routed_experts
    reverted.setattr(
        worker, "materialize_routed_experts", fake_layers.FUNCTION_LAYERS[how](original)
    )
    _assert_packed_outputs_skips_naming(f"{WORKER}:materialize_routed_experts")
    reverted.setattr(worker, "materialize_routed_experts", original)
    assert layer.apply(["packed_outputs"]).outcome("packed_outputs").state == layer.APPLIED


def test_class_anchor_with_a_wrapped_method_skips_the_patch(reverted: pytest.MonkeyPatch) -> None:
    """PendingAuxOutput is a dataclass anchor; its generated __init__ wrapped elsewhere."""
    from vllm.distributed.aux_output_connector.worker import PendingAuxOutput

    original = PendingAuxOutput.__dict__["__init__"]
    reverted.setattr(PendingAuxOutput, "__init__", fake_layers.with_functools_wraps(original))
    _assert_packed_outputs_skips_naming(f"{WORKER}:PendingAuxOutput")
    reverted.setattr(PendingAuxOutput, "__init__", original)
    assert layer.apply(["packed_outputs"]).outcome("packed_outputs").state == layer.APPLIED


def test_class_anchor_replaced_by_a_look_alike_subclass_skips_the_patch(
    reverted: pytest.MonkeyPatch,
) -> None:
    from vllm.distributed.aux_output_connector import connector

    original = connector.AuxRequestOutput
    stand_in = type("AuxRequestOutput", (original,), {"__module__": CONNECTOR})
    reverted.setattr(connector, "AuxRequestOutput", stand_in)
    _assert_packed_outputs_skips_naming(f"{CONNECTOR}:AuxRequestOutput")
    reverted.setattr(connector, "AuxRequestOutput", original)
    assert layer.apply(["packed_outputs"]).outcome("packed_outputs").state == layer.APPLIED


def test_upstream_decorated_anchors_and_our_own_wrappers_count_as_plain(reverted) -> None:  # noqa: ANN001
    """Worker.compile_or_warm_up_model (@instrument) and lifespan (@asynccontextmanager,
    a functools.wraps layer from contextlib) are plain; so is BlockObjectStore once
    store_eviction (when it applies here) wrapped its _evict_to_fit."""
    import importlib

    from prime_r3.patches import REGISTRY

    layer.apply()
    for spec in REGISTRY:
        for anchor in spec.anchors_for(guards.installed_vllm_version()):
            importlib.import_module(anchor.module)
            resolved = guards.resolve(anchor)
            assert not isinstance(resolved, str), resolved
            reason = guards.check_source(anchor, resolved)
            version_reason = guards.check_version(spec, guards.installed_vllm_version())
            assert reason is None or version_reason is not None, reason
    lifespan = importlib.import_module("vllm.entrypoints.launchers.utils.server_utils").lifespan
    assert lifespan.__wrapped__.__code__.co_name == "lifespan"  # a real decorator layer


@pytest.mark.parametrize("how", sorted(fake_layers.FUNCTION_LAYERS))
def test_target_replaced_by_another_layer_skips_the_patch(
    reverted: pytest.MonkeyPatch, how: str
) -> None:
    """Before, a wraps-style wrapper compiled under upstream's file name passed."""
    from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector as cls

    original = cls.__dict__["process_output"]
    theirs = fake_layers.FUNCTION_LAYERS[how](original)
    reverted.setattr(cls, "process_output", theirs)
    with pytest.raises(prime_r3.PatchNotApplied) as raised:
        layer.apply(["packed_outputs"])
    reason = raised.value.report.outcome("packed_outputs").reason
    assert reason.startswith(f"target {WORKER}:AuxOutputWorkerConnector.process_output is not"), (
        reason
    )
    assert cls.__dict__["process_output"] is theirs


def test_another_layer_over_an_upstream_decorated_anchor_skips(reverted) -> None:  # noqa: ANN001
    """lifespan carries one contextlib layer of its own; a second one is another layer's."""
    import importlib

    server_utils = importlib.import_module("vllm.entrypoints.launchers.utils.server_utils")
    original = server_utils.lifespan
    reverted.setattr(server_utils, "lifespan", fake_layers.with_functools_wraps(original))
    with pytest.raises(prime_r3.PatchNotApplied) as raised:
        layer.apply(["engine_gc"])
    reason = raised.value.report.outcome("engine_gc").reason
    key = "vllm.entrypoints.launchers.utils.server_utils:lifespan"
    assert reason.startswith(f"anchor {key} is not upstream's plain object"), reason
    assert "2 wrapper(s) over lifespan, its decorators add 1" in reason
    reverted.setattr(server_utils, "lifespan", original)
    assert layer.apply(["engine_gc"]).outcome("engine_gc").state == layer.APPLIED
