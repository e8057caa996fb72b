"""``vllm serve`` through vLLM's CLI, 2 API servers and tensor parallel 2: prime_r3 against
``PRIME_R3=0``.

One server configuration covers both: ``vllm serve --api-server-count 2
--tensor-parallel-size 2`` (``vllm.entrypoints.cli.main``, run by
tests/vllm_cli_launcher.py), the small profile, the CPU engine settings of
``prime_r3.e2e.engine`` and ``VLLM_CPU_OMP_THREADS_BIND=0|1`` (one core per TP worker).
Each arm (r3_upstream, then r3_prime; one at a time on a 2-core machine) is started once,
sent a few short staggered requests, then more single ones until each API server logged
requests of its own (``--enable-log-requests``: ``Added request``, per pid), and stopped
with SIGTERM; the tests check what the run recorded. See tests/e2e_harness.py.
"""

from __future__ import annotations

import concurrent.futures
import pathlib
import re
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e_harness import PRIME, UPSTREAM, kv_bytes, needs_cpu_engine
from tests.test_e2e_serve import _parity, _requests

pytestmark = needs_cpu_engine

LAUNCHER = [sys.executable, str(pathlib.Path(__file__).with_name("vllm_cli_launcher.py")), "serve"]
SHAPE = {"api_server_count": 2, "tensor_parallel_size": 2, "enable_log_requests": True}
CLIENT = {"packed_hop", "response_rows", "response_b64", "response_json", "output_turns"}
WORKER = {"store_headroom", "batched_commit", "packed_outputs"}
_ADDED = re.compile(r"^\(\S+ pid=(\d+)\) INFO .*\] Added request ", re.M)


def _added(server: Any, pids: list[int]) -> list[int]:
    """How many requests each of ``pids`` logged as added (vLLM's own log)."""
    seen = [int(pid) for pid in _ADDED.findall(server.log_path.read_text(errors="replace"))]
    return [seen.count(pid) for pid in pids]


def _run(server: Any) -> dict[str, Any]:
    """Start, requests, SIGTERM: what the tests check, with the exit code and leftovers."""
    try:
        server.start()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = []
            for r in _requests(4, max_tokens=8):  # staggered: each arrives while others run
                futures.append(pool.submit(server.generate, r, 300))
                time.sleep(0.5)
            results = [f.result(timeout=330) for f in futures]
        api = [p.pid for p in server.processes() if p.name.startswith("ApiServer")]
        for r in _requests(8, max_tokens=2, base=20):  # until each API server had requests
            if len(api) != 2 or min(_added(server, api)) > 0:
                break
            results.append(server.generate(r, timeout=300))
        run = {"results": results, "api": api, "added": _added(server, api)}
        run["procs"] = [p for p in server.processes() if p.role != "forked"]
    finally:
        pgid = server.proc.pid  # the session's leader: start() ran Popen
        run_exit = server.stop(timeout=120)
    deadline = time.monotonic() + 30
    while server.group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.5)
    return {**run, "exit": run_exit, "left": server.group_alive(pgid), "log": server.log_path}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict, dict]]:
    from prime_r3.e2e import checkpoint
    from prime_r3.e2e.serve import Server

    profile = checkpoint.PROFILES["small"]
    model = checkpoint.ensure(profile)
    tmp = tmp_path_factory.mktemp("serve_cli")
    args = {"kv_cache_memory_bytes": kv_bytes(profile, 4096), "max_model_len": 512, **SHAPE}
    arms = []
    for name, env in (("r3_upstream", UPSTREAM), ("r3_prime", PRIME)):
        env = {**env, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
        arms.append(_run(Server(name, model, tmp, env=env, args=args, command=LAUNCHER)))
    yield arms[0], arms[1]


def test_cli_tp2_parity(runs: tuple[dict, dict]) -> None:
    """Token ids and routed-expert bytes of every request sent to both arms are identical."""
    upstream, prime = (r["results"] for r in runs)
    shared = min(len(upstream), len(prime))
    _parity(upstream[:shared], prime[:shared])
    shapes = [c["routed_experts"]["shape"] for r in prime[:4] for c in r["choices"]]
    assert shapes == [[20 + i + 8 - 1, 4, 4] for i in range(4)]


def test_cli_both_api_servers_served_requests(runs: tuple[dict, dict]) -> None:
    """Each arm's two API servers each added requests of their own to the engine."""
    for run in runs:
        assert len(run["api"]) == 2 and min(run["added"]) > 0, run["added"]


def test_cli_every_process_reports_its_patches(runs: tuple[dict, dict]) -> None:
    """The launcher, both API servers, EngineCore and both TP workers each printed their
    line once; with prime_r3 each API server has the client's patches in force, EngineCore
    packs only once both API servers declared, both workers have theirs; ``PRIME_R3=0``
    disables every patch everywhere."""
    from prime_r3.e2e.engine import visible_lines
    from prime_r3.patches import REGISTRY

    for run in runs:
        procs = run["procs"]
        names = sorted(re.sub(r"\d+$", "N", p.name) for p in procs)
        assert names == ["ApiServer_N"] * 2 + ["EngineCore", "MainProcess"] + ["VllmWorker-N"] * 2
        assert visible_lines(run["log"]) == {p.pid: 1 for p in procs}
        assert all(p.summaries == 1 for p in procs)
        assert len({p.version for p in procs}) == 1 and str(procs[0].version).endswith("+cpu")
    upstream, prime = (run["procs"] for run in runs)
    every = {spec.name for spec in REGISTRY}
    assert all(p.active == [] and set(p.disabled) == every for p in upstream), upstream
    for p in prime:
        assert p.disabled == [], p.describe()
        if p.name.startswith("ApiServer"):
            assert CLIENT <= set(p.active), p.describe()
        elif p.role == "worker":
            assert WORKER <= set(p.active), p.describe()
            assert any(s.startswith("engine_gc (no effect in a vLLM CPU worker") for s in p.skipped)
        elif p.role == "engine_core":
            assert "batched_take" in p.active and "packed_outputs" in p.installed, p.describe()
            hop = [
                m.split(" client(s) ")[0] for m in p.lines if m.startswith("prime_r3 packed_hop")
            ]
            both = "prime_r3 packed_hop: all 2"  # before it, at most the first of the two
            assert hop in ([both], ["prime_r3 packed_hop: 1 of 2", both]), hop


def test_cli_clean_shutdown(runs: tuple[dict, dict]) -> None:
    """SIGTERM: vllm serve exits 0 and no process of its group outlives it."""
    for run in runs:
        assert run["exit"] == 0 and not run["left"], run
