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
subclass's or an instance's override, nor another layer's wrapper). The worker
packs only when the metadata of its current step (what ``begin_step`` stored) carries
the version it writes; otherwise the step goes as upstream's dict. So an EngineCore
where this patch did not apply (changed anchor, ``PRIME_R3=0``, other
``PRIME_R3_PATCHES``, another format, prime_r3 absent) never receives a packed step.
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
* Generic code (msgspec, ``asdict``, ``copy``, ``==``, mutation) sees a dict.

A step whose outputs cannot share one array (never seen: all rows of a step share the
capturer's dtype and per-token shape, whether they are views of the step snapshot,
``buffer.read`` copies or arrays over the store's bytes) pickles as upstream's dict.
Ray's detach (``ray_utils.detach_zero_copy_from_model_runner_output``) is not an anchor:
it is gone in 0.33; it was checked by hand in 0.31 and 0.32, and a test runs it.
"""

from __future__ import annotations

import inspect
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


def _declare_packed_reader(params: Mapping[str, Any]) -> WrapperFn:
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    from prime_r3.packed import FORMAT_VERSION, READS_MARK

    # The consumer the packed form was verified against (an anchor, guarded at apply;
    # another prime_r3 patch may wrap it, e.g. batched R3's take_output).
    upstream_take_output = prime_state.unwrap_ours(
        AuxOutputSchedulerConnector.__dict__["take_output"]
    )

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

    def declare_packed_reader(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        metadata = wrapped(*args, **kwargs)
        # Declare only while the live connector's consumer is upstream's function: a
        # subclass or instance that overrides take_output may not read a
        # PackedAuxOutputs as the dict it is, so its workers keep sending dicts.
        if reads_like_upstream(instance):
            try:
                setattr(metadata, READS_MARK, FORMAT_VERSION)  # a plain int: any worker reads it
            except AttributeError:
                pass  # a metadata object that takes no attributes: workers send dicts
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
