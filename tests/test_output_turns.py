"""output_turns and its diff (15): a backlog of steps in vLLM's real ``AsyncMPClient``.

``tests/turns_scenarios.py`` queues a backlog of steps through vLLM's real output thread,
socket and ``AsyncMPClient``, and takes them as ``AsyncLLM``'s output handler does: with
``PRIME_R3_PATCHES=output_turns``, with ``PRIME_R3=0`` on the installed release, and with
``PRIME_R3=0`` on a copy patched with ``patches/``, each with R3 on and off. The same
steps must arrive in the same order everywhere, and only the fix with R3 on lets the loop
turn between them.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.test_upstream_diffs import RELEASE, SITE, patches
from tests.turns_scenarios import STEPS

ROOT = Path(__file__).resolve().parents[1]


def _start(
    out: Path, r3: bool, env_vars: dict[str, str], tree: Path | None = None
) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_R3")}
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="ERROR", **env_vars)
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (tree, ROOT) if p is not None)
    command = [sys.executable, "-m", "tests.turns_scenarios", str(out), str(int(r3))]
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("turns")
    tree = Path(patches.apply(SITE, RELEASE, tmp / "vllm_tree"))
    arms = {
        "overlay": (True, {"PRIME_R3_PATCHES": "output_turns"}),
        "overlay_r3_off": (False, {"PRIME_R3_PATCHES": "output_turns"}),
        "upstream": (True, {"PRIME_R3": "0"}),
        "diffs": (True, {"PRIME_R3": "0"}, tree),
        "diffs_r3_off": (False, {"PRIME_R3": "0"}, tree),
    }
    started = {arm: _start(tmp / f"{arm}.pickle", *spec) for arm, spec in arms.items()}
    found = {}
    for arm, process in started.items():
        output, _ = process.communicate(timeout=600)
        assert process.returncode == 0, output[-6000:]
        found[arm] = pickle.loads((tmp / f"{arm}.pickle").read_bytes())
    for arm in ("diffs", "diffs_r3_off"):
        assert Path(found[arm]["vllm_file"]).is_relative_to(tree), found[arm]["vllm_file"]
    assert Path(found["upstream"]["vllm_file"]).is_relative_to(SITE)
    return found


def _upstreams_fields(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps as described, without 02's ``packed_routed_experts`` (a field the diffs'
    ``EngineCoreOutputs`` has, None once the client unpacked the step)."""
    found = []
    for step in steps:
        name, fields = step["outputs"]
        if fields.get("packed_routed_experts", "absent") is None:
            fields = {k: v for k, v in fields.items() if k != "packed_routed_experts"}
        found.append({**step, "outputs": (name, fields)})
    return found


def test_the_handler_gets_upstreams_steps_in_upstreams_order(runs: dict) -> None:
    assert runs["overlay"]["state"] == "applied"
    assert len(runs["upstream"]["steps"]) == STEPS
    sent = [float(k + 1) for k in range(STEPS)]
    assert [s["timestamp"] for s in runs["upstream"]["steps"]] == sent
    for arm in ("overlay", "overlay_r3_off"):
        assert runs[arm]["steps"] == runs["upstream"]["steps"], arm
    for arm in ("diffs", "diffs_r3_off"):
        assert _upstreams_fields(runs[arm]["steps"]) == runs["upstream"]["steps"], arm


def test_upstream_works_off_a_backlog_in_one_turn_the_overlay_turns_per_step(
    runs: dict,
) -> None:
    # Upstream (and the overlay with R3 off): no task runs between two queued steps.
    assert runs["upstream"]["turns_before"][1:] == [0] * (STEPS - 1)
    assert runs["overlay_r3_off"]["turns_before"][1:] == [0] * (STEPS - 1)
    assert runs["diffs_r3_off"]["turns_before"][1:] == [0] * (STEPS - 1)
    # The fix: the ticker ran before every queued step reached the handler.
    for arm in ("overlay", "diffs"):
        assert all(t >= 1 for t in runs[arm]["turns_before"][1:]), runs[arm]
    counters = runs["overlay"]["counters"]
    # The cancelled call and the STEPS calls after it each found a step queued.
    assert counters == {"turns": STEPS + 1, "waited": 0, "r3_off": 0}, counters
    # R3 off: upstream's calls, the first taking its step before the cancel (12 in all).
    assert runs["overlay_r3_off"]["counters"] == {"turns": 0, "waited": 0, "r3_off": STEPS}


def test_a_call_cancelled_during_its_turn_takes_no_step(runs: dict) -> None:
    for arm in ("overlay", "diffs"):
        assert runs[arm]["cancelled"] and runs[arm]["left_after_cancel"] == STEPS, arm
    # Upstream's call takes its step in its first run, before the cancel reaches it.
    assert runs["upstream"]["left_after_cancel"] == STEPS - 1
    assert runs["overlay_r3_off"]["left_after_cancel"] == STEPS - 1
    assert runs["diffs_r3_off"]["left_after_cancel"] == STEPS - 1


def test_a_call_on_an_empty_queue_waits_and_an_engine_death_raises_as_upstream(
    runs: dict,
) -> None:
    for arm, seen in runs.items():
        assert not seen["waited_done_early"], arm  # it waited for the step
        (after_wait,) = _upstreams_fields([{"outputs": seen["after_wait"]}])
        assert after_wait["outputs"] == runs["upstream"]["after_wait"], arm
        assert seen["raised"] == runs["upstream"]["raised"], arm
    assert runs["upstream"]["raised"][0] == "EngineDeadError"
    overlay = runs["overlay"]
    assert overlay["counters_after_wait"]["waited"] == overlay["counters"]["waited"] + 1


def test_no_client_class_of_the_release_overrides_the_target() -> None:
    """The DP clients inherit ``AsyncMPClient.get_output_async``, so the patch covers
    them; an override in a release would be a client the patch silently misses."""
    import inspect

    from vllm.v1.engine import core_client

    clients = [
        cls
        for _, cls in inspect.getmembers(core_client, inspect.isclass)
        if issubclass(cls, core_client.AsyncMPClient) and cls is not core_client.AsyncMPClient
    ]
    assert clients, "no subclass of AsyncMPClient found"
    assert [c.__name__ for c in clients if "get_output_async" in vars(c)] == []


def test_a_client_whose_config_lacks_the_flag_gets_upstreams_call() -> None:
    """A config without ``aux_output_config`` (a test's stand-in config, say) is R3 off:
    upstream's call, counted, never an ``AttributeError`` upstream's call would not raise."""
    import asyncio
    from types import SimpleNamespace

    from prime_r3.fixes import output_turns

    async def upstream() -> str:
        return "step"

    client = SimpleNamespace(vllm_config=SimpleNamespace(), outputs_queue=None)
    before = output_turns.COUNTERS.snapshot()["r3_off"]
    got = asyncio.run(output_turns._turn_then(upstream, client, (), {}))
    assert got == "step"
    assert output_turns.COUNTERS.snapshot()["r3_off"] == before + 1
