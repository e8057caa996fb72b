"""The entry point reaches fresh processes exactly as vLLM's EngineCore and workers load it."""

from __future__ import annotations

import importlib.metadata
import multiprocessing
import os
import sys
from typing import Any

import pytest


def _child(env: dict[str, str], queue: Any) -> None:
    """Runs in a fresh spawned interpreter: only what vLLM itself would do."""
    for var in list(os.environ):
        if var.startswith("PRIME_R3"):
            del os.environ[var]
    os.environ.update(env)
    try:
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        imported_by_load = "vllm.v1.worker.gpu_worker" in sys.modules
        import vllm.v1.engine.core as core
        import vllm.v1.worker.gpu_worker as gpu_worker

        import prime_r3

        queue.put(
            {
                "imported_by_load": imported_by_load,
                "engine_core": prime_r3.is_object_patched(core.freeze_gc_heap),
                "worker": prime_r3.is_object_patched(gpu_worker.freeze_gc_heap),
                "states": {o.name: o.state for o in prime_r3.status().outcomes},
                "reasons": {o.name: o.reason for o in prime_r3.status().outcomes},
            }
        )
    except BaseException as error:  # noqa: BLE001 - report to the parent
        queue.put({"error": f"{type(error).__name__}: {error}"})


def _run_spawned(env: dict[str, str]) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(env, queue))
    proc.start()
    result = queue.get(timeout=300)
    proc.join(60)
    return result


def test_entry_point_is_registered() -> None:
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.value == "prime_r3.plugin:load" for ep in eps)


@pytest.mark.parametrize("start_method", ["spawn"])
def test_load_general_plugins_in_a_spawned_process_applies_patches(start_method: str) -> None:
    result = _run_spawned({"VLLM_TARGET_DEVICE": "cpu"})
    assert "error" not in result, result
    assert result["engine_core"] and result["worker"]
    # Installed in the two modules imported here; the API-server target waits for its module.
    assert result["states"]["engine_gc"] == "pending_import"
    assert result["reasons"]["engine_gc"] == (
        "waits for import of vllm.entrypoints.launchers.utils.server_utils"
    )
    # Loading the plugin must not import the worker module (it starts helper processes):
    # its targets are installed when vLLM imports it.
    assert result["imported_by_load"] is False


def test_spawned_process_honours_prime_r3_off() -> None:
    result = _run_spawned({"VLLM_TARGET_DEVICE": "cpu", "PRIME_R3": "0"})
    assert "error" not in result, result
    assert not result["engine_core"] and not result["worker"]
    assert set(result["states"].values()) == {"disabled"}


def test_spawned_process_with_bad_env_refuses_to_start() -> None:
    result = _run_spawned({"VLLM_TARGET_DEVICE": "cpu", "PRIME_R3_PATCHES": "engine_gcc"})
    assert result.get("error", "").startswith("ConfigError: PRIME_R3_PATCHES='engine_gcc'")


# -- Ray workers: vLLM's real env-copy code carries the head's settings ---------------
#
# Ray is not installed here (and need not run): the head side runs vLLM's real
# functions that build a worker's environment (``get_env_vars_to_copy`` for the legacy
# executor and the Ray DP EngineCore actors, ``get_driver_env_vars`` for RayExecutorV2);
# the worker side is a fresh spawned process with a "node" environment of its own that
# receives that environment the way each executor applies it (the legacy executor via
# the real ``WorkerWrapperBase.update_environment_variables``, V2 with ``setdefault``
# as ``RayWorkerProc.initialize_worker`` does, checked in the release's source) and then
# loads the plugins as vLLM's worker init does.

HEAD_THRESHOLDS = "40000,15,90"
NODE_OWN = {"PRIME_R3_ENGINE_GC_THRESHOLDS": "1111,1,1"}


def _worker_node(
    head_env: dict[str, str], own_env: dict[str, str], mode: str, machine: str, queue: Any
) -> None:
    """A worker process on a node with its own environment; reports the applied GC thresholds."""
    import gc

    for var in list(os.environ):
        if var.startswith("PRIME_R3"):
            del os.environ[var]
    os.environ.update(own_env)
    try:
        if mode == "overwrite":  # legacy RayDistributedExecutor: update_environment_variables
            from vllm.v1.worker.worker_base import WorkerWrapperBase

            WorkerWrapperBase(rpc_rank=0).update_environment_variables([head_env])
        elif mode == "setdefault":  # RayExecutorV2: RayWorkerProc.initialize_worker
            for key, value in head_env.items():
                os.environ.setdefault(key, value)
        import prime_r3.config

        if machine != "same":
            prime_r3.config.machine_id = lambda: machine  # type: ignore[assignment]
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        import vllm.v1.engine.core as core

        import prime_r3

        gc.freeze = lambda: None  # type: ignore[assignment]  # keep this heap unfrozen
        core.freeze_gc_heap()  # what EngineCore / the worker call after startup
        queue.put(
            {
                "patched": prime_r3.is_object_patched(core.freeze_gc_heap),
                "thresholds": list(gc.get_threshold()),
            }
        )
    except BaseException as error:  # noqa: BLE001 - report to the parent
        queue.put({"error": f"{type(error).__name__}: {error}"})


