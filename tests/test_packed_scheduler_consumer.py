"""A scheduler that overrides ``update_from_output`` never receives a packed step.

The packed step (``packed_outputs``) and its unfilled form (``batched_take``) were
verified against one consumer: vLLM's own ``Scheduler.update_from_output``, which hands
``model_runner_output.aux_output_connector_output`` to ``take_output`` and reads it no
other way. A scheduler class configured through vLLM's ``scheduler_cls`` (a plugin, a
custom scheduler) that overrides ``update_from_output`` may read the step itself: with
msgspec, for one, which reads a dict's storage directly and sees an unfilled step as
``{}``. EngineCore therefore declares the packed format only for a scheduler whose
``update_from_output`` is upstream's (``prime_r3.fixes.packed_outputs``), so such a
subclass gets upstream's plain dict, as with the overlay off.

On the installed release's real code: the bench's simulator (vLLM's real ``Scheduler``
built by ``SchedulerConfig.get_scheduler_cls()`` as EngineCore builds it, the real
scheduler and worker connectors, vLLM's ``MessageQueue`` between them; only the model is
simulated), with every patch applied vs the overlay off.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import functools  # noqa: E402
import logging  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import msgspec  # noqa: E402
import pytest  # noqa: E402

import prime_r3  # noqa: E402
from prime_r3.bench import vllm_setup  # noqa: E402
from prime_r3.bench.loop import Simulator  # noqa: E402
from prime_r3.bench.workload import BenchConfig  # noqa: E402
from tests.test_packed_consumers import _numpy_hook  # noqa: E402

STEPS = 40


def _config(async_scheduling: bool) -> BenchConfig:
    return BenchConfig(
        concurrency=24, steps=STEPS, warmup=0, layers=2, topk=2, experts=8,
        prefix_len=16, problem_len=12, samples_per_prompt=2, max_tokens=24, min_tokens=2,
        max_num_batched_tokens=128, kv_fraction=1.0, async_scheduling=async_scheduling,
        seed=3,
    )  # fmt: skip


def _overriding(base: type, seen: list[Any]) -> type:
    """A scheduler class of the kind a plugin configures: ``update_from_output``
    overridden, reading the step output itself (here: msgspec, as a custom consumer
    might ship it elsewhere) before upstream's code runs."""

    class Overriding(base):  # type: ignore[misc, valid-type]
        def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
            aux = model_runner_output.aux_output_connector_output
            if aux is not None:
                seen.append(
                    (type(aux), len(aux), msgspec.msgpack.encode(aux, enc_hook=_numpy_hook))
                )
            return super().update_from_output(scheduler_output, model_runner_output)

    return Overriding


def _not_overriding(base: type, seen: list[Any]) -> type:
    """A subclass that keeps upstream's ``update_from_output`` (it changes scheduling
    only): the consumer is upstream's, so steps still go packed."""

    class Scheduling(base):  # type: ignore[misc, valid-type]
        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            seen.append("schedule")
            return super().schedule(*args, **kwargs)

    return Scheduling


def _run(
    async_scheduling: bool,
    make_cls: Callable[[type, list[Any]], type] | None,
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[list[Any], dict[str, Any], type]:
    """STEPS engine steps; returns what the scheduler class saw, every finished
    request's rows digest, and the class EngineCore's config resolved."""
    seen: list[Any] = []
    build = vllm_setup.build_vllm_config

    def configured(cfg: BenchConfig, r3: bool) -> Any:
        config = build(cfg, r3)
        if make_cls is not None:  # as --scheduler-cls / a plugin sets it
            base = config.scheduler_config.get_scheduler_cls()
            config.scheduler_config.scheduler_cls = make_cls(base, seen)
        return config

    with monkeypatch.context() as patch:
        patch.setattr(vllm_setup, "build_vllm_config", configured)
        # vLLM loads its general plugins (prime_r3) while building a config: the test
        # decides what is applied, not the plugin.
        patch.setenv("PRIME_R3", "0")
        sim = Simulator(_config(async_scheduling), r3=True)
    try:
        for _ in range(STEPS):
            sim.step()
        digests = {r: (sha, rows) for r, (sha, _, rows) in sim.finished.items()}
        return seen, digests, type(sim.scheduler)
    finally:
        sim.close()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record)


def _counters() -> dict[str, Any]:
    from prime_r3.fixes import batched_take, packed_outputs

    return {
        "take": batched_take.COUNTERS.snapshot(),
        "handshake": packed_outputs.COUNTERS.snapshot(),
    }


