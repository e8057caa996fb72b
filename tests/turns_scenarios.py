"""A backlog of engine steps in vLLM's real ``AsyncMPClient``, for output_turns and its diff.

    python -m tests.turns_scenarios OUT.pickle R3 SLICE_MS   # PRIME_R3, PYTHONPATH: the caller

Builds vLLM's real ``AsyncMPClient`` (its constructor, in the externally-managed mode of
``tests/hop_scenarios.py``) and vLLM's real ``EngineCoreProc.process_output_sockets``
thread. While the event loop is blocked, the engine sends ``STEPS`` steps; once the
client's socket task has queued them all, a consumer takes them with
``get_output_async`` as ``AsyncLLM``'s output handler does, while a ticker task counts
the loop's turns. Records: each step as received (its outputs described field by field),
the steps the socket task queued in each turn of the loop while the backlog arrived, the
turns the ticker got before each step reached the consumer, the patch's counters,
what a cancellation during a call leaves in the queue, a call made on an empty queue,
and what a call raises once the engine died.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import pickle
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

from tests.engine_outputs_scenarios import _describe
from tests.hop_scenarios import (
    _addresses,
    _config,
    _Engine,
    _engine_inputs,
    _start_output_thread,
    _stop,
)

STEPS = 12


def _steps() -> list[Any]:
    import numpy as np
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    steps = []
    for k in range(STEPS):
        rows = np.full((1, 4, 2), k, dtype=np.uint8)
        output = EngineCoreOutput(f"req-{k % 3}", [k], routed_experts=rows)
        steps.append(EngineCoreOutputs(outputs=[output], timestamp=float(k + 1)))
    return steps


def run(r3: bool) -> dict[str, Any]:
    import vllm.v1.engine.async_llm  # noqa: F401 - the patch's anchor: the API server has it
    from vllm.v1.engine import core_client

    from prime_r3.fixes import output_turns

    ((in0, out0),) = _addresses(1)
    engine, stop = _Engine(), threading.Event()
    made: list[Any] = []
    ready = threading.Thread(target=lambda: made.append(_engine_inputs([in0], engine, stop)))
    ready.start()
    config = _config()
    config.aux_output_config = SimpleNamespace(enable_return_routed_experts=r3)

    async def main() -> dict[str, Any]:
        client = core_client.AsyncMPClient(
            config, None, False, client_addresses={"input_address": in0, "output_address": out0}
        )
        ready.join()
        threads = [made[0], _start_output_thread(engine, [out0])]
        client._ensure_output_queue_task()
        turns = 0
        intake: list[int] = []  # the queue's size at each turn while the backlog arrives

        async def ticker() -> None:
            nonlocal turns
            while True:
                turns += 1
                if len(intake) < 10_000 and (not intake or intake[-1] < STEPS):
                    intake.append(client.outputs_queue.qsize())
                await asyncio.sleep(0)

        ticking = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        for step in _steps():  # sent while the loop is blocked: a backlog
            engine.output_queue.put_nowait((0, step))
        deadline = time.monotonic() + 30  # the output thread took every step ...
        while not engine.output_queue.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)  # ... and sent it
        deadline = time.monotonic() + 30
        while client.outputs_queue.qsize() < STEPS:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {client.outputs_queue.qsize()} steps queued")
            await asyncio.sleep(0.01)
        socket_counters = output_turns.COUNTERS.snapshot()
        output_turns.COUNTERS.reset()

        # A call cancelled while it gives its turn takes no step.
        pending = asyncio.create_task(client.get_output_async())
        await asyncio.sleep(0)
        cancelled = pending.cancel()
        try:
            got_early = await pending
        except asyncio.CancelledError:
            got_early = None
        left_after_cancel = client.outputs_queue.qsize()

        received, turns_before = [], []
        if got_early is not None:
            received.append(got_early)
            turns_before.append(None)
        while len(received) < STEPS:
            start = turns
            received.append(await client.get_output_async())
            turns_before.append(turns - start)
        counters = output_turns.COUNTERS.snapshot()

        # A call on an empty queue waits for the next step, as upstream's.
        waiting = asyncio.create_task(client.get_output_async())
        await asyncio.sleep(0.05)
        waited_done = waiting.done()
        engine.output_queue.put_nowait((0, _steps()[0]))
        after_wait = await asyncio.wait_for(waiting, 30)
        counters_after_wait = output_turns.COUNTERS.snapshot()

        # The engine dies: the socket task queues upstream's error, the call raises it.
        from vllm.v1.engine.core import EngineCoreProc

        engine.output_queue.put_nowait(EngineCoreProc.ENGINE_CORE_DEAD)
        try:
            await asyncio.wait_for(client.get_output_async(), 30)
            raised = None
        except Exception as e:  # noqa: BLE001 - recorded for the test to judge
            raised = (type(e).__name__, str(e))
        ticking.cancel()
        _stop(engine, threads, stop)
        client.shutdown()
        return {
            "vllm_file": core_client.__file__,
            "steps": [
                {"timestamp": s.timestamp, "type": type(s).__qualname__, "outputs": _describe(s)}
                for s in received
            ],
            "turns_before": turns_before,
            "queued_per_turn": [b - a for a, b in itertools.pairwise(intake)],
            "socket_counters": socket_counters,
            "counters": counters,
            "waited_done_early": waited_done,
            "after_wait": _describe(after_wait),
            "counters_after_wait": counters_after_wait,
            "raised": raised,
            "cancelled": cancelled,
            "left_after_cancel": left_after_cancel,
        }

    return asyncio.run(main())


def main() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    out, r3, slice_ms = sys.argv[1], sys.argv[2] == "1", float(sys.argv[3])
    # The slice in both forms: the overlay's setting, the patched tree's constant.
    os.environ["PRIME_R3_OUTPUT_TURNS_SLICE_MS"] = f"{slice_ms:g}"
    from vllm.v1.engine import core_client

    if hasattr(core_client, "ROUTED_EXPERTS_TURN_SLICE_S"):
        core_client.ROUTED_EXPERTS_TURN_SLICE_S = slice_ms / 1000

    from prime_r3 import layer

    layer.apply()
    result = run(r3)
    result["state"] = layer.status().outcome("output_turns").state
    with open(out, "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main()
