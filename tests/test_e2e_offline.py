"""A real vLLM engine with prime_r3, offline (``LLM``): the overlay against ``PRIME_R3=0``.

One pair of engines (r3_upstream with ``PRIME_R3=0``, r3_prime with the overlay) per
mode, shared by the scenarios: multiprocess (vLLM's default: front-end, EngineCore and a
worker process) on the small profile, and in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on the uint16 profile (300 experts). Each scenario
runs the same requests on both and compares every request's token ids and routed-expert
bytes; each checks that vLLM's own counters show the scenario happened (preemptions,
prefix-cache hits). See tests/e2e_harness.py for when they run.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import pytest

from prime_r3.patches import REGISTRY
from tests.e2e_harness import (
    PRIME,
    UPSTREAM,
    assert_parity,
    assert_rows,
    basic,
    kv_bytes,
    needs_cpu_engine,
    prompt,
    run_both,
)

pytestmark = needs_cpu_engine


def _pair(tmp: pathlib.Path, profile_name: str, env: dict[str, str]) -> Iterator[tuple[Any, Any]]:
    from prime_r3.e2e import checkpoint, client

    profile = checkpoint.PROFILES[profile_name]
    model = checkpoint.ensure(profile)
    args = {"kv_cache_memory_bytes": kv_bytes(profile), "max_model_len": 512}
    upstream = client.Engine(
        "r3_upstream", model, r3=True, env={**env, **UPSTREAM}, args=args, workdir=tmp
    )
    prime = client.Engine("r3_prime", model, r3=True, env={**env, **PRIME}, args=args, workdir=tmp)
    with client.engines(upstream, prime) as pair:
        yield pair


@pytest.fixture(scope="module")
def mp_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    yield from _pair(tmp_path_factory.mktemp("mp"), "small", {})


@pytest.fixture(scope="module")
def inproc_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    yield from _pair(
        tmp_path_factory.mktemp("inproc"), "uint16", {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    )


def test_multiprocess_parity(mp_pair: tuple[Any, Any]) -> None:
    up, prime = run_both(mp_pair, basic())
    assert_parity(up, prime)
    assert_rows(prime, "uint8", layers=4, topk=4)
    lengths = {len(s["token_ids"]) for r in prime["results"] for s in r["samples"]}
    assert lengths == {12}


def test_prefix_cache_hits_with_n_samples(mp_pair: tuple[Any, Any]) -> None:
    """GRPO-style groups: a shared 96-token prompt, n=4 samples, two groups."""
    shared = prompt(7, 96)
    reqs = [
        {"prompt": shared + prompt(50 + g, 8), "max_tokens": 10, "n": 4, "seed": 300 + g}
        for g in range(2)
    ]
    up, prime = run_both(mp_pair, reqs)
    assert_parity(up, prime)
    assert all(len(r["samples"]) == 4 for r in prime["results"])
    for result in (up, prime):
        assert result["counters"]["vllm:prefix_cache_hits"] > 0


def test_forced_preemption(mp_pair: tuple[Any, Any]) -> None:
    """12 requests growing to ~160 tokens each in a 1024-token KV cache."""
    reqs = [{"prompt": prompt(900 + i, 64), "max_tokens": 96, "seed": 900 + i} for i in range(12)]
    up, prime = run_both(mp_pair, reqs)
    assert_parity(up, prime)
    for result in (up, prime):
        assert result["counters"]["vllm:num_preemptions"] > 0


def test_abort_mid_flight(mp_pair: tuple[Any, Any]) -> None:
    reqs = basic(n=6, max_tokens=16)
    up, prime = run_both(mp_pair, reqs, abort={"index": 2, "after_steps": 3})
    assert_parity(up, prime)
    for result in (up, prime):
        assert [r["finished"] for r in result["results"]] == [True, True, False, True, True, True]


def test_routed_experts_prompt_start(mp_pair: tuple[Any, Any]) -> None:
    reqs = [
        {
            "prompt": prompt(40 + i, 40),
            "max_tokens": 8,
            "seed": 40 + i,
            "routed_experts_prompt_start": k,
        }
        for i, k in enumerate((0, 16, 39))
    ]
    up, prime = run_both(mp_pair, reqs)
    assert_parity(up, prime)
    rows = [r["samples"][0]["routed_experts"]["shape"][0] for r in prime["results"]]
    assert rows == [40 + 8 - 1 - k for k in (0, 16, 39)]


def test_multiprocess_processes_report_their_patches(mp_pair: tuple[Any, Any]) -> None:
    """Each process (front-end, EngineCore, worker) printed its line once in vLLM's log;
    the overlay's arm has EngineCore's and the worker's patches in force there and
    engine_gc skipped in the CPU worker with the reason; the upstream arm none anywhere."""
    from prime_r3.e2e.engine import visible_lines

    upstream, prime = mp_pair
    for engine in (upstream, prime):
        procs = [p for p in engine.processes() if p.role != "forked"]
        assert sorted(p.role for p in procs) == ["engine_core", "front-end", "worker"], procs
        assert all(p.summaries == 1 for p in procs), [(p.role, p.summaries) for p in procs]
        assert visible_lines(engine.log_path) == {p.pid: 1 for p in procs}
        assert all(p.version is not None and p.version.endswith("+cpu") for p in procs)
    every = len(REGISTRY)  # PRIME_R3=0 disables every registry patch
    assert all(p.active == [] and len(p.disabled) == every for p in upstream.processes())
    roles = {p.role: p for p in prime.processes()}
    assert "batched_take" in roles["engine_core"].active
    assert {"store_headroom", "batched_commit", "packed_outputs"} <= set(roles["worker"].active)
    worker = roles["worker"]
    assert "engine_gc" not in worker.active and "engine_gc" not in worker.installed
    assert any(s.startswith("engine_gc (no effect in a vLLM CPU worker") for s in worker.skipped), (
        worker.skipped
    )


def test_in_process_uint16_parity(inproc_pair: tuple[Any, Any]) -> None:
    """In-process engine (one process), 300 experts: rows are uint16."""
    up, prime = run_both(inproc_pair, basic(n=6, max_tokens=10))
    assert_parity(up, prime)
    assert_rows(prime, "uint16", layers=2, topk=2)
    ids = {
        e for r in prime["results"] for s in r["samples"] for e in [s["routed_experts"]["sha256"]]
    }
    assert len(ids) == 6
    shared = prompt(3, 64)
    reqs = [{"prompt": shared, "max_tokens": 6, "n": 3, "seed": 77}]
    up, prime = run_both(inproc_pair, reqs)
    assert_parity(up, prime)
    from prime_r3.e2e.engine import visible_lines

    procs = inproc_pair[1].processes()
    assert [p.role for p in procs] == ["front-end"] and procs[0].summaries == 1
    assert visible_lines(inproc_pair[1].log_path) == {procs[0].pid: 1}
    assert {"batched_take", "store_headroom", "packed_outputs"} <= set(procs[0].active)