def _reset_counters() -> None:
    from prime_r3.fixes import batched_take, packed_outputs

    batched_take.COUNTERS.reset()
    packed_outputs.COUNTERS.reset()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_overriding_scheduler_gets_upstreams_dict(
    async_scheduling: bool, reverted: pytest.MonkeyPatch
) -> None:
    """Every step it receives is a plain dict whose msgspec encoding is the overlay-off
    one, and the rows every request finishes with are upstream's. Failed before the
    consumer check: it received unfilled ``PackedAuxOutputs`` that msgspec encoded as
    ``{}``."""
    expected, expected_rows, cls = _run(async_scheduling, _overriding, reverted)
    assert cls.__name__ == "Overriding"
    assert len(expected) > STEPS // 2 and {t for t, _, _ in expected} == {dict}
    report = prime_r3.apply(log=False)
    assert {"packed_outputs", "batched_take", "batched_commit"} <= set(report.applied)
    _reset_counters()
    from prime_r3.fixes import packed_outputs

    reverted.setattr(packed_outputs, "_logged", set())  # a fresh process's record
    records = _Records()  # on prime_r3's logger: vLLM's may or may not propagate to root
    logger = logging.getLogger("vllm.prime_r3")
    logger.addHandler(records)
    try:
        got, got_rows, _ = _run(async_scheduling, _overriding, reverted)
    finally:
        logger.removeHandler(records)
    assert [t for t, _, _ in got] == [dict] * len(expected)
    assert got == expected  # same sizes and msgspec bytes, step by step
    assert got_rows == expected_rows
    counts = _counters()
    assert counts["handshake"]["declared_steps"] == 0
    assert counts["handshake"]["withheld_reasons"] == {
        "update_from_output": counts["handshake"]["withheld_steps"]
    }
    assert counts["handshake"]["withheld_steps"] >= len(got)
    assert counts["take"]["fast_requests"] == 0  # nothing packed reached take_output
    warnings = [r.getMessage() for r in records.seen if "update_from_output" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once per process and class, not per step
    assert "Overriding" in warnings[0] and "dict" in warnings[0]


@pytest.mark.parametrize("subclass", [False, True])
def test_upstreams_scheduler_still_gets_packed_steps(
    subclass: bool, reverted: pytest.MonkeyPatch
) -> None:
    """vLLM's own scheduler class (``Scheduler`` or ``AsyncScheduler``, whichever the
    config resolves), or a subclass that keeps its ``update_from_output``: every step is
    declared, arrives packed and unfilled, and batched_take serves its requests by slice;
    rows as with the overlay off."""
    from vllm.v1.core.sched.scheduler import Scheduler

    make = _not_overriding if subclass else None
    _, expected_rows, cls = _run(True, make, reverted)
    assert issubclass(cls, Scheduler) and (cls.__name__ == "Scheduling") is subclass
    prime_r3.apply(log=False)
    _reset_counters()
    seen, got_rows, _ = _run(True, make, reverted)
    assert got_rows == expected_rows
    counts = _counters()
    assert counts["handshake"]["withheld_steps"] == 0, counts
    assert counts["handshake"]["declared_steps"] > STEPS // 2
    assert counts["take"]["batched_steps"] > STEPS // 2  # packed, unfilled steps read
    assert counts["take"]["fast_requests"] > 10 * STEPS
    assert counts["take"]["fallback_reasons"].get("not_packed", 0) == 0
    assert (len(seen) > STEPS // 2) is subclass


def test_an_instance_or_foreign_layer_on_update_from_output_withholds(
    reverted: pytest.MonkeyPatch,
) -> None:
    """The consumer is what EngineCore calls: an instance attribute, or another layer's
    wrapper of ``Scheduler.update_from_output`` (``functools.wraps`` copies its names,
    identity does not), is not upstream's function."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.__dict__["update_from_output"]

    @functools.wraps(original)
    def layered(self: Any, *args: Any, **kwargs: Any) -> Any:
        return original(self, *args, **kwargs)

    prime_r3.apply(log=False)
    reverted.setattr(Scheduler, "update_from_output", layered)
    _reset_counters()
    _run(False, None, reverted)
    counts = _counters()
    assert counts["handshake"]["declared_steps"] == 0, counts
    assert counts["handshake"]["withheld_reasons"].keys() == {"update_from_output"}
    reverted.setattr(Scheduler, "update_from_output", original)
    _reset_counters()  # the layer gone, upstream's function is found and verified again
    _run(False, None, reverted)
    counts = _counters()
    assert counts["handshake"]["withheld_steps"] == 0 and counts["handshake"]["declared_steps"]

    def instance_level(base: type, seen: list[Any]) -> type:
        class Patched(base):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self.update_from_output = functools.partial(base.update_from_output, self)

        return Patched

    _reset_counters()
    _run(False, instance_level, reverted)
    counts = _counters()
    assert counts["handshake"]["declared_steps"] == 0, counts
    assert counts["handshake"]["withheld_reasons"].keys() == {"update_from_output"}


def test_a_consumer_changed_between_steps_is_seen_at_the_next_step(
    reverted: pytest.MonkeyPatch,
) -> None:
    """The scheduler is found once, then each step checks its consumer by identity: a
    layer put on ``Scheduler.update_from_output``, or an instance attribute, after steps
    were declared withholds from the next step on; removed, the next step is declared."""
    import types

    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler

    from prime_r3.packed import FORMAT_VERSION, READS_MARK
    from tests.test_packed_outputs import real_vllm

    if not hasattr(SchedulerOutput, "make_empty"):
        pytest.skip("no SchedulerOutput.make_empty on this release")
    scheduler = real_vllm().scheduler
    empty = SchedulerOutput.make_empty()

    def build(self: Any) -> Any:  # as Scheduler.schedule calls it, from its own method
        return self.aux_output_connector.build_connector_meta(empty, {})

    step = types.MethodType(build, scheduler)
    prime_r3.apply(["packed_outputs"], log=False)
    assert getattr(step(), READS_MARK) == FORMAT_VERSION
    original = Scheduler.__dict__["update_from_output"]

    @functools.wraps(original)
    def layered(self: Any, *args: Any, **kwargs: Any) -> Any:
        return original(self, *args, **kwargs)

    reverted.setattr(Scheduler, "update_from_output", layered)
    assert not hasattr(step(), READS_MARK)
    reverted.setattr(Scheduler, "update_from_output", original)
    assert getattr(step(), READS_MARK) == FORMAT_VERSION
    bound = functools.partial(original, scheduler)
    reverted.setattr(scheduler, "update_from_output", bound, raising=False)
    assert not hasattr(step(), READS_MARK)
    reverted.delattr(scheduler, "update_from_output")
    assert getattr(step(), READS_MARK) == FORMAT_VERSION


def test_two_engines_stepping_on_two_threads_each_get_their_own_schedulers_judgement(
    reverted: pytest.MonkeyPatch,
) -> None:
    """Two in-process engines in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), each
    stepping on its own thread: engine A's scheduler is upstream's, engine B's overrides
    ``update_from_output``. The declaration caches one (connector, scheduler) pair; a
    thread switch between A's check of the cached connector and its read of the cached
    scheduler, while B's step replaces the pair, judged A's step by B's scheduler (and
    B's by A's: a packed step for the overriding consumer). Here the switch is made
    deterministic: a line tracer runs B's step at the start of the line where A reads
    the cached scheduler, as the interpreter may switch threads there (failed before: A
    withheld, and B declared; a free-running two-thread loop did both, 3 + 3 times in
    400,000 steps)."""
    import linecache
    import sys
    import types

    from vllm.v1.core.sched.output import SchedulerOutput

    from prime_r3.fixes import packed_outputs
    from prime_r3.packed import FORMAT_VERSION, READS_MARK
    from tests.test_packed_outputs import real_vllm

    if not hasattr(SchedulerOutput, "make_empty"):
        pytest.skip("no SchedulerOutput.make_empty on this release")
    real = real_vllm()
    engine_a = real.scheduler
    engine_b = vllm_setup.build_scheduler(real.vllm_config, real.kv_cache_config)
    assert engine_a is not engine_b
    engine_b.__class__ = _overriding(type(engine_b), [])  # its consumer is its own
    empty = SchedulerOutput.make_empty()

    def build(self: Any) -> Any:  # as Scheduler.schedule calls it, from its own method
        return self.aux_output_connector.build_connector_meta(empty, {})

    step_a, step_b = types.MethodType(build, engine_a), types.MethodType(build, engine_b)
    prime_r3.apply(["packed_outputs"], log=False)
    code = packed_outputs._declare_packed_reader.__code__

    def interleaved(first: Any, other: Any) -> Any:
        """``first``'s step, with ``other``'s step run where ``first`` reads the cached
        scheduler (``first``'s pair cached before); returns ``first``'s declaration."""
        first()  # caches first's (connector, scheduler)
        switched: list[bool] = []

        def at_line(frame: Any, event: str, arg: Any) -> Any:
            if event == "line" and not switched:
                line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
                if "= cached[" in line and "]()" in line:  # reads the cached consumer
                    switched.append(True)
                    other()  # the other engine steps "on its thread"
            return at_line

        def on_call(frame: Any, event: str, arg: Any) -> Any:
            if frame.f_code.co_name == "consumer_withholds" and (
                frame.f_code.co_filename == code.co_filename
            ):
                return at_line
            return None

        sys.settrace(on_call)
        try:
            declared = getattr(first(), READS_MARK, None)
        finally:
            sys.settrace(None)
        assert switched, "the cached scheduler was not read: the test reached nothing"
        return declared

    assert interleaved(step_a, step_b) == FORMAT_VERSION, "A's step judged by B's scheduler"
    assert interleaved(step_b, step_a) is None, "B's overriding consumer was declared to"
    assert getattr(step_a(), READS_MARK) == FORMAT_VERSION and not hasattr(step_b(), READS_MARK)


class _Stop(BaseException):
    """Ends an engine step once its metadata is built (not an ``Exception``: EngineCore's
    ``log_error_detail`` would dump it)."""


class _Executor:
    """The model executor's one call the step makes before the model runs: keeps the
    step's ``SchedulerOutput`` (what EngineCore sends the workers) and ends the step."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        self.sent.append(scheduler_output)
        raise _Stop


def _fresh_scheduler() -> Any:
    """vLLM's real Scheduler (its real connector), built as EngineCore builds it, holding
    the handshake test's three requests."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from prime_r3.bench.loop import _block_hasher
    from tests.test_packed_handshake import PROMPTS
    from tests.test_packed_outputs import real_vllm

    real = real_vllm()
    scheduler = vllm_setup.build_scheduler(real.vllm_config, real.kv_cache_config)
    hasher = _block_hasher(real.vllm_config, real.kv_cache_config)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    for k, (request_id, length) in enumerate(PROMPTS.items()):
        tokens = [100 * (k + 1) + t for t in range(length)]
        scheduler.add_request(Request(request_id, tokens, params, None, block_hasher=hasher))
    return scheduler


def _engine(engine_cls: type, scheduler: Any) -> Any:
    """An engine of ``engine_cls`` (vLLM's ``EngineCore`` or a subclass) holding the
    attributes its step methods read up to ``execute_model``; its constructor would load
    a model, so it is not run."""
    import collections

    engine = engine_cls.__new__(engine_cls)
    engine.scheduler = scheduler
    engine.model_executor = _Executor()
    engine.batch_queue = collections.deque()
    engine.batch_queue_size = 2
    return engine


def _engine_step(engine: Any, method: str) -> Any:
    """One step of ``engine`` through ``method`` (vLLM's step code, or an override),
    ended at ``execute_model``; then what the real worker connector makes of the
    metadata sent: the step output's type (``PackedAuxOutputs`` only when declared)."""
    from tests.test_packed_handshake import _worker_step

    with pytest.raises(_Stop):
        getattr(engine, method)()
    sent = engine.model_executor.sent[-1]
    output = _worker_step(sent.aux_output_connector_metadata, dict(sent.num_scheduled_tokens))
    return type(output)


def _overriding_step(base: type, method: str) -> type:
    """An EngineCore subclass whose ``method`` reads the model output before its
    scheduler (here it only calls upstream's: what it could read is the point)."""

    def override(self: Any) -> Any:
        return getattr(super(cls, self), method)()

    cls = type("OverridingEngine", (base,), {method: override})
    return cls


def _count_searches(reverted: pytest.MonkeyPatch) -> list[Any]:
    """Every stack search the handshake makes from now on (``_consumer_of``'s results,
    in order), for tests asserting it searches once and then uses its cache."""
    from prime_r3.fixes import packed_outputs

    searches: list[Any] = []
    search = packed_outputs._consumer_of

    def counted(connector: Any, frame: Any) -> Any:
        searches.append(search(connector, frame))
        return searches[-1]

    reverted.setattr(packed_outputs, "_consumer_of", counted)
    return searches


@pytest.mark.parametrize("method", ["step", "step_with_batch_queue"])
@pytest.mark.parametrize(
    "variant", ["upstream", "class override", "instance attribute", "other method overridden"]
)
def test_the_engine_step_on_the_path_is_judged(
    method: str, variant: str, reverted: pytest.MonkeyPatch
) -> None:
    """vLLM's own ``EngineCore.step`` / ``step_with_batch_queue`` with vLLM's Scheduler:
    declared, the worker packs, and the consumer is found on the stack once, then each
    step takes the cached identity checks. An EngineCore subclass (or an instance)
    overriding the step method that calls ``schedule`` may read
    ``model_output.aux_output_connector_output`` before the scheduler: withheld
    (``engine_step``), the worker sends upstream's dict (failed before: the scheduler
    alone was judged, so it was declared to). Overriding the other step method, not on
    this engine's path, keeps the packed path."""
    from vllm.v1.engine.core import EngineCore

    from prime_r3.fixes import packed_outputs
    from prime_r3.packed import PackedAuxOutputs

    other = "step_with_batch_queue" if method == "step" else "step"
    engine_cls = {
        "upstream": EngineCore,
        "class override": _overriding_step(EngineCore, method),
        "instance attribute": EngineCore,
        "other method overridden": _overriding_step(EngineCore, other),
    }[variant]
    engine = _engine(engine_cls, _fresh_scheduler())
    if variant == "instance attribute":
        engine.__dict__[method] = functools.partial(getattr(EngineCore, method), engine)
    prime_r3.apply(["packed_outputs"], log=False)
    _reset_counters()
    searches = _count_searches(reverted)
    packed = variant in ("upstream", "other method overridden")
    assert _engine_step(engine, method) is (PackedAuxOutputs if packed else dict)
    for _ in range(2):
        with pytest.raises(_Stop):
            getattr(engine, method)()
    counts = packed_outputs.COUNTERS.snapshot()
    if packed:
        assert counts == {"declared_steps": 3, "withheld_steps": 0, "withheld_reasons": {}}
    else:
        assert counts["declared_steps"] == 0, counts
        assert counts["withheld_reasons"] == {"engine_step": 3}, counts
    assert len(searches) == 1 and searches[0][0] is engine  # found once, then cached
    assert searches[0][1] == method


def test_a_delegating_scheduler_is_judged_by_its_own_consumer(
    reverted: pytest.MonkeyPatch,
) -> None:
    """A ``scheduler_cls`` that delegates ``schedule()`` to an inner vLLM ``Scheduler``
    (which builds the step and holds the connector) but consumes the output with its own
    ``update_from_output``: EngineCore hands the output to the outer one, so the step is
    withheld (failed before: the nearest scheduler frame, the inner one, was judged and
    the step declared). The same outer class delegating the consumer too is upstream's
    chain and stays packed."""
    from vllm.v1.engine.core import EngineCore

    from prime_r3.fixes import packed_outputs
    from prime_r3.packed import PackedAuxOutputs

    class Delegating:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def has_requests(self) -> bool:
            return self.inner.has_requests()

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            return self.inner.schedule(*args, **kwargs)

        def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
            return self.inner.update_from_output(scheduler_output, model_runner_output)

    prime_r3.apply(["packed_outputs"], log=False)
    _reset_counters()
    engine = _engine(EngineCore, Delegating(_fresh_scheduler()))
    assert _engine_step(engine, "step") is dict
    counts = packed_outputs.COUNTERS.snapshot()
    assert counts["withheld_reasons"] == {"update_from_output": 1}, counts
    # The engine's scheduler is what it calls: the inner one, unwrapped, is upstream's.
    engine = _engine(EngineCore, engine.scheduler.inner)
    assert _engine_step(engine, "step") is PackedAuxOutputs


def test_a_function_of_its_own_stepping_an_upstream_engine_withholds(
    reverted: pytest.MonkeyPatch,
) -> None:
    """The engine's class is vLLM's, but the frame calling ``schedule`` runs code of its
    own that happens to be named ``step`` (it then gets the model output itself): it is
    not vLLM's ``EngineCore.step``, so the step is withheld (``engine_step``)."""
    from vllm.v1.engine.core import EngineCore

    from prime_r3.fixes import packed_outputs

    def step(engine: Any) -> Any:
        return engine.model_executor.execute_model(engine.scheduler.schedule(), non_block=True)

    engine = _engine(EngineCore, _fresh_scheduler())
    engine.custom_step = functools.partial(step, engine)
    prime_r3.apply(["packed_outputs"], log=False)
    _reset_counters()
    assert _engine_step(engine, "custom_step") is dict
    assert packed_outputs.COUNTERS.snapshot()["withheld_reasons"] == {"engine_step": 1}


def test_a_helper_whose_first_parameter_is_not_self_is_still_judged(
    reverted: pytest.MonkeyPatch,
) -> None:
    """No engine on the stack: a custom scheduler (overriding ``update_from_output``)
    building its metadata from a helper whose first parameter is ``sched`` is found
    by its first argument, whatever its name, and withheld (failed before: no scheduler
    found, the step was judged by ``take_output`` alone and declared)."""
    from vllm.v1.core.sched.output import SchedulerOutput

    from prime_r3.fixes import packed_outputs
    from prime_r3.packed import READS_MARK

    if not hasattr(SchedulerOutput, "make_empty"):
        pytest.skip("no SchedulerOutput.make_empty on this release")
    scheduler = _fresh_scheduler()
    scheduler.__class__ = _overriding(type(scheduler), [])
    empty = SchedulerOutput.make_empty()

    def helper(sched: Any) -> Any:
        return sched.aux_output_connector.build_connector_meta(empty, {})

    prime_r3.apply(["packed_outputs"], log=False)
    _reset_counters()
    assert not hasattr(helper(scheduler), READS_MARK)
    assert packed_outputs.COUNTERS.snapshot()["withheld_reasons"] == {"update_from_output": 1}


def test_a_caller_whose_first_argument_cannot_be_inspected_does_not_break_the_step(
    reverted: pytest.MonkeyPatch,
) -> None:
    """The stack search reads each caller's first argument (``isinstance``, ``vars``);
    a driver's frame may hold one that raises there (a dead ``weakref.proxy`` raises
    ``ReferenceError``). That caller is not the engine or scheduler: it is skipped and
    the step is judged as with no such frame, never an error out of
    ``build_connector_meta`` that upstream would not raise (failed before: the
    ``ReferenceError`` reached the caller of ``schedule``)."""
    import weakref

    from vllm.v1.core.sched.output import SchedulerOutput

    from prime_r3.fixes import packed_outputs
    from prime_r3.packed import FORMAT_VERSION, READS_MARK

    if not hasattr(SchedulerOutput, "make_empty"):
        pytest.skip("no SchedulerOutput.make_empty on this release")
    scheduler = _fresh_scheduler()
    empty = SchedulerOutput.make_empty()

    class Handle:
        pass

    handle = Handle()
    dead = weakref.proxy(handle)
    del handle

    def driver(gone: Any) -> Any:  # its first argument: a proxy whose referent is gone
        return scheduler.aux_output_connector.build_connector_meta(empty, {})

    prime_r3.apply(["packed_outputs"], log=False)
    _reset_counters()
    assert getattr(driver(dead), READS_MARK) == FORMAT_VERSION
    assert packed_outputs.COUNTERS.snapshot()["declared_steps"] == 1


@pytest.mark.parametrize("consumer", ["scheduler", "engine"])
def test_a_subclass_holding_the_function_a_layer_replaced_is_withheld(
    consumer: str, reverted: pytest.MonkeyPatch
) -> None:
    """One check judges the engine's step method and the scheduler's
    ``update_from_output``: the object's class must resolve the name to the function
    vLLM's class holds *now*, verified as upstream's. A subclass holding upstream's
    function itself in its own dict (``update_from_output = Scheduler.update_from_output``)
    is declared; once another layer replaces vLLM's class attribute, it is withheld from
    the next step on, as it is when the layer came before the first step: the answer does
    not depend on whether a step was verified before the layer came. Restored, declared
    again. Failed before for ``scheduler``: its per-step fast path compared with the
    function verified at the first step and kept declaring (the engine's check read the
    class attribute at each step, so ``engine`` passed before and fails on a merge that
    gives both the scheduler's former fast path)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    from prime_r3.fixes import packed_outputs
    from prime_r3.packed import PackedAuxOutputs

    owner, name, reason = {
        "scheduler": (Scheduler, "update_from_output", "update_from_output"),
        "engine": (EngineCore, "step", "engine_step"),
    }[consumer]
    original = owner.__dict__[name]

    @functools.wraps(original)
    def layered(self: Any, *args: Any, **kwargs: Any) -> Any:
        return original(self, *args, **kwargs)

    scheduler = _fresh_scheduler()
    if consumer == "scheduler":
        scheduler.__class__ = type("Holding", (type(scheduler),), {name: original})
        engine = _engine(EngineCore, scheduler)
    else:
        engine = _engine(type("Holding", (EngineCore,), {name: original}), scheduler)
    prime_r3.apply(["packed_outputs"], log=False)
    _reset_counters()
    assert _engine_step(engine, "step") is PackedAuxOutputs  # its function is upstream's
    reverted.setattr(owner, name, layered)
    assert _engine_step(engine, "step") is dict
    assert _engine_step(engine, "step") is dict
    reverted.setattr(owner, name, original)
    assert _engine_step(engine, "step") is PackedAuxOutputs
    counts = packed_outputs.COUNTERS.snapshot()
    assert counts["declared_steps"] == 2 and counts["withheld_reasons"] == {reason: 2}, counts
    # The layer in place before any step of a fresh declaration: the same answer.
    prime_r3.revert()
    reverted.setattr(owner, name, layered)
    prime_r3.apply(["packed_outputs"], log=False)
    _reset_counters()
    assert _engine_step(engine, "step") is dict
    assert packed_outputs.COUNTERS.snapshot()["withheld_reasons"] == {reason: 1}


@pytest.mark.parametrize("first", ["step", "step_with_batch_queue"])
def test_a_loop_driving_both_step_methods_is_judged_by_the_one_on_the_path(
    first: str, reverted: pytest.MonkeyPatch
) -> None:
    """vLLM fixes ``step_fn`` once, but a custom loop may drive both step methods of an
    engine whose class overrides only ``step_with_batch_queue`` (the override then runs
    vLLM's own code through ``super()``): a step built from vLLM's ``step`` is declared,
    one built from the override is withheld, whichever ran first. The engine is found on
    the stack once per switch of method, not once per step (failed before: the method
    found at the first search was cached and judged every later step, so the override's
    steps were declared after a first ``step``, or ``step``'s withheld after a first
    ``step_with_batch_queue``)."""
    from vllm.v1.engine.core import EngineCore

    from prime_r3.fixes import packed_outputs
    from prime_r3.packed import PackedAuxOutputs

    engine = _engine(_overriding_step(EngineCore, "step_with_batch_queue"), _fresh_scheduler())
    prime_r3.apply(["packed_outputs"], log=False)
    _reset_counters()
    searches = _count_searches(reverted)
    other = "step_with_batch_queue" if first == "step" else "step"
    expected = {"step": PackedAuxOutputs, "step_with_batch_queue": dict}
    order = [first, first, other, other, first]
    assert [_engine_step(engine, m) for m in order] == [expected[m] for m in order]
    counts = packed_outputs.COUNTERS.snapshot()
    withheld = order.count("step_with_batch_queue")
    assert counts["declared_steps"] == len(order) - withheld, counts
    assert counts["withheld_reasons"] == {"engine_step": withheld}, counts
    assert [s[1] for s in searches] == [first, other, first]  # once per switch
    assert all(s[0] is engine for s in searches)


def test_batched_takes_wrapper_is_unwrapped_once_not_per_step(
    reverted: pytest.MonkeyPatch,
) -> None:
    """With ``batched_take`` in force the connector's ``take_output`` is our wrapper, not
    upstream's function, so the declaration finds what lies under it: once per class
    attribute, not at every step (failed before: ``unwrap_ours`` and ``getattr_static``
    ran on every step, ~4 us of the ~4.5 us the declaration cost per step). A foreign
    layer put on top afterwards is still seen at the next step, and its removal too."""
    import inspect
    import sys

    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector
    from vllm.v1.engine.core import EngineCore

    from prime_r3 import state
    from prime_r3.fixes import packed_outputs
    from prime_r3.packed import PackedAuxOutputs

    engine = _engine(EngineCore, _fresh_scheduler())
    for name in ("packed_outputs", "batched_take"):
        assert prime_r3.apply([name], log=False).outcome(name).state == "applied"
    ours = AuxOutputSchedulerConnector.__dict__["take_output"]
    assert state.is_object_patched(ours)
    _reset_counters()
    assert _engine_step(engine, "step") is PackedAuxOutputs
    walks: list[str] = []
    unwrap = state.unwrap_ours

    def counted(obj: Any) -> Any:
        walks.append(sys._getframe(1).f_code.co_filename)
        return unwrap(obj)

    reverted.setattr(state, "unwrap_ours", counted)
    for _ in range(3):
        assert _engine_step(engine, "step") is PackedAuxOutputs
    assert inspect.getsourcefile(packed_outputs) not in walks, walks
    assert packed_outputs.COUNTERS.snapshot()["declared_steps"] == 4

    @functools.wraps(ours)
    def foreign(self: Any, request: Any, output: Any) -> Any:
        return ours(self, request, output)

    # Put back by hand (not monkeypatch, which would undo after the fixture's revert and
    # so reinstall our wrapper behind prime_r3's back).
    AuxOutputSchedulerConnector.take_output = foreign
    try:
        assert _engine_step(engine, "step") is dict
    finally:
        AuxOutputSchedulerConnector.take_output = ours
    assert _engine_step(engine, "step") is PackedAuxOutputs
    assert packed_outputs.COUNTERS.snapshot()["withheld_reasons"] == {"take_output": 1}


def test_the_cached_engine_frame_keeps_no_code_alive(reverted: pytest.MonkeyPatch) -> None:
    """The declaration caches where the engine's frame was and the code it ran, so a
    later step checks with one frame read. An engine class made at run time (a plugin
    building one per config) whose own ``step`` calls ``schedule``: withheld, and once
    the class and its engine are gone, the cache must not keep that ``step``'s code
    alive, as upstream keeps nothing (failed before: the code was held strongly)."""
    import gc
    import weakref

    from vllm.v1.engine.core import EngineCore

    from prime_r3.fixes import packed_outputs

    namespace: dict[str, Any] = {"EngineCore": EngineCore, "_Stop": _Stop}
    exec(  # a fresh code object, owned by this class alone
        "class MadeEngine(EngineCore):\n"
        "    def step(self):\n"
        "        self.scheduler.schedule()\n"
        "        raise _Stop\n",
        namespace,
    )
    made = namespace.pop("MadeEngine")
    code = weakref.ref(made.__dict__["step"].__code__)
    engine = _engine(made, _fresh_scheduler())
    prime_r3.apply(["packed_outputs"], log=False)
    _reset_counters()
    for _ in range(2):
        with pytest.raises(_Stop):
            engine.step()
    counts = packed_outputs.COUNTERS.snapshot()
    assert counts["withheld_reasons"] == {"engine_step": 2}, counts
    del engine, made, namespace
    gc.collect()
    assert code() is None, "the handshake's cache keeps a dead engine class's step code"


def test_the_take_output_verdict_keeps_no_connector_class_alive(
    reverted: pytest.MonkeyPatch,
) -> None:
    """The declaration keeps its verdict on ``take_output`` by the class attribute's
    identity. A scheduler connector class made at run time (a plugin building one per
    config) whose own ``take_output`` calls upstream's through ``super()``: withheld, and
    once its scheduler, engine and class are gone, the cache must not keep that
    ``take_output`` alive (nor, through its ``__class__`` cell, the class), as upstream
    keeps nothing (review finding: the verdict held the attribute strongly)."""
    import gc
    import weakref

    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector
    from vllm.v1.engine.core import EngineCore

    from prime_r3.fixes import packed_outputs

    namespace: dict[str, Any] = {"Base": AuxOutputSchedulerConnector}
    exec(  # a fresh function, owned by this class alone
        "class MadeConnector(Base):\n"
        "    def take_output(self, request, output):\n"
        "        return super().take_output(request, output)\n",
        namespace,
    )
    made = namespace.pop("MadeConnector")
    function = weakref.ref(made.__dict__["take_output"])
    cls_ref = weakref.ref(made)
    scheduler = _fresh_scheduler()
    scheduler.aux_output_connector.__class__ = made
    engine = _engine(EngineCore, scheduler)
    prime_r3.apply(["packed_outputs"], log=False)
    _reset_counters()
    for _ in range(2):
        with pytest.raises(_Stop):
            engine.step()
    counts = packed_outputs.COUNTERS.snapshot()
    assert counts["withheld_reasons"] == {"take_output": 2}, counts
    del engine, scheduler, made, namespace
    gc.collect()
    assert function() is None, "the take_output verdict keeps a dead class's take_output"
    assert cls_ref() is None


def test_the_consumer_check_keeps_no_removed_foreign_layer_alive(
    reverted: pytest.MonkeyPatch,
) -> None:
    """``_vllm_method`` compares vLLM's class attribute with the one it last verified. A
    foreign layer put on ``Scheduler.update_from_output`` (withheld while there) and then
    removed, with no step after: the check must not keep that layer alive, as upstream
    keeps nothing (review finding: the last verified attribute was held strongly)."""
    import gc
    import weakref

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    from prime_r3.fixes import packed_outputs

    original = Scheduler.__dict__["update_from_output"]

    def foreign(self: Any, *args: Any, **kwargs: Any) -> Any:
        return original(self, *args, **kwargs)

    layer_ref = weakref.ref(foreign)
    engine = _engine(EngineCore, _fresh_scheduler())
    prime_r3.apply(["packed_outputs"], log=False)
    _reset_counters()
    Scheduler.update_from_output = foreign
    try:
        with pytest.raises(_Stop):
            engine.step()
    finally:
        Scheduler.update_from_output = original
    counts = packed_outputs.COUNTERS.snapshot()
    assert counts["withheld_reasons"] == {"update_from_output": 1}, counts
    del foreign, engine
    gc.collect()
    assert layer_ref() is None, "the consumer check keeps a removed foreign layer alive"


class _Payload:
    """A stand-in for whatever a driver's frame holds (a step's outputs, a batch)."""


def _drive(scheduler: Any) -> None:
    scheduler.schedule()


@pytest.mark.xfail(
    strict=True,
    reason="review finding, not fixed: with no EngineCore on the stack the consumer "
    "search reads frame.f_locals of up to 16 callers; on Python 3.11 that stores a "
    "snapshot dict of each frame's locals on the frame, so a long-lived caller's "
    "locals at the first step stay referenced until that frame ends (upstream keeps "
    "nothing). vLLM's own engine path stops at EngineCore.step (short-lived frames); "
    "a fix needs a locals read that leaves no snapshot (none in 3.11 short of clearing "
    "the frame's dict, unsafe under a trace function).",
)
def test_the_consumer_search_keeps_no_callers_locals_alive(
    reverted: pytest.MonkeyPatch,
) -> None:
    """A driver of its own (the bench's simulator, a test) calling ``schedule`` with no
    engine: an object its long-lived frame held at the first step and then dropped must
    be freed, as with the overlay off."""
    import gc
    import weakref

    scheduler = _fresh_scheduler()
    prime_r3.apply(["packed_outputs"], log=False)
    payload = _Payload()
    payload_ref = weakref.ref(payload)
    _drive(scheduler)  # the first step: the consumer is searched on the stack
    del payload
    gc.collect()
    assert payload_ref() is None, "a caller frame's locals snapshot keeps the payload alive"


def test_an_engine_driving_a_scheduler_first_driven_without_one_is_judged(
    reverted: pytest.MonkeyPatch,
) -> None:
    """A scheduler first stepped by a driver of its own (declared: its consumer is the
    scheduler), then by an EngineCore whose own ``step`` overrides vLLM's: that engine's
    steps are withheld (``engine_step``), as when it builds the first step (review
    finding; failed before: the scheduler was cached with no check of its driver)."""
    from vllm.v1.engine.core import EngineCore

    from prime_r3.fixes import packed_outputs

    scheduler = _fresh_scheduler()
    prime_r3.apply(["packed_outputs"], log=False)
    _reset_counters()
    _drive(scheduler)
    assert packed_outputs.COUNTERS.snapshot()["declared_steps"] == 1
    engine = _engine(_overriding_step(EngineCore, "step"), scheduler)
    assert _engine_step(engine, "step") is dict
    assert packed_outputs.COUNTERS.snapshot()["withheld_reasons"] == {"engine_step": 1}


def test_metadata_that_takes_no_attribute_withholds(reverted: pytest.MonkeyPatch) -> None:
    """A release (or a wrapper) whose connector metadata is frozen or slotted cannot carry
    the declaration: the step is withheld (``metadata``) and the engine runs on with
    upstream's dict, as it would without the overlay."""
    import dataclasses

    from vllm.distributed.aux_output_connector import connector as connector_module
    from vllm.v1.engine.core import EngineCore

    from prime_r3.fixes import packed_outputs

    upstream = connector_module.AuxOutputConnectorMetadata
    fields = {f.name: f.type for f in dataclasses.fields(upstream)}
    frozen = dataclasses.make_dataclass("AuxOutputConnectorMetadata", fields, frozen=True)
    reverted.setattr(connector_module, "AuxOutputConnectorMetadata", frozen)
    engine = _engine(EngineCore, _fresh_scheduler())
    prime_r3.apply(["packed_outputs"], log=False)
    _reset_counters()
    assert _engine_step(engine, "step") is dict
    assert packed_outputs.COUNTERS.snapshot()["withheld_reasons"] == {"metadata": 1}
