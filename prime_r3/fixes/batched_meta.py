"""batched_meta: build_connector_meta without a Python pass over every scheduled request.

``AuxOutputSchedulerConnector.build_connector_meta`` (EngineCore, every step) walks each
scheduled request: ``setdefault`` of its sent-hash count, ``_pack_new_hashes`` (0.31,
0.32) or ``_take_new_hashes`` (0.33), then the emit start
``max(min(prompt_start, num_prompt_tokens), 0 if num_output_tokens == 0 else
num_tokens - 1)`` (0.31 has no ``min``). At 400-1000 running requests that is ~0.5-1 ms
of EngineCore CPU per step, almost all for requests where nothing happens but the emit
start moving one token on.

*Fast* requests are those whose step changes no connector state: already sent (known
to ``_sent_hash_counts``), no new block hash to send (0.31/0.32: as many hashes as
sent; 0.33: ``min(len(block_hashes), (computed + scheduled) // hash_block_size)`` not
beyond the sent count) and, on 0.33, no ``_loading`` entry to pop. For them upstream's
loop only computes the emit start, which we compute for the whole step from arrays
filled by C-level ``map``s over upstream's ``Request`` objects (the same attributes and
properties upstream reads).

Design: upstream builds the metadata. We call ``wrapped`` (upstream's function, or the
inner wrapper of a patch registered before us, e.g. packed_outputs' reader declaration)
with a shallow copy of ``scheduler_output`` whose ``num_scheduled_tokens`` holds only
the other scheduled requests, in the scheduler's order, while ``_sent_hash_counts`` is
bound to a dict of only the entries not fast (in their order). Upstream's own code then
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

Upstream's whole, untouched call handles any step we do not cover: not plain dicts, a
connector subclass or instance overriding the hash helpers, a scheduled id missing from
``requests``, an attribute that fails (``sampling_params`` None), a prompt start that is
not an ``int``, a hash history that shrank (upstream's assertions raise with upstream's
effects), or a step of fewer than ``MIN_BATCH`` requests (numpy's fixed cost there is
more than the loop).
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Mapping
from itertools import compress, filterfalse, repeat
from typing import Any

import numpy as np

from prime_r3.fixes.aux_output import CONNECTOR_MODULE as _CONNECTOR
from prime_r3.fixes.batched_commit import Counters
from prime_r3.spec import Anchor, PatchSpec, Process, Target, WrapperFn

#: ``fast_requests``: scheduled requests whose emit start we computed; the rest by
#: reason: ``new`` (first schedule), ``hashes`` (block hashes to send), ``loading``
#: (0.33: a ``_loading`` entry to pop), ``step`` (the whole step went to upstream).
COUNTERS = Counters()

#: Below this many scheduled requests the whole step goes to upstream (counted as
#: ``step``): numpy's fixed per-call cost exceeds the loop's there.
MIN_BATCH = 16

_REQUEST = "vllm.v1.request"

# Verified build_connector_meta sources (scripts/fingerprint.py) and what each computes.
# 0.31.0: emit = max(prompt_start, floor); 0.32.0: max(min(prompt_start, num_prompt_tokens),
# floor); 0.33.0: as 0.32 with hashes taken up to the computed tokens (_take_new_hashes),
# a _loading pop per scheduled request, and retained/released hashes.
_V031, _V032, _V033 = "1c711c2cec26dcf1", "db0b9aab742a9e2d", "07c164aa04c92587"
_BUILD_CONNECTOR_META = frozenset({_V031, _V032, _V033})

_prompt_start = operator.attrgetter("sampling_params.routed_experts_prompt_start")
_num_prompt_tokens = operator.attrgetter("num_prompt_tokens")
_num_output_tokens = operator.attrgetter("num_output_tokens")
_num_tokens = operator.attrgetter("num_tokens")
_num_computed_tokens = operator.attrgetter("num_computed_tokens")
_block_hashes = operator.attrgetter("block_hashes")


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

    def batched_meta(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        try:
            scheduler_output, requests = _arguments(args, kwargs)
            plan = _plan(instance, scheduler_output, requests, variant, helper, upstream_helper)
        except _Whole:
            count = len(getattr(_first(args, kwargs), "num_scheduled_tokens", None) or ())
            COUNTERS.add(0, {"step": count} if count else {})
            return wrapped(*args, **kwargs)
        scheduled, emit, fast, reasons = plan
        fast_ids = set(compress(scheduled, fast))
        slow_ids = list(filterfalse(fast_ids.__contains__, scheduled))
        sent = instance._sent_hash_counts
        kept = list(filterfalse(fast_ids.__contains__, sent)) if len(fast_ids) < len(sent) else []
        trimmed_sent = dict(zip(kept, map(sent.__getitem__, kept), strict=True))
        trimmed_output = copy.copy(scheduler_output)
        num_scheduled = scheduler_output.num_scheduled_tokens
        trimmed_output.num_scheduled_tokens = dict(
            zip(slow_ids, map(num_scheduled.__getitem__, slow_ids), strict=True)
        )
        COUNTERS.add(len(fast_ids), reasons)
        instance._sent_hash_counts = trimmed_sent
        try:
            metadata = wrapped(trimmed_output, requests)
        finally:
            # Upstream only sets values and appends keys (setdefault) in this dict.
            instance._sent_hash_counts = sent
            sent.update(trimmed_sent)
        values = emit.tolist()
        if slow_ids:
            upstream_values = metadata.requests
            for position, request_id in zip(np.flatnonzero(~fast).tolist(), slow_ids, strict=True):
                values[position] = upstream_values[request_id]
        metadata.requests = dict(zip(scheduled, values, strict=True))
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


def _plan(
    connector: Any,
    scheduler_output: Any,
    requests: Any,
    variant: str,
    helper: str,
    upstream_helper: Any,
) -> tuple[list[str], np.ndarray, np.ndarray, dict[str, int]]:
    """(scheduled ids, emit starts, fast mask, fallback counts by reason), or _Whole."""
    num_scheduled = getattr(scheduler_output, "num_scheduled_tokens", None)
    sent = getattr(connector, "_sent_hash_counts", None)
    if (
        type(num_scheduled) is not dict
        or type(requests) is not dict
        or type(sent) is not dict
        or len(num_scheduled) < MIN_BATCH
        # A subclass or instance with its own hash helper may do more than upstream's.
        or getattr(type(connector), helper, None) is not upstream_helper
        or helper in getattr(connector, "__dict__", ())
    ):
        raise _Whole
    scheduled = list(num_scheduled)
    n = len(scheduled)
    try:
        reqs = list(map(requests.__getitem__, scheduled))
        starts = list(map(_prompt_start, reqs))
        if set(map(type, starts)) != {int}:
            raise _Whole  # upstream's max/min keep the object; ours would be an int
        start = np.fromiter(starts, np.int64, n)
        num_tokens = np.fromiter(map(_num_tokens, reqs), np.int64, n)
        num_output = np.fromiter(map(_num_output_tokens, reqs), np.int64, n)
        if variant != _V031:
            np.minimum(start, np.fromiter(map(_num_prompt_tokens, reqs), np.int64, n), out=start)
        num_sent = np.fromiter(map(sent.get, scheduled, repeat(-1)), np.int64, n)
        num_hashes = np.fromiter(map(len, map(_block_hashes, reqs)), np.int64, n)
        if variant == _V033:
            computed = np.fromiter(map(_num_computed_tokens, reqs), np.int64, n)
            computed += np.fromiter(num_scheduled.values(), np.int64, n)
            computed //= connector._hash_block_size
            keyed = np.minimum(num_hashes, computed)
            loading = connector._loading
    except (KeyError, AttributeError, TypeError, ValueError, OverflowError) as error:
        raise _Whole from error  # upstream meets the same failure at its request
    known = num_sent >= 0
    if bool((known & (num_sent > num_hashes)).any()):
        raise _Whole  # "KV block-hash history shrank": upstream's assertion
    emit = np.maximum(start, np.where(num_output == 0, 0, num_tokens - 1))
    if variant == _V033:
        quiet = keyed <= num_sent
    else:
        quiet = num_hashes == num_sent
    fast = known & quiet
    reasons: dict[str, int] = {}
    if variant == _V033 and loading:
        pops = np.fromiter(map(loading.__contains__, scheduled), bool, n)
        reasons["loading"] = int((fast & pops).sum())
        fast &= ~pops
    new = int(n - known.sum())
    hashes = int((known & ~quiet).sum())
    reasons.update(new=new, hashes=hashes)
    return scheduled, emit, fast, {k: v for k, v in reasons.items() if v}


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
    diff_pending="upstream would keep per-request emit inputs in arrays in build_connector_meta",
)
