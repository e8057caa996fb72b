"""packed_hop under data parallelism: vLLM's real DP clients and coordinator, two engines.

    python -m tests.test_dp_hop OUT.pickle    # one arm; PRIME_R3* set by the caller

vLLM's CPU build cannot run ``--data-parallel-size 2`` with an MoE model (its CPU
communicator has no ``all_gatherv`` for the MoE dispatch, issue 36), so the engines here
are stand-ins speaking vLLM's socket protocol, as ``prime-r3 bench wave``'s is; the rest
is vLLM's real code, built by its real constructors:

* the **DP coordinator**: ``DPCoordinator`` (its own process, forked by vLLM's
  ``get_mp_context``, ``DPCoordinatorProc`` as installed): engines subscribe and get
  ``READY``, engines' stats reach it and it publishes them to the clients;
* two **clients** (two API servers' worth): ``DPLBAsyncMPClient`` (the load-balancing
  client ``AsyncLLM`` builds for internal-LB data parallelism) with ``client_count=2`` and
  ``client_index`` 0 / 1, in externally-managed mode as a multi-API-server worker gets it
  (``client_addresses``: input, output, and the coordinator's ``stats_update_address``):
  ``MPClient.__init__`` waits for both engines' ready messages, the stats task
  subscribes to the coordinator, ``add_request_async`` picks the engine (load balancing
  over the coordinator's counts and its own in-flight requests) and
  ``get_output_async`` hands out what its output task decoded;
* two **engines**, each a process of its own (forked before any client exists, as
  vLLM's ``launch_core_engines`` forks them) holding a real ``DPEngineCoreProc`` object
  without its ``__init__`` and running its real threads: the input thread
  ``process_input_sockets`` (a DEALER per client with the engine's DP identity
  ``rank.to_bytes(2, "little")``, the ready message, the coordinator's XSUB and
  ``READY``; its real ``preprocess_add_request``), the output thread
  ``process_output_sockets`` (one PUSH per client, the coordinator's PUSH) and, for
  every request the input thread queues, the real ``DPEngineCoreProc._handle_client_request``
  (``START_DP_WAVE`` from the coordinator; the rest through ``EngineCoreProc``'s, which
  is where packed_hop takes the declaration). What replaces the scheduler and the model
  is a busy loop: each step every running request gets one output with its R3 rows
  (its prompt's rows first, then one row per token: ``(n, 46, 8)`` uint8, a function of
  the request id and position), one ``EngineCoreOutputs`` per client as vLLM's
  scheduler groups them, and the engine's request counts go to the coordinator as
  ``DPEngineCoreProc._maybe_publish_request_counts`` sends them.

Both arms (the overlay with all its patches, and ``PRIME_R3=0``) run the same waves of
requests, each client sending 8 (one with a prompt whose rows pass 8 KiB, which keeps
its own frame) and reading them all back through ``get_output_async``:

1. ``one_client``: only client 0 exists; each engine was started for two clients, so
   1 of 2 declared: every message upstream's;
2. ``declared``: client 1 built (it declares): both engines pack;
3. ``restarted``: engine 1 killed (SIGKILL) and a new engine process started with the
   same identity. vLLM's client takes an engine back under its identity only with
   elastic EP on (``MPClient`` then makes its input ROUTER with ``ZMQ_ROUTER_HANDOVER``),
   so both clients and the coordinator are configured with ``enable_elastic_ep`` (in
   these classes it changes only that and the coordinator's engine sockets, TCP instead
   of IPC); the test waits until a utility call reaches the new engine. No client
   declares again, so the new engine sends upstream's messages; engine 0 still packs;
4. ``redeclared_one``: client 0 declares again (the overlay's own ``_declare``, which
   the client's constructor runs): 1 of 2, the new engine still sends upstream's;
5. ``redeclared_all``: client 1 too: the new engine packs.

Each engine records every message its output thread sends (packed or upstream's, per
client) and every row it put on its outputs; the tests compare them with what the
clients received, and with the ``PRIME_R3=0`` arm's, byte for byte.

What stays untested, and why:

* vLLM's real EngineCore behind the sockets (``DPEngineCoreProc.__init__``, its busy
  loop, scheduler, model and the DP all-reduce): it needs an MoE model on a DP process
  group, which vLLM's CPU build cannot run. So the lockstep of the engines (dummy steps,
  ``wave_complete``, the coordinator's wave bookkeeping from real engines) is not
  exercised; the stand-ins step independently. The hop's code is the same in either
  case: packed_hop acts in the output thread and ``_handle_client_request``, both real.
* An engine **added** with a new identity: ``DPLBAsyncMPClient`` adds engines only by
  elastic EP scale-up (``_commit_scale_up_elastic_ep``), which needs the Ray DP backend's
  ``CoreEngineActorManager``, a torch TCP store and the engines' ``reinitialize_distributed``
  (vLLM asserts ``data_parallel_backend == "ray"``): not runnable here. By the contract
  such an engine is in the restarted engine's place: no client declares to it (clients
  declare in their constructor only), so it sends upstream's messages.
* An engine restarted under its identity **without** elastic EP: vLLM's client ROUTER
  (no handover) never routes to the new connection, so the new engine gets no request
  at all, with or without the overlay (seen with raw pyzmq here, libzmq 4.3.5): vLLM's
  limit, no path of the hop.
* A restarted engine in a deployment stays on upstream's messages for the rest of its
  clients' lives (vLLM's client never calls its constructor again). Rows are safe; the
  saving is lost for that engine. Waves 4-5 declare again with the overlay's function to
  show the engine packs once every client has declared, not a path vLLM takes.
* ``DPAsyncMPClient`` on its own (external / hybrid LB: one engine per client, the
  engine's ``dp_stats_address`` in its ready message) and clients and engines on other
  machines (the clients' sockets over TCP): the same client code for the hop
  (``AsyncMPClient.__init__`` declares to every engine in ``core_engines``), not built
  here.
* The API server above the client (``AsyncLLM``'s output handler and processor):
  ``get_output_async`` is where this test reads the rows; the rest is the
  one-engine path, tested elsewhere (``test_front_end_parity.py``, ``test_e2e_*.py``).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import pickle
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
WAVES = ("one_client", "declared", "restarted", "redeclared_one", "redeclared_all")
PER_CLIENT, LONG_PROMPT, SHORT_PROMPT, MAX_TOKENS = 8, 32, 3, 5
SHAPE = (46, 8)  # layers x top-k, uint8: 368 bytes a row; 32 rows pass 8 KiB
IDENTITY = {rank: rank.to_bytes(2, "little") for rank in (0, 1)}


# -- the arm (a subprocess) ----------------------------------------------------------------


def _rows(request_id: str, position: int, n: int) -> Any:
    import numpy as np

    seed = int.from_bytes(hashlib.sha256(f"{request_id}:{position}".encode()).digest()[:8])
    return np.random.default_rng(seed).integers(0, 128, (n, *SHAPE), dtype=np.uint8)


def _config() -> Any:
    """What vLLM's DP clients and ``DPCoordinator`` read of the config: internal LB, two
    local engines managed by one front end (ranks 0 and 1), elastic EP on: the
    deployment in which vLLM's client takes an engine back under its identity (its
    input ROUTER with ``ZMQ_ROUTER_HANDOVER``; without it the ROUTER keeps routing to
    the dead connection and the new engine never gets a request)."""
    from types import SimpleNamespace

    parallel = SimpleNamespace(
        enable_elastic_ep=True,
        enable_fault_tolerance=False,
        data_parallel_size=2,
        data_parallel_index=0,
        data_parallel_rank=0,
        data_parallel_size_local=2,
        data_parallel_rank_local=None,
        data_parallel_master_ip="127.0.0.1",
        data_parallel_external_lb=False,
        data_parallel_hybrid_lb=False,
        local_engines_only=False,
    )
    cache = SimpleNamespace(effective_attention_block_size=None)
    return SimpleNamespace(parallel_config=parallel, cache_config=cache, model_config=None)


def _engine_main(
    rank: int, inputs: list[str], outputs: list[str], coord: tuple[str, str], conn: Any
) -> None:
    """One EngineCore process (see the module docstring); answers ``report`` on
    ``conn`` with what it sent since the last report, and stops on ``stop``."""
    import msgspec
    import zmq
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.engine.core import DPEngineCoreProc, EngineCoreProc, EngineShutdownState
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder

    from prime_r3.fixes import packed_hop
    from tests.hop_scenarios import _Records

    packed_hop.COUNTERS.reset()  # the fork's copy of the parent's
    records = _Records().__enter__()
    engine = DPEngineCoreProc.__new__(DPEngineCoreProc)
    engine.input_queue, engine.aborts_queue = queue.Queue(), queue.Queue()
    engine.output_queue = queue.Queue()
    engine.tensor_ipc_receiver = engine.mm_receiver_cache = None
    engine.request_block_hasher = None
    engine.shutdown_state = EngineShutdownState.RUNNING
    engine.reject_new_requests = False  # 0.33: not paused
    engine._make_ready_response = lambda: msgspec.Raw(b"")  # nothing to sync back
    engine.engine_index, engine.current_wave = rank, 0
    engine.engines_running = engine.ignore_start_dp_wave = False
    engine.ping = lambda: "pong"
    live: dict[str, list[Any]] = {}  # request id -> [Request, position]

    def add_request(request: Any, request_wave: int = 0) -> None:  # the scheduler's place
        live[request.request_id] = [request, 0]
        engine.current_wave = max(engine.current_wave, request_wave)

    engine.add_request = add_request

    # Every message the output thread sends: to which client, packed or upstream's.
    head = 0x90 + len(EngineCoreOutputs.__struct_fields__) + 1
    upstream = MsgpackDecoder(EngineCoreOutputs)
    send = EngineCoreProc._send_msg_tracking_payload
    endpoints = {path: i for i, path in enumerate(outputs)}
    wire: list[dict[str, Any]] = []

    def tracking(socket: Any, buffers: Any) -> Any:
        first = memoryview(buffers[0]).cast("B")
        entry = {
            "client": endpoints[socket.getsockopt(zmq.LAST_ENDPOINT).decode()],
            "packed": bool(first.nbytes) and first[0] == head,
            "frames": len(buffers),
        }
        if not entry["packed"]:
            message = upstream.decode(buffers)
            entry["outputs"] = len(message.outputs)
            entry["small"] = sum(  # rows pack wants: under 8 KiB
                o.routed_experts is not None and o.routed_experts.nbytes < 8192
                for o in message.outputs
            )
            entry["utility"] = message.utility_output is not None
        wire.append(entry)
        return send(socket, buffers)

    engine._send_msg_tracking_payload = tracking

    ready = threading.Event()
    threading.Thread(
        target=EngineCoreProc.process_input_sockets,
        args=(engine, inputs, coord[0], IDENTITY[rank], ready),
        daemon=True,  # upstream's input thread never returns
    ).start()
    threading.Thread(
        target=EngineCoreProc.process_output_sockets,
        args=(engine, outputs, coord[1], rank),
        daemon=True,
    ).start()
    if not ready.wait(60):
        raise RuntimeError(f"engine {rank}: no READY from the DP coordinator")
    conn.send(("ready", rank))

    sent: dict[str, list[tuple[str, tuple[int, ...], bytes]]] = {}
    served: list[tuple[int, str]] = []
    last_counts = None

    def report() -> dict[str, Any]:
        record = packed_hop._records.get(engine)
        taken = wire[: len(wire)]
        del wire[: len(taken)]
        found = {
            "counters": packed_hop.COUNTERS.snapshot(),
            "declared": None if record is None else sorted(record.declared),
            "clients": None if record is None else record.clients,
            "wire": taken,
            "sent": dict(sent),
            "served": list(served),
            "loud": [r for r in records.described() if r[1] not in ("DEBUG", "INFO") or r[3]],
        }
        sent.clear()
        served.clear()
        return found

    while True:
        if conn.poll(0):
            command = conn.recv()
            if command == "stop":
                return
            while engine.output_queue.qsize():  # the steps so far, sent
                time.sleep(0.002)
            conn.send(report())
        try:
            request = engine.input_queue.get(timeout=0 if live else 0.005)
        except queue.Empty:
            request = None
        while request is not None:  # as the busy loop: every request queued so far
            engine._handle_client_request(*request)
            try:
                request = engine.input_queue.get_nowait()
            except queue.Empty:
                request = None
        if not live:
            continue
        steps: dict[int, list[Any]] = {}
        finished: dict[int, set[str]] = {}
        for request_id, entry in list(live.items()):
            request, position = entry
            if position == 0:
                served.append((request.client_index, request_id))
            n = len(request.prompt_token_ids) if position == 0 else 1
            rows = _rows(request_id, position, n)
            sent.setdefault(request_id, []).append((rows.dtype.str, rows.shape, rows.tobytes()))
            last = position + 1 == request.sampling_params.max_tokens
            steps.setdefault(request.client_index, []).append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=[1000 * rank + position],
                    finish_reason=FinishReason.LENGTH if last else None,
                    routed_experts=rows,
                )
            )
            if last:
                del live[request_id]
                finished.setdefault(request.client_index, set()).add(request_id)
            else:
                entry[1] += 1
        for client, step in steps.items():
            message = EngineCoreOutputs(
                outputs=step,
                timestamp=time.monotonic(),
                finished_requests=finished.get(client) or None,
            )
            engine.output_queue.put_nowait((client, message))
        counts = (0, len(live))
        if counts != last_counts:  # as _maybe_publish_request_counts
            last_counts = counts
            stats = SchedulerStats(num_running_reqs=len(live), num_waiting_reqs=0)
            engine.output_queue.put_nowait((-1, EngineCoreOutputs(scheduler_stats=stats)))
        time.sleep(0.002)  # a step's time: requests sent meanwhile join the next one


def _engine_process(
    rank: int,
    inputs: list[str],
    outputs: list[str],
    coord: tuple[str, str],
    conn: Any,
    wait: bool,
) -> None:
    try:
        if not wait or conn.recv() == "go":
            _engine_main(rank, inputs, outputs, coord, conn)
    except BaseException:  # noqa: BLE001 - handed to the driver
        conn.send(("error", traceback.format_exc()))
    finally:
        os._exit(0)


def _describe(output: Any) -> tuple[Any, ...]:
    rows = output.routed_experts
    if rows is not None:
        flags = rows.flags
        rows = (
            type(rows).__name__,
            rows.dtype.str,
            rows.shape,
            rows.tobytes(),
            flags.writeable,
            flags.c_contiguous,
        )
    reason = None if output.finish_reason is None else str(output.finish_reason)
    return list(output.new_token_ids), reason, rows


def _request(request_id: str, prompt_len: int) -> Any:
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    params = SamplingParams(max_tokens=MAX_TOKENS, detokenize=False)
    return EngineCoreRequest(
        request_id, [7] * prompt_len, None, params, None, 0.0, None, None, None,
        external_req_id=request_id,
    )  # fmt: skip


def run_arm() -> dict[str, Any]:
    import multiprocessing

    from prime_r3 import layer

    layer.apply()
    from vllm.v1.engine import core, core_client
    from vllm.v1.engine.coordinator import DPCoordinator

    del core  # imported: packed_hop's EngineCore targets installed before any fork
    state = layer.status().outcome("packed_hop").state

    from prime_r3.fixes import packed_hop
    from tests.hop_scenarios import _addresses, _Records, _wait_declared

    coordinator = DPCoordinator(_config().parallel_config)
    coord = coordinator.get_engine_socket_addresses()
    stats_address = coordinator.get_stats_publish_address()
    (in0, out0), (in1, out1) = _addresses(2)
    fork = multiprocessing.get_context("fork")

    def start(rank: int, wait: bool) -> tuple[Any, Any]:
        parent, child = fork.Pipe()
        args = (rank, [in0, in1], [out0, out1], coord, child, wait)
        process = fork.Process(target=_engine_process, args=args, daemon=True)
        process.start()
        child.close()
        return process, parent

    def ask(conn: Any, command: str, timeout: float = 60) -> Any:
        if command:
            conn.send(command)
        if not conn.poll(timeout):
            raise RuntimeError(f"no answer to {command!r} from an engine")
        answer = conn.recv()
        if isinstance(answer, tuple) and answer[0] == "error":
            raise RuntimeError(answer[1])
        return answer

    # Every engine process is forked here, before any client thread or socket exists;
    # engine 1's replacement waits for its turn.
    engines = {0: start(0, False), 1: start(1, False)}
    spare = start(1, True)

    def client(index: int) -> Any:
        addresses = {"input_address": (in0, in1)[index], "output_address": (out0, out1)[index]}
        addresses["stats_update_address"] = stats_address
        return core_client.DPLBAsyncMPClient(
            _config(), None, False, client_addresses=addresses, client_count=2, client_index=index
        )

    async def wave(clients: list[Any], tag: str) -> dict[str, Any]:
        async def one(c: Any) -> dict[str, list[Any]]:
            ids = []
            for i in range(PER_CLIENT):
                request_id = f"{tag}-c{c.client_index}-{i}"
                ids.append(request_id)
                await c.add_request_async(
                    _request(request_id, LONG_PROMPT if i == 0 else SHORT_PROMPT)
                )
            got: dict[str, list[Any]] = {}
            pending = set(ids)
            while pending:
                outputs = await asyncio.wait_for(c.get_output_async(), 60)
                for output in outputs.outputs:
                    got.setdefault(output.request_id, []).append(_describe(output))
                    if output.finish_reason is not None:
                        pending.discard(output.request_id)
            return got

        try:
            received = await asyncio.gather(*(one(c) for c in clients))
        except TimeoutError:
            for rank, (_, conn) in engines.items():
                if conn.poll(0):
                    raise RuntimeError(f"engine {rank}: {conn.recv()}") from None
            raise
        loop = asyncio.get_running_loop()
        reports = {}
        for rank, (_, conn) in engines.items():
            reports[rank] = await loop.run_in_executor(None, ask, conn, "report")
        declarations = dict(packed_hop.COUNTERS.declarations)
        return {"received": received, "engines": reports, "declarations": declarations}

    async def declared() -> list[str]:
        return await asyncio.get_running_loop().run_in_executor(None, _wait_declared, None)

    async def reach(clients: list[Any], rank: int) -> None:
        """Until each client's ROUTER routes to the engine that took ``rank``'s identity
        (a request sent before that is dropped, as ZMQ's ROUTER drops one to an unknown
        peer)."""
        for c in clients:
            deadline = time.monotonic() + 60
            while True:
                call = c._call_utility_async("ping", engine=IDENTITY[rank])
                try:
                    assert await asyncio.wait_for(call, 1) == "pong"
                    break
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise

    async def main() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        for rank, (_, conn) in engines.items():
            assert await loop.run_in_executor(None, ask, conn, "") == ("ready", rank)
        result: dict[str, Any] = {"state": state, "waves": {}}
        waves = result["waves"]
        with _Records() as records:
            clients = [client(0)]
            result["declared_first"] = await declared()
            waves["one_client"] = await wave(clients, "w1")
            clients.append(client(1))
            result["declared_second"] = await declared()
            waves["declared"] = await wave(clients, "w2")
            # Engine 1 dies and a new process takes its identity.
            process, conn = engines[1]
            os.kill(process.pid, signal.SIGKILL)
            process.join(30)
            engines[1] = spare
            spare[1].send("go")
            assert await loop.run_in_executor(None, ask, spare[1], "") == ("ready", 1)
            await reach(clients, 1)
            waves["restarted"] = await wave(clients, "w3")
            packed_hop._declare(clients[0], 0)
            await declared()
            waves["redeclared_one"] = await wave(clients, "w4")
            packed_hop._declare(clients[1], 1)
            await declared()
            waves["redeclared_all"] = await wave(clients, "w5")
            result["coordinator_alive"] = coordinator.proc.is_alive()
            result["lb_engines"] = [list(map(float, e)) for e in clients[0].lb_engines]
            for c in clients:
                c.shutdown()
        result["records"] = records.described()
        result["client_counters"] = packed_hop.COUNTERS.snapshot()
        return result

    try:
        return asyncio.run(main())
    finally:
        shutil.rmtree(os.path.dirname(in0.removeprefix("ipc://")), ignore_errors=True)
        for process, conn in engines.values():
            if process.is_alive():
                conn.send("stop")
                process.join(10)
        if spare[0].is_alive():
            spare[0].kill()
        coordinator.shutdown()


def main() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    result = run_arm()
    with open(sys.argv[1], "wb") as f:
        pickle.dump(result, f)
    print("ok")


# -- the tests -----------------------------------------------------------------------------


def _start(out: Path, env_vars: dict[str, str]) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_R3")}
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="ERROR", **env_vars)
    env["PYTHONPATH"] = str(ROOT)
    command = [sys.executable, "-m", "tests.test_dp_hop", str(out)]
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The overlay (every patch) and upstream (``PRIME_R3=0``), side by side."""
    tmp = tmp_path_factory.mktemp("dp_hop")
    arms = {"overlay": {}, "upstream": {"PRIME_R3": "0"}}
    started = {arm: _start(tmp / f"{arm}.pickle", env) for arm, env in arms.items()}
    found = {}
    for arm, process in started.items():
        output, _ = process.communicate(timeout=600)
        assert process.returncode == 0, output[-6000:]
        found[arm] = pickle.loads((tmp / f"{arm}.pickle").read_bytes())
    return found


