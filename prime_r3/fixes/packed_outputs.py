"""packed_outputs: the output worker sends one ``PackedAuxOutputs`` per step, not a dict.

vLLM (0.31-0.33) returns ``dict[request_id, AuxRequestOutput]`` from
``AuxOutputWorkerConnector.process_output``; async_utils stores it in
``ModelRunnerOutput.aux_output_connector_output`` and the MessageQueue pickles one
array per running request, which EngineCore then rebuilds one object at a time.
We wrap ``process_output`` and hand on its dict as a ``PackedAuxOutputs``: the same
dict, whose pickled form is one rows array (see ``prime_r3.packed``). The wrapper also
hands pack the step's ``PendingAuxOutput`` fields (``StepRows``): rows that are views of
the step's snapshot are then copied with one slice or gather from it rather than
concatenated one small array at a time.

Handshake (who may send it): packing happens in the worker, reading in EngineCore,
possibly on another node with another prime_r3 (or none). EngineCore's
``build_connector_meta`` wrapper marks each step's ``AuxOutputConnectorMetadata``
(sent to workers inside ``SchedulerOutput``) with ``READS_MARK = FORMAT_VERSION``, a
plain int attribute, and only while the live scheduler connector's ``take_output`` is
upstream's plain function or ``batched_take``'s wrapper of exactly that function (not a
subclass's or an instance's override, nor another layer's wrapper), **and** the chain
that consumes the step is upstream's: the ``EngineCore`` building the step runs vLLM's
own ``step`` / ``step_with_batch_queue`` (whichever called ``schedule``), and the
scheduler it holds consumes the output with vLLM's own ``Scheduler.update_from_output``
(inherited through its class's MRO, as ``AsyncScheduler`` does; not a subclass's
override, an instance attribute or another layer's wrapper). Why the engine and the
scheduler too: the packed form, and the unfilled one ``batched_take`` reads, were
verified against upstream's chain, which hands the step to ``take_output`` only. An
overriding engine step or ``update_from_output`` may read the step itself (msgspec, for
one, reads a dict's storage directly and sees an unfilled step as ``{}``), so its
workers send upstream's dict: what it gets with the overlay off. The engine's
``scheduler`` is judged, not the scheduler frame nearest the connector: a
``scheduler_cls`` delegating ``schedule`` to an inner vLLM ``Scheduler`` consumes with
its own ``update_from_output``. With no EngineCore on the stack (the connector driven
by a loop of its own: the bench's simulator, tests) the scheduler found on the stack is
judged, and a direct call with neither by ``take_output`` alone; failing closed there
would also withhold from those drivers, whose consumer is the scheduler they call.
The engine's step method and the scheduler's ``update_from_output`` are judged by one
check (``_vllm_method``) against the function vLLM's class holds at that step.
Withheld steps are counted (``COUNTERS``) and logged once per class. The engine (or
scheduler) is found on the caller stack (vLLM gives the connector no reference to it)
once per connector, and again only when the frame it was found in runs other code (a
loop driving both of an engine's step methods), and kept weakly; each step then costs
one frame read and a few identity checks (what lies under batched_take's wrapper of
``take_output`` is found once per class attribute, not per step). The worker
packs only when the metadata of its current step (what ``begin_step`` stored) carries
the version it writes; otherwise the step goes as upstream's dict. So an EngineCore
where this patch did not apply (changed anchor, ``PRIME_R3=0``, other
``PRIME_R3_PATCHES``, another format, prime_r3 absent), or whose consumer is not
upstream's, never receives a packed step.
The declaration is made per step, and the worker reads it from the metadata of its
current step, which under async scheduling (or a batch queue) may be the step after the
output it packs. That is safe while the consumer does not change: it is judged the same
for both. A consumer changed at runtime (a layer put on ``update_from_output``, an
engine step replaced) while steps are in flight can still receive the steps declared
before the change, one or two packed steps: inherent to declaring ahead of the output,
as upstream's own metadata is; the change is seen from the next built step on.

The packed form of a step is ``prime_r3.packed``'s ``_pack`` (a gather from the step's
snapshot, ``StepRows``); its plain form, upstream's dict walked request by request, is
``packed.pack_reference``, and the tests hold the two equal.

Consumers keep working unchanged:

* ``AuxOutputSchedulerConnector.take_output`` (EngineCore) uses ``in`` and ``[]`` and
  reads ``token_start`` / ``rows``: a received ``PackedAuxOutputs`` is a filled dict
  (dict's own ``in`` / ``[]``) whose rows each own their memory, so the chunks an
  in-process frontend keeps pin no more than upstream's per-request arrays do.
* Ray's ``detach_zero_copy_from_model_runner_output`` (0.31, 0.32) iterates
  ``values()`` and reassigns ``rows``: received rows are private and writable, so it
  copies nothing.
* Uniproc executor: nothing is pickled; the scheduler reads upstream's own values.
* Generic code (msgspec, ``asdict``, ``copy``, ``==``, mutation) sees a dict; a
  received step left unfilled for ``batched_take`` reaches only upstream's
  ``update_from_output`` (the handshake above), which reads it through ``take_output``.

A step whose outputs cannot share one array (never seen: all rows of a step share the
capturer's dtype and per-token shape, whether they are views of the step snapshot,
``buffer.read`` copies or arrays over the store's bytes) pickles as upstream's dict.
Ray's detach (``ray_utils.detach_zero_copy_from_model_runner_output``) is not an anchor:
it is gone in 0.33; it was checked by hand in 0.31 and 0.32, and a test runs it.
Why this module is long: the handshake. A worker may pack only for a consumer verified
to read the packed step, and that consumer (the engine's step method, its scheduler's
``update_from_output``, the connector's ``take_output``) is judged at every step against
subclasses, instance attributes and other layers, cheaply enough to run every step.
"""

