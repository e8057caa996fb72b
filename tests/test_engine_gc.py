"""engine_gc on vLLM's real code paths: thresholds end configured, no extra freeze."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest

import prime_r3


@pytest.fixture
def gc_probe(reverted: pytest.MonkeyPatch):  # noqa: ANN201
    """Count gc.freeze() calls (without freezing the test heap); restore thresholds."""
    saved = gc.get_threshold()
    calls = []
    reverted.setattr(gc, "freeze", lambda: calls.append("freeze"))
    gc.set_threshold(700, 10, 10)
    yield reverted, calls
    prime_r3.revert()
    gc.set_threshold(*saved)


def _worker_self() -> SimpleNamespace:
    """The attributes Worker.compile_or_warm_up_model reads, for an eager CPU stand-in."""
    from vllm.config import CompilationMode

    compilation = SimpleNamespace(
        mode=CompilationMode.NONE, compilation_time=0.0, encoder_compilation_time=0.0, backend=""
    )
    runner = SimpleNamespace(
        get_model=lambda: None,
        _dummy_run=lambda *a, **k: None,
        maybe_remove_all_loras=lambda cfg: None,
        lora_config=None,
    )
    return SimpleNamespace(
        vllm_config=SimpleNamespace(
            compilation_config=compilation,
            kernel_config=SimpleNamespace(enable_jit_warmup=False),
        ),
        compilation_config=compilation,
        model_runner=runner,
        randomize_dummy_inputs=False,
        use_v2_model_runner=True,
        model_config=SimpleNamespace(enforce_eager=True, seed=0),
        cache_config=SimpleNamespace(kv_cache_memory_bytes=1),
        parallel_config=SimpleNamespace(data_parallel_index=0),
        device="cpu",
        _maybe_activate_jit_monitor=lambda: None,
    )


def _warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the real Worker.compile_or_warm_up_model with device work stubbed out."""
    import vllm.v1.worker.gpu_worker as gpu_worker

    for name in ("kernel_warmup", "set_random_seed", "enable_gpu_sync_check"):
        monkeypatch.setattr(gpu_worker, name, lambda *a, **k: None)
    gpu_worker.Worker.compile_or_warm_up_model(_worker_self())


def test_worker_warm_up_ends_with_thresholds_and_no_extra_freeze(gc_probe) -> None:  # noqa: ANN001
    monkeypatch, calls = gc_probe
    _warm_up(monkeypatch)  # upstream alone
    upstream_freezes = len(calls)
    assert upstream_freezes == 1 and gc.get_threshold() == (700, 10, 10)

    calls.clear()
    prime_r3.apply(["engine_gc"])
    _warm_up(monkeypatch)
    assert gc.get_threshold() == (50_000, 20, 100)
    assert len(calls) == upstream_freezes, "engine_gc must not add a freeze"

    # A later warm-up (sleep/wake, graph recapture): still only upstream's freeze,
    # thresholds set once per process and not fought over.
    calls.clear()
    gc.set_threshold(1234, 5, 6)
    _warm_up(monkeypatch)
    assert len(calls) == upstream_freezes
    assert gc.get_threshold() == (1234, 5, 6)


def test_engine_core_init_looks_up_the_patched_name(gc_probe) -> None:  # noqa: ANN001
    monkeypatch, calls = gc_probe
    from vllm.v1.engine.core import EngineCore

    init = EngineCore.__init__
    assert "freeze_gc_heap" in init.__code__.co_names  # resolved via module globals
    monkeypatch.setenv("PRIME_R3_ENGINE_GC_THRESHOLDS", "40000,15,90")
    prime_r3.apply(["engine_gc"])
    looked_up = init.__globals__["freeze_gc_heap"]
    assert prime_r3.is_object_patched(looked_up)
    looked_up()  # exactly what EngineCore.__init__ calls after startup
    assert gc.get_threshold() == (40_000, 15, 90)
    assert calls == ["freeze"]  # upstream's own freeze, once


def test_revert_restores_thresholds_and_the_original_function(gc_probe) -> None:  # noqa: ANN001
    import vllm.utils.gc_utils as gc_utils
    import vllm.v1.engine.core as core

    prime_r3.apply(["engine_gc"])
    core.freeze_gc_heap()
    assert gc.get_threshold() == (50_000, 20, 100)
    prime_r3.revert(["engine_gc"])
    assert core.freeze_gc_heap is gc_utils.freeze_gc_heap
    assert gc.get_threshold() == (700, 10, 10)


def test_api_server_keeps_defaults_unless_asked(gc_probe) -> None:  # noqa: ANN001
    import vllm.entrypoints.launchers.utils.server_utils as server_utils

    monkeypatch, _ = gc_probe
    prime_r3.apply(["engine_gc"])
    server_utils.freeze_gc_heap()
    assert gc.get_threshold() == (700, 10, 10)
    prime_r3.revert()
    monkeypatch.setenv("PRIME_R3_ENGINE_GC_API_SERVER", "1")
    prime_r3.apply(["engine_gc"])
    server_utils.freeze_gc_heap()
    assert gc.get_threshold() == (50_000, 20, 100)


def test_changed_upstream_source_skips_engine_gc_and_leaves_it_untouched(reverted) -> None:  # noqa: ANN001
    import vllm.utils.gc_utils as gc_utils
    import vllm.v1.engine.core as core

    from prime_r3 import fingerprint

    real = fingerprint.module_source

    def upstream_changed(module_name: str) -> str:
        text = real(module_name)
        if module_name == "vllm.utils.gc_utils":
            text = text.replace("gc.collect(2)\n", "gc.collect(2)\n    gc.collect(2)\n", 1)
        return text

    reverted.setattr(fingerprint, "module_source", upstream_changed)
    outcome = prime_r3.apply().outcome("engine_gc")
    assert outcome.state == "skipped"
    assert outcome.reason.startswith("target source changed: vllm.v1.engine.core:freeze_gc_heap")
    assert core.freeze_gc_heap is gc_utils.freeze_gc_heap


def test_vllm_outside_range_skips_engine_gc(reverted) -> None:  # noqa: ANN001
    import vllm.v1.engine.core as core

    from prime_r3 import guards

    reverted.setattr(guards, "installed_vllm_version", lambda: "0.34.0")
    outcome = prime_r3.apply().outcome("engine_gc")
    assert outcome.state == "skipped"
    assert outcome.reason == "vllm 0.34.0 is outside the verified range >=0.31,<0.34"
    assert not prime_r3.is_object_patched(core.freeze_gc_heap)