def _run_worker_node(head_env: dict[str, str], mode: str, machine: str) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(
        target=_worker_node,
        args=(head_env, {"VLLM_TARGET_DEVICE": "cpu", **NODE_OWN}, mode, machine, queue),
    )
    proc.start()
    result = queue.get(timeout=300)
    proc.join(60)
    assert "error" not in result, result
    return result


@pytest.fixture
def head(reverted: pytest.MonkeyPatch):  # noqa: ANN201
    """This process as the head: the user's settings, then the plugin loaded."""
    import vllm.envs as envs

    from prime_r3 import config, plugin

    envs.disable_envs_cache()  # vLLM reads the prefix list lazily until EngineCore's init
    reverted.delenv(config.HEAD_VAR, raising=False)
    reverted.setenv(config.RAY_PREFIXES_VAR, "MYLIB_")  # the user's own extra prefix
    reverted.setenv("MYLIB_FLAG", "1")
    reverted.setenv("PRIME_R3_ENGINE_GC_THRESHOLDS", HEAD_THRESHOLDS)
    reverted.setenv("PRIME_R3_PATCHES", "engine_gc")
    plugin.load()
    return reverted


def _legacy_copy() -> dict[str, str]:
    """The env the legacy RayDistributedExecutor sends each worker (0.31/0.32)."""
    from vllm.platforms import current_platform
    from vllm.ray.ray_env import get_env_vars_to_copy
    from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS

    names = get_env_vars_to_copy(
        exclude_vars=WORKER_SPECIFIC_ENV_VARS,
        additional_vars=set(current_platform.additional_env_vars),
        destination="workers",
    )
    return {name: os.environ[name] for name in names if name in os.environ}


def test_vllm_ray_copy_list_carries_prime_r3_and_keeps_the_users_prefixes(head) -> None:  # noqa: ANN001
    from vllm.ray.ray_env import get_env_vars_to_copy

    names = get_env_vars_to_copy(destination="workers")  # vLLM's real list builder
    assert {"PRIME_R3_ENGINE_GC_THRESHOLDS", "PRIME_R3_PATCHES", "PRIME_R3_FROM_HEAD"} <= names
    assert "MYLIB_FLAG" in names  # the user's extra prefix still works
    assert os.environ["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"] == "MYLIB_,PRIME_R3"
    from prime_r3 import plugin

    plugin.load()  # loading again (another process of the tree) adds nothing twice
    assert os.environ["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"] == "MYLIB_,PRIME_R3"


def _legacy_executor_source() -> str | None:
    from prime_r3 import fingerprint

    try:
        return fingerprint.file_source("vllm.v1.executor.ray_executor")
    except fingerprint.SourceUnavailable:
        return None


def test_legacy_ray_executor_worker_on_another_node_runs_the_heads_settings(head) -> None:  # noqa: ANN001
    """0.31/0.32's default Ray executor: copied by prefix, worker's own value overwritten."""
    import vllm

    source = _legacy_executor_source()
    # 0.33 removed the legacy executor (RayExecutorV2 is the only Ray backend there).
    assert (source is not None) == (vllm.__version__ in ("0.31.0", "0.32.0")), vllm.__version__
    if source is None:
        pytest.skip(f"vllm {vllm.__version__} has no legacy Ray executor")
    # How that release builds and sends each worker's environment.
    assert "get_env_vars_to_copy(" in source and '"update_environment_variables"' in source
    result = _run_worker_node(_legacy_copy(), "overwrite", "another-machine")
    assert result == {"patched": True, "thresholds": [40000, 15, 90]}


def test_ray_v2_worker_on_another_node_runs_the_heads_settings(head) -> None:  # noqa: ANN001
    """RayExecutorV2 copies everything with setdefault: the node's own value would win."""
    from vllm.v1.executor.ray_env_utils import get_driver_env_vars
    from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS

    from prime_r3 import fingerprint

    init = fingerprint.segment(
        fingerprint.file_source("vllm.v1.executor.ray_executor_v2"),
        "RayWorkerProc.initialize_worker",
    )
    assert "os.environ.setdefault(key, value)" in init  # how every release applies it
    driver_env = get_driver_env_vars(worker_specific_vars=WORKER_SPECIFIC_ENV_VARS)
    result = _run_worker_node(driver_env, "setdefault", "another-machine")
    assert result == {"patched": True, "thresholds": [40000, 15, 90]}


def test_process_on_the_heads_machine_keeps_its_own_settings(head) -> None:  # noqa: ANN001
    """A child the user starts with other PRIME_R3* values on the same machine means it."""
    from vllm.v1.executor.ray_env_utils import get_driver_env_vars

    driver_env = get_driver_env_vars(worker_specific_vars=set())
    result = _run_worker_node(driver_env, "setdefault", "same")
    assert result == {"patched": True, "thresholds": [1111, 1, 1]}