from __future__ import annotations

import inspect
import logging
import sys
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from prime_r3 import state as prime_state
from prime_r3.counts import Counts
from prime_r3.fixes.aux_output import (
    AUX_REQUEST_OUTPUT,
    BEGIN_STEP,
    COMMIT_OUTPUT,
    MATERIALIZE_ROUTED_EXPERTS,
    PENDING_AUX_OUTPUT,
    PROCESS_OUTPUT,
    TAKE_OUTPUT,
)
from prime_r3.fixes.aux_output import CONNECTOR_MODULE as _CONNECTOR
from prime_r3.fixes.aux_output import ROUTED_EXPERTS_MODULE as _ROUTED_EXPERTS
from prime_r3.fixes.aux_output import WORKER_MODULE as _WORKER
from prime_r3.spec import Anchor, PatchSpec, Process, Target, WrapperFn

logger = logging.getLogger("vllm.prime_r3")
#: The module of vLLM's own scheduler, whose ``update_from_output`` consumes the step.
_SCHEDULER = "vllm.v1.core.sched.scheduler"
#: The module of vLLM's EngineCore, whose step methods run the scheduler's consumer.
_ENGINE = "vllm.v1.engine.core"
#: EngineCore's methods that call ``self.scheduler.schedule()`` and hand the step's
#: output to ``self.scheduler.update_from_output`` (the only callers in 0.31-0.33).
_ENGINE_STEPS = frozenset({"step", "step_with_batch_queue"})


