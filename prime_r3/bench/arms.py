"""Arms and the process runner: each arm runs in its own spawned process, one at a time.

A fresh spawned interpreter per arm means no patch, GC threshold or frozen heap can
leak from one arm into the next, and the arms do not fight over the (few) cores.
The overlay is configured through the environment before vLLM is imported -- vLLM's
plugin loader applies prime_r3 from ``PRIME_R3``/``PRIME_R3_PATCHES`` -- and then
``prime_r3.apply(names=...)`` makes sure the requested patches really are active.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prime_r3.bench.workload import BenchConfig

_PROGRESS_EVERY = 10


@dataclass(frozen=True)
class Arm:
    """One configuration to measure: R3 on/off and which prime_r3 patches are active."""

    name: str
    r3: bool
    #: ``None``: the overlay is off (upstream vLLM); otherwise the patch names applied.
    patches: tuple[str, ...] | None = None


#: The A/A arm: r3_prime again, in its own process and place in the round. It cannot
#: differ from r3_prime, so its reading is the spread of the measurement itself.
AGAIN = "r3_prime_again"


def default_arms(
    registry_names: Sequence[str],
    per_patch: Sequence[str] = (),
    left_out: Sequence[str] = (),
    again: bool = False,
) -> list[Arm]:
    """R3 off, R3 on upstream, R3 on with every patch (and, with ``again``, the A/A arm),
    then one arm per requested patch alone (``r3_prime[NAME]``: its share over upstream),
    then one arm per patch left out of the rest (``r3_prime[-NAME]``: its share inside
    r3_prime; a patch that only acts with another, as batched_take with packed_outputs,
    shows its share only here)."""
    arms = [
        Arm("r3_off", r3=False),
        Arm("r3_upstream", r3=True),
        Arm("r3_prime", r3=True, patches=tuple(registry_names)),
    ]
    if again:
        arms.append(Arm(AGAIN, r3=True, patches=tuple(registry_names)))
    arms += [Arm(f"r3_prime[{name}]", r3=True, patches=(name,)) for name in per_patch]
    arms += [
        Arm(f"r3_prime[-{name}]", r3=True, patches=tuple(n for n in registry_names if n != name))
        for name in left_out
    ]
    return arms


class _NoKernelsNote(logging.Filter):
    """Drop vLLM's "Failed to import from vllm._C" warning from the arms' output.

    The simulator runs none of vLLM's compiled kernels (there is no model), and the CPU
    torch build here has none to load, so the warning, printed once per spawned arm,
    says nothing about the measurement.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to import from vllm._C" not in record.getMessage()


def _child(arm: Arm, cfg: BenchConfig, out: Any, gate: Any = None, slices: int = 0) -> None:
    """Spawned entry point: configure the overlay, run the loop, send the result.

    With a ``gate`` (interleaved runs), the measured window is cut into ``slices``: before
    the window and before each further slice the child says so (``"turn"``) and waits on
    the gate until the parent gives it its turn."""
    for name in ("vllm.platforms.interface", "vllm.platforms.cpu"):
        logging.getLogger(name).addFilter(_NoKernelsNote())
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ["PRIME_R3"] = "1" if arm.patches else "0"
    if arm.patches:
        os.environ["PRIME_R3_PATCHES"] = ",".join(arm.patches)
    else:
        os.environ.pop("PRIME_R3_PATCHES", None)
    try:
        import prime_r3
        from prime_r3 import layer
        from prime_r3.bench import loop

        _settle_imports()
        if arm.patches:
            prime_r3.apply(names=arm.patches, log=False)
        active = _active(layer)
        expected = set(arm.patches or ())
        if set(active) != expected:
            raise RuntimeError(f"arm {arm.name}: active patches {active}, expected {expected}")

        def progress(step: int) -> None:
            if (step + 1) % _PROGRESS_EVERY == 0:
                out.put(("progress", _PROGRESS_EVERY))

        before_step = None
        if gate is not None:
            starts = set(slice_starts(cfg, slices))

            def before_step(step: int) -> None:
                if step in starts:
                    out.put(("turn", step))
                    gate.acquire()

        result = loop.run(cfg, arm.r3, progress, before_step)
        result["active_patches"] = active
        out.put(("done", result))
    except BaseException:  # noqa: BLE001 - report to the parent instead of dying silently
        out.put(("failed", traceback.format_exc()))
    # Everything the arm owns is closed by now (store thread, queue, shared memory).
    # Skip interpreter teardown: native extensions vLLM loads print leak reports there.
    out.close()
    out.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _settle_imports() -> None:
    """Import what a vLLM worker imports, and wait for the helper builds it spawns.

    Importing ``vllm.v1.worker.gpu_worker`` (where engine_gc's worker target lives) starts
    short-lived helper processes (kernel-launcher builds); an arm that imported it would
    share the cores with them while it is measured. Every arm imports it first and waits,
    so all arms start equal and engine_gc's worker target is installed as in a worker.
    """
    import threading

    import vllm.v1.worker.gpu_worker  # noqa: F401

    for thread in threading.enumerate():
        if thread.name.endswith("bg-build-reaper"):
            thread.join(timeout=300)


