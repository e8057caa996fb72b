"""packed_outputs' handshake per step: what EngineCore's declaration adds to
``build_connector_meta`` once the consumer is cached.

    .venv/bin/python scripts/bench_handshake.py [--calls 20000] [--rounds 7]
        [--patches all|packed_outputs] [--against OLD_packed_outputs.py]

The wrapper (``declare_packed_reader``) is called ``--calls`` times in a row with
upstream's ``build_connector_meta`` replaced by a function returning one metadata
object, so only the handshake is timed: the connector's ``take_output``, the engine's
step method, its scheduler's ``update_from_output``, the mark. The callers are vLLM's
real code: ``engine step`` / ``engine batch queue`` call it from inside vLLM's own
``EngineCore.step`` / ``step_with_batch_queue`` (an ``EngineCore`` built without its
constructor, which would load a model, holding a scheduler of vLLM's ``Scheduler``
class whose ``schedule`` runs the timed loop), ``scheduler`` from a driver of its own
with no engine on the stack (as the bench's simulator). Every call must be declared
(checked). ``--patches`` is what is applied first: ``all`` (the default, as the
plugin applies them: batched_take's wrapper is then the connector's ``take_output``)
or a comma list (``packed_outputs``: upstream's bare ``take_output``). Timed as thread
CPU time (another process's load on a shared machine moves it little). Printed per
caller and arm: the median over ``--rounds`` of ns per call minus the same loop
calling a bare pass-through wrapper (also printed), and the first rounds' values.
``--against FILE`` (e.g. ``git show REV:prime_r3/fixes/packed_outputs.py > FILE``)
adds that file's wrapper as an arm, loaded under another name; arms alternate within
each round, so both see the same machine load, and the median of per-round
differences is printed too.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


class _Done(BaseException):
    """Ends the engine step once the timed loop ran inside it."""


def _wrapper_of(path: str | None) -> tuple[Callable[..., Any], Any]:
    """``declare_packed_reader`` (a fresh closure) and its module's COUNTERS."""
    if path is None:
        from prime_r3.fixes import packed_outputs as module
    else:
        spec = importlib.util.spec_from_file_location("_packed_outputs_against", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module._declare_packed_reader({}), module.COUNTERS


def _bare(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    return wrapped(*args, **kwargs)


def _timed(wrapper: Callable[..., Any], connector: Any, calls: int) -> float:
    """thread CPU ns per call of ``wrapper`` as wrapt calls it, ``calls`` in a row."""
    metadata = _METADATA

    def build() -> Any:
        return metadata

    start = time.thread_time_ns()
    for _ in range(calls):
        wrapper(build, connector, (), {})
    return (time.thread_time_ns() - start) / calls


class _Meta:
    """Stands in for the step's ``AuxOutputConnectorMetadata`` (takes the mark)."""


_METADATA = _Meta()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--against", default=None, help="another packed_outputs.py")
    parser.add_argument(
        "--patches",
        default="all",
        help="what prime_r3.apply applies first: all (batched_take wraps take_output), "
        "or a comma list (packed_outputs: take_output stays upstream's plain function)",
    )
    opts = parser.parse_args()
    if opts.calls < 1 or opts.rounds < 1:
        parser.error(f"--calls and --rounds must be >= 1 (got {opts.calls}, {opts.rounds})")

    import prime_r3

    # As the plugin applies them (all: batched_take wraps take_output); each applies
    # as vLLM's modules are imported.
    try:
        prime_r3.apply(None if opts.patches == "all" else opts.patches.split(","), log=False)
    except prime_r3.ConfigError as error:
        parser.error(f"--patches {opts.patches!r}: {error}")
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    applied = [o.name for o in prime_r3.status().outcomes if o.state == "applied"]

    arms: dict[str, tuple[Callable[..., Any], Any]] = {"current": _wrapper_of(None)}
    if opts.against:
        arms["against"] = _wrapper_of(opts.against)
    arms["bare"] = (_bare, None)
    results: dict[str, dict[str, list[float]]] = {}

    class TimingScheduler(Scheduler):  # vLLM's update_from_output: the packed chain
        def has_requests(self) -> bool:
            return True

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            run(self)
            raise _Done

    def run(scheduler: Any) -> None:
        """One round: every arm, alternating, from this caller's stack."""
        per = results.setdefault(caller, {arm: [] for arm in arms})
        for arm, (wrapper, counters) in arms.items():
            _timed(wrapper, scheduler.aux_output_connector, 200)  # found and cached
            before = counters.declared_steps if counters is not None else 0
            per[arm].append(_timed(wrapper, scheduler.aux_output_connector, opts.calls))
            if counters is not None and counters.declared_steps - before != opts.calls:
                raise SystemExit(f"{arm} did not declare every step: {counters.snapshot()}")

    def driver(scheduler: Any) -> None:  # no engine on the stack
        run(scheduler)

    for _ in range(opts.rounds):
        for caller in ("engine step", "engine batch queue", "scheduler"):
            # Fresh objects per caller: each arm finds its consumer again.
            scheduler = TimingScheduler.__new__(TimingScheduler)
            scheduler.aux_output_connector = AuxOutputSchedulerConnector.__new__(
                AuxOutputSchedulerConnector
            )
            engine = EngineCore.__new__(EngineCore)
            engine.scheduler = scheduler
            engine.batch_queue = []
            engine.batch_queue_size = 2
            if caller == "scheduler":
                driver(scheduler)
                continue
            try:
                (engine.step if caller == "engine step" else engine.step_with_batch_queue)()
            except _Done:
                pass

    print(f"applied: {', '.join(applied)}")
    print(f"ns per call over the bare wrapper ({opts.calls} calls, {opts.rounds} rounds)")
    for caller, per in results.items():
        bare = per["bare"]
        for arm, values in per.items():
            if arm == "bare":
                continue
            over = [v - b for v, b in zip(values, bare, strict=True)]
            print(
                f"  {caller:18s} {arm:8s} {statistics.median(over):7.1f}   "
                + " ".join(f"{v:.0f}" for v in over[:12])
                + (" ..." if len(over) > 12 else "")
            )
        if "against" in per:
            paired = [c - a for c, a in zip(per["current"], per["against"], strict=True)]
            print(
                f"  {caller:18s} {'current - against, paired per round':36s} "
                f"{statistics.median(paired):7.1f}"
            )
        print(f"  {caller:18s} {'bare':8s} {statistics.median(bare):7.1f} (the bare call)")


if __name__ == "__main__":
    main()
