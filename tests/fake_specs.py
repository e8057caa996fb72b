"""Registry records for the fake upstream modules (``tests/fake_upstream.py`` and friends).

The layer, stacking and plain-calling tests each register small patches on the same
fakes; one builder here so their specs cannot drift apart.
"""

from __future__ import annotations

from typing import Any

from prime_r3 import fingerprint
from prime_r3.spec import PatchSpec, Process, Target


def fp(obj: object) -> frozenset[str]:
    """The verified fingerprints of ``obj``: exactly its current source."""
    return frozenset({fingerprint.of_object(obj)})


def spec(name: str, *targets: Target, **kw: Any) -> PatchSpec:
    """A worker patch of ``targets`` for vLLM >=0.31,<0.34 (``kw``: other PatchSpec fields)."""
    return PatchSpec(
        name=name,
        summary="test",
        targets=targets,
        vllm_range=kw.pop("vllm_range", ">=0.31,<0.34"),
        processes=frozenset({Process.WORKER}),
        **kw,
    )
