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


def _worker_node(head_env: dict[str, str], own_env: dict[str, str], queue: Any) -> None:
    """A child of the head that starts with its own PRIME_R3* values and gets the head's
    environment as RayExecutorV2 gives it (``setdefault``); reports the GC thresholds."""
    import gc

    for var in list(os.environ):
        if var.startswith("PRIME_R3"):
            del os.environ[var]
    os.environ.update(own_env)
    try:
        for key, value in head_env.items():  # RayExecutorV2's RayWorkerProc.initialize_worker
            os.environ.setdefault(key, value)
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


def _run_worker_node(head_env: dict[str, str]) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(
        target=_worker_node,
        args=(head_env, {"VLLM_TARGET_DEVICE": "cpu", **NODE_OWN}, queue),
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


def test_vllm_ray_copy_list_carries_prime_r3_and_keeps_the_users_prefixes(head) -> None:  # noqa: ANN001
    from vllm.ray.ray_env import get_env_vars_to_copy

    names = get_env_vars_to_copy(destination="workers")  # vLLM's real list builder
    assert {"PRIME_R3_ENGINE_GC_THRESHOLDS", "PRIME_R3_PATCHES", "PRIME_R3_FROM_HEAD"} <= names
    assert "MYLIB_FLAG" in names  # the user's extra prefix still works
    assert os.environ["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"] == "MYLIB_,PRIME_R3"
    from prime_r3 import plugin

    plugin.load()  # loading again (another process of the tree) adds nothing twice
    assert os.environ["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"] == "MYLIB_,PRIME_R3"


def test_process_on_the_heads_machine_keeps_its_own_settings(head) -> None:  # noqa: ANN001
    """A child the user starts with other PRIME_R3* values on the same machine means it."""
    from vllm.v1.executor.ray_env_utils import get_driver_env_vars

    driver_env = get_driver_env_vars(worker_specific_vars=set())
    result = _run_worker_node(driver_env)
    assert result == {"patched": True, "thresholds": [1111, 1, 1]}
