"""Targets in modules not yet imported are installed when vLLM imports them, not before."""

from __future__ import annotations

import logging
import pathlib
import sys

import pytest

import prime_r3
from prime_r3 import fingerprint, layer
from prime_r3.spec import PatchSpec, Process, Target
from tests import fake_layers

LAZY = "tests.fake_lazy_upstream"
CONSUMER = "tests.fake_lazy_consumer"
HERE = pathlib.Path(__file__).parent


def _fp(module_file: str, qualname: str) -> frozenset[str]:
    """Fingerprint from the file, without importing the module."""
    return frozenset({fingerprint.of_source((HERE / module_file).read_text(), qualname)})


def _plus(n: int):  # noqa: ANN202
    def factory(params):  # noqa: ANN001, ANN202
        return lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs) + n

    return factory


def _suffix(params):  # noqa: ANN001, ANN202
    return lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs) + "+patched"


def _unimport() -> None:
    for name in (LAZY, CONSUMER):
        sys.modules.pop(name, None)
        attr = name.rsplit(".", 1)[1]
        if hasattr(sys.modules["tests"], attr):
            delattr(sys.modules["tests"], attr)


def _registry(step_fp: frozenset[str] | None = None) -> tuple[PatchSpec, ...]:
    step = Target(LAZY, "step", step_fp or _fp("fake_lazy_upstream.py", "step"), _plus(100))
    warm = Target(LAZY, "Worker.warm_up", _fp("fake_lazy_upstream.py", "Worker.warm_up"), _suffix)
    consume = Target(CONSUMER, "consume", _fp("fake_lazy_consumer.py", "consume"), _plus(1))
    common = dict(summary="t", vllm_range=">=0.31,<0.34", processes=frozenset({Process.WORKER}))
    return (
        PatchSpec(name="lazy", targets=(step, warm), **common),
        PatchSpec(name="spanning", targets=(consume, step), **common),
    )


@pytest.fixture
def lazy(reverted: pytest.MonkeyPatch):  # noqa: ANN201
    _unimport()
    yield reverted
    layer.revert()
    _unimport()


def test_apply_does_not_import_and_installs_on_import(lazy) -> None:  # noqa: ANN001
    lazy.setattr(layer, "registry", lambda: _registry()[:1])
    report = layer.apply()
    outcome = report.outcome("lazy")
    assert outcome.state == layer.PENDING
    assert outcome.reason == f"waits for import of {LAZY}"
    assert "on import: lazy (waits for import of tests.fake_lazy_upstream)" in report.summary()
    assert LAZY not in sys.modules
    assert layer.apply().outcome("lazy").state == layer.PENDING  # idempotent

    from tests import fake_lazy_upstream as mod

    assert mod.step(1) == 102 and mod.Worker().warm_up() == "warm+patched"
    assert prime_r3.is_object_patched(mod.step)
    assert layer.status().outcome("lazy").state == layer.APPLIED
    original = layer.get_original(LAZY, "step")
    layer.revert()
    assert mod.step is original and mod.step(1) == 2


def test_revert_before_import_cancels_the_hook(lazy) -> None:  # noqa: ANN001
    lazy.setattr(layer, "registry", lambda: _registry()[:1])
    layer.apply()
    assert layer.revert().outcome("lazy").state == layer.REVERTED
    from tests import fake_lazy_upstream as mod

    assert mod.step(1) == 2 and not prime_r3.is_object_patched(mod.step)


def test_a_patch_spanning_two_lazy_modules_completes_on_the_second(lazy) -> None:  # noqa: ANN001
    lazy.setattr(layer, "registry", lambda: _registry()[1:])
    layer.apply()
    from tests import fake_lazy_consumer as consumer

    assert consumer.consume(1) == 11
    assert layer.status().outcome("spanning").state == layer.PENDING
    from tests import fake_lazy_upstream as mod

    assert mod.step(1) == 102
    assert layer.status().outcome("spanning").state == layer.APPLIED


