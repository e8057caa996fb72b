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
from types import SimpleNamespace
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
    assert counters == {**_NONE, "turns": STEPS + 1}, counters
    # R3 off: upstream's calls, the first taking its step before the cancel (12 in all).
    assert runs["overlay_r3_off"]["counters"] == {**_NONE, "r3_off": STEPS}


_NONE = {"turns": 0, "waited": 0, "r3_off": 0, "socket_turns": 0, "socket_foreign": 0}


def test_upstreams_socket_task_queues_a_backlog_in_one_turn_the_overlay_one_per_turn(
    runs: dict,
) -> None:
    # Upstream: pyzmq's done futures let the socket task receive every waiting step at
    # once (all STEPS, or all but the first if that one woke it on its own).
    for arm in ("upstream", "overlay_r3_off", "diffs_r3_off"):
        assert max(runs[arm]["queued_per_turn"]) >= STEPS - 1, (arm, runs[arm])
    # The fix: the first receive after waiting (its future pending) does not know yet
    # that it is behind, the second finds a message waiting; from then on one a turn.
    for arm in ("overlay", "diffs"):
        assert sum(runs[arm]["queued_per_turn"]) == STEPS, (arm, runs[arm])
        assert max(runs[arm]["queued_per_turn"]) <= 2, (arm, runs[arm])
    socket = runs["overlay"]["socket_counters"]
    assert socket["socket_turns"] >= STEPS - 2 and socket["socket_foreign"] == 0, socket
    assert runs["overlay_r3_off"]["socket_counters"]["socket_turns"] == 0


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
    """The DP clients inherit ``AsyncMPClient.get_output_async`` and
    ``_ensure_output_queue_task``, so the patch covers them; an override in a release
    would be a client the patch silently misses."""
    import inspect

    from vllm.v1.engine import core_client

    clients = [
        cls
        for _, cls in inspect.getmembers(core_client, inspect.isclass)
        if issubclass(cls, core_client.AsyncMPClient) and cls is not core_client.AsyncMPClient
    ]
    assert clients, "no subclass of AsyncMPClient found"
    for target in ("get_output_async", "_ensure_output_queue_task"):
        assert [c.__name__ for c in clients if target in vars(c)] == [], target


def test_a_client_whose_config_lacks_the_flag_gets_upstreams_call() -> None:
    """A config without ``aux_output_config`` (a test's stand-in config, say) is R3 off:
    upstream's call, counted, never an ``AttributeError`` upstream's call would not raise."""
    import asyncio

    from prime_r3.fixes import output_turns

    async def upstream() -> str:
        return "step"

    client = SimpleNamespace(vllm_config=SimpleNamespace(), outputs_queue=None)
    before = output_turns.COUNTERS.snapshot()["r3_off"]
    got = asyncio.run(output_turns._turn_then(upstream, client, (), {}))
    assert got == "step"
    assert output_turns.COUNTERS.snapshot()["r3_off"] == before + 1


class _Socket:
    """An object with a class ``recv_multipart`` and a ``__dict__``, as pyzmq's sockets."""

    def recv_multipart(self, *args: Any, **kwargs: Any) -> Any:
        return ("class", args, kwargs)


def _client(socket: Any, r3: bool = True) -> Any:
    aux = SimpleNamespace(enable_return_routed_experts=r3)
    return SimpleNamespace(
        vllm_config=SimpleNamespace(aux_output_config=aux),
        resources=SimpleNamespace(output_socket=socket, output_queue_task=None),
    )


def test_the_socket_gets_its_recv_only_with_r3_on_and_revert_takes_it_back() -> None:
    from prime_r3.fixes import output_turns

    on, off = _Socket(), _Socket()
    output_turns._socket_turns(lambda: None, _client(on), (), {})
    output_turns._socket_turns(lambda: None, _client(off, r3=False), (), {})
    assert "recv_multipart" in vars(on) and "recv_multipart" not in vars(off)
    assert output_turns.SPEC.on_revert is output_turns._forget_sockets
    output_turns._forget_sockets()
    assert "recv_multipart" not in vars(on)
    assert on.recv_multipart(1, copy=False) == ("class", (1,), {"copy": False})


