"""``vllm serve`` with prime_r3 on 127.0.0.1: the routed-experts endpoint against ``PRIME_R3=0``.

One pair of servers (r3_upstream with ``PRIME_R3=0``, r3_prime with the overlay) on the
small profile, with ``--enable-scale-out`` (``POST /inference/v1/generate`` returns the
routed experts as base64 ``.npy``). Every request's token ids and routed-expert bytes are
compared. Requests are bounded in count and time; each server is stopped by this module
(the last test checks the clean shutdown itself). See tests/e2e_harness.py.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e_harness import PRIME, UPSTREAM, kv_bytes, needs_cpu_engine, prompt

pytestmark = needs_cpu_engine


def _requests(n: int, max_tokens: int = 12, base: int = 0) -> list[dict[str, Any]]:
    return [
        {"prompt": prompt(base + i, 20 + i), "max_tokens": max_tokens, "seed": 500 + base + i}
        for i in range(n)
    ]


def _concurrent(server: Any, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: server.generate(r, timeout=300), requests))


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    from prime_r3.e2e import checkpoint
    from prime_r3.e2e.serve import Server

    profile = checkpoint.PROFILES["small"]
    model = checkpoint.ensure(profile)
    tmp = tmp_path_factory.mktemp("serve")
    args = {"kv_cache_memory_bytes": kv_bytes(profile, 4096), "max_model_len": 512}
    pair = (
        Server("r3_upstream", model, tmp, env=UPSTREAM, args=args),
        Server("r3_prime", model, tmp, env=PRIME, args=args),
    )
    try:
        for s in pair:
            s.start()
        yield pair
    finally:
        for s in pair:
            if s.proc is not None:
                s.stop()


def _parity(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x == y, f"request {i}: r3_prime differs from r3_upstream"
        for c in x["choices"]:
            assert c["routed_experts"] is not None and c["routed_experts"]["dtype"] == "uint8"


def test_serve_concurrent_requests_parity(servers: tuple[Any, Any]) -> None:
    reqs = _requests(8)
    upstream, prime = (_concurrent(s, reqs) for s in servers)
    _parity(upstream, prime)
    shapes = [c["routed_experts"]["shape"] for r in prime for c in r["choices"]]
    assert shapes == [[20 + i + 12 - 1, 4, 4] for i in range(8)]


def test_serve_client_disconnects_mid_request(servers: tuple[Any, Any]) -> None:
    """A streaming client hangs up while 6 others run; they, and the server, are unaffected."""
    reqs = _requests(6, base=40)
    results = []
    for server in servers:
        with concurrent.futures.ThreadPoolExecutor(7) as pool:
            gone = pool.submit(
                server.disconnect_mid_request,
                {"prompt": prompt(99, 30), "max_tokens": 200, "seed": 9},
            )
            futures = [pool.submit(server.generate, r, 300) for r in reqs]
            gone.result(timeout=120)
            results.append([f.result(timeout=330) for f in futures])
        after = server.generate(_requests(1, base=80)[0], timeout=120)
        assert after["choices"][0]["routed_experts"] is not None
    _parity(*results)


def test_serve_processes_report_their_patches(servers: tuple[Any, Any]) -> None:
    """API server, EngineCore and worker each printed their line once; the overlay's
    patches are in force in EngineCore and the worker, engine_gc is skipped in the CPU
    worker with the reason, and nothing is in force anywhere with PRIME_R3=0."""
    from prime_r3.e2e.engine import visible_lines

    for server in servers:
        procs = [p for p in server.processes() if p.role != "forked"]
        assert sorted(p.role for p in procs) == ["engine_core", "front-end", "worker"], procs
        assert all(p.summaries == 1 for p in procs)
        assert visible_lines(server.log_path) == {p.pid: 1 for p in procs}
    upstream, prime = (s.processes() for s in servers)
    assert all(p.active == [] and p.disabled for p in upstream)
    roles = {p.role: p for p in prime}
    assert "batched_take" in roles["engine_core"].active
    assert {"store_headroom", "batched_commit", "packed_outputs"} <= set(roles["worker"].active)
    assert any(
        s.startswith("engine_gc (no effect in a vLLM CPU worker") for s in roles["worker"].skipped
    )


def test_serve_clean_shutdown(servers: tuple[Any, Any]) -> None:
    """SIGTERM: each server exits 0 and leaves no process of its group behind."""
    for server in servers:
        pgid = server.proc.pid
        assert server.stop(timeout=120) == 0, server.tail()
        deadline = time.monotonic() + 30
        while server.group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not server.group_alive(pgid), "an engine process outlived vllm serve"


def test_serve_bogus_patches_exits_with_the_config_error(tmp_path: Any) -> None:
    """A bad overlay setting stops ``vllm serve`` at start with the ConfigError message."""
    from prime_r3.e2e import checkpoint
    from prime_r3.e2e.serve import Server

    model = checkpoint.ensure(checkpoint.PROFILES["small"])
    server = Server("bogus", model, tmp_path, env={"PRIME_R3_PATCHES": "bogus"})
    with open(server.log_path, "wb") as log:
        proc = subprocess.Popen(
            server.argv, env=server.env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    try:
        code = proc.wait(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own group: whatever it left
    text = server.log_path.read_text(errors="replace")
    assert code != 0
    assert "PRIME_R3_PATCHES='bogus': unknown patch 'bogus'; valid names: all," in text, text[
        -3000:
    ]