def test_guard_failing_at_import_rolls_back_the_other_targets(lazy, caplog) -> None:  # noqa: ANN001
    """The module changed between apply() (checked from its file) and its import."""
    specs = _registry(frozenset({"0" * 16}))[1:]
    lazy.setattr(layer, "registry", lambda: specs)
    real_check = layer._check
    lazy.setattr(layer, "_check", lambda spec, version: None)  # apply-time file check passes
    layer.apply()
    lazy.setattr(layer, "_check", real_check)
    from tests import fake_lazy_consumer as consumer

    assert consumer.consume(1) == 11  # installed: its own module passed the guards
    with caplog.at_level(logging.WARNING, logger="vllm.prime_r3"):
        from tests import fake_lazy_upstream as mod
    assert "spanning skipped on import of tests.fake_lazy_upstream: target source changed" in (
        caplog.text
    )
    assert mod.step(1) == 2 and consumer.consume(1) == 10  # both back to upstream
    assert not prime_r3.is_object_patched(consumer.consume)
    assert layer.status().outcome("spanning").state == layer.SKIPPED


def test_requested_patch_with_changed_unimported_source_raises_at_apply(lazy) -> None:  # noqa: ANN001
    lazy.setattr(layer, "registry", lambda: _registry(frozenset({"0" * 16}))[:1])
    with pytest.raises(prime_r3.PatchNotApplied, match="lazy: target source changed"):
        layer.apply(["lazy"])
    assert LAZY not in sys.modules


def test_revert_after_a_reimport_restores_the_new_modules_original(lazy) -> None:  # noqa: ANN001
    lazy.setattr(layer, "registry", lambda: _registry()[:1])
    from tests import fake_lazy_upstream as first

    layer.apply()
    layer.revert()
    stale = first.step
    _unimport()
    from tests import fake_lazy_upstream as second

    assert second is not first and second.step is not stale
    fresh = second.step
    layer.apply()
    assert second.step(1) == 102
    layer.revert()
    assert second.step is fresh


def test_status_imports_nothing_and_fires_no_hook(lazy) -> None:  # noqa: ANN001
    lazy.setattr(layer, "registry", lambda: _registry())
    assert layer.status().outcome("lazy").state == layer.WOULD_APPLY
    assert LAZY not in sys.modules and CONSUMER not in sys.modules
    layer.apply()
    assert layer.status().outcome("lazy").state == layer.PENDING
    assert LAZY not in sys.modules


def test_changed_source_of_an_unimported_module_skips_at_apply(lazy) -> None:  # noqa: ANN001
    lazy.setattr(layer, "registry", lambda: _registry(frozenset({"0" * 16})))
    report = layer.apply()
    for name in ("lazy", "spanning"):
        outcome = report.outcome(name)
        assert outcome.state == layer.SKIPPED
        assert outcome.reason.startswith(f"target source changed: {LAZY}:step")
    assert LAZY not in sys.modules
    from tests import fake_lazy_consumer as consumer

    assert not prime_r3.is_object_patched(consumer.consume)


def test_missing_source_file_skips_instead_of_raising(lazy, tmp_path) -> None:  # noqa: ANN001
    """An image that ships only .pyc: the guard cannot read the source, so it skips."""
    from prime_r3 import fingerprint as fp

    def no_source(module_name: str) -> fp.ModuleText:
        raise fp.SourceUnavailable(f"no source for module {module_name}")

    lazy.setattr(layer, "registry", lambda: _registry()[:1])
    lazy.setattr(fp, "read_installed", no_source)
    outcome = layer.apply().outcome("lazy")
    assert outcome.state == layer.SKIPPED and "source unavailable" in outcome.reason


# -- real vLLM modules imported after apply(): anchors re-checked on import ----------

AUX = "vllm.distributed.aux_output_connector"
AUX_MODULES = tuple(f"{AUX}.{m}" for m in ("connector", "routed_experts", "store", "worker"))
#: packed_outputs anchors a consumer in a module holding no target (connector) and a
#: producer in its target's module (worker); it applies on 0.31, 0.32 and 0.33.
ANCHORS = {
    "consumer in another module": (
        f"{AUX}.connector",
        "AuxOutputSchedulerConnector",
        "take_output",
    ),
    "producer in the target module": (
        f"{AUX}.worker",
        "AuxOutputWorkerConnector",
        "_commit_output",
    ),
}
LAYERS = {"functools.wraps": fake_layers.with_functools_wraps, "wrapt": fake_layers.with_wrapt}