def test_no_task_made_leaves_the_socket_as_it_was() -> None:
    """Upstream's call raises (e.g. no running loop): the socket is left as it was."""
    from prime_r3.fixes import output_turns

    def no_loop() -> None:
        raise RuntimeError("no running event loop")

    sock = _Socket()
    with pytest.raises(RuntimeError, match="no running event loop"):
        output_turns._socket_turns(no_loop, _client(sock), (), {})
    assert "recv_multipart" not in vars(sock)


def test_the_socket_recv_awaits_the_class_methods_future_and_turns_when_behind() -> None:
    import asyncio

    from prime_r3.fixes import output_turns

    class Waiting(_Socket):
        """Messages 0 and 1 are already waiting (done futures); 2 is not yet."""

        made = 0

        def recv_multipart(self, *args: Any, **kwargs: Any) -> Any:
            future = asyncio.get_running_loop().create_future()
            k, Waiting.made = Waiting.made, Waiting.made + 1
            if k < 2:
                future.set_result((k, args, kwargs))
            else:
                asyncio.get_running_loop().call_later(0.01, future.set_result, (k, args, kwargs))
            return future

    async def main() -> list[tuple[Any, int]]:
        sock = Waiting()
        output_turns._socket_turns(lambda: None, _client(sock), (), {})
        turns = 0

        async def ticker() -> None:
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        ticking = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        got = []
        for _ in range(4):
            start = turns
            got.append((await sock.recv_multipart(copy=False), turns - start))
        ticking.cancel()
        output_turns._forget_sockets()
        return got

    before = output_turns.COUNTERS.snapshot()["socket_turns"]
    got = asyncio.run(main())
    assert [message for message, _ in got] == [(k, (), {"copy": False}) for k in range(4)]
    # None before 0 (its future was done: no suspension); 0 and 1 were waiting: the loop
    # turned before 1 and before 2 (which then waits); 3 waits too.
    assert got[0][1] == 0 and all(t >= 1 for _, t in got[1:]), got
    assert output_turns.COUNTERS.snapshot()["socket_turns"] == before + 2


def test_the_socket_recv_hands_out_futures() -> None:
    """Not behind: the class method's own future; behind: a task (a Future: done
    callbacks, cancel), so a caller of pyzmq's Future API (``recv_serialized``) works."""
    import asyncio

    from prime_r3.fixes import output_turns

    made: list[Any] = []

    class Waiting(_Socket):
        def recv_multipart(self, *args: Any, **kwargs: Any) -> Any:
            future = asyncio.get_running_loop().create_future()
            future.set_result(len(made))
            made.append(future)
            return future

    async def main() -> tuple[Any, Any, list[Any]]:
        sock = Waiting()
        output_turns._socket_turns(lambda: None, _client(sock), (), {})
        first = sock.recv_multipart()
        second = sock.recv_multipart()  # the first was done: behind
        called: list[Any] = []
        second.add_done_callback(called.append)
        results = [await first, await second]
        cancelled = sock.recv_multipart()  # behind again: cancelled during its turn
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        output_turns._forget_sockets()
        return first, second, [results, called == [second], len(made)]

    first, second, (results, called_back, received) = asyncio.run(main())
    assert type(first) is asyncio.Future and first.result() == 0
    assert isinstance(second, asyncio.Task) and second.result() == 1
    assert results == [0, 1] and called_back
    assert received == 2  # the cancelled call received nothing


def _foreign(*args: Any, **kwargs: Any) -> str:
    return "foreign"


def _with_own_recv() -> Any:
    sock = _Socket()
    sock.recv_multipart = _foreign
    return sock


class _Unhashable(_Socket):
    __hash__ = None  # type: ignore[assignment]


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(_with_own_recv, id="its_own_recv"),  # someone else's attribute
        pytest.param(SimpleNamespace, id="no_class_recv"),  # a stand-in
        pytest.param(_Unhashable, id="cannot_be_weakly_referenced"),
    ],
)
def test_a_socket_not_ours_to_wrap_is_left_as_found(make: Any) -> None:
    from prime_r3.fixes import output_turns

    sock = make()
    found = dict(vars(sock))
    before = output_turns.COUNTERS.snapshot()["socket_foreign"]
    assert output_turns._socket_turns(lambda: "made", _client(sock), (), {}) == "made"
    assert vars(sock) == found
    assert output_turns.COUNTERS.snapshot()["socket_foreign"] == before + 1
    output_turns._forget_sockets()  # not ours: stays
    assert vars(sock) == found
