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
subclass's or an instance's override, nor another layer's wrapper), **and** the
scheduler building the step consumes its output with vLLM's own
``Scheduler.update_from_output`` (inherited through its class's MRO, as
``AsyncScheduler`` does; not a ``scheduler_cls`` subclass's override, an instance
attribute or another layer's wrapper). Why the scheduler too: the packed form, and the
unfilled one ``batched_take`` reads, were verified against upstream's consumer, which
hands the step to ``take_output`` only. An overriding ``update_from_output`` may read
the step itself (msgspec, for one, reads a dict's storage directly and sees an unfilled
step as ``{}``), so its workers send upstream's dict: what it gets with the overlay
off. Withheld steps are counted (``COUNTERS``) and logged once per class. The scheduler
is found once per connector on the caller stack (vLLM gives the connector no reference
to it) and kept weakly; each step then costs one identity check (~0.15 us). The worker
packs only when the metadata of its current step (what ``begin_step`` stored) carries
the version it writes; otherwise the step goes as upstream's dict. So an EngineCore
where this patch did not apply (changed anchor, ``PRIME_R3=0``, other
``PRIME_R3_PATCHES``, another format, prime_r3 absent), or whose consumer is not
upstream's, never receives a packed step.
The declaration is per process and stable, so reading the current step's metadata
from ``process_output`` (which may run a step behind under async scheduling) is safe.

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
"""

from __future__ import annotations

import inspect
import logging
import sys
import weakref
from collections import Counter
from collections.abc import Mapping
from typing import Any

from prime_r3 import state as prime_state
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


class HandshakeCounters:
    """EngineCore's declaration, per step: declared, or withheld and why.

    Reasons: ``take_output`` (the scheduler connector's consumer is not upstream's
    ``take_output``, bare or under prime_r3's wrappers), ``update_from_output`` (the
    scheduler calling ``build_connector_meta`` runs another ``update_from_output`` than
    vLLM's own ``Scheduler``'s), ``metadata`` (the metadata object takes no attribute).
    Plain increments: ``build_connector_meta`` runs on EngineCore's scheduler thread,
    once per step. ``snapshot()`` is what tests and tools read.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.declared_steps = 0
        self.withheld_steps = 0
        self.withheld_reasons: Counter[str] = Counter()

    def withheld(self, reason: str) -> None:
        self.withheld_steps += 1
        self.withheld_reasons[reason] += 1

    def snapshot(self) -> dict[str, Any]:
        return {
            "declared_steps": self.declared_steps,
            "withheld_steps": self.withheld_steps,
            "withheld_reasons": dict(self.withheld_reasons),
        }


COUNTERS = HandshakeCounters()

#: (reason, class) pairs already logged in this process: one warning each, not per step.
_logged: set[tuple[str, str]] = set()

#: Caller frames searched for the scheduler building the step (our wrappers, another
#: layer's, a subclass's ``schedule`` calling upstream's: a handful).
_MAX_FRAMES = 16


def _warn_once(reason: str, cls: type, message: str) -> None:
    key = (reason, f"{cls.__module__}.{cls.__qualname__}")
    if key not in _logged:
        _logged.add(key)
        logger.warning("prime_r3 packed_outputs: %s", message)


def _scheduler_of(connector: Any, frame: Any) -> Any:
    """The scheduler building this step's metadata: the nearest caller whose ``self``
    holds ``connector`` as its ``aux_output_connector`` (vLLM's ``Scheduler.schedule``,
    whichever class runs it) or has an ``update_from_output`` (a scheduler of its own
    keeping the connector elsewhere). None when no scheduler is on the stack (a direct
    call: tests, tools).

    Why the stack: the connector holds no reference to its scheduler (vLLM builds it
    inside ``Scheduler.__init__``: no arguments in 0.31/0.32, the KV manager and KV
    connector in 0.33), and ``Scheduler.schedule`` is its only caller in vLLM
    0.31-0.33. Searched once per connector (the result is cached by the caller);
    reading ``f_locals`` only on frames whose first argument is ``self``.
    """
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            owner = frame.f_locals.get("self")
            if owner is not None and owner is not connector:
                try:
                    holds = vars(owner).get("aux_output_connector") is connector
                except TypeError:  # no __dict__
                    holds = False
                if holds or inspect.getattr_static(owner, "update_from_output", None):
                    return owner
        frame = frame.f_back
    return None


def _live_update_from_output() -> tuple[type | None, Any]:
    """vLLM's ``Scheduler`` class (None if its module is not loaded) and the object its
    class dict holds as ``update_from_output`` now."""
    scheduler = getattr(sys.modules.get(_SCHEDULER), "Scheduler", None)
    if not isinstance(scheduler, type):
        return None, None
    return scheduler, scheduler.__dict__.get("update_from_output")


def _upstream_update_from_output(scheduler: type | None, live: Any) -> Any:
    """Upstream's function under ``live`` (``Scheduler.update_from_output``, perhaps
    under prime_r3's wrappers), verified as upstream's plain function (compiled from
    its ``def`` in the installed scheduler.py, as the guards check targets), or None:
    the module is not loaded, or another layer replaced or wrapped it.

    Not an anchor of the patch: it is checked only in EngineCore, at the first step
    (again only if the class attribute is replaced), and an anchor's fingerprint would
    skip the whole patch whenever a release touches that long method, though the packed
    step relies only on its handing the step to ``take_output`` (the anchor). Another
    layer on it is another consumer, so then no scheduler gets the declaration.
    """
    from prime_r3 import fingerprint, guards

    if scheduler is None:
        return None
    found = prime_state.unwrap_ours(live)
    try:
        why = guards.not_plain(
            found, fingerprint.locate(_SCHEDULER, "Scheduler.update_from_output")
        )
    except fingerprint.SourceUnavailable as error:
        why = f"source unavailable: {error}"
    if why is not None:
        _warn_once(
            "update_from_output",
            scheduler,
            f"vLLM's Scheduler.update_from_output is not upstream's plain function ({why}); "
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
    counters = COUNTERS
    # Upstream's update_from_output, verified at the first step (vLLM's scheduler
    # module is EngineCore's, not the workers') as (the class attribute verified, the
    # result), again only when the class attribute is another object; and (connector,
    # scheduler) weakly: a step then checks by identity only.
    verified: tuple[Any, Any] | None = None
    owner_of: tuple[Any, Any] | None = None

    def upstream_update() -> Any:
        nonlocal verified
        scheduler, live = _live_update_from_output()
        if verified is None or verified[0] is not live:
            verified = (live, _upstream_update_from_output(scheduler, live))
        return verified[1]

    def reads_like_upstream(instance: Any) -> bool:
        """Whether the live connector's consumer is upstream's take_output, bare or
        under prime_r3's own wrappers: a registry patch that wraps it stacks on this
        declaration, so it must read a PackedAuxOutputs as the dict it is."""
        if "take_output" in getattr(instance, "__dict__", ()):
            return False
        cls = type(instance)
        if cls.take_output is upstream_take_output:  # unwrapped: no class lookup needed
            return True
        found = prime_state.unwrap_ours(inspect.getattr_static(cls, "take_output", None))
        return found is not None and found is upstream_take_output

    def scheduler_reads_like_upstream(instance: Any) -> bool:
        """Whether the scheduler that will receive this step's output consumes it with
        vLLM's own ``Scheduler.update_from_output`` (inherited through its class's MRO,
        e.g. ``AsyncScheduler``, bare or under prime_r3's wrappers, no instance
        attribute). A step built with no scheduler on the stack is judged by
        ``take_output`` alone, as its caller reads it with whatever it calls.

        Why: that is the consumer the packed and unfilled forms were verified with (it
        hands the step to ``take_output`` and reads it no other way). A scheduler class
        configured through ``scheduler_cls`` that overrides it may read the step itself,
        e.g. with msgspec, which sees an unfilled step as ``{}``; it gets upstream's dict.
        Per step: one weakref call, one class attribute and one instance-dict lookup.
        """
        nonlocal owner_of
        owner = None
        # One read of the shared pair: engines stepping on other threads replace it, and
        # a thread switch between reading its connector and its scheduler would judge
        # this step by another engine's scheduler.
        cached = owner_of
        if cached is not None and cached[0]() is instance:
            owner = cached[1]()
        if owner is None:
            owner = _scheduler_of(instance, sys._getframe(2))
            if owner is None:
                return True
            try:
                owner_of = (weakref.ref(instance), weakref.ref(owner))
            except TypeError:  # not weakly referable: searched again next step
                owner_of = None
        upstream = verified[1] if verified is not None else upstream_update()
        cls = type(owner)
        if (
            upstream is not None
            and getattr(cls, "update_from_output", None) is upstream
            and "update_from_output" not in getattr(owner, "__dict__", ())
        ):
            return True
        upstream = upstream_update()  # Scheduler's own attribute may have been replaced
        found = prime_state.unwrap_ours(inspect.getattr_static(cls, "update_from_output", None))
        if (
            upstream is not None
            and found is upstream
            and "update_from_output" not in getattr(owner, "__dict__", ())
        ):
            return True
        _warn_once(
            "update_from_output",
            cls,
            f"scheduler {cls.__module__}.{cls.__qualname__} does not consume step outputs "
            "with vLLM's own Scheduler.update_from_output (overridden, an instance "
            "attribute or another layer); its workers send upstream's dict, not packed "
            "steps (prime_r3.fixes.packed_outputs.COUNTERS counts the steps)",
        )
        return False

    def declare_packed_reader(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        metadata = wrapped(*args, **kwargs)
        # Declare only while the live connector's consumer is upstream's function and
        # the scheduler's consumer is upstream's update_from_output: a subclass or
        # instance that overrides either may not read a PackedAuxOutputs (or an
        # unfilled one) as the dict it is, so its workers keep sending dicts.
        if not reads_like_upstream(instance):
            counters.withheld("take_output")
            cls = type(instance)
            _warn_once(
                "take_output",
                cls,
                f"scheduler connector {cls.__module__}.{cls.__qualname__} does not consume "
                "step outputs with vLLM's own take_output; its workers send upstream's dict",
            )
        elif not scheduler_reads_like_upstream(instance):
            counters.withheld("update_from_output")
        else:
            try:
                setattr(metadata, READS_MARK, FORMAT_VERSION)  # a plain int: any worker reads it
            except AttributeError:  # a metadata object that takes no attributes
                counters.withheld("metadata")
            else:
                counters.declared_steps += 1
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
