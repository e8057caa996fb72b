"""engine_gc: raise the GC thresholds right after vLLM freezes its startup heap.

vLLM (0.31-0.33) calls ``freeze_gc_heap()`` at the end of ``EngineCore.__init__`` and
of the worker's warm-up but keeps CPython's thresholds (700, 10, 10), so router
replay's per-step churn triggers a collection every few steps.

Replaces ``freeze_gc_heap`` where its callers look it up (each module imports it with
``from ... import``): ``vllm.v1.engine.core``, ``vllm.v1.worker.gpu_worker`` and the
API server's ``server_utils``; and ``EngineCore.shutdown``. Anchors: the callers
(``EngineCore.__init__``, ``Worker.compile_or_warm_up_model``, on 0.33 also
``Worker._compile_or_warm_up_model``, ``lifespan``) must still freeze where verified.
The CPU worker (``CPUWorker``) overrides warm-up without a freeze, so in a vLLM CPU
worker process (``VllmWorker-<rank>`` on the CPU platform) the patch is reported skipped
with that reason (``_no_effect_here``) rather than installed there for nothing.

Each wrapper calls upstream's function first, with the same arguments, and returns its
result; what it adds:

* EngineCore's freeze: ``gc.set_threshold(*thresholds)``, and the engine whose
  ``__init__`` is calling (the nearest of ``_MAX_FRAMES`` calling frames whose ``self``
  is an ``EngineCore``; read, never written, held weakly) is recorded. A freeze no
  engine is found for is counted as unattributed and keeps the thresholds until
  ``revert()``.
* the worker's freeze: the thresholds, the first time in the process only.
* the API server's freeze: the thresholds only with ``PRIME_R3_ENGINE_GC_API_SERVER=1``
  (default: CPython's; the measurement is in scripts/README.md).
* ``EngineCore.shutdown``: upstream's shutdown (its ``gc.unfreeze()`` undoes the freeze),
  then, also if it raised, a recorded engine is dropped once; when no recorded engine
  and no unattributed freeze is left (the last in-process engine,
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the thresholds found before the first change
  are put back, unless the live ones are no longer the ones we set (the user changed
  them since: theirs stay). ``revert()`` restores the same way.

Why the result equals upstream's: the frozen heap, the objects alive and every
function's result are upstream's; only when collections run differs, which is the
fix. No freeze of our own is added (upstream freezes on every warm-up; a second freeze
would pin request-scoped objects forever). An engine built before the overlay was
applied never froze through us, so its shutdown restores nothing; an engine whose
``__init__`` fails after its freeze keeps the thresholds, as upstream keeps its frozen
heap.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import sys
import weakref
from collections.abc import Mapping
from typing import Any

from prime_r3.config import C_INT_MAX, parse_bool, parse_int_tuple
from prime_r3.spec import Anchor, Param, PatchSpec, Process, Target, WrapperFn

logger = logging.getLogger("vllm.prime_r3")

DEFAULT_THRESHOLDS = (50_000, 20, 100)

# Per process: thresholds before we first changed them (restored on revert and when
# the last EngineCore shuts down), the ones we set, whether the worker already got its
# thresholds (set once per process), the live EngineCores whose freeze set them (weak:
# never kept alive by us), and freezes from callers we could not attribute to an engine.
_saved_thresholds: tuple[int, int, int] | None = None
_set_by_us: tuple[int, ...] | None = None
_worker_done = False
_engines: weakref.WeakSet[Any] = weakref.WeakSet()
_unattributed = 0
#: How far up from the freeze wrapper EngineCore.__init__'s frame may be (it is the
#: direct caller in every supported release).
_MAX_FRAMES = 4


def _set_thresholds(thresholds: tuple[int, ...], where: str) -> None:
    global _saved_thresholds, _set_by_us
    if _saved_thresholds is None:
        _saved_thresholds = gc.get_threshold()
    gc.set_threshold(*thresholds)
    _set_by_us = tuple(thresholds)
    logger.debug("prime_r3 engine_gc: %s gc thresholds %s", where, thresholds)


def _calling_engine(engine_class: type) -> Any:
    """The EngineCore whose code is running the freeze (its ``__init__``), else None."""
    frame = sys._getframe(2)  # our wrapper's caller's caller: wrapt adds no Python frame
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, engine_class):
            return candidate
        frame = frame.f_back
    return None


def _engine_core(params: Mapping[str, Any]) -> WrapperFn:
    from vllm.v1.engine.core import EngineCore  # imports vLLM: only when applying

    thresholds = params["thresholds"]

    def after_engine_freeze(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        global _unattributed
        result = wrapped(*args, **kwargs)
        engine = _calling_engine(EngineCore)
        _set_thresholds(thresholds, "EngineCore")
        if engine is not None:
            _engines.add(engine)
        else:
            _unattributed += 1
        return result

    return after_engine_freeze


def _engine_core_shutdown(params: Mapping[str, Any]) -> WrapperFn:
    def restore_after_shutdown(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        """Upstream's shutdown, then the thresholds back, as upstream unfreezes its heap.

        Only an engine whose freeze set them counts (once, however often it is shut
        down); the thresholds go back when no such engine is left and no freeze we
        could not attribute set them.
        """
        # Called through the class (``EngineCore.shutdown(engine)``), wrapt passes no
        # instance: the engine is then the first argument, as for upstream's function.
        engine = args[0] if instance is None and args else instance
        try:
            return wrapped(*args, **kwargs)
        finally:
            if engine is not None and engine in _engines:
                _engines.discard(engine)
                if not _engines and not _unattributed:
                    _restore_thresholds()

    return restore_after_shutdown


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


def _no_effect_here() -> str | None:
    """A vLLM CPU worker process never freezes its heap, so the thresholds would never be set.

    vLLM's ``MultiprocExecutor`` names its worker processes ``VllmWorker-<rank>``; on the
    CPU platform their worker is ``CPUWorker``, whose ``compile_or_warm_up_model``
    replaces ``Worker``'s and calls no ``freeze_gc_heap`` (0.31-0.33). EngineCore and the
    API server are other processes (and an in-process engine's process is not a
    ``VllmWorker``), so the patch still applies there. Not seen by this check: a Ray
    worker on CPU (an actor, not a ``VllmWorker``; reported applied though CPUWorker never
    freezes) and a custom ``worker_cls`` on CPU (reported skipped even if it freezes).
    """
    if not multiprocessing.current_process().name.startswith("VllmWorker-"):
        return None
    platforms = sys.modules.get("vllm.platforms")
    platform = getattr(platforms, "current_platform", None) if platforms else None
    if platform is None or not platform.is_cpu():
        return None
    return (
        "no effect in a vLLM CPU worker: CPUWorker.compile_or_warm_up_model never calls "
        "freeze_gc_heap, after which engine_gc sets its thresholds"
    )


def _restore_thresholds() -> None:
    """Put back the thresholds found before we set ours, unless someone changed them since."""
    global _saved_thresholds, _set_by_us, _worker_done, _unattributed
    if _saved_thresholds is not None and gc.get_threshold() == _set_by_us:
        gc.set_threshold(*_saved_thresholds)
        logger.debug("prime_r3 engine_gc: gc thresholds restored to %s", _saved_thresholds)
    _saved_thresholds = None
    _set_by_us = None
    _worker_done = False
    _engines.clear()
    _unattributed = 0


# Verified source fingerprints (scripts/fingerprint.py) for vLLM 0.31.0, 0.32.0, 0.33.0.
_FREEZE_GC_HEAP = frozenset({"1d7588fe2805731a"})
_ENGINE_CORE_INIT = frozenset({"776cc0fd8c339734", "701c2d37f74c33d6", "642d0d7022c2d490"})
_WORKER_WARM_UP = frozenset({"35945994940de9b5", "1489248a0da2619f", "855a911e315f7d0f"})
# 0.33 moved the warm-up body, and its freeze, into this method (only 0.33 has it).
_WORKER_WARM_UP_BODY = frozenset({"9c01be2e9a61f7f4"})
_LIFESPAN = frozenset({"82e7ccf721d101b4"})
_ENGINE_CORE_SHUTDOWN = frozenset({"02dc398505e70746"})

SPEC = PatchSpec(
    name="engine_gc",
    summary="GC thresholds (50000, 20, 100) after vLLM's heap freeze in EngineCore and workers",
    vllm_range=">=0.31,<0.34",
    processes=frozenset({Process.ENGINE_CORE, Process.WORKER}),
    targets=(
        Target("vllm.v1.engine.core", "freeze_gc_heap", _FREEZE_GC_HEAP, _engine_core),
        Target(
            "vllm.v1.engine.core",
            "EngineCore.shutdown",
            _ENGINE_CORE_SHUTDOWN,
            _engine_core_shutdown,
        ),
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
        Anchor(
            "vllm.v1.worker.gpu_worker",
            "Worker._compile_or_warm_up_model",
            _WORKER_WARM_UP_BODY,
            releases=">=0.33",
        ),
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
    no_effect_here=_no_effect_here,
)
