"""output_turns and its diff (12): a backlog of steps in vLLM's real ``AsyncMPClient``.

``tests/turns_scenarios.py`` queues a backlog of steps through vLLM's real output thread,
socket and ``AsyncMPClient``, and takes them as ``AsyncLLM``'s output handler does: with
``PRIME_R3_PATCHES=output_turns``, with ``PRIME_R3=0`` on the installed release, and with
``PRIME_R3=0`` on a copy patched with ``patches/``, each with R3 on and off, with a slice
of 0 (a turn before every waiting step) and with a slice longer than the backlog lasts.
The same steps must arrive in the same order everywhere; only the fix with R3 on lets the
loop turn between them, and within a slice it works the backlog off as upstream does.
The slice's clock itself is held in process (``test_*_slice_*``).
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
#: A slice far longer than the scenario's backlog of cheap steps takes to work off.
_LONG_SLICE_MS = 1000


def _start(
    out: Path, r3: bool, slice_ms: float, env_vars: dict[str, str], tree: Path | None = None
) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_R3")}
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="ERROR", **env_vars)
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (tree, ROOT) if p is not None)
    command = [sys.executable, "-m", "tests.turns_scenarios", str(out), str(int(r3))]
    command.append(str(slice_ms))
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


#: The patched tree's arms: run where the session runs the ``tree_parity`` tests (CI: the
#: default release only), as the other tree-parity runs are.
DIFFS = ("diffs", "diffs_r3_off", "diffs_slice")


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("turns")
    overlay, upstream = {"PRIME_R3_PATCHES": "output_turns"}, {"PRIME_R3": "0"}
    arms: dict[str, tuple[Any, ...]] = {  # (R3, slice ms, environment[, tree])
        "overlay": (True, 0, overlay),
        "overlay_r3_off": (False, 0, overlay),
        "upstream": (True, 0, upstream),
        "overlay_slice": (True, _LONG_SLICE_MS, overlay),
    }
    if any(item.get_closest_marker("tree_parity") for item in request.session.items):
        tree = Path(patches.apply(SITE, RELEASE, tmp / "vllm_tree"))
        arms["diffs"] = (True, 0, upstream, tree)
        arms["diffs_r3_off"] = (False, 0, upstream, tree)
        arms["diffs_slice"] = (True, _LONG_SLICE_MS, upstream, tree)
    started = {arm: _start(tmp / f"{arm}.pickle", *spec) for arm, spec in arms.items()}
    found = {}
    for arm, process in started.items():
        output, _ = process.communicate(timeout=600)
        assert process.returncode == 0, output[-6000:]
        found[arm] = pickle.loads((tmp / f"{arm}.pickle").read_bytes())
    for arm in DIFFS:
        if arm in found:
            assert Path(found[arm]["vllm_file"]).is_relative_to(tree), found[arm]["vllm_file"]
    assert Path(found["upstream"]["vllm_file"]).is_relative_to(SITE)
    return found


def _ran(runs: dict[str, Any], *arms: str) -> list[str]:
    """Those of ``arms`` that ran (the patched tree's only where tree_parity runs)."""
    return [arm for arm in arms if arm in runs]


@pytest.mark.tree_parity
def test_the_patched_trees_arms_ran(runs: dict[str, Any]) -> None:
    assert set(DIFFS) <= set(runs)


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
    for arm in ("overlay", "overlay_r3_off", "overlay_slice"):
        assert runs[arm]["steps"] == runs["upstream"]["steps"], arm
    for arm in _ran(runs, *DIFFS):
        assert _upstreams_fields(runs[arm]["steps"]) == runs["upstream"]["steps"], arm


def test_upstream_works_off_a_backlog_in_one_turn_the_overlay_turns_per_step(
    runs: dict,
) -> None:
    # Upstream (and the overlay with R3 off): no task runs between two queued steps.
    assert runs["upstream"]["turns_before"][1:] == [0] * (STEPS - 1)
    for arm in _ran(runs, "overlay_r3_off", "diffs_r3_off"):
        assert runs[arm]["turns_before"][1:] == [0] * (STEPS - 1), arm
    # The fix: the ticker ran before every queued step reached the handler.
    for arm in _ran(runs, "overlay", "diffs"):
        assert all(t >= 1 for t in runs[arm]["turns_before"][1:]), runs[arm]
    counters = runs["overlay"]["counters"]
    # The cancelled call and the STEPS calls after it each found a step queued.
    assert counters == {**_NONE, "turns": STEPS + 1}, counters
    # R3 off: upstream's calls, the first taking its step before the cancel (12 in all).
    assert runs["overlay_r3_off"]["counters"] == {**_NONE, "r3_off": STEPS}


def test_within_a_slice_the_backlog_is_worked_off_as_upstream_does(runs: dict) -> None:
    """The coalescing a stream behind the engine gets from upstream is kept: within the
    slice no other task runs between queued steps, in the handler and the socket task."""
    for arm in _ran(runs, "overlay_slice", "diffs_slice"):
        assert runs[arm]["turns_before"][1:] == [0] * (STEPS - 1), runs[arm]
        assert max(runs[arm]["queued_per_turn"]) >= STEPS - 1, runs[arm]
        # Upstream's call took its step in its first run, before the cancel reached it.
        assert runs[arm]["left_after_cancel"] == STEPS - 1, arm
    # The first call after the steps were queued (the cancelled one) starts the slice:
    # every call is within it.
    assert runs["overlay_slice"]["counters"] == {**_NONE, "within": STEPS}
    socket = runs["overlay_slice"]["socket_counters"]
    assert socket["socket_turns"] == 0 and socket["socket_within"] >= STEPS - 2, socket


_NONE = {
    "turns": 0,
    "within": 0,
    "waited": 0,
    "r3_off": 0,
    "socket_turns": 0,
    "socket_within": 0,
    "socket_foreign": 0,
}


def test_upstreams_socket_task_queues_a_backlog_in_one_turn_the_overlay_one_per_turn(
    runs: dict,
) -> None:
    # Upstream: pyzmq's done futures let the socket task receive every waiting step at
    # once (all STEPS, or all but the first if that one woke it on its own).
    for arm in _ran(runs, "upstream", "overlay_r3_off", "diffs_r3_off"):
        assert max(runs[arm]["queued_per_turn"]) >= STEPS - 1, (arm, runs[arm])
    # The fix: the first receive after waiting (its future pending) does not know yet
    # that it is behind, the second finds a message waiting; from then on one a turn.
    for arm in _ran(runs, "overlay", "diffs"):
        assert sum(runs[arm]["queued_per_turn"]) == STEPS, (arm, runs[arm])
        assert max(runs[arm]["queued_per_turn"]) <= 2, (arm, runs[arm])
    socket = runs["overlay"]["socket_counters"]
    assert socket["socket_turns"] >= STEPS - 2 and socket["socket_foreign"] == 0, socket
    assert runs["overlay_r3_off"]["socket_counters"]["socket_turns"] == 0


def test_a_call_cancelled_during_its_turn_takes_no_step(runs: dict) -> None:
    for arm in _ran(runs, "overlay", "diffs"):
        assert runs[arm]["cancelled"] and runs[arm]["left_after_cancel"] == STEPS, arm
    # Upstream's call takes its step in its first run, before the cancel reaches it.
    assert runs["upstream"]["left_after_cancel"] == STEPS - 1
    for arm in _ran(runs, "overlay_r3_off", "diffs_r3_off"):
        assert runs[arm]["left_after_cancel"] == STEPS - 1, arm


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
        output_turns._socket_turns(lambda: None, _client(sock), (), {}, 0.0)  # every step
        turns = _Turns()
        ticking = asyncio.create_task(turns.count())
        await asyncio.sleep(0)
        got = []
        for _ in range(4):
            start = turns.seen
            got.append((await sock.recv_multipart(copy=False), turns.seen - start))
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
        output_turns._socket_turns(lambda: None, _client(sock), (), {}, 0.0)  # every step
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


class _Turns:
    """The event loop's turns, counted by a task that yields at each (``count``)."""

    seen = 0

    async def count(self) -> None:
        import asyncio

        while True:
            self.seen += 1
            await asyncio.sleep(0)


class _Clock:
    """``output_turns._clock`` for a test: time moves only when the test says."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("slice_ms", [0, 25])
def test_the_handler_turns_once_a_slice_of_backlog_is_used_up(
    monkeypatch: pytest.MonkeyPatch, slice_ms: float
) -> None:
    """Each queued step costs 10 ms: with a 25 ms slice the loop turns before every
    fourth step (the slice started at the first), with 0 before every step; a call that
    finds the queue empty waits, and the next step found queued starts a new slice."""
    import asyncio

    from prime_r3.fixes import output_turns

    clock = _Clock()
    monkeypatch.setattr(output_turns, "_clock", clock)
    turn_then = output_turns._get_output_async({"slice_ms": slice_ms})

    async def main() -> tuple[list[int], dict[str, int]]:
        queue: asyncio.Queue[int] = asyncio.Queue()
        aux = SimpleNamespace(enable_return_routed_experts=True)
        client = SimpleNamespace(vllm_config=SimpleNamespace(aux_output_config=aux))
        client.outputs_queue = queue
        turns = _Turns()
        ticking = asyncio.create_task(turns.count())
        await asyncio.sleep(0)
        for k in range(8):
            queue.put_nowait(k)
        before = output_turns.COUNTERS.snapshot()
        got, turns_before = [], []
        for _ in range(8):
            start = turns.seen
            got.append(await turn_then(queue.get, client, (), {}))
            turns_before.append(turns.seen - start)
            clock.now += 0.010  # the step's processing
        # Empty: the call waits (the loop turns), and the next backlog's slice starts anew.
        waiting = asyncio.create_task(turn_then(queue.get, client, (), {}))
        await asyncio.sleep(0)
        for k in range(8, 11):
            queue.put_nowait(k)
        got.append(await waiting)
        for _ in range(2):
            start = turns.seen
            got.append(await turn_then(queue.get, client, (), {}))
            turns_before.append(turns.seen - start)
            clock.now += 0.010
        ticking.cancel()
        after = output_turns.COUNTERS.snapshot()
        assert got == list(range(11))
        return turns_before, {k: after[k] - before[k] for k in ("turns", "within", "waited")}

    turns_before, counts = asyncio.run(main())
    if slice_ms == 0:
        assert all(t >= 1 for t in turns_before), turns_before
        assert counts == {"turns": 10, "within": 0, "waited": 1}
    else:
        # Steps at 0, 10, 20 ms within the slice begun at 0; a turn at 30, the slice
        # restarts; 40, 50 within; a turn at 60; 70 within. After the wait: 80, 90 within.
        turned = [t >= 1 for t in turns_before]
        assert turned == [False, False, False, True, False, False, True, False, False, False]
        assert counts == {"turns": 2, "within": 8, "waited": 1}


def test_the_socket_task_turns_once_a_slice_of_waiting_messages_is_used_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Messages already waiting (done futures), 10 ms to decode each, a 25 ms slice: the
    first receive starts the slice, a turn comes before the receive that finds it used
    up; a receive that waited (a pending future) starts a new slice."""
    import asyncio

    from prime_r3.fixes import output_turns

    clock = _Clock()
    monkeypatch.setattr(output_turns, "_clock", clock)
    pending_at = {8}

    class Waiting(_Socket):
        made = 0

        def recv_multipart(self, *args: Any, **kwargs: Any) -> Any:
            loop = asyncio.get_running_loop()
            future = loop.create_future()
            k, Waiting.made = Waiting.made, Waiting.made + 1
            if k in pending_at:
                loop.call_later(0.01, future.set_result, k)
            else:
                future.set_result(k)
            return future

    async def main() -> list[bool]:
        sock = Waiting()
        wrap = output_turns._output_task({"slice_ms": 25})
        wrap(lambda: None, _client(sock), (), {})
        turned = []
        before = output_turns.COUNTERS.snapshot()["socket_turns"]
        for k in range(13):
            got = sock.recv_multipart(copy=False)
            turned.append(isinstance(got, asyncio.Task))
            assert await got == k
            clock.now += 0.010  # the message's decoding
        output_turns._forget_sockets()
        assert output_turns.COUNTERS.snapshot()["socket_turns"] == before + sum(turned)
        return turned

    turned = asyncio.run(main())
    # Receive k at 10k ms. 0 starts the slice; 1, 2 within it; 3 past it: a turn, the
    # slice restarts at 30; 4, 5 within; 6 a turn (60); 7 within; 8 within, and waits; 9
    # follows a wait: a new slice at 90; 10, 11 within; 12 a turn (120).
    expected = [False, False, False, True, False, False, True, False, False, False, False]
    assert turned == [*expected, False, True], turned
