"""batched_meta: build_connector_meta finds the requests that change nothing in one lean pass.

``AuxOutputSchedulerConnector.build_connector_meta`` (EngineCore, every step) walks each
scheduled request: ``setdefault`` of its sent-hash count, ``_pack_new_hashes`` (0.31,
0.32) or ``_take_new_hashes`` (0.33), then the emit start
``max(min(prompt_start, num_prompt_tokens), 0 if num_output_tokens == 0 else
num_tokens - 1)`` (0.31 has no ``min``). That is ~0.2-0.5 ms of EngineCore CPU per
step at 400 running requests and ~0.5-1.3 ms at 1000, almost all for requests where
nothing happens but the emit start moving one token on (and, for a few, a hash block
completing).

What the pass saves depends on the caches: on a step's requests measured hot
(``scripts/bench_meta.py``: the same step repeated) it is half of upstream's loop or
less; in the engine loop (``scripts/bench_meta.py --loop``) the requests' objects are
cold between steps, and touching them (the request, three lists, the sampling params:
the reads upstream's emit start needs) is most of both upstream's loop and the pass,
so the saving there is small.

*Fast* requests are those whose emit start does not depend on the prompt start's value
and whose step changes no connector state beyond their sent-hash count: already known
to ``_sent_hash_counts``, on 0.33 no ``_loading`` entry to pop, and decoding past the
prompt (an output token, ``num_tokens - 1 > num_prompt_tokens``, an ``int`` prompt
start; 0.31 also ``prompt_start < num_tokens - 1``), where upstream's emit start is
exactly ``num_tokens - 1``. One lean pass finds them and their emit starts (a dict
lookup, three lengths and an int per request, no call, no write); everything else is
upstream's code.

Most fast requests have no new block hash to send (0.31/0.32: as many hashes as sent;
0.33: ``min(len(block_hashes), (computed + scheduled) // hash_block_size)`` not beyond
the sent count). Those that completed a hash block (~6% of a decoding batch per step,
one per request every block of tokens) are fast too (``fast_hashes``): their hashes
are packed by upstream's own helper, ``_pack_new_hashes(block_hashes, num_sent)``
(0.31/0.32) or ``_pack_hashes(block_hashes[num_sent:num_keyed])`` (0.33, exactly what
``_take_new_hashes`` packs, with ``num_keyed`` computed as it does), and their count set
to what upstream sets (``len(block_hashes)``; 0.33 ``num_keyed``); keys already exist,
so the dict's order is unchanged. The packs are made before anything is written, so a
pack that raises (a hash that is not bytes) sends the step to upstream whole. The
counts are written before upstream's call on the other requests, which is upstream's
state unless upstream's first loop raises part way (it writes the counts of the
requests before the failing one only); after the scan's checks that loop can only
raise on a request whose prompt start is not an ``int`` or whose hashes it cannot join
(an item that is not ``bytes``), and on 0.33 reads the count under
``request.request_id``, so with such a request among the others (or one keyed under
another id) the step goes to upstream whole. A scheduled id with a pending terminal
event (it cannot be a known request: ``request_finished`` popped its count) would move
upstream's entry for it: whole as well.

Why a pass and not array operations: the cost of this step is touching each request's
objects (the request, its lists, its sampling params), not arithmetic. Measured on the
real scheduler's requests at N=400 with cold caches (as between engine steps), reading
the same values column-wise (``map``/``attrgetter``/``np.fromiter`` per attribute)
costs more than upstream's whole loop, while one lean pass costs about half of it.

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
wrapper runs on every step, fast or not. ``block_hashes`` is upstream's dict when no
fast request had hashes; otherwise it is rebuilt in upstream's order: scheduled
requests' packs in scheduler order (ours and upstream's interleaved), then upstream's
later entries (unscheduled hash-only updates in the dict's order, then terminal events).

Upstream's whole, untouched call handles any step we do not cover: not plain dicts, a
connector subclass or instance overriding the hash helpers, a scheduled id missing from
``requests``, ``sampling_params`` None or a hash history that shrank (upstream raises
its own error with its own effects), or a step of fewer than ``MIN_BATCH`` requests.

The prompt start's type is checked on every release (an ``int``, as ``SamplingParams``
declares it): anything else (``None``, a float) goes to upstream, whose ``min``/``max``
then computes or raises exactly as it would (found by review: 0.32/0.33 once skipped
the read, so ``None`` raised upstream's ``TypeError`` there and not here).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from itertools import filterfalse
from typing import Any

from prime_r3.fixes.aux_output import CONNECTOR_MODULE as _CONNECTOR
from prime_r3.fixes.batched_commit import Counters
from prime_r3.spec import Anchor, PatchSpec, Process, Target, WrapperFn


class MetaCounters(Counters):
    """``batched_commit``'s counters plus ``fast_hashes``: how many of the fast requests
    had new block hashes, packed by upstream's helper without upstream's loop."""

    def reset(self) -> None:
        super().reset()
        self.fast_hashes = 0

    def add(self, fast: int, reasons: Mapping[str, int], hashes: int = 0) -> None:
        super().add(fast, reasons)
        with self._lock:
            self.fast_hashes += hashes

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            fast_hashes = self.fast_hashes
        return super().snapshot() | {"fast_hashes": fast_hashes}


#: ``fast_requests``: scheduled requests whose emit start we computed
#: (``fast_hashes`` of them with new block hashes packed); the rest by reason: ``new``
#: (first schedule), ``hashes`` (block hashes to send while not decoding), ``prompt``
#: (prefill chunk, first output token, or 0.31's prompt start ahead), ``loading``
#: (0.33: a ``_loading`` entry to pop), ``step`` (the whole step went to upstream).
COUNTERS = MetaCounters()

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
    names = ("_take_new_hashes", "_pack_hashes") if variant == _V033 else ("_pack_new_hashes",)
    # What a class attribute lookup gives (the static helpers' functions).
    helpers = tuple((name, getattr(AuxOutputSchedulerConnector, name)) for name in names)
    scan = {_V031: _scan_031, _V032: _scan_032, _V033: _scan_033}[variant]
    if variant == _V033:  # _take_new_hashes packs _pack_hashes(block_hashes[num_sent:num_keyed])
        pack_hashes = AuxOutputSchedulerConnector._pack_hashes

        def pack(hashed: list[tuple[str, Any, int, int]]) -> dict[str, Any]:
            return {r: pack_hashes(hashes[sent:end]) for r, hashes, sent, end in hashed}

    else:  # _pack_new_hashes(block_hashes, num_sent) packs block_hashes[num_sent:]
        pack_new_hashes = AuxOutputSchedulerConnector._pack_new_hashes

        def pack(hashed: list[tuple[str, Any, int, int]]) -> dict[str, Any]:
            return {r: pack_new_hashes(hashes, sent) for r, hashes, sent, _ in hashed}

    def batched_meta(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        try:
            scheduler_output, requests = _arguments(args, kwargs)
            _check(instance, scheduler_output, requests, helpers)
            num_scheduled = scheduler_output.num_scheduled_tokens
            values, slow, reasons, hashed, order = scan(instance, num_scheduled, requests)
            packs = _pack(instance, num_scheduled, requests, slow, hashed, pack) if hashed else None
        except _Whole:
            count = len(getattr(_first(args, kwargs), "num_scheduled_tokens", None) or ())
            COUNTERS.add(0, {"step": count} if count else {})
            return wrapped(*args, **kwargs)
        sent = instance._sent_hash_counts
        num_known = len(num_scheduled) - reasons.get("new", 0)
        # The other requests' known entries; their place in the dict is read by nothing
        # (upstream's second loop skips scheduled ids, the merge below updates in place).
        kept = list(filter(sent.__contains__, slow))
        if len(sent) > num_known:
            # Unscheduled entries: upstream's second loop walks them in the dict's order.
            kept[:0] = filterfalse(num_scheduled.__contains__, sent)
        trimmed_sent = dict(zip(kept, map(sent.__getitem__, kept), strict=True))
        trimmed_output = copy.copy(scheduler_output)
        trimmed_output.num_scheduled_tokens = dict(
            zip(slow, map(num_scheduled.__getitem__, slow), strict=True)
        )
        COUNTERS.add(len(num_scheduled) - len(slow), reasons, len(hashed))
        if packs:
            # Upstream's first loop sets these counts (keys already present: no order
            # change); no upstream call below reads them (fast ids are not passed).
            sent.update([(item[0], item[3]) for item in hashed])
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
        if packs:
            metadata.block_hashes = _merge_hashes(order, packs, metadata.block_hashes)
        return metadata

    return batched_meta


def _pack(
    connector: Any,
    num_scheduled: dict[str, int],
    requests: dict[str, Any],
    slow: list[str],
    hashed: list[tuple[str, Any, int, int]],
    pack: Any,
) -> dict[str, Any]:
    """Upstream's packing of the new block hashes of the decoding requests that have some.

    Nothing is written here, so a _Whole raised here leaves upstream's whole call the
    state it would have had. Upstream's first loop writes these requests' counts in
    scheduler order, between its writes for the others; the caller writes them before
    upstream's call on the others, which is the same state unless upstream's first
    loop raises part way (then only the counts before the failing request are written).
    After the scan's checks that loop can raise on another request only through its
    prompt start (``min``/``max`` on a non-``int``), its hashes (``b"".join`` of a
    non-``bytes`` item, a ``block_hashes`` that is not a list) or, on 0.33, a
    ``request.request_id`` other than its key (``_take_new_hashes`` reads the count
    under it): with such a request among the others the step goes to upstream whole.
    A scheduled id with a pending terminal event (it cannot be a known request:
    ``request_finished`` popped its count) would move upstream's entry for it: whole too.
    """
    finished = connector._finished_requests
    if type(finished) is not dict or (
        finished and not finished.keys().isdisjoint(num_scheduled.keys())
    ):
        raise _Whole
    for request_id in slow:
        request = requests[request_id]
        hashes = request.block_hashes
        if (
            type(request.sampling_params.routed_experts_prompt_start) is not int
            or request.request_id != request_id
            or type(hashes) is not list
            or not _BYTES.issuperset(map(type, hashes))
        ):
            raise _Whole
    try:
        return pack(hashed)
    except Exception:  # noqa: BLE001 - e.g. a hash that is not bytes: upstream raises its own
        raise _Whole from None


#: The only item type a hash list may hold when upstream's loop runs beside our packs.
_BYTES = frozenset({bytes})


def _merge_hashes(
    order: list[str], packs: dict[str, Any], upstream: dict[str, Any]
) -> dict[str, Any]:
    """Upstream's ``block_hashes`` order: scheduled requests' packs in scheduler order,
    then what upstream's call added after its first loop (unscheduled, finished).

    ``order`` is the scheduled requests that were not fast-without-hashes, in scheduler
    order; upstream's packs of scheduled requests are among them (``_pack`` made sure
    no finished id is scheduled, so none of upstream's later entries has a scheduled id).
    """
    merged = {}
    for request_id in order:
        value = packs.get(request_id)
        if value is None:
            value = upstream.get(request_id)
            if value is None:
                continue
        merged[request_id] = value
    merged.update(upstream)
    return merged


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
    connector: Any, scheduler_output: Any, requests: Any, helpers: tuple[tuple[str, Any], ...]
) -> None:
    """Raise _Whole unless the step has the types and the connector the code we verified."""
    if (
        type(getattr(scheduler_output, "num_scheduled_tokens", None)) is not dict
        or type(requests) is not dict
        or type(getattr(connector, "_sent_hash_counts", None)) is not dict
        or len(scheduler_output.num_scheduled_tokens) < MIN_BATCH
    ):
        raise _Whole
    # A subclass or instance with its own hash helper may do more than upstream's.
    instance_attributes = getattr(connector, "__dict__", ())
    for name, upstream in helpers:
        if getattr(type(connector), name, None) is not upstream or name in instance_attributes:
            raise _Whole


# The scans: one lean pass over the scheduled requests, in the scheduler's order. Each
# returns the step's `requests` dict (the emit start of every fast request, a placeholder
# None where upstream's value goes), the other requests in order, and their reasons.
# A fast request is decoding past its prompt: it has an output token and
# num_tokens - 1 > num_prompt_tokens, with an int prompt start, so upstream's emit start
# max(min(prompt_start, num_prompt_tokens), num_tokens - 1) is exactly num_tokens - 1
# (0.31, without the min, needs prompt_start < num_tokens - 1 too). The lengths are
# read where the anchored num_tokens / num_output_tokens properties read them.
# Reading rows here and not columns is measured: the cost is touching each request's
# objects, and one pass over each request costs half of upstream's loop where column
# passes (map/attrgetter/np.fromiter per attribute) cost more than upstream's loop.


def _slow_reason(num_sent: int, num_hashes: int, quiet: bool) -> str:
    if num_sent < 0:
        return "new"
    if num_sent > num_hashes:
        raise _Whole  # "KV block-hash history shrank": upstream's assertion, its effects
    return "prompt" if quiet else "hashes"


_Scan = tuple[dict[str, Any], list[str], dict[str, int], list[tuple[str, Any, int, int]], list[str]]


def _scan_032(connector: Any, num_scheduled: dict[str, int], requests: dict[str, Any]) -> _Scan:
    sent_get = connector._sent_hash_counts.get
    values: dict[str, Any] = {}
    slow: list[str] = []
    reasons: dict[str, int] = {}
    hashed: list[tuple[str, Any, int, int]] = []
    order: list[str] = []
    for request_id in num_scheduled:
        try:
            request = requests[request_id]
        except KeyError:
            raise _Whole from None  # upstream's KeyError, at that request
        sampling = request.sampling_params
        if sampling is None:
            raise _Whole  # upstream's assertion
        num_sent = sent_get(request_id, -1)
        block_hashes = request.block_hashes
        num_hashes = len(block_hashes)
        emit = len(request._all_token_ids) - 1
        if (
            request._output_token_ids
            and emit > request.num_prompt_tokens
            and type(sampling.routed_experts_prompt_start) is int
        ):
            if num_sent == num_hashes:
                values[request_id] = emit
                continue
            if 0 <= num_sent < num_hashes:  # new hashes: upstream's helper packs them
                values[request_id] = emit
                hashed.append((request_id, block_hashes, num_sent, num_hashes))
                order.append(request_id)
                continue
        reason = _slow_reason(num_sent, num_hashes, num_sent == num_hashes)
        reasons[reason] = reasons.get(reason, 0) + 1
        values[request_id] = None
        slow.append(request_id)
        order.append(request_id)
    return values, slow, reasons, hashed, order


def _scan_031(connector: Any, num_scheduled: dict[str, int], requests: dict[str, Any]) -> _Scan:
    sent_get = connector._sent_hash_counts.get
    values: dict[str, Any] = {}
    slow: list[str] = []
    reasons: dict[str, int] = {}
    hashed: list[tuple[str, Any, int, int]] = []
    order: list[str] = []
    for request_id in num_scheduled:
        try:
            request = requests[request_id]
        except KeyError:
            raise _Whole from None
        sampling = request.sampling_params
        if sampling is None:
            raise _Whole
        num_sent = sent_get(request_id, -1)
        block_hashes = request.block_hashes
        num_hashes = len(block_hashes)
        emit = len(request._all_token_ids) - 1
        start = sampling.routed_experts_prompt_start
        if (
            request._output_token_ids
            and emit > request.num_prompt_tokens
            and type(start) is int
            and emit > start
        ):
            if num_sent == num_hashes:
                values[request_id] = emit
                continue
            if 0 <= num_sent < num_hashes:
                values[request_id] = emit
                hashed.append((request_id, block_hashes, num_sent, num_hashes))
                order.append(request_id)
                continue
        reason = _slow_reason(num_sent, num_hashes, num_sent == num_hashes)
        reasons[reason] = reasons.get(reason, 0) + 1
        values[request_id] = None
        slow.append(request_id)
        order.append(request_id)
    return values, slow, reasons, hashed, order


def _scan_033(connector: Any, num_scheduled: dict[str, int], requests: dict[str, Any]) -> _Scan:
    sent_get = connector._sent_hash_counts.get
    hash_block_size = connector._hash_block_size
    loading = connector._loading
    values: dict[str, Any] = {}
    slow: list[str] = []
    reasons: dict[str, int] = {}
    hashed: list[tuple[str, Any, int, int]] = []
    order: list[str] = []
    for request_id, num_tokens in num_scheduled.items():
        try:
            request = requests[request_id]
        except KeyError:
            raise _Whole from None
        sampling = request.sampling_params
        if sampling is None:
            raise _Whole
        num_sent = sent_get(request_id, -1)
        block_hashes = request.block_hashes
        num_hashes = len(block_hashes)
        emit = len(request._all_token_ids) - 1
        # _take_new_hashes sends block_hashes[num_sent:num_keyed] if num_keyed > num_sent.
        quiet = num_sent == num_hashes
        num_keyed = num_sent
        if 0 <= num_sent < num_hashes:
            num_keyed = min(
                num_hashes, (request.num_computed_tokens + num_tokens) // hash_block_size
            )
            quiet = num_keyed <= num_sent
        if (
            request._output_token_ids
            and emit > request.num_prompt_tokens
            and type(sampling.routed_experts_prompt_start) is int
            and not (loading and request_id in loading)
        ):
            if quiet:
                values[request_id] = emit
                continue
            # _take_new_hashes reads and writes the count under request.request_id.
            if 0 <= num_sent < num_hashes and request.request_id == request_id:
                values[request_id] = emit
                hashed.append((request_id, block_hashes, num_sent, num_keyed))
                order.append(request_id)
                continue
        reason = _slow_reason(num_sent, num_hashes, quiet)
        if reason == "prompt" and request_id in loading:
            reason = "loading"
        reasons[reason] = reasons.get(reason, 0) + 1
        values[request_id] = None
        slow.append(request_id)
        order.append(request_id)
    return values, slow, reasons, hashed, order


# Verified source fingerprints (scripts/fingerprint.py).
_METADATA = frozenset({"675d2b630402ee5b", "39ee9e24bf7fd4e4"})
_PACKED_BLOCK_HASHES = frozenset({"9fafb80b6e8a7dd1"})  # identical in 0.31-0.33
# 0.31.0/0.32.0 (identical), 0.33.0 (the KV-cache-manager constructor).
_CONNECTOR_INIT = frozenset({"cdd8bf1fed84a47e", "015ffaecd312149d"})
_PACK_NEW_HASHES = frozenset({"64c59202c11ce9d1"})  # 0.31.0, 0.32.0
_TAKE_NEW_HASHES = frozenset({"81da0afc43de081d"})  # 0.33.0
_PACK_HASHES = frozenset({"8c529c18bf40a84d"})  # 0.33.0
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
        # 0.33: what _take_new_hashes packs new hashes with, called by us for the
        # decoding requests that have some (0.31/0.32: _pack_new_hashes itself).
        Anchor(
            _CONNECTOR,
            "AuxOutputSchedulerConnector._pack_hashes",
            _PACK_HASHES,
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
