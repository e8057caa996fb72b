"""engine_gc: raise GC thresholds after vLLM freezes its startup heap.

vLLM (0.31-0.33) calls ``freeze_gc_heap()`` at the end of ``EngineCore.__init__``
and of ``Worker.compile_or_warm_up_model`` but keeps CPython's default thresholds
(700, 10, 10), so the per-step churn of router replay triggers a collection every
few steps. We wrap ``freeze_gc_heap`` *where those modules look it up* (it is
imported with ``from ... import``) and set the thresholds right after upstream's
freeze. We add no freeze of our own: upstream already freezes on every warm-up,
and a second freeze would pin request-scoped objects forever.

The API server (``lifespan`` in ``server_utils``) keeps the defaults unless
``PRIME_R3_ENGINE_GC_API_SERVER=1``: see README for the measurement behind that.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Mapping
from typing import Any

from prime_r3.config import C_INT_MAX, parse_bool, parse_int_tuple
from prime_r3.spec import Anchor, Param, PatchSpec, Process, Target, WrapperFn

logger = logging.getLogger("vllm.prime_r3")

DEFAULT_THRESHOLDS = (50_000, 20, 100)

# Per process: thresholds before we first changed them (restored on revert), and
# whether the worker already got its thresholds (set once per process).
_saved_thresholds: tuple[int, int, int] | None = None
_worker_done = False


def _set_thresholds(thresholds: tuple[int, ...], where: str) -> None:
    global _saved_thresholds
    if _saved_thresholds is None:
        _saved_thresholds = gc.get_threshold()
    gc.set_threshold(*thresholds)
    logger.debug("prime_r3 engine_gc: %s gc thresholds %s", where, thresholds)


def _engine_core(params: Mapping[str, Any]) -> WrapperFn:
    thresholds = params["thresholds"]

    def after_engine_freeze(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        result = wrapped(*args, **kwargs)
        _set_thresholds(thresholds, "EngineCore")
        return result

    return after_engine_freeze


def _worker(params: Mapping[str, Any]) -> WrapperFn:
    thresholds = params["thresholds"]

    def after_worker_freeze(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        global _worker_done
        result = wrapped(*args, **kwargs)  # upstream's own freeze; we add none
        if not _worker_done:
            _worker_done = True
            _set_thresholds(thresholds, "worker")
        return result

    return after_worker_freeze


def _api_server(params: Mapping[str, Any]) -> WrapperFn:
    thresholds = params["thresholds"]
    enabled = params["api_server"]

    def after_api_server_freeze(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        result = wrapped(*args, **kwargs)
        if enabled:
            _set_thresholds(thresholds, "API server")
        return result

    return after_api_server_freeze


def _restore_thresholds() -> None:
    global _saved_thresholds, _worker_done
    if _saved_thresholds is not None:
        gc.set_threshold(*_saved_thresholds)
    _saved_thresholds = None
    _worker_done = False


# Verified source fingerprints (scripts/fingerprint.py) for vLLM 0.31.0, 0.32.0, 0.33.0.
_FREEZE_GC_HEAP = frozenset({"1d7588fe2805731a"})
_ENGINE_CORE_INIT = frozenset({"776cc0fd8c339734", "701c2d37f74c33d6", "642d0d7022c2d490"})
_WORKER_WARM_UP = frozenset({"35945994940de9b5", "1489248a0da2619f", "855a911e315f7d0f"})
_LIFESPAN = frozenset({"82e7ccf721d101b4"})

SPEC = PatchSpec(
    name="engine_gc",
    summary="GC thresholds (50000, 20, 100) after vLLM's heap freeze in EngineCore and workers",
    vllm_range=">=0.31,<0.34",
    processes=frozenset({Process.ENGINE_CORE, Process.WORKER}),
    targets=(
        Target("vllm.v1.engine.core", "freeze_gc_heap", _FREEZE_GC_HEAP, _engine_core),
        Target("vllm.v1.worker.gpu_worker", "freeze_gc_heap", _FREEZE_GC_HEAP, _worker),
        Target(
            "vllm.entrypoints.launchers.utils.server_utils",
            "freeze_gc_heap",
            _FREEZE_GC_HEAP,
            _api_server,
        ),
    ),
    anchors=(
        # The callers must still freeze exactly where we expect.
        Anchor("vllm.v1.engine.core", "EngineCore.__init__", _ENGINE_CORE_INIT),
        Anchor("vllm.v1.worker.gpu_worker", "Worker.compile_or_warm_up_model", _WORKER_WARM_UP),
        Anchor("vllm.entrypoints.launchers.utils.server_utils", "lifespan", _LIFESPAN),
    ),
    params=(
        Param(
            "thresholds",
            DEFAULT_THRESHOLDS,
            parse_int_tuple(3, minimum=0, maximum=C_INT_MAX),
            "gc.set_threshold() values for EngineCore and workers",
            f"three integers in 0..{C_INT_MAX} (gc.set_threshold takes C ints), e.g. 50000,20,100",
        ),
        Param(
            "api_server",
            False,
            parse_bool,
            "also set the thresholds in the API server process",
            "a boolean (1/0, true/false, on/off, yes/no)",
        ),
    ),
    on_revert=_restore_thresholds,
)
