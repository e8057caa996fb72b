"""engine_gc on vLLM's real code paths: thresholds end configured, no extra freeze."""

from __future__ import annotations

import contextlib
import gc
import json
import pathlib
import types
from types import SimpleNamespace
from typing import Any

import pytest
import vllm

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
    """The attributes Worker.compile_or_warm_up_model reads, for an eager CPU stand-in.

    Per release (read in each one's gpu_worker.py): 0.31 and 0.32 run the warm-up
    directly; 0.33 wraps it in ``model_runner.eplb.suppress()`` (its V2 runner records
    expert load on warm-up forwards), so the runner stand-in carries an ``eplb`` whose
    ``suppress`` is a plain context manager. Older releases never read it.
    """
    from vllm.config import CompilationMode

    compilation = SimpleNamespace(
        mode=CompilationMode.NONE, compilation_time=0.0, encoder_compilation_time=0.0, backend=""
    )
    runner = SimpleNamespace(
        get_model=lambda: None,
        _dummy_run=lambda *a, **k: None,
        maybe_remove_all_loras=lambda cfg: None,
        lora_config=None,
        eplb=SimpleNamespace(suppress=contextlib.nullcontext),
    )
    stand_in = SimpleNamespace(
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
    # 0.33 split the warm-up: the public method suppresses EPLB and calls the real
    # ``_compile_or_warm_up_model``, which holds the freeze; 0.31/0.32 have one method.
    from vllm.v1.worker.gpu_worker import Worker

    split = hasattr(Worker, "_compile_or_warm_up_model")
    assert split == (vllm.__version__ == "0.33.0"), vllm.__version__
    if split:
        stand_in._compile_or_warm_up_model = types.MethodType(
            Worker._compile_or_warm_up_model, stand_in
        )
    return stand_in


def _stub_device_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up's device calls (kernel JIT, CUDA RNG seeding, sync check) do nothing."""
    import vllm.v1.worker.gpu_worker as gpu_worker

    for name in ("kernel_warmup", "set_random_seed", "enable_gpu_sync_check"):
        monkeypatch.setattr(gpu_worker, name, lambda *a, **k: None, raising=False)


def _warm_up(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Run the real Worker.compile_or_warm_up_model with device work stubbed out."""
    import vllm.v1.worker.gpu_worker as gpu_worker

    _stub_device_work(monkeypatch)
    return gpu_worker.Worker.compile_or_warm_up_model(_worker_self())


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


# -- EngineCore: its real __init__ and shutdown, in-process -----------------------


def _model_dir(directory: pathlib.Path) -> str:
    """A tiny Mixtral-shaped HF config (no hub download; the model is never loaded)."""
    config = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 512,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


class _LightWorker:
    """The worker side of a one-rank engine, on the CPU.

    Answers the RPCs EngineCore's init makes (KV spec, memory, layout) with fixed
    values, and runs the release's real ``Worker.compile_or_warm_up_model`` on a CPU
    stand-in self: an in-process worker, as ``UniProcExecutor`` gives a trainer that
    runs vLLM with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._monkeypatch = monkeypatch
        self.warm_ups = 0

    def get_kv_cache_spec(self) -> dict[str, Any]:
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
        return {f"model.layers.{i}.self_attn.attn": spec for i in range(2)}

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["NHD"]

    def set_kv_cache_layout(self, *args: Any) -> None:
        pass

    def determine_available_memory(self) -> int:
        return 8 << 20

    def get_simple_cpu_offload_num_cpu_blocks(self) -> None:
        return None

    def initialize_from_config(self, kv_cache_configs: Any) -> None:
        pass

    def compile_or_warm_up_model(self) -> Any:
        self.warm_ups += 1
        return _warm_up(self._monkeypatch)

    def shutdown(self) -> None:
        pass


def _light_executor(monkeypatch: pytest.MonkeyPatch) -> type:
    """vLLM's real ``Executor`` base with one in-process CPU worker behind its RPCs.

    Like the executor stand-ins of vLLM's own engine tests: everything EngineCore does
    with the executor goes through the real base class methods.
    """
    from vllm.v1.executor.abstract import Executor

    class LightExecutor(Executor):
        def _init_executor(self) -> None:
            self.worker = _LightWorker(monkeypatch)

        def collective_rpc(  # type: ignore[override]
            self,
            method: Any,
            timeout: float | None = None,
            args: tuple = (),
            kwargs: dict | None = None,
            non_block: bool = False,
        ) -> list[Any]:
            if isinstance(method, str):
                result = getattr(self.worker, method)(*args, **(kwargs or {}))
            else:
                result = method(self.worker, *args, **(kwargs or {}))
            return [result]

        def check_health(self) -> None:
            pass

    return LightExecutor


@pytest.fixture
def engine_env(gc_probe, tmp_path):  # noqa: ANN001, ANN201
    """A VllmConfig for a tiny model and the light executor; undoes the envs cache that
    EngineCore's init turns on for the rest of the process."""
    import vllm.envs as envs
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch, calls = gc_probe
    # The plugin exports these for Ray workers: put them back as they were after the test.
    monkeypatch.delenv("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", raising=False)
    monkeypatch.delenv("PRIME_R3_FROM_HEAD", raising=False)
    monkeypatch.setenv("PRIME_R3", "0")  # building the config loads plugins: not yet
    vllm_config = EngineArgs(
        model=_model_dir(tmp_path),
        skip_tokenizer_init=True,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=8,
    ).create_engine_config()
    yield monkeypatch, calls, vllm_config, _light_executor(monkeypatch)
    envs.disable_envs_cache()


def _inproc_client(
    monkeypatch: pytest.MonkeyPatch, vllm_config: Any, executor: type, **env: str
) -> Any:
    """vLLM's in-process client: its real __init__ builds the real EngineCore, whose
    init loads the general plugins (prime_r3's entry point) as in a fresh process."""
    import vllm.plugins
    from vllm.v1.engine.core_client import InprocClient

    monkeypatch.delenv("PRIME_R3", raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    return InprocClient(vllm_config, executor, False)


#: The overlay as a trainer enables it for this test: engine_gc only, via the plugin.
ENGINE_GC = {"PRIME_R3_PATCHES": "engine_gc"}


def test_engine_core_init_sets_thresholds_after_its_own_freeze(engine_env) -> None:  # noqa: ANN001
    """The real EngineCore.__init__ (and the real in-process worker warm-up under it)."""
    import vllm.v1.engine.core as core

    monkeypatch, calls, vllm_config, executor = engine_env
    client = _inproc_client(monkeypatch, vllm_config, executor, PRIME_R3="0")  # upstream
    upstream_freezes = len(calls)
    assert upstream_freezes == 2  # worker warm-up + end of EngineCore.__init__
    assert gc.get_threshold() == (700, 10, 10)
    client.shutdown()

    calls.clear()
    thresholds_at_freeze = []
    real_freeze = gc.freeze
    monkeypatch.setattr(
        gc, "freeze", lambda: (thresholds_at_freeze.append(gc.get_threshold()), real_freeze())
    )
    client = _inproc_client(
        monkeypatch,
        vllm_config,
        executor,
        PRIME_R3_ENGINE_GC_THRESHOLDS="40000,15,90",
        **ENGINE_GC,
    )
    assert prime_r3.is_object_patched(core.freeze_gc_heap)  # by the plugin, in __init__
    assert client.engine_core.model_executor.worker.warm_ups == 1
    assert gc.get_threshold() == (40_000, 15, 90)
    assert len(calls) == upstream_freezes, "engine_gc must not add a freeze"
    # Set *after* upstream's freeze (the worker's, then EngineCore's): the first freeze
    # still ran with the defaults in place.
    assert thresholds_at_freeze[0] == (700, 10, 10)
    client.shutdown()


def test_in_process_engine_shutdown_restores_the_users_thresholds(engine_env) -> None:  # noqa: ANN001
    """A trainer running vLLM in-process gets its own thresholds back at shutdown."""
    monkeypatch, calls, vllm_config, executor = engine_env
    gc.set_threshold(900, 11, 12)  # the trainer's own choice
    client = _inproc_client(monkeypatch, vllm_config, executor, **ENGINE_GC)
    assert gc.get_threshold() == (50_000, 20, 100)
    client.shutdown()  # InprocClient.shutdown -> the real EngineCore.shutdown
    assert gc.get_threshold() == (900, 11, 12)
    client.shutdown()  # idempotent
    assert gc.get_threshold() == (900, 11, 12)

    # A second engine in the same process gets the thresholds again (worker too).
    client = _inproc_client(monkeypatch, vllm_config, executor, **ENGINE_GC)
    assert gc.get_threshold() == (50_000, 20, 100)
    client.shutdown()
    assert gc.get_threshold() == (900, 11, 12)


def test_shutdown_of_one_engine_keeps_thresholds_for_a_live_one(engine_env) -> None:  # noqa: ANN001
    monkeypatch, calls, vllm_config, executor = engine_env
    first = _inproc_client(monkeypatch, vllm_config, executor, **ENGINE_GC)
    second = _inproc_client(monkeypatch, vllm_config, executor, **ENGINE_GC)
    first.shutdown()
    first.engine_core.shutdown()  # a second shutdown of the same engine counts once
    assert gc.get_threshold() == (50_000, 20, 100)
    second.shutdown()
    assert gc.get_threshold() == (700, 10, 10)


def test_engine_built_before_the_overlay_does_not_restore_under_a_live_one(engine_env) -> None:  # noqa: ANN001
    """Only engines whose freeze set the thresholds count at shutdown.

    The first engine is upstream's (overlay off when it was built); the second applies
    engine_gc through the plugin. Shutting the first down (through our shutdown wrapper,
    in force by then) must leave the second engine's thresholds alone.
    """
    monkeypatch, calls, vllm_config, executor = engine_env
    before = _inproc_client(monkeypatch, vllm_config, executor, PRIME_R3="0")
    assert gc.get_threshold() == (700, 10, 10)
    counted = _inproc_client(monkeypatch, vllm_config, executor, **ENGINE_GC)
    assert gc.get_threshold() == (50_000, 20, 100)
    before.shutdown()
    assert gc.get_threshold() == (50_000, 20, 100)
    counted.shutdown()
    assert gc.get_threshold() == (700, 10, 10)


def test_shutdown_called_through_the_class_counts_that_engine(engine_env) -> None:  # noqa: ANN001
    """``EngineCore.shutdown(engine)`` works as upstream's function does and counts once."""
    from vllm.v1.engine.core import EngineCore

    monkeypatch, calls, vllm_config, executor = engine_env
    client = _inproc_client(monkeypatch, vllm_config, executor, **ENGINE_GC)
    EngineCore.shutdown(client.engine_core)
    assert gc.get_threshold() == (700, 10, 10)
    client.engine_core.shutdown()  # the same engine again, bound this time: counted once
    assert gc.get_threshold() == (700, 10, 10)


def test_thresholds_changed_by_the_user_after_init_are_kept_at_shutdown(engine_env) -> None:  # noqa: ANN001
    monkeypatch, calls, vllm_config, executor = engine_env
    client = _inproc_client(monkeypatch, vllm_config, executor, **ENGINE_GC)
    gc.set_threshold(3000, 7, 8)  # the user's later choice wins over our restore
    client.shutdown()
    assert gc.get_threshold() == (3000, 7, 8)


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