@pytest.fixture
def aux_unimported(reverted: pytest.MonkeyPatch):  # noqa: ANN201
    """vLLM's aux-output modules as if not imported yet; the session's put back after."""
    import vllm.distributed.aux_output_connector as package

    saved = {name: sys.modules.pop(name) for name in AUX_MODULES if name in sys.modules}
    attrs = {n: vars(package)[n] for n in ("connector", "routed_experts", "store", "worker")
             if n in vars(package)}  # fmt: skip
    for name in attrs:
        delattr(package, name)
    yield reverted
    layer.revert()
    for name in AUX_MODULES:
        sys.modules.pop(name, None)
    sys.modules.update(saved)
    for name in ("connector", "routed_experts", "store", "worker"):
        if name in attrs:
            setattr(package, name, attrs[name])
        elif hasattr(package, name):
            delattr(package, name)


@pytest.mark.parametrize("how", sorted(LAYERS))
@pytest.mark.parametrize("where", sorted(ANCHORS))
def test_anchor_wrapped_by_another_layer_on_import_rolls_the_patch_back(
    aux_unimported,
    caplog,
    where: str,
    how: str,  # noqa: ANN001
) -> None:
    """Another layer's own import hook (registered first) wraps the anchor on import."""
    import wrapt

    module, cls_name, name = ANCHORS[where]

    def other_layer(mod: object) -> None:
        cls = getattr(mod, cls_name)
        setattr(cls, name, LAYERS[how](cls.__dict__[name]))

    wrapt.register_post_import_hook(other_layer, module)
    outcome = layer.apply(["packed_outputs"]).outcome("packed_outputs")
    assert outcome.state == layer.PENDING  # the files verify; nothing imported
    assert not any(m in sys.modules for m in AUX_MODULES)
    with caplog.at_level(logging.WARNING, logger="vllm.prime_r3"):
        from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector
    key = f"{module}:{cls_name}.{name}"
    assert f"packed_outputs skipped on import of {module}: anchor {key} is not upstream's" in (
        caplog.text
    )
    current = getattr(sys.modules[module], cls_name).__dict__[name]
    assert type(current) is type(LAYERS[how](len))  # their layer stays, ours never went on
    assert not prime_r3.is_object_patched(AuxOutputWorkerConnector.__dict__["process_output"])
    status = layer.status().outcome("packed_outputs")
    assert status.state == layer.SKIPPED and key in status.reason


def test_unwrapped_anchors_on_import_let_the_patch_install(aux_unimported) -> None:  # noqa: ANN001
    """The same sequence without the other layer: the patch installs on import."""
    assert layer.apply(["packed_outputs"]).outcome("packed_outputs").state == layer.PENDING
    from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector

    assert prime_r3.is_object_patched(AuxOutputWorkerConnector.__dict__["process_output"])
    assert layer.status().outcome("packed_outputs").state == layer.APPLIED


def test_anchor_module_imported_after_the_targets_rolls_them_back_if_replaced(
    lazy,  # noqa: ANN001
    caplog,  # noqa: ANN001
) -> None:
    """The patch waits for its anchor's module too; a layer found there then undoes it."""
    import wrapt

    from prime_r3.spec import Anchor

    step = Target(LAZY, "step", _fp("fake_lazy_upstream.py", "step"), _plus(100))
    anchor = Anchor(CONSUMER, "consume", _fp("fake_lazy_consumer.py", "consume"))
    spec = PatchSpec(
        name="anchored",
        summary="t",
        targets=(step,),
        anchors=(anchor,),
        vllm_range=">=0.31,<0.34",
        processes=frozenset({Process.WORKER}),
    )
    lazy.setattr(layer, "registry", lambda: (spec,))

    def other_layer(mod) -> None:  # noqa: ANN001
        mod.consume = fake_layers.with_functools_wraps(mod.consume)

    wrapt.register_post_import_hook(other_layer, CONSUMER)
    layer.apply()
    from tests import fake_lazy_upstream as mod

    assert mod.step(1) == 102  # installed with its module
    assert layer.status().outcome("anchored").reason == f"waits for import of {CONSUMER}"
    with caplog.at_level(logging.WARNING, logger="vllm.prime_r3"):
        from tests import fake_lazy_consumer  # noqa: F401
    assert f"anchored skipped on import of {CONSUMER}: anchor {CONSUMER}:consume" in caplog.text
    assert mod.step(1) == 2 and not prime_r3.is_object_patched(mod.step)