def _active(layer: Any) -> list[str]:
    """Patches in force here: fully applied, or applied to every module imported so far
    (engine_gc's API-server target waits for a module the simulator never imports)."""
    states = (layer.APPLIED, layer.PENDING)
    return [o.name for o in layer.status().outcomes if o.state in states]


def run_arms(
    arms: Sequence[Arm],
    cfg: BenchConfig,
    on_progress: Callable[[Arm, int], None] | None = None,
    timeout: float = 3600.0,
) -> dict[str, dict[str, Any]]:
    """Run each arm in a fresh spawned process, sequentially; return results by arm name."""
    ctx = mp.get_context("spawn")
    results: dict[str, dict[str, Any]] = {}
    for arm in arms:
        out = ctx.Queue()
        proc = ctx.Process(target=_child, args=(arm, cfg, out), name=f"prime-r3-bench-{arm.name}")
        proc.start()
        try:
            found = _collect(arm, proc, out, on_progress, timeout)
            if found is None:  # only an interleaved run's children wait for turns
                found = {"error": "arm waited for a turn outside --slices"}
            results[arm.name] = found
        finally:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
            out.close()
    return results


def slice_starts(cfg: BenchConfig, slices: int) -> list[int]:
    """The first step of each slice of the measured window (``slices`` near-equal parts)."""
    return [cfg.warmup + (cfg.steps * k) // slices for k in range(slices)]


def run_interleaved(
    arms: Sequence[Arm],
    cfg: BenchConfig,
    slices: int,
    on_progress: Callable[[Arm, int], None] | None = None,
    timeout: float = 3600.0,
    target: Callable[..., None] = _child,
) -> dict[str, dict[str, Any]]:
    """Every arm in its own spawned process at once, taking turns slice by slice.

    All arms warm up (side by side), then measure one at a time: slice ``k`` of the window
    runs arm after arm, the order rotated by one per slice. Arms run the same seeded
    workload, so slice ``k`` of two arms is the same stretch of steps, seconds apart: the
    pairs the effect table compares. Each arm still has its own interpreter, so nothing
    leaks between arms; only one steps at a time. ``target(arm, cfg, out, gate, slices)``
    is the child's entry point (``_child``; tests give a stand-in speaking its protocol).
    """
    ctx = mp.get_context("spawn")
    procs: dict[str, tuple[Any, Any, Any]] = {}
    results: dict[str, dict[str, Any]] = {}
    finished = False
    try:
        for arm in arms:
            out, gate = ctx.Queue(), ctx.Semaphore(0)
            proc = ctx.Process(
                target=target,
                args=(arm, cfg, out, gate, slices),
                name=f"prime-r3-bench-{arm.name}",
            )
            proc.start()
            procs[arm.name] = (proc, out, gate)

        def at_turn(arm: Arm) -> bool:
            """Whether ``arm`` stands at a slice's start; if it ended instead (an error, or
            its last slice), its result is recorded."""
            proc, out, _ = procs[arm.name]
            found = _collect(arm, proc, out, on_progress, timeout)
            if found is not None:
                results[arm.name] = found
            return found is None

        waiting = [arm for arm in arms if at_turn(arm)]  # standing at a slice's start
        for k in range(slices):
            order = waiting[k % len(waiting) :] + waiting[: k % len(waiting)] if waiting else []
            for arm in order:
                procs[arm.name][2].release()
                if not at_turn(arm) and arm in waiting:
                    waiting.remove(arm)
        finished = True
    finally:
        for proc, out, _ in procs.values():
            proc.join(timeout=30 if finished else 0)  # interrupted: children wait at a gate
            if proc.is_alive():
                proc.kill()
                proc.join()
            out.close()
    return results


def _collect(
    arm: Arm,
    proc: Any,
    out: Any,
    on_progress: Callable[[Arm, int], None] | None,
    timeout: float,
) -> dict[str, Any] | None:
    """The arm's result (or its error), or None when it stands at a slice's start and
    waits for its turn (interleaved runs)."""
    waited = 0.0
    while True:
        try:
            kind, payload = out.get(timeout=1.0)
        except queue.Empty:
            waited += 1.0
            if not proc.is_alive():
                return {"error": f"arm process exited with code {proc.exitcode}"}
            if waited > timeout:
                return {"error": f"arm timed out after {timeout:.0f} s"}
            continue
        if kind == "turn":
            return None
        if kind == "progress":
            if on_progress is not None:
                on_progress(arm, payload)
        elif kind == "done":
            return payload
        else:
            return {"error": payload}
