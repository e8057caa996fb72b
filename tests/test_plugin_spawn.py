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
