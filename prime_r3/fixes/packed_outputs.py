"""packed_outputs: the output worker sends one ``PackedAuxOutputs`` per step, not a dict.

vLLM (0.31-0.33) returns ``dict[request_id, AuxRequestOutput]`` from
``AuxOutputWorkerConnector.process_output``; async_utils stores it in
``ModelRunnerOutput.aux_output_connector_output`` and the MessageQueue pickles one
array per running request, which EngineCore then rebuilds one object at a time.
We wrap ``process_output`` and pack its dict into one rows array (see
``prime_r3.packed``). The wrapper also hands pack the step's ``PendingAuxOutput``
fields (``StepRows``): rows that are views of the step's snapshot are then copied with
one slice or gather from it rather than concatenated one small array at a time. Every
consumer keeps working unchanged:

* ``AuxOutputSchedulerConnector.take_output`` (EngineCore) uses ``in`` and ``[]`` and
  reads ``token_start`` / ``rows``: ``PackedAuxOutputs`` is a read-only dict, filled
  with real ``AuxRequestOutput`` values on first lookup, after which ``in`` and ``[]``
  are dict's own. It is an anchor: if it changes, the patch skips.
* Ray's ``detach_zero_copy_from_model_runner_output`` (0.31, 0.32) iterates
  ``values()`` and reassigns ``rows``: values are cached, so the assignment sticks,
  and unpickled rows are already writable and private, so it copies nothing.
* Uniproc executor: nothing is pickled; the packed rows are a fresh copy per step,
  so nothing handed downstream aliases the worker's step snapshot or reused buffers.

A step whose outputs cannot share one array (never seen: all rows of a step share the
capturer's dtype and per-token shape, whether they are views of the step snapshot,
``buffer.read`` copies or arrays over the store's bytes) is passed on as upstream's dict.
Ray's detach (``ray_utils.detach_zero_copy_from_model_runner_output``) is not an anchor:
it is gone in 0.33; it was checked by hand in 0.31 and 0.32, and a test runs it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from prime_r3.fixes.aux_output import CONNECTOR_MODULE as _CONNECTOR
from prime_r3.fixes.aux_output import ROUTED_EXPERTS_MODULE as _ROUTED_EXPERTS
from prime_r3.fixes.aux_output import WORKER_MODULE as _WORKER
from prime_r3.spec import Anchor, PatchSpec, Process, Target, WrapperFn

logger = logging.getLogger("vllm.prime_r3")


def _pack_step_output(params: Mapping[str, Any]) -> WrapperFn:
    from prime_r3.packed import PackedAuxOutputs, StepRows  # imports vLLM: only when applying

    warned = False

    def pack_step_output(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        nonlocal warned
        outputs = wrapped(*args, **kwargs)
        if type(outputs) is not dict:
            return outputs
        try:
            return PackedAuxOutputs.pack(outputs, _step_rows(args, kwargs, StepRows))
        except (TypeError, ValueError) as error:
            if not warned:
                warned = True
                logger.warning("prime_r3 packed_outputs: sending a step unpacked: %s", error)
            return outputs

    return pack_step_output


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
_PROCESS_OUTPUT = frozenset({"06ee5fa311ada6e3"})
_COMMIT_OUTPUT = frozenset({"29bd5bec6708d002"})
_TAKE_OUTPUT = frozenset({"08dfe701debdb1e5"})
_AUX_REQUEST_OUTPUT = frozenset({"c86fdd3be04a8c32"})
_PENDING_AUX_OUTPUT = frozenset({"41701d3db6f69d56"})
_BUFFER_READ = frozenset({"cb98f753b1c45077"})
_MATERIALIZE = frozenset({"467c3027a566df14"})

SPEC = PatchSpec(
    name="packed_outputs",
    summary="output worker sends one packed rows array per step instead of a dict per request",
    vllm_range=">=0.31,<0.34",
    # Packed in the output worker; unpacked and looked up by the scheduler in EngineCore.
    processes=frozenset({Process.WORKER, Process.ENGINE_CORE}),
    targets=(
        Target(
            _WORKER, "AuxOutputWorkerConnector.process_output", _PROCESS_OUTPUT, _pack_step_output
        ),
    ),
    anchors=(
        # The producer: one dtype and per-token shape per step; rows are views of the
        # step's fresh snapshot, buffer.read copies or the store's bytes (read-only).
        # A snapshot view ends at query_start_loc[j + 1] - num_rejected[j] (StepRows).
        Anchor(_WORKER, "AuxOutputWorkerConnector._commit_output", _COMMIT_OUTPUT),
        # The EngineCore consumer: only `in`, `[]`, `.token_start` and `.rows`.
        Anchor(_CONNECTOR, "AuxOutputSchedulerConnector.take_output", _TAKE_OUTPUT),
        # We build these positionally as (token_start, rows).
        Anchor(_CONNECTOR, "AuxRequestOutput", _AUX_REQUEST_OUTPUT),
        # StepRows reads these fields of the step snapshot.
        Anchor(_WORKER, "PendingAuxOutput", _PENDING_AUX_OUTPUT),
        # The gather relies on non-snapshot rows never being views of the snapshot:
        # buffer.read copies, and the store path returns arrays over stored bytes.
        Anchor(_ROUTED_EXPERTS, "RoutedExpertsBuffer.read", _BUFFER_READ),
        Anchor(_ROUTED_EXPERTS, "materialize_routed_experts", _MATERIALIZE),
    ),
)
