"""output_turns: the API server's output handler gives the event loop a turn per queued step.

What it replaces. ``AsyncMPClient.get_output_async`` (``vllm.v1.engine.core_client``),
which ``AsyncLLM``'s output handler (``_run_output_handler``'s ``output_handler`` task, on
the API server's event loop) awaits once per engine step; the DP clients
(``DPAsyncMPClient``, ``DPLBAsyncMPClient``) inherit it. Upstream, the client's socket
task (``_ensure_output_queue_task``'s ``process_outputs_socket``) puts every decoded step
on ``outputs_queue`` (an ``asyncio.Queue``, made in ``AsyncMPClient.__init__``);
``await outputs_queue.get()`` returns at once while a step is queued, and the handler's
``process_outputs`` of at most ``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE`` outputs (128 by
default) never yields. So once the handler is k steps behind the engine (after a GC
pause, a burst of responses, a slow step), it works off all k in one turn of the loop
(it suspends in between only to send aborts for stop strings): no other task, timer or
connection runs meanwhile (``/health``, the serving coroutines sending responses, new
requests), for k times a step's cost. With R3 a step costs more (each output's rows),
so backlogs are longer.

The fast case. R3 on in this client (``vllm_config.aux_output_config.
enable_return_routed_experts``, read on every call; a config without it counts as R3
off, so the wrapper never raises where upstream's call would not) and a step already
queued when the handler asks for the next one: one ``await asyncio.sleep(0)`` (a turn of
the loop), then upstream's ``get_output_async``. Only the handler takes from the queue, so the step
is still there and upstream's call returns it without waiting.

Otherwise upstream's call unchanged: the queue empty or not made yet (upstream's call
waits for the next step, which gives the loop its turn anyway; counted ``waited``), or R3
off (``r3_off``). ``turns`` counts the turns given. ``live_note`` says in ``status`` and
the log which of these this process has seen.

Why the result equals upstream's. The wrapper takes nothing from the queue and catches
nothing: every step reaches the handler in the same order as the same object, and an
exception on the queue (``EngineDeadError`` included) raises from upstream's call as
before. The turn comes before the step is taken, so a cancellation during it leaves the
step queued, as a cancellation of upstream's waiting ``get`` does (only ``shutdown``
cancels the handler; nothing reads the queue after it). What changes is when the
handler runs: between two queued steps, the tasks and callbacks that were ready run
once. A streamed response may then get a backlog's tokens in more, smaller chunks
(its collector merges only the steps that arrived before it ran); the content is the
same. The socket task still decodes every frame that is waiting before it yields (a
done future from pyzmq's ``recv_multipart`` returns without suspending); with
``packed_hop`` a step's decode is ~0.1 ms at 100 outputs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from prime_r3.counts import Counts
from prime_r3.spec import Anchor, PatchSpec, Process, Target, WrapperFn

_CLIENT = "vllm.v1.engine.core_client"
_ASYNC_LLM = "vllm.v1.engine.async_llm"

COUNTERS = Counts("turns", "waited", "r3_off")


def live_note() -> str:
    """What the patch has done in this process (``prime-r3 status``, the log)."""
    c = COUNTERS.snapshot()
    if not (c["turns"] or c["waited"] or c["r3_off"]):
        return "no output handler has asked for a step in this process yet"
    if c["r3_off"] and not (c["turns"] or c["waited"]):
        return f"R3 is off in this client: upstream's calls ({c['r3_off']})"
    return f"turns given {c['turns']}, calls that waited {c['waited']}, R3 off {c['r3_off']}"


def _get_output_async(params: Mapping[str, Any]) -> WrapperFn:
    return _turn_then


async def _turn_then(wrapped: Any, client: Any, args: Any, kwargs: Any) -> Any:
    """The wrapper (wrapt's ``wrapped, instance, args, kwargs``): a turn of the loop if a
    step is already queued (R3 on), then upstream's call."""
    aux = getattr(getattr(client, "vllm_config", None), "aux_output_config", None)
    if not getattr(aux, "enable_return_routed_experts", False):  # a config without it too
        COUNTERS.r3_off += 1
    else:
        queued = client.outputs_queue
        if queued is not None and not queued.empty():
            COUNTERS.turns += 1
            await asyncio.sleep(0)
        else:
            COUNTERS.waited += 1
    return await wrapped(*args, **kwargs)


# Verified source fingerprints (scripts/fingerprint.py) for vLLM 0.31.0, 0.32.0, 0.33.0.
_GET_OUTPUT = frozenset({"f64b1b2c19402fc5"})
_OUTPUT_TASK = frozenset({"16518c3a7c906b5b"})
_CLIENT_INIT = frozenset({"4cf2df710885934f"})
_AUX_CONFIG = frozenset({"7938998b85f0cc7c"})
_OUTPUT_HANDLER = frozenset({"af9f4cc5aa44a56f", "47a49110a9a7fbcd", "add96d65cccf87eb"})

SPEC = PatchSpec(
    name="output_turns",
    summary="API server: the output handler yields to the event loop between queued steps",
    vllm_range=">=0.31,<0.34",
    processes=frozenset({Process.API_SERVER}),
    targets=(Target(_CLIENT, "AsyncMPClient.get_output_async", _GET_OUTPUT, _get_output_async),),
    anchors=(
        # outputs_queue (an asyncio.Queue), its one producer (the socket task) and its
        # one consumer (the handler's loop: a call per step, process_outputs without a
        # yield), and the R3 flag read on every call (the config is a pydantic
        # dataclass; the method that hashes the flag names it).
        Anchor(_CLIENT, "AsyncMPClient.__init__", _CLIENT_INIT),
        Anchor(_CLIENT, "AsyncMPClient._ensure_output_queue_task", _OUTPUT_TASK),
        Anchor(_ASYNC_LLM, "AsyncLLM._run_output_handler", _OUTPUT_HANDLER),
        Anchor("vllm.config.aux_output", "AuxOutputConfig.compute_hash", _AUX_CONFIG),
    ),
    notes="Same steps, same order; only when the handler runs changes.",
    live_note=live_note,
)
