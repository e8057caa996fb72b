"""vLLM's AuxOutput connector names that several patches target, declared once.

Not a patch: the module paths of ``vllm.distributed.aux_output_connector`` and the
whole-class anchor on ``BlockObjectStore`` that store_eviction and store_growth share
(both rely on how ``put``, ``_retain``, ``_release`` and ``_evict_to_fit`` use ``_lru``
and ``_references`` together). Fingerprint from scripts/fingerprint.py; store.py is
byte-identical in vLLM 0.31.0 and 0.32.0. vLLM 0.33.0 rewrote the class (referenced keys
leave the LRU, the arena grows), so the anchor no longer verifies there: besides the
version rule, the source guard alone skips both patches on 0.33.
"""

from __future__ import annotations

from prime_r3.spec import Anchor

_PACKAGE = "vllm.distributed.aux_output_connector"
STORE_MODULE = f"{_PACKAGE}.store"
WORKER_MODULE = f"{_PACKAGE}.worker"
CONNECTOR_MODULE = f"{_PACKAGE}.connector"
ROUTED_EXPERTS_MODULE = f"{_PACKAGE}.routed_experts"

BLOCK_OBJECT_STORE = Anchor(STORE_MODULE, "BlockObjectStore", frozenset({"0655595744a153a8"}))
