"""batched_meta: build_connector_meta finds the requests that change nothing in one lean pass.

``AuxOutputSchedulerConnector.build_connector_meta`` (EngineCore, every step) walks each
scheduled request: ``setdefault`` of its sent-hash count, ``_pack_new_hashes`` (0.31,
0.32) or ``_take_new_hashes`` (0.33), then the emit start
``max(min(prompt_start, num_prompt_tokens), 0 if num_output_tokens == 0 else
num_tokens - 1)`` (0.31 has no ``min``): almost all of it for requests where nothing
happens but the emit start moving one token on.

*Fast* requests are those whose step changes no connector state and whose emit start
does not depend on the prompt start's value: already sent (known to
``_sent_hash_counts``), no new block hash to send (0.31/0.32: as many hashes as sent;
0.33: ``min(len(block_hashes), (computed + scheduled) // hash_block_size)`` not beyond
the sent count), on 0.33 no ``_loading`` entry to pop, and decoding past the prompt (an
output token, ``num_tokens - 1 > num_prompt_tokens``, an ``int`` prompt start; 0.31 also
``prompt_start < num_tokens - 1``), where upstream's emit start is exactly ``num_tokens
- 1``. One lean pass finds them and their emit starts (a dict lookup, a length, the
request's ``num_output_tokens`` / ``num_tokens`` properties as upstream reads them, no
write); everything else is upstream's code. ``scan_reference`` is the plain form of
the pass: upstream's loop, read-only, with upstream's emit-start formula.

Design: upstream builds the metadata. We call ``wrapped`` (upstream's function, or the
inner wrapper of a patch registered before us, e.g. packed_outputs' reader declaration)
with a shallow copy of ``scheduler_output`` whose ``num_scheduled_tokens`` holds only
the other scheduled requests, in the scheduler's order, while ``_sent_hash_counts`` is
bound to a dict of only the entries not fast (the unscheduled ones in the dict's own
order: the only order upstream's code reads). Upstream's own code then
does everything that changes state: new requests, block-hash packing, the hash-only
updates of unscheduled requests (its second loop sees exactly the unscheduled entries it
would see, in the same order, and the same ``len`` test decides whether it runs), the
terminal events, the generation and 0.33's retained/released hashes. Afterwards
the entries are merged back into the original dict object (values updated in place,
new requests appended in scheduler order: upstream's ``setdefault`` order), also when
upstream raises; and the returned metadata's ``requests`` is replaced by the full dict,
in the scheduler's order, with upstream's values for the requests it handled. Because
the metadata object is the one ``wrapped`` returned, whatever an inner wrapper set on it
(packed_outputs' ``READS_MARK``) stays; with layers stacked in registry order the inner
wrapper runs on every step, fast or not. ``block_hashes`` needs no merge: fast requests
add no entry, so upstream's dict (scheduled entries in scheduler order, then
unscheduled, then finished) is already the whole step's.

Upstream's whole, untouched call handles any step we do not cover (the scan only
reads, so anything it raises on also sends the step to upstream, which raises its own
error; nothing of the arguments is read before upstream beyond what the scan read):
not plain dicts, a
connector subclass or instance overriding the hash helpers, a scheduled id missing from
``requests`` (on 0.33 also one whose ``request.request_id`` differs from its key: upstream
reads the sent count under the request's own id), ``sampling_params`` None or a hash
history that shrank (upstream raises its own error with its own effects), or a step of
fewer than ``MIN_BATCH`` requests.

The prompt start's type is checked on every release (an ``int``, as ``SamplingParams``
declares it): anything else (``None``, a float) goes to upstream, whose ``min``/``max``
then computes or raises exactly as it would.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from itertools import filterfalse
from typing import Any

from prime_r3.fixes.aux_output import CONNECTOR_MODULE as _CONNECTOR
from prime_r3.fixes.batched_commit import Counters
from prime_r3.spec import Anchor, PatchSpec, Process, Target, WrapperFn

#: ``fast_requests``: scheduled requests whose emit start we computed; the rest by
#: reason: ``new`` (first schedule), ``hashes`` (block hashes to send), ``prompt``
#: (prefill chunk, first output token, or 0.31's prompt start ahead), ``loading``
#: (0.33: a ``_loading`` entry to pop), ``step`` (the whole step went to upstream).
COUNTERS = Counters()

#: Below this many scheduled requests the whole step goes to upstream (counted as
#: ``step``): the wrapper's fixed cost (copies, a second call) exceeds the saving there.
MIN_BATCH = 16

_REQUEST = "vllm.v1.request"

# Verified build_connector_meta sources (scripts/fingerprint.py) and what each computes.
# 0.31.0: emit = max(prompt_start, floor); 0.32.0: max(min(prompt_start, num_prompt_tokens),
# floor); 0.33.0: as 0.32 with hashes taken up to the computed tokens (_take_new_hashes),
# a _loading pop per scheduled request, and retained/released hashes.
_V031, _V032, _V033 = "1c711c2cec26dcf1", "db0b9aab742a9e2d", "07c164aa04c92587"
_BUILD_CONNECTOR_META = frozenset({_V031, _V032, _V033})


class _Whole(Exception):
    """This step goes to upstream untouched."""


def _batched_meta(params: Mapping[str, Any]) -> WrapperFn:
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    from prime_r3 import fingerprint

    # Which release's code runs here, read from the file (the guards verified it).
    variant = fingerprint.of_name(_CONNECTOR, "AuxOutputSchedulerConnector.build_connector_meta")
    if variant not in _BUILD_CONNECTOR_META:  # the guards skip the patch first
        raise RuntimeError(f"build_connector_meta fingerprint {variant} is not verified")
    helper = "_take_new_hashes" if variant == _V033 else "_pack_new_hashes"
    # What a class attribute lookup gives (0.31/0.32's is a staticmethod's function).
    upstream_helper = getattr(AuxOutputSchedulerConnector, helper)
    scan = {_V031: _scan_031, _V032: _scan_032, _V033: _scan_033}[variant]

    def batched_meta(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        try:
            scheduler_output, requests = _arguments(args, kwargs)
            _check(instance, scheduler_output, requests, helper, upstream_helper)
            values, slow, reasons = scan(instance, scheduler_output.num_scheduled_tokens, requests)
        except Exception:  # noqa: BLE001 - _Whole, or a read upstream raises on: upstream's
            # The scans only read, so upstream runs on what it would have had, and raises
            # its own error with its own effects. Counted without reading anything more:
            # a plain dict's requests, else the step once.
            scheduled = getattr(_first(args, kwargs), "num_scheduled_tokens", None)
            COUNTERS.add(0, {"step": len(scheduled) if type(scheduled) is dict else 1})
            return wrapped(*args, **kwargs)
        num_scheduled = scheduler_output.num_scheduled_tokens
        sent = instance._sent_hash_counts
        num_known = len(num_scheduled) - reasons.get("new", 0)
        if len(sent) > num_known:
            # Unscheduled entries: upstream's second loop walks them in the dict's order.
            fast_ids = num_scheduled.keys() - slow
            kept = list(filterfalse(fast_ids.__contains__, sent))
        else:  # every entry is scheduled: nothing walks this dict in order
            kept = list(filter(sent.__contains__, slow))
        trimmed_sent = dict(zip(kept, map(sent.__getitem__, kept), strict=True))
        trimmed_output = copy.copy(scheduler_output)
        trimmed_output.num_scheduled_tokens = dict(
            zip(slow, map(num_scheduled.__getitem__, slow), strict=True)
        )
        COUNTERS.add(len(num_scheduled) - len(slow), reasons)
        instance._sent_hash_counts = trimmed_sent
        try:
            metadata = wrapped(trimmed_output, requests)
        finally:
            # Upstream only sets values and appends keys (setdefault) in this dict.
            instance._sent_hash_counts = sent
            sent.update(trimmed_sent)
        if slow:  # upstream's values for its requests, each at its place in the order
            values.update(metadata.requests)
        metadata.requests = values
        return metadata

    return batched_meta


def _first(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    return args[0] if args else kwargs.get("scheduler_output")


def _arguments(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, Any]:
    if len(args) == 2 and not kwargs:
        return args
    merged = dict(zip(("scheduler_output", "requests"), args, strict=False)) | dict(kwargs)
    if merged.keys() != {"scheduler_output", "requests"}:
        raise _Whole  # upstream raises its own TypeError
    return merged["scheduler_output"], merged["requests"]


def _check(
    connector: Any, scheduler_output: Any, requests: Any, helper: str, upstream_helper: Any
) -> None:
    """Raise _Whole unless the step has the types and the connector the code we verified."""
    if (
        type(getattr(scheduler_output, "num_scheduled_tokens", None)) is not dict
        or type(requests) is not dict
        or type(getattr(connector, "_sent_hash_counts", None)) is not dict
        or len(scheduler_output.num_scheduled_tokens) < MIN_BATCH
        # A subclass or instance with its own hash helper may do more than upstream's.
        or getattr(type(connector), helper, None) is not upstream_helper
        or helper in getattr(connector, "__dict__", ())
    ):
        raise _Whole


# The scans: one lean pass over the scheduled requests, in the scheduler's order. Each
# returns the step's `requests` dict (the emit start of every fast request, a placeholder
# None where upstream's value goes), the other requests in order, and their reasons.
# A fast request is decoding past its prompt: it has an output token and
# num_tokens - 1 > num_prompt_tokens, with an int prompt start, so upstream's emit start
# max(min(prompt_start, num_prompt_tokens), num_tokens - 1) is exactly num_tokens - 1
# (0.31, without the min, needs prompt_start < num_tokens - 1 too). The counts are read
# through the request's num_output_tokens / num_tokens properties, as upstream reads them
# (num_tokens only when there is an output token, as upstream's conditional does), so a
# subclassed or duck-typed request gives upstream's values.


def emit_start_reference(request: Any, variant: str) -> Any:
    """Upstream's emit start for ``request`` in ``build_connector_meta`` of ``variant``
    (a verified fingerprint): ``max(prompt_start, floor)`` on 0.31, ``max(min(prompt_start,
    num_prompt_tokens), floor)`` on 0.32 and 0.33, where ``floor`` is 0 before the first
    output token and ``num_tokens - 1`` after it."""
    prompt_start = request.sampling_params.routed_experts_prompt_start
    floor = 0 if request.num_output_tokens == 0 else request.num_tokens - 1
    if variant == _V031:
        return max(prompt_start, floor)
    return max(min(prompt_start, request.num_prompt_tokens), floor)


def scan_reference(
    connector: Any, num_scheduled: dict[str, int], requests: dict[str, Any], variant: str
) -> tuple[dict[str, Any], list[str]]:
    """The reference form of the scans, read-only: upstream's loop over the scheduled
    requests, in order, asking of each whether its step changes connector state (a first
    schedule, block hashes to send, on 0.33 a ``_loading`` entry to pop) and, when it
    does not and the request decodes past its prompt with an ``int`` prompt start (0.31:
    one below ``num_tokens - 1``), taking upstream's emit start by upstream's formula
    (``emit_start_reference``). Returns (``requests`` as the scans build it: those emit
    starts, None for upstream's requests; the requests left to upstream, in order)."""
    sent = connector._sent_hash_counts
    values: dict[str, Any] = {}
    slow: list[str] = []
    for request_id, num_tokens in num_scheduled.items():
        request = requests[request_id]
        num_sent = sent.get(request_id)
        num_hashes = len(request.block_hashes)
        if variant == _V033:
            computed = request.num_computed_tokens + num_tokens
            sends = num_sent is not None and (
                min(num_hashes, computed // connector._hash_block_size) > num_sent
            )
            loading = request_id in connector._loading
        else:
            sends = num_sent is not None and num_hashes > num_sent
            loading = False
        prompt_start = request.sampling_params.routed_experts_prompt_start
        decoding = (
            request.num_output_tokens > 0
            and request.num_tokens - 1 > request.num_prompt_tokens
            and type(prompt_start) is int
            and (variant != _V031 or prompt_start < request.num_tokens - 1)
        )
        if num_sent is None or sends or loading or not decoding:
            values[request_id] = None
            slow.append(request_id)
        else:
            values[request_id] = emit_start_reference(request, variant)
    return values, slow


def _slow_reason(num_sent: int, num_hashes: int, quiet: bool) -> str:
    if num_sent < 0:
        return "new"
    if num_sent > num_hashes:
        raise _Whole  # "KV block-hash history shrank": upstream's assertion, its effects
    return "prompt" if quiet else "hashes"


def _scan_032(
    connector: Any, num_scheduled: dict[str, int], requests: dict[str, Any]
) -> tuple[dict[str, Any], list[str], dict[str, int]]:
    sent_get = connector._sent_hash_counts.get
    values: dict[str, Any] = {}
    slow: list[str] = []
    reasons: dict[str, int] = {}
    for request_id in num_scheduled:
        try:
            request = requests[request_id]
        except KeyError:
            raise _Whole from None  # upstream's KeyError, at that request
        sampling = request.sampling_params
        if sampling is None:
            raise _Whole  # upstream's assertion
        num_sent = sent_get(request_id, -1)
        num_hashes = len(request.block_hashes)
        if (
            num_sent == num_hashes
            and request.num_output_tokens
            and (emit := request.num_tokens - 1) > request.num_prompt_tokens
            and type(sampling.routed_experts_prompt_start) is int
        ):
            values[request_id] = emit
            continue
        reason = _slow_reason(num_sent, num_hashes, num_sent == num_hashes)
        reasons[reason] = reasons.get(reason, 0) + 1
        values[request_id] = None
        slow.append(request_id)
    return values, slow, reasons


def _scan_031(
    connector: Any, num_scheduled: dict[str, int], requests: dict[str, Any]
) -> tuple[dict[str, Any], list[str], dict[str, int]]:
    sent_get = connector._sent_hash_counts.get
    values: dict[str, Any] = {}
    slow: list[str] = []
    reasons: dict[str, int] = {}
    for request_id in num_scheduled:
        try:
            request = requests[request_id]
        except KeyError:
            raise _Whole from None
        sampling = request.sampling_params
        if sampling is None:
            raise _Whole
        num_sent = sent_get(request_id, -1)
        num_hashes = len(request.block_hashes)
        start = sampling.routed_experts_prompt_start
        if (
            num_sent == num_hashes
            and request.num_output_tokens
            and (emit := request.num_tokens - 1) > request.num_prompt_tokens
            and type(start) is int
            and emit > start
        ):
            values[request_id] = emit
            continue
        reason = _slow_reason(num_sent, num_hashes, num_sent == num_hashes)
        reasons[reason] = reasons.get(reason, 0) + 1
        values[request_id] = None
        slow.append(request_id)
    return values, slow, reasons


def _scan_033(
    connector: Any, num_scheduled: dict[str, int], requests: dict[str, Any]
) -> tuple[dict[str, Any], list[str], dict[str, int]]:
    sent_get = connector._sent_hash_counts.get
    hash_block_size = connector._hash_block_size
    loading = connector._loading
    values: dict[str, Any] = {}
    slow: list[str] = []
    reasons: dict[str, int] = {}
    for request_id, num_tokens in num_scheduled.items():
        try:
            request = requests[request_id]
        except KeyError:
            raise _Whole from None
        sampling = request.sampling_params
        if sampling is None or request.request_id != request_id:
            # _take_new_hashes reads the sent count under request.request_id: a request
            # keyed under another id gets upstream's answer (or error), whole.
            raise _Whole
        num_sent = sent_get(request_id, -1)
        num_hashes = len(request.block_hashes)
        # _take_new_hashes sends nothing unless min(num_hashes, keyed) > num_sent.
        quiet = num_sent == num_hashes or (
            0 <= num_sent < num_hashes
            and (request.num_computed_tokens + num_tokens) // hash_block_size <= num_sent
        )
        if (
            quiet
            and request.num_output_tokens
            and (emit := request.num_tokens - 1) > request.num_prompt_tokens
            and type(sampling.routed_experts_prompt_start) is int
            and not (loading and request_id in loading)
        ):
            values[request_id] = emit
            continue
        reason = _slow_reason(num_sent, num_hashes, quiet)
        if reason == "prompt" and request_id in loading:
            reason = "loading"
        reasons[reason] = reasons.get(reason, 0) + 1
        values[request_id] = None
        slow.append(request_id)
    return values, slow, reasons


# Verified source fingerprints (scripts/fingerprint.py).
_METADATA = frozenset({"675d2b630402ee5b", "39ee9e24bf7fd4e4"})
_PACKED_BLOCK_HASHES = frozenset({"9fafb80b6e8a7dd1"})  # identical in 0.31-0.33
# 0.31.0/0.32.0 (identical), 0.33.0 (the KV-cache-manager constructor).
_CONNECTOR_INIT = frozenset({"cdd8bf1fed84a47e", "015ffaecd312149d"})
_PACK_NEW_HASHES = frozenset({"64c59202c11ce9d1"})  # 0.31.0, 0.32.0
_TAKE_NEW_HASHES = frozenset({"81da0afc43de081d"})  # 0.33.0
# vllm/v1/request.py: identical in 0.31.0, 0.32.0 and 0.33.0.
_NUM_TOKENS = frozenset({"d29df866fdb5c8c1"})
_NUM_OUTPUT_TOKENS = frozenset({"616935f99e1c80fc"})
_REQUEST_INIT = frozenset({"639c859ff99c4821"})

SPEC = PatchSpec(
    name="batched_meta",
    summary="EngineCore's build_connector_meta computes quiet requests' emit starts at once",
    vllm_range=">=0.31,<0.34",
    processes=frozenset({Process.ENGINE_CORE}),
    targets=(
        Target(
            _CONNECTOR,
            "AuxOutputSchedulerConnector.build_connector_meta",
            _BUILD_CONNECTOR_META,
            _batched_meta,
        ),
    ),
    anchors=(
        # We replace the returned metadata's `requests` (a plain dataclass field).
        Anchor(_CONNECTOR, "AuxOutputConnectorMetadata", _METADATA),
        # Upstream builds these only for requests with new hashes (never fast ones).
        Anchor(_CONNECTOR, "PackedBlockHashes", _PACKED_BLOCK_HASHES),
        # The state we read and rebind: _sent_hash_counts (0.33: _loading, the hash
        # block size).
        Anchor(_CONNECTOR, "AuxOutputSchedulerConnector.__init__", _CONNECTOR_INIT),
        # "No new hash" means the helper returns None and leaves the count as it was.
        Anchor(
            _CONNECTOR,
            "AuxOutputSchedulerConnector._pack_new_hashes",
            _PACK_NEW_HASHES,
            releases="<0.33",
        ),
        Anchor(
            _CONNECTOR,
            "AuxOutputSchedulerConnector._take_new_hashes",
            _TAKE_NEW_HASHES,
            releases=">=0.33",
        ),
        # Read for every scheduled request, as upstream reads them: side-effect free
        # lengths (so reading them column-wise instead of row-wise changes nothing),
        # and the plain attributes num_prompt_tokens, block_hashes, sampling_params,
        # num_computed_tokens set up in __init__.
        Anchor(_REQUEST, "Request.num_tokens", _NUM_TOKENS),
        Anchor(_REQUEST, "Request.num_output_tokens", _NUM_OUTPUT_TOKENS),
        Anchor(_REQUEST, "Request.__init__", _REQUEST_INIT),
    ),
)