def _pack_step_output(params: Mapping[str, Any]) -> WrapperFn:
    from prime_r3.packed import (  # imports vLLM: only when applying
        PackedAuxOutputs,
        StepRows,
        reader_declared,
    )

    def pack_step_output(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        outputs = wrapped(*args, **kwargs)
        if type(outputs) is not dict:
            return outputs
        # The handshake: pack only for an EngineCore that declared, in the step's
        # connector metadata, that it reads this format (see declare_packed_reader).
        if not reader_declared(getattr(instance, "_step_metadata", None)):
            return outputs
        # Packs when pickled (nothing is copied if the step never leaves the process).
        return PackedAuxOutputs.pack(outputs, _step_rows(args, kwargs, StepRows))

    return pack_step_output


def handshake_counters() -> Counts:
    """EngineCore's declaration, per step: ``declared_steps``, or ``withheld_steps`` and
    why (``withheld_reasons``).

    Reasons: ``take_output`` (the scheduler connector's consumer is not upstream's
    ``take_output``, bare or under prime_r3's wrappers), ``engine_step`` (the EngineCore
    building the step runs another ``step`` / ``step_with_batch_queue`` than vLLM's
    own), ``update_from_output`` (the scheduler consuming the step, the engine's or with
    no engine the one calling ``build_connector_meta``, runs another
    ``update_from_output`` than vLLM's own ``Scheduler``'s), ``metadata`` (the metadata
    object takes no attribute). Written on EngineCore's scheduler thread, once per
    step (``build_connector_meta``); ``snapshot()`` is what tests and tools read.
    """
    return Counts("declared_steps", "withheld_steps", tallies=("withheld_reasons",))


COUNTERS = handshake_counters()

#: (reason, class) pairs already logged in this process: one warning each, not per step.
_logged: set[tuple[str, str]] = set()

#: Caller frames searched for the engine (or scheduler) building the step (our wrappers,
#: another layer's, a subclass's or a delegating ``schedule``, then EngineCore's step:
#: a handful).
_MAX_FRAMES = 16


def _warn_once(reason: str, cls: type, message: str) -> None:
    key = (reason, f"{cls.__module__}.{cls.__qualname__}")
    if key not in _logged:
        _logged.add(key)
        logger.warning("prime_r3 packed_outputs: %s", message)


def _consumer_of(connector: Any, frame: Any) -> tuple[Any, str, Any, int, Any]:
    """Who will consume this step's output: ``(engine, method, scheduler, hops, code)``.

    ``engine`` is the nearest caller whose first argument is an instance of vLLM's
    ``EngineCore`` (its ``step`` or ``step_with_batch_queue`` calls
    ``self.scheduler.schedule()``, and then hands the step's output to
    ``self.scheduler.update_from_output``), ``method`` the name of the vLLM
    ``EngineCore`` method that frame runs (``<qualname>`` when the frame runs code of
    its own: no vLLM step method, so the step is withheld); then ``scheduler`` is None:
    the engine's own ``scheduler`` attribute is what consumes the step, not the nearest
    scheduler frame (a delegating scheduler's inner ``Scheduler`` builds the step, the
    outer one consumes it). ``hops`` (callers above ``frame``) and ``code`` say where
    the engine's frame is and what it runs, so that a later step can check with one
    frame read that it is built from the same method (``consumer_withholds``). With no
    engine on the stack (a driver of its own, the bench's simulator, tests)
    ``scheduler`` is the nearest caller whose first argument holds ``connector`` as its
    ``aux_output_connector`` (vLLM's ``Scheduler.schedule``) or has an
    ``update_from_output``, and ``hops`` / ``code`` say where that frame's caller (the
    driver) is and what it runs, so a later step driven by other code (an EngineCore
    stepping a scheduler a driver of its own stepped first) is searched again; both
    None when neither is on the stack (a direct call), ``code`` None then.

    Why the stack: the connector holds no reference to its scheduler or engine (vLLM
    builds it inside ``Scheduler.__init__``), and ``Scheduler.schedule`` is its only
    caller in vLLM 0.31-0.33. The first argument is read whatever its name (a helper of
    a custom scheduler may call it ``sched``). Searched once per connector and engine
    method (the caller caches the result weakly).
    """
    module = sys.modules.get(_ENGINE)
    engine_cls = getattr(module, "EngineCore", None) if module is not None else None
    if not isinstance(engine_cls, type):
        engine_cls = None
    scheduler = None
    caller_hops, caller_code = 0, None
    for hops in range(_MAX_FRAMES):
        if frame is None:
            break
        code = frame.f_code
        if code.co_argcount:
            owner = frame.f_locals.get(code.co_varnames[0])
            if owner is not None and owner is not connector:
                try:
                    is_engine = engine_cls is not None and isinstance(owner, engine_cls)
                except Exception:  # e.g. a dead weakref.proxy: not the engine, skipped
                    frame = frame.f_back
                    continue
                if is_engine:
                    name = code.co_name
                    if code.co_qualname != f"EngineCore.{name}" or code.co_filename != (
                        getattr(module, "__file__", None)
                    ):  # not vLLM's own code (a subclass's, a function of its own)
                        name = f"<{code.co_qualname}>"
                    return owner, name, None, hops, code
                if scheduler is None:
                    try:
                        holds = vars(owner).get("aux_output_connector") is connector
                    except Exception:  # no __dict__ (TypeError), a dead weakref.proxy, ...
                        holds = False
                    if holds or inspect.getattr_static(owner, "update_from_output", None):
                        scheduler = owner
                        caller = frame.f_back  # who steps the scheduler (the driver)
                        if caller is not None:
                            caller_hops, caller_code = hops + 1, caller.f_code
        frame = frame.f_back
    return None, "", scheduler, caller_hops, caller_code


#: A class attribute that is not there (``dict.get``'s default), and a weak reference's
#: stand-in for it; ``_dead`` is a reference whose object is gone (matches no object).
_ABSENT = object()


def _absent() -> Any:
    return _ABSENT


def _dead() -> Any:
    return None


def _vllm_method(module: str, owner: str, name: str) -> Callable[[Any], bool]:
    """A check of whether an object runs vLLM's own ``owner.name`` (the class ``owner``
    of ``module``): the object vLLM's class holds now is upstream's plain function,
    perhaps under prime_r3's wrappers (``_upstream_method``), the object's class
    resolves ``name`` through its MRO to that function, bare or under our wrappers, and
    the object has no instance attribute ``name``.

    One check for the engine's step method (``EngineCore.step`` /
    ``step_with_batch_queue``) and the scheduler's consumer
    (``Scheduler.update_from_output``), so both are judged alike. vLLM's class attribute
    is read at every step: a subclass holding the function vLLM's class held when it
    was verified is withheld once another layer replaces that class attribute, as it
    is when the layer came before the first step; the answer does not depend on which
    step verified what.

    Per step: vLLM's class and its attribute compared by identity with those last
    verified (verified again only when either is another object), then the
    object's instance dict and its class's attribute. The state is one tuple, replaced
    whole: a thread reads one consistent state.
    """
    #: (weak references to the module's ``owner`` class and to the object it held as
    #: ``name`` (``_ABSENT`` when it held none), upstream's function under that object
    #: or None). Weak: a foreign layer verified once and then removed, or a class that
    #: replaced vLLM's for a while, is not kept alive here once nothing else holds it
    #: (upstream keeps nothing); a dead reference matches no live object.
    state: tuple[Any, Any, Any] = (_dead, _dead, None)
    modules = sys.modules.get  # the interpreter's one dict of modules, read at each step

    def verify(found: Any) -> Any:
        nonlocal state
        cls = found if isinstance(found, type) else None
        live = cls.__dict__.get(name, _ABSENT) if cls is not None else _ABSENT
        last = state
        if cls is None or cls is not last[0]() or live is not last[1]():
            upstream = _upstream_method(module, cls, name, None if live is _ABSENT else live)
            try:
                last = state = (
                    _dead if cls is None else weakref.ref(cls),
                    _absent if live is _ABSENT else weakref.ref(live),
                    upstream,
                )
            except TypeError:  # not weakly referable: verified again at the next check
                state = (_dead, _dead, None)
                return upstream
        return last[2]

    def runs(obj: Any) -> bool:
        cls_ref, live_ref, upstream = state
        cls = cls_ref()
        if (
            cls is None
            or getattr(modules(module), owner, None) is not cls
            or cls.__dict__.get(name, _ABSENT) is not live_ref()
        ):
            upstream = verify(getattr(modules(module), owner, None))
        if upstream is None or name in getattr(obj, "__dict__", ()):
            return False
        cls = type(obj)
        return getattr(cls, name, None) is upstream or (
            prime_state.unwrap_ours(inspect.getattr_static(cls, name, None)) is upstream
        )

    return runs


def _upstream_method(module: str, cls: type | None, name: str, live: Any) -> Any:
    """Upstream's function under ``live`` (``cls.name``, perhaps under prime_r3's
    wrappers), verified as upstream's plain function (compiled from its ``def`` in the
    installed source, as the guards check targets), or None: the module is not loaded,
    or another layer replaced or wrapped it.

    Used for ``Scheduler.update_from_output`` and ``EngineCore.step`` /
    ``step_with_batch_queue`` (``_vllm_method``). Not anchors of the patch: they are
    checked only in EngineCore, at the first step (again only if the class attribute is
    replaced), and an anchor's fingerprint would skip the whole patch whenever a release
    touches those long methods, though the packed step relies only on their handing
    the step to ``take_output`` (the anchor). Another layer on one is another consumer,
    so then no step on that path gets the declaration.
    """
    from prime_r3 import fingerprint, guards

    if cls is None:
        return None
    found = prime_state.unwrap_ours(live)
    qualname = f"{cls.__qualname__}.{name}"
    try:
        why = guards.not_plain(found, fingerprint.locate(module, qualname))
    except fingerprint.SourceUnavailable as error:
        why = f"source unavailable: {error}"
    if why is not None:
        _warn_once(
            name,
            cls,
            f"vLLM's {qualname} is not upstream's plain function ({why}); "
            "workers send upstream's dict",
        )
        return None
    return found


def _declare_packed_reader(params: Mapping[str, Any]) -> WrapperFn:
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    from prime_r3.packed import FORMAT_VERSION, READS_MARK

    # The consumer the packed form was verified against (an anchor, guarded at apply;
    # another prime_r3 patch may wrap it, e.g. batched R3's take_output).
    upstream_take_output = prime_state.unwrap_ours(
        AuxOutputSchedulerConnector.__dict__["take_output"]
    )
    connector_cls = AuxOutputSchedulerConnector
    connector_view = connector_cls.__dict__
    counters = COUNTERS
    # The scheduler's consumer and EngineCore's step methods, each verified at its first
    # check (vLLM's scheduler and engine modules are EngineCore's, not the workers').
    update_runs = _vllm_method(_SCHEDULER, "Scheduler", "update_from_output")
    step_runs = {name: _vllm_method(_ENGINE, "EngineCore", name) for name in _ENGINE_STEPS}
    # (take_output as the connector's class holds it, whether that is upstream's, bare
    # or under our wrappers): batched_take's wrapper is not upstream's function, and
    # finding what lies under it costs microseconds, so that is done when it changes.
    # The answer depends on that object alone while it is there (our wrappers stay
    # recorded while installed), as _vllm_method's verification relies on too.
    # Held weakly: a connector class made at run time, or a foreign layer, whose
    # take_output was judged once must not outlive its class or its removal here.
    take_verdict: tuple[Any, bool] = (_dead, False)
    # (connector, engine, engine method name, scheduler, hops, code, check of the
    # method); the connector, engine, scheduler and code weakly (a dynamically made
    # engine class's step code must not outlive its class here): a step then checks
    # by identity only.
    owner_of: tuple[Any, Any, str, Any, int, Any, Any] | None = None

    def class_takes_like_upstream(cls: type) -> bool:
        """Whether the connector class's ``take_output`` is upstream's under prime_r3's
        own wrappers (its bare function is checked by identity before): a registry
        patch that wraps it stacks on this declaration, so it must read a
        PackedAuxOutputs as the dict it is. What lies under our wrappers is found again
        only when the class attribute is another object (batched_take's wrapper is on
        every step's path, and the walk costs microseconds)."""
        nonlocal take_verdict
        # What getattr_static finds: vLLM's class holds its own take_output.
        found = (
            connector_view.get("take_output")
            if cls is connector_cls
            else inspect.getattr_static(cls, "take_output", None)
        )
        last = take_verdict
        if found is None:
            return False
        if found is not last[0]():
            verdict = prime_state.unwrap_ours(found) is upstream_take_output
            try:
                take_verdict = (weakref.ref(found), verdict)
            except TypeError:  # not weakly referable: judged again at the next step
                take_verdict = (_dead, False)
            return verdict
        return last[1]

    def consumer_withholds(instance: Any) -> str | None:
        """Why this step's consumer may not read a packed step (a ``COUNTERS`` reason),
        or None: it is upstream's chain.

        With an EngineCore on the stack (``_consumer_of``), the chain is the engine's
        step method that called ``schedule`` (``engine_step``) and the scheduler the
        engine holds, whose ``update_from_output`` it calls (``update_from_output``).
        With none (a driver of its own: the bench's simulator, tests), the scheduler
        found on the stack is judged as the consumer, and a step built with neither on
        the stack is judged by ``take_output`` alone, as its caller reads it with
        whatever it calls.

        The engine found is cached with its frame's place and code: a step whose frame
        there runs other code (a loop driving both step methods, one overridden) is
        searched again, so it is judged by the method it is built from. A scheduler
        found with no engine is cached with its driver's place and code alike: an
        engine that later steps the same scheduler is searched for, and judged.
        """
        nonlocal owner_of
        engine = scheduler = None
        # One read of the shared tuple: engines stepping on other threads replace it,
        # and a thread switch between reading its connector and its engine (or
        # scheduler) would judge this step by another engine's consumer.
        cached = owner_of
        if cached is not None and cached[0]() is instance:
            if cached[1] is not None:
                engine = cached[1]()
                try:  # the same engine method builds this step: one frame read
                    if sys._getframe(2 + cached[4]).f_code is not cached[5]():
                        engine = None
                except ValueError:  # a shallower stack: another caller
                    engine = None
                name, runs = cached[2], cached[6]
            else:
                scheduler = cached[3]()
                code_ref = cached[5]
                try:  # the same driver steps the scheduler: one frame read
                    if code_ref is not None and (
                        sys._getframe(2 + cached[4]).f_code is not code_ref()
                    ):
                        scheduler = None
                except ValueError:  # a shallower stack: another caller
                    scheduler = None
        if engine is None and scheduler is None:
            found = _consumer_of(instance, sys._getframe(2))
            engine, name, scheduler, hops, code = found
            if engine is None and scheduler is None:
                return None
            runs = step_runs.get(name)  # None: not one of vLLM's step methods
            try:
                owner_of = (
                    weakref.ref(instance),
                    None if engine is None else weakref.ref(engine),
                    name,
                    None if scheduler is None else weakref.ref(scheduler),
                    hops,
                    None if code is None else weakref.ref(code),
                    runs,
                )
            except TypeError:  # not weakly referable: searched again next step
                owner_of = None
        if engine is not None:
            if runs is None or not runs(engine):
                cls = type(engine)
                _warn_once(
                    "engine_step",
                    cls,
                    f"EngineCore {cls.__module__}.{cls.__qualname__} builds steps from its "
                    f"own {name} (overridden, an instance attribute, another layer or "
                    "another method than vLLM's step / step_with_batch_queue), which may "
                    "read step outputs itself; its workers send upstream's dict, not "
                    "packed steps (prime_r3.fixes.packed_outputs.COUNTERS counts the steps)",
                )
                return "engine_step"
            scheduler = getattr(engine, "scheduler", None)
        if not update_runs(scheduler):
            cls = type(scheduler)
            _warn_once(
                "update_from_output",
                cls,
                f"scheduler {cls.__module__}.{cls.__qualname__} does not consume step "
                "outputs with vLLM's own Scheduler.update_from_output (overridden, an "
                "instance attribute or another layer); its workers send upstream's dict, "
                "not packed steps (prime_r3.fixes.packed_outputs.COUNTERS counts the steps)",
            )
            return "update_from_output"
        return None

    def declare_packed_reader(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        metadata = wrapped(*args, **kwargs)
        # Declare only while the live connector's consumer is upstream's function and
        # the engine's step and its scheduler's update_from_output are upstream's: a
        # subclass or instance that overrides any may not read a PackedAuxOutputs (or
        # an unfilled one) as the dict it is, so its workers keep sending dicts.
        cls = type(instance)
        if "take_output" not in getattr(instance, "__dict__", ()) and (
            cls.take_output is upstream_take_output or class_takes_like_upstream(cls)
        ):
            reason = consumer_withholds(instance)
        else:
            reason = "take_output"
            _warn_once(
                "take_output",
                cls,
                f"scheduler connector {cls.__module__}.{cls.__qualname__} does not consume "
                "step outputs with vLLM's own take_output; its workers send upstream's dict",
            )
        if reason is None:
            try:
                setattr(metadata, READS_MARK, FORMAT_VERSION)  # a plain int: any worker reads it
            except AttributeError:  # a metadata object that takes no attributes
                reason = "metadata"
            else:
                counters.declared_steps += 1
                return metadata
        counters.add("withheld_reasons", reason, total="withheld_steps")
        return metadata

    return declare_packed_reader


def _step_rows(args: tuple[Any, ...], kwargs: Mapping[str, Any], step_rows: Any) -> Any:
    """The ``PendingAuxOutput`` fields pack gathers the step's rows from, or None.

    Its common-case rows are views of ``pending.routed_experts`` (see ``StepRows``);
    without them pack concatenates row by row, as it does for any other step.
    """
    pending = args[0] if args else kwargs.get("pending")
    try:
        return step_rows(
            pending.routed_experts,
            pending.request_ids,
            pending.query_start_loc,
            pending.num_rejected,
        )
    except AttributeError:
        return None


# Verified source fingerprints (scripts/fingerprint.py) for vLLM 0.31.0, 0.32.0, 0.33.0.
# build_connector_meta differs in each release (0.32 clamps the prompt start, 0.33 adds
# retained/released block hashes) and returns AuxOutputConnectorMetadata, a plain
# dataclass, in all three; begin_step stores the metadata first thing in all three.
_BUILD_CONNECTOR_META = frozenset({"1c711c2cec26dcf1", "db0b9aab742a9e2d", "07c164aa04c92587"})
_BUFFER_READ = frozenset({"cb98f753b1c45077"})

SPEC = PatchSpec(
    name="packed_outputs",
    summary="output worker sends one packed rows array per step instead of a dict per request",
    vllm_range=">=0.31,<0.34",
    # Packed in the output worker; unpacked and looked up by the scheduler in EngineCore.
    processes=frozenset({Process.WORKER, Process.ENGINE_CORE}),
    targets=(
        Target(
            _WORKER, "AuxOutputWorkerConnector.process_output", PROCESS_OUTPUT, _pack_step_output
        ),
        # EngineCore declares in each step's metadata that it reads the packed format.
        Target(
            _CONNECTOR,
            "AuxOutputSchedulerConnector.build_connector_meta",
            _BUILD_CONNECTOR_META,
            _declare_packed_reader,
        ),
    ),
    anchors=(
        # The producer: one dtype and per-token shape per step; rows are views of the
        # step's fresh snapshot, buffer.read copies or the store's bytes (read-only).
        # A snapshot view ends at query_start_loc[j + 1] - num_rejected[j] (StepRows).
        Anchor(_WORKER, "AuxOutputWorkerConnector._commit_output", COMMIT_OUTPUT),
        # The worker reads the declaration from the metadata begin_step stores.
        Anchor(_WORKER, "AuxOutputWorkerConnector.begin_step", BEGIN_STEP),
        # The EngineCore consumer: only `in`, `[]`, `.token_start` and `.rows`.
        Anchor(_CONNECTOR, "AuxOutputSchedulerConnector.take_output", TAKE_OUTPUT),
        # We build these positionally as (token_start, rows).
        Anchor(_CONNECTOR, "AuxRequestOutput", AUX_REQUEST_OUTPUT),
        # StepRows reads these fields of the step snapshot.
        Anchor(_WORKER, "PendingAuxOutput", PENDING_AUX_OUTPUT),
        # The gather relies on non-snapshot rows never being views of the snapshot:
        # buffer.read copies, and the store path returns arrays over stored bytes.
        Anchor(_ROUTED_EXPERTS, "RoutedExpertsBuffer.read", _BUFFER_READ),
        Anchor(_ROUTED_EXPERTS, "materialize_routed_experts", MATERIALIZE_ROUTED_EXPERTS),
        # ... and the name _commit_output actually calls (worker.py imports it with
        # `from ... import`): another layer may wrap it there and not at its definition.
        Anchor(_WORKER, "materialize_routed_experts", MATERIALIZE_ROUTED_EXPERTS),
    ),
)