def _steps(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The engine's messages carrying outputs (packed ones always do)."""
    return [m for m in report["wire"] if m["packed"] or m["outputs"]]


#: Per wave, which engines pack (both clients' steps), in the overlay arm.
PACKING = {
    "one_client": (),
    "declared": (0, 1),
    "restarted": (0,),
    "redeclared_one": (0,),
    "redeclared_all": (0, 1),
}


def test_both_arms_ran_on_vllms_dp_clients_and_coordinator(runs: dict) -> None:
    assert runs["overlay"]["state"] == "applied" and runs["upstream"]["state"] == "disabled"
    for arm, run in runs.items():
        assert run["coordinator_alive"], arm
        assert list(run["waves"]) == list(WAVES), arm
        assert run["lb_engines"] and len(run["lb_engines"]) == 2, arm


@pytest.mark.parametrize("wave", WAVES)
def test_requests_spread_across_both_engines(runs: dict, wave: str) -> None:
    for arm, run in runs.items():
        engines = run["waves"][wave]["engines"]
        clients = 1 if wave == "one_client" else 2
        for rank in (0, 1):
            served = engines[rank]["served"]
            for client in range(clients):  # at least two outputs per step to pack
                assert sum(c == client for c, _ in served) >= 2, (arm, wave, rank, served)
        assert sum(len(e["served"]) for e in engines.values()) == clients * PER_CLIENT


@pytest.mark.parametrize("wave", WAVES)
def test_each_engine_packs_only_while_all_its_clients_declared(runs: dict, wave: str) -> None:
    """Per engine (its own process, its own counters): a step of two or more outputs
    is packed exactly when every client the engine was started for has declared; in
    the upstream arm never. Engine 1 of waves 3-5 is the restarted process."""
    declared = {
        "one_client": {0: [0], 1: [0]},
        "declared": {0: [0, 1], 1: [0, 1]},
        "restarted": {0: [0, 1], 1: []},
        "redeclared_one": {0: [0, 1], 1: [0]},
        "redeclared_all": {0: [0, 1], 1: [0, 1]},
    }[wave]
    for arm, run in runs.items():
        for rank, report in run["waves"][wave]["engines"].items():
            steps = _steps(report)
            assert steps, (arm, wave, rank)
            packs = arm == "overlay" and rank in PACKING[wave]
            if arm == "overlay":
                assert report["declared"] == declared[rank], (wave, rank)
                assert report["clients"] == 2, (wave, rank)
            else:
                assert report["declared"] is None and report["clients"] is None
            for message in steps:
                many = message["packed"] or message["small"] >= 2
                assert message["packed"] == (packs and many), (arm, wave, rank, message)
            if packs:
                assert {m["client"] for m in steps if m["packed"]} == (
                    {0} if wave == "one_client" else {0, 1}
                ), (wave, rank)


def test_the_counters_of_each_engine_agree(runs: dict) -> None:
    """packed_hop's own counters in each engine process: packed steps are the messages
    seen packed on the wire; an undeclared engine counts its steps ``undeclared``."""
    overlay = runs["overlay"]["waves"]
    for rank in (0, 1):
        previous = {"packed_steps": 0}
        for wave in WAVES:
            report = overlay[wave]["engines"][rank]
            counters = report["counters"]
            if wave == "restarted" and rank == 1:
                previous = {"packed_steps": 0}  # a new process
            packed = sum(m["packed"] for m in report["wire"])
            assert counters["packed_steps"] - previous["packed_steps"] == packed, (wave, rank)
            if rank not in PACKING[wave]:
                assert packed == 0 and counters["upstream_steps"].get("undeclared"), (wave, rank)
            previous = counters
    assert runs["overlay"]["client_counters"]["read_packed"] > 0
    assert runs["upstream"]["client_counters"]["read_packed"] == 0


def test_declarations_as_the_clients_see_them(runs: dict) -> None:
    overlay, upstream = runs["overlay"], runs["upstream"]
    assert overlay["declared_first"] == overlay["declared_second"] == ["acknowledged"] * 2
    for wave in WAVES:
        assert overlay["waves"][wave]["declarations"] == {
            "engine 0": "acknowledged",
            "engine 1": "acknowledged",
        }
        assert upstream["waves"][wave]["declarations"] == {}


@pytest.mark.parametrize("wave", WAVES)
def test_every_request_gets_the_rows_its_engine_sent_and_upstreams(runs: dict, wave: str) -> None:
    """Each client's outputs through ``get_output_async``, per request: the rows the
    engine put on its outputs (bytes, dtype, shape), and in both arms identical (type,
    dtype, shape, bytes, writeable, C-contiguous; token ids, finish reasons)."""
    got = {}
    for arm, run in runs.items():
        received = {}
        for per_client in run["waves"][wave]["received"]:
            received.update(per_client)
        sent = {}
        for report in run["waves"][wave]["engines"].values():
            sent.update(report["sent"])
        assert sorted(received) == sorted(sent), (arm, wave)
        for request_id, outputs in received.items():
            rows = [(r[1], r[2], r[3]) for _, _, r in outputs]
            assert rows == sent[request_id], (arm, wave, request_id)
            assert len(outputs) == MAX_TOKENS and outputs[-1][1] is not None
        got[arm] = {
            request_id: [(tokens[0] % 1000, reason, rows) for tokens, reason, rows in outputs]
            for request_id, outputs in received.items()
        }
    assert got["overlay"] == got["upstream"]
    long_rows = [o[0][2][2] for rid, o in got["overlay"].items() if rid.endswith("-0")]
    assert long_rows and all(shape == (LONG_PROMPT, *SHAPE) for shape in long_rows)


def test_nothing_louder_than_info(runs: dict) -> None:
    """No error, warning or traceback from vLLM's loggers in the clients' process or in
    any engine (the overlay's declarations to an engine with it included)."""
    for arm, run in runs.items():
        loud = [r for r in run["records"] if r[1] not in ("DEBUG", "INFO") or r[3]]
        assert loud == [], arm
        for wave in WAVES:
            for rank, report in run["waves"][wave]["engines"].items():
                assert report["loud"] == [], (arm, wave, rank)


if __name__ == "__main__":
    main()
