"""vLLM's AuxOutput connector names that several patches target, declared once.

Not a patch: the module paths of ``vllm.distributed.aux_output_connector``, the verified
fingerprints of connector code that several patches target or anchor (packed_outputs,
batched_commit, batched_take), and the whole-class anchor on ``BlockObjectStore`` that
store_eviction and store_growth share (both rely on how ``put``, ``_retain``,
``_release`` and ``_evict_to_fit`` use ``_lru`` and ``_references`` together).
Fingerprint from scripts/fingerprint.py; store.py is byte-identical in vLLM 0.31.0 and
0.32.0. vLLM 0.33.0 rewrote the class (referenced keys leave the LRU, the arena grows),
so the anchor no longer verifies there: besides the version rule, the source guard alone
skips both patches on 0.33.
"""

from __future__ import annotations

from prime_r3.spec import Anchor

_PACKAGE = "vllm.distributed.aux_output_connector"
STORE_MODULE = f"{_PACKAGE}.store"
WORKER_MODULE = f"{_PACKAGE}.worker"
CONNECTOR_MODULE = f"{_PACKAGE}.connector"
ROUTED_EXPERTS_MODULE = f"{_PACKAGE}.routed_experts"

BLOCK_OBJECT_STORE = Anchor(STORE_MODULE, "BlockObjectStore", frozenset({"0655595744a153a8"}))

# Verified source fingerprints (scripts/fingerprint.py) shared by several patches. Each
# set holds every release's value where they differ (0.31/0.32, 0.33); the rest are
# byte-identical in vLLM 0.31.0, 0.32.0 and 0.33.0.
PROCESS_OUTPUT = frozenset({"06ee5fa311ada6e3"})
COMMIT_OUTPUT = frozenset({"29bd5bec6708d002"})
BEGIN_STEP = frozenset({"573fa6addb501b76", "679e7b1853ff78be"})
WORKER_REQUEST_STATE = frozenset({"6055aab0a3f9e256"})
PENDING_AUX_OUTPUT = frozenset({"41701d3db6f69d56"})
TAKE_OUTPUT = frozenset({"08dfe701debdb1e5"})
AUX_REQUEST_OUTPUT = frozenset({"c86fdd3be04a8c32"})
MATERIALIZE_ROUTED_EXPERTS = frozenset({"467c3027a566df14"})
