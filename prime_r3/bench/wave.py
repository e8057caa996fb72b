"""The front-end wave: many long R3 requests finishing together on vLLM's real API server.

    python -m prime_r3.bench.wave [--shape writeup|grpo] [--requests 100] [--rounds 3]
        [--arms off,upstream,prime] [--stream] [--quick] [--json FILE]

Four processes per arm, over 127.0.0.1 and ZMQ:

* the **API server**: vLLM's own ``run_server_worker`` (uvicorn, vLLM's FastAPI app and
  routes, the real ``AsyncLLM`` client, output processor and ``/inference/v1/generate``
  serving code, ``--enable-scale-out``), given the engine's socket addresses as a
  multi-API-server worker is (``client_config``), so it starts no engine of its own. A
  probe task on its event loop sleeps 5 ms at a time and records how late it wakes;
* an **EngineCore stand-in** (the real CPU engine runs ~0.65 s a step: a 16k-token wave
  would take hours): it joins with vLLM's handshake (a DEALER with the engine's identity
  sending an ``EngineCoreReadyResponse``), answers the client's utility calls, and
  once every request of the wave has arrived runs the wave's steps, each an
  ``EngineCoreOutputs`` of real ``EngineCoreOutput``s put on the queue of vLLM's real
  output thread (``EngineCoreProc.process_output_sockets``: vLLM's msgspec encoder and
  zero-copy frames). A request's first output carries its prompt rows (one array), every
  later one one row; all finish (``length``) in the same step. Where prime_r3 is on it
  loads vLLM's plugins as EngineCore does and hands a client's ``prime_r3_packed_hop``
  declaration (a ``WAKEUP`` request) to ``EngineCoreProc._handle_client_request``, so the
  hop is packed as between two real processes with the overlay;
* a **client**: aiohttp, every request at once; it stops by itself (``--timeout``);
* a **health** poller: ``GET /health`` every 50 ms on one keep-alive connection, in a
  process of its own (the client's reading and hashing of the bodies would delay it).

Engine death (``tests/test_engine_death.py``; ``PR3WAVE_DIE_AFTER_STEP=K`` in ``run_arm``'s
``env_extra``, or the engine's ``--die-after-step K``): the stand-in writes its stats and
SIGKILLs itself once it has sent K steps; the API server gets vLLM's engine monitor as
``vllm serve`` with one API server has it (``_watch_engine``), and its stats carry its
rows mappings sampled every 0.1 s and at exit (``rows_maps``, ``rows_maps_end``:
``_rows_mappings``).

Shapes: ``writeup`` (``--requests`` requests of a 16-token prompt, each generating
``--max-tokens`` 16384 tokens: 16k row chunks of 46 x 8 uint8 each) and ``grpo``
(``--requests`` samples, in groups of ``--n`` of one ``--prompt-len`` 12288-token prompt,
4096 tokens each; every sample's first output carries the prompt's rows, as upstream's
engine sends them for samples whose prompt blocks come from the store).

Arms: ``off`` (R3 off, ``PRIME_R3=0``), ``upstream`` (R3 on, ``PRIME_R3=0``), ``prime``
(R3 on, prime_r3 as the plugin applies it), and on request ``prime_gc`` (``prime`` with
``PRIME_R3_ENGINE_GC_API_SERVER=1``), ``prime_no_turns`` (``prime`` without
``output_turns``), ``prime-<PATCH>`` (every patch but PATCH), ``prime_again`` (``prime``
once more: the A/A arm, what arms that cannot differ read) and ``prime_slice<MS>``
(``output_turns`` with a slice of MS ms; 0: a turn before every waiting step), alternated
in each round. Per arm, the median
over rounds of: the loop's longest stall and p99 lag during the wave and during its
finish (from the engine's last step to the last response), ``/health`` latency (max,
p99), client errors, API-server CPU (all threads, read from ``/proc`` by the driver, so a
stall is counted) per response over the wave and over its finish, peak RSS,
bytes per response, for streamed responses the server-sent events per response
(chunks) and the client's CPU per response (reading, not parsing, the bodies), and the
wave's wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import queue
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

LAYERS, TOPK, EXPERTS, VOCAB = 46, 8, 128, 32000
PROBE_S = 0.005
HEALTH_S = 0.05
#: How long the API server may take to start (a loaded 2-core machine: minutes).
START_S = 600
ARMS = ("off", "upstream", "prime", "prime_again", "prime_gc", "prime_no_turns")
DEFAULT_ARMS = ("off", "upstream", "prime")


# -- shapes ------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    name: str
    requests: int  # samples (engine requests) in the wave
    n: int  # samples per HTTP request
    prompt_len: int
    max_tokens: int

    #: Tests: the HTTP requests cycle through (n=1, n), each non-streaming and streaming.
    mix: bool = False

    def plan(self, stream: bool) -> list[tuple[int, bool]]:
        """(samples, streaming) of each HTTP request; the samples sum to ``requests``."""
        if not self.mix:
            return [(self.n, stream)] * (self.requests // self.n)
        kinds = [(1, False), (1, True), (self.n, False), (self.n, True)]
        plan: list[tuple[int, bool]] = []
        left = self.requests
        while left > 0:
            n, streaming = kinds[len(plan) % 4]
            n = min(n, left)
            plan.append((n, streaming))
            left -= n
        return plan


def make_shape(args: argparse.Namespace) -> Shape:
    if args.shape == "writeup":
        shape = Shape("writeup", args.requests, 1, args.prompt_len or 16, args.max_tokens or 16384)
    else:
        shape = Shape(
            "grpo", args.requests, args.n, args.prompt_len or 12288, args.max_tokens or 4096
        )
    if shape.requests % shape.n:
        raise SystemExit(f"--requests {shape.requests} is not a multiple of --n {shape.n}")
    return shape


def prompt_ids(shape: Shape, group: int) -> list[int]:
    return [(group * 7919 + i * 31) % (VOCAB - 1) + 1 for i in range(shape.prompt_len)]


# -- the EngineCore stand-in -------------------------------------------------------


def _ready_payload(args: argparse.Namespace) -> bytes:
    import msgspec
    from vllm import __version__
    from vllm.v1.engine import EngineCoreReadyResponse

    return msgspec.msgpack.encode(
        EngineCoreReadyResponse(
            max_model_len=args.max_model_len,
            num_gpu_blocks=1 << 20,
            block_size=16,
            dp_stats_address=None,
            dtype="bfloat16",
            vllm_version=__version__,
            world_size=1,
            data_parallel_size=1,
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            decode_context_parallel_size=1,
            data_parallel_rank=0,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_model_len,
            instance_id="prime-r3-wave",
            supports_lora=False,
            max_loras=0,
        )
    )


def sample_number(prompt: Sequence[int], child: int) -> int:
    """A sample's number, from its prompt and its index among the prompt's samples: the
    same in every arm, whatever order the requests reach the engine in."""
    return (prompt[0] * 1_000_003 + len(prompt) * 101 + child) % (1 << 31)


class Rows:
    """Deterministic routed-expert rows: the stand-in's, and what a response must carry."""

    def __init__(self) -> None:
        import numpy as np

        rng = np.random.default_rng(0)
        self.table = rng.integers(0, EXPERTS, size=(4099, LAYERS, TOPK), dtype=np.uint8)

    def prompt(self, prompt: Sequence[int]) -> Any:
        import numpy as np

        return self.table[(np.arange(len(prompt)) + prompt[0]) % len(self.table)]

    def row(self, sample: int, step: int) -> Any:
        i = (sample * 13 + step) % len(self.table)
        return self.table[i : i + 1].copy()  # a fresh array per output, as the engine's

    def expected(self, prompt: Sequence[int], child: int, max_tokens: int) -> Any:
        """All rows of a finished sample: its prompt's, then one per step but the last."""
        import numpy as np

        sample = sample_number(prompt, child)
        steps = [self.row(sample, step) for step in range(1, max_tokens)]
        return np.concatenate([self.prompt(prompt), *steps])


def token(sample: int, step: int) -> int:
    return (sample * 131 + step * 7) % (VOCAB - 1) + 1


#: Engine death (``tests/test_engine_death.py``, through ``run_arm``'s ``env_extra``): the
#: engine stand-in SIGKILLs itself once it has sent this many steps (0: never), and the
#: API server watches it (``_watch_engine``) and samples its rows mappings.
DIE_AFTER_STEP_ENV = "PR3WAVE_DIE_AFTER_STEP"


def _die_after_step() -> int:
    return int(os.environ.get(DIE_AFTER_STEP_ENV) or 0)


def _die(stats: dict[str, Any], path: str, output_queue: queue.Queue) -> None:
    """A killed engine: its stats written, its steps so far handed to ZMQ, SIGKILL."""
    while output_queue.qsize():
        time.sleep(0.001)
    time.sleep(0.2)  # the output thread's last send, out of ZMQ's I/O thread
    stats["last_step"] = stats["died"] = time.monotonic()
    with open(path, "w") as f:
        json.dump(stats, f)
    os.kill(os.getpid(), signal.SIGKILL)


def engine_main(argv: Sequence[str]) -> int:
    """The EngineCore stand-in (see the module docstring)."""
    import msgspec
    import zmq
    from vllm.v1.engine import (
        EngineCoreOutput,
        EngineCoreOutputs,
        EngineCoreRequest,
        EngineCoreRequestType,
        FinishReason,
        UtilityOutput,
    )
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.serial_utils import MsgpackDecoder, UtilityResult

    p = argparse.ArgumentParser(prog="wave engine")
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--requests", type=int, required=True)
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--r3", type=int, required=True)
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--max-num-seqs", type=int, required=True)
    p.add_argument("--step-ms", type=float, default=0.0)
    p.add_argument("--stats", required=True)
    p.add_argument("--timeout", type=float, default=600)
    # Engine death (DIE_AFTER_STEP_ENV): the driver passes it through the environment.
    p.add_argument("--die-after-step", type=int, default=_die_after_step())
    args = p.parse_args(argv)

    if os.environ.get("PRIME_R3") != "0":
        # As EngineCore does at start-up: the plugins, so the overlay applies here too
        # (packed_hop's output thread and declarations, as in a real engine process).
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    from vllm.v1.engine.core import EngineShutdownState

    rows = Rows() if args.r3 else None
    output_queue: queue.Queue = queue.Queue()
    # An EngineCoreProc without its __init__: what its output thread and its handling of
    # a client's utility calls read (the queue, the shutdown state), nothing more.
    engine = EngineCoreProc.__new__(EngineCoreProc)
    engine.output_queue = output_queue
    engine.shutdown_state = EngineShutdownState.RUNNING
    out_thread = threading.Thread(
        target=EngineCoreProc.process_output_sockets,
        args=(engine, [args.output], None, 0),
        daemon=True,
    )
    out_thread.start()

    ctx = zmq.Context()
    inp = ctx.socket(zmq.DEALER)
    inp.setsockopt(zmq.IDENTITY, (0).to_bytes(2, "little"))
    inp.connect(args.input)
    inp.send(_ready_payload(args))
    add_decoder = MsgpackDecoder(EngineCoreRequest)
    generic = MsgpackDecoder()

    live: dict[str, tuple[int, list[int]]] = {}  # request id -> (sample number, prompt)
    children: dict[tuple[int, ...], int] = {}  # samples of each prompt seen so far
    aborted: set[str] = set()
    stats: dict[str, Any] = {"steps": 0, "aborted": 0}
    deadline = time.monotonic() + args.timeout

    def handle(frames: list[Any]) -> None:
        kind = EngineCoreRequestType(bytes(frames[0].buffer))
        if kind == EngineCoreRequestType.ADD:
            req = add_decoder.decode(frames[1:])
            prompt = list(req.prompt_token_ids)
            child = children.get(tuple(prompt), 0)
            children[tuple(prompt)] = child + 1
            live[req.request_id] = (sample_number(prompt, child), prompt)
        elif kind == EngineCoreRequestType.UTILITY:
            client_idx, call_id, method, call_args = generic.decode(frames[1:])
            result = {"get_supported_tasks": ("generate",)}.get(method)
            out = UtilityOutput(call_id, result=UtilityResult(result))
            output_queue.put_nowait((client_idx, EngineCoreOutputs(utility_output=out)))
        elif kind == EngineCoreRequestType.WAKEUP:  # packed_hop's declaration: EngineCore's
            EngineCoreProc._handle_client_request(engine, kind, generic.decode(frames[1:]))
        elif kind == EngineCoreRequestType.ABORT:
            for rid in generic.decode(frames[1:]):
                if live.pop(rid, None) is not None:
                    aborted.add(rid)

    def poll(timeout_ms: int) -> None:
        while inp.poll(timeout_ms):
            handle(inp.recv_multipart(copy=False))
            timeout_ms = 0

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.is_set() and time.monotonic() < deadline:
        # Wait for the whole wave, then run it.
        poll(50)
        if len(live) < args.requests:
            continue
        stats["wave_start"] = time.monotonic()
        next_at = time.monotonic()
        for step in range(args.max_tokens):
            poll(0)
            last = step == args.max_tokens - 1
            outputs = []
            for rid, (sample, prompt) in live.items():
                routed = None
                if rows is not None:
                    routed = rows.prompt(prompt) if step == 0 else rows.row(sample, step)
                outputs.append(
                    EngineCoreOutput(
                        request_id=rid,
                        new_token_ids=[token(sample, step)],
                        finish_reason=FinishReason.LENGTH if last else None,
                        routed_experts=routed,
                    )
                )
            output_queue.put_nowait(
                (0, EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic()))
            )
            stats["steps"] += 1
            # Keep at most a few steps ahead of the output thread.
            while output_queue.qsize() > 4:
                time.sleep(0.0002)
            if stats["steps"] == args.die_after_step:
                _die(stats, args.stats, output_queue)
            if args.step_ms:
                next_at += args.step_ms / 1000
                delay = next_at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            if stop.is_set() or time.monotonic() > deadline:
                break
        stats["last_step"] = time.monotonic()
        stats["aborted"] = len(aborted)
        live.clear()
        aborted.clear()
        children.clear()
        break
    while output_queue.qsize():
        time.sleep(0.01)
    if os.environ.get("PRIME_R3") != "0":
        from prime_r3.fixes import packed_hop

        stats["packed_hop"] = packed_hop.COUNTERS.snapshot()
    with open(args.stats, "w") as f:
        json.dump(stats, f)
    # Idle until the driver stops us (the client may still send aborts / utilities).
    while not stop.is_set() and time.monotonic() < deadline:
        poll(100)
    del msgspec
    return 0


# -- the API server ----------------------------------------------------------------


def _write_model_dir(directory: str) -> str:
    config = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": LAYERS,
        "num_local_experts": EXPERTS,
        "num_experts_per_tok": TOPK,
        "vocab_size": VOCAB,
        "max_position_embeddings": 1 << 17,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


async def _probe(samples: list[tuple[float, float]]) -> None:
    """Sleep PROBE_S at a time; record (wake time, lateness). CPU: ``ProcessCpu``."""
    loop = asyncio.get_running_loop()
    while True:
        start = loop.time()
        await asyncio.sleep(PROBE_S)
        now = time.monotonic()
        samples.append((now, loop.time() - start - PROBE_S))


class StallStacks(threading.Thread):
    """While the loop is late by more than ``after`` s, sample its thread's stack every
    ``every`` s: ``seen`` is (time, innermost frames) (``--stall-stacks``)."""

    def __init__(self, samples: list[tuple[float, float]], after: float = 0.05) -> None:
        super().__init__(daemon=True, name="prime_r3-stall-stacks")
        self.samples, self.after, self.every = samples, after, 0.01
        self.loop_thread = threading.get_ident()
        self.seen: list[tuple[float, str]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        import traceback

        while not self.stop.wait(self.every):
            if not self.samples or time.monotonic() - self.samples[-1][0] < PROBE_S + self.after:
                continue
            frame = sys._current_frames().get(self.loop_thread)
            if frame is None:
                continue
            stack = traceback.extract_stack(frame)[-6:]
            key = " < ".join(
                f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack)
            )
            self.seen.append((time.monotonic(), key))


class GcPauses:
    """Each collection's (end time, generation, seconds), through ``gc.callbacks``."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, int, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append(
                (time.monotonic(), info["generation"], time.perf_counter() - self._start)
            )


def _overlay_state() -> dict[str, Any]:
    """The front-end patches' states in this process and their counters."""
    from prime_r3 import layer
    from prime_r3.fixes import output_turns, response_b64, response_json, response_rows

    report = layer.status()
    modules = {
        "response_rows": response_rows,
        "response_b64": response_b64,
        "response_json": response_json,
        "output_turns": output_turns,
    }
    return {
        "states": {o.name: o.state for o in report.outcomes if o.name in modules},
        "counters": {name: m.COUNTERS.snapshot() for name, m in modules.items()},
    }


def _config_with_r3() -> None:
    """The API server's ``VllmConfig`` with ``enable_return_routed_experts`` on, set after
    vLLM built and checked it (its check wants Model Runner V2, which the front end never
    runs). Only this benchmark's server process does this. Nothing else in the front end
    reads the flag; it is part of the config's hash, so both R3 arms' responses carry
    another ``system_fingerprint`` than the off arm's, as a real R3 server's do."""
    from vllm.engine.arg_utils import EngineArgs

    create = EngineArgs.create_engine_config

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = create(self, *args, **kwargs)
        config.aux_output_config.enable_return_routed_experts = True
        return config

    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]


def _watch_engine(input_address: str) -> None:
    """Engine death: the client's engine monitor as ``vllm serve`` with one API server has
    it. There ``MPClient.start_engine_core_monitor`` watches the processes of its
    ``CoreEngineProcManager`` and, once one exits, marks the engine dead and shuts the
    client down (every request in flight fails with ``EngineDeadError``); given an
    engine's addresses (``client_config``) it has no manager and watches nothing. Here it
    gets a manager of the stand-in's process (found by its command line), run by vLLM's
    own ``monitor_engine_liveness`` with a pidfd as the process's sentinel."""
    from vllm.v1.engine.core_client import MPClient
    from vllm.v1.engine.utils import CoreEngineProcManager

    class Process:
        name, exitcode = "EngineCore", None  # not our child: its exit code is unknown

        def __init__(self, pid: int) -> None:
            self.sentinel = os.pidfd_open(pid)

    class Manager:
        monitor_engine_liveness = CoreEngineProcManager.monitor_engine_liveness

        def __init__(self, pid: int) -> None:
            self.processes, self.failed_proc_name = [Process(pid)], None
            self.manager_stopped = threading.Event()

        def shutdown(self, timeout: float | None = None) -> None:
            self.manager_stopped.set()

    start = MPClient.start_engine_core_monitor

    def start_engine_core_monitor(self: Any) -> None:
        if self.resources.engine_manager is None:
            self.resources.engine_manager = Manager(_engine_pid(input_address))
        start(self)

    MPClient.start_engine_core_monitor = start_engine_core_monitor  # type: ignore[method-assign]


def _engine_pid(input_address: str) -> int:
    """The engine stand-in's pid: the process running ``wave engine --input ADDRESS``."""
    wanted = {b"prime_r3.bench.wave", b"engine", input_address.encode()}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = set(f.read().split(b"\0"))
        except OSError:  # not a process, or gone
            continue
        if entry.isdigit() and wanted <= argv:
            return int(entry)
    raise RuntimeError(f"no engine stand-in process with --input {input_address}")


def _rows_mappings() -> list[Any]:
    """[time, VMAs, rows VMAs and their KiB, response_rows' mappings in flight, handed
    out] of this process. Rows VMAs, the kernel's view of the rows mappings: private
    read-write VMAs advised ``MADV_NOHUGEPAGE`` (``nh`` in ``/proc/self/smaps``; response_rows
    advises each of its mappings so, and neighbours may merge into one VMA) that are not
    a thread's stack (glibc advises those too, below a ``---p`` guard page, also ``nh``);
    the upstream arm shows none."""
    from prime_r3.fixes import response_rows

    vmas: list[list[Any]] = []  # [permissions, KiB, nh]
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef":  # a VMA's header; its fields are capitalised
                vmas.append([line.split()[1], 0, False])
            elif line.startswith("Size:"):
                vmas[-1][1] = int(line.split()[1])
            elif line.startswith("VmFlags:"):
                vmas[-1][2] = "nh" in line.split()
    rows = [
        kib
        for below, (perms, kib, nh) in zip([None, *vmas], vmas, strict=False)
        if nh and perms == "rw-p" and not (below and below[0] == "---p" and below[2])
    ]
    in_flight, handed = len(response_rows._IN_FLIGHT), len(response_rows._HANDED_OUT)
    return [time.monotonic(), len(vmas), len(rows), sum(rows), in_flight, handed]


async def _sample_rows_mappings(samples: list[list[Any]]) -> None:
    while True:
        samples.append(_rows_mappings())
        await asyncio.sleep(0.1)


def server_main(argv: Sequence[str]) -> int:
    """vLLM's API server worker, attached to the stand-in engine's sockets."""
    import uvloop

    try:
        from vllm.entrypoints.common.cli_args import (
            make_arg_parser,
            validate_parsed_serve_args,
        )
    except ImportError:
        from vllm.entrypoints.launchers.cli_args import (
            make_arg_parser,
            validate_parsed_serve_args,
        )
    from vllm.entrypoints.launchers.api_server.entry import run_server_worker
    from vllm.entrypoints.launchers.launcher import setup_server
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = argparse.ArgumentParser(prog="wave server")
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--r3", type=int, required=True)
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--max-num-seqs", type=int, required=True)
    p.add_argument("--stats", required=True)
    p.add_argument("--stall-stacks", type=int, default=0)
    ours = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="prime_r3_wave_model_") as model:
        vllm_argv = [
            "--model",
            _write_model_dir(model),
            "--skip-tokenizer-init",
            "--load-format",
            "dummy",
            "--enable-scale-out",
            "--served-model-name",
            "wave",
            "--host",
            "127.0.0.1",
            "--port",
            str(ours.port),
            "--max-model-len",
            str(ours.max_model_len),
            "--max-num-seqs",
            str(ours.max_num_seqs),
            "--max-num-batched-tokens",
            str(ours.max_model_len),
            "--disable-uvicorn-access-log",
            "--disable-log-stats",
        ]
        # No --enable-return-routed-experts: building the config refuses R3 without Model
        # Runner V2 and Triton (none on CPU). The front end's R3 work is driven by the
        # routed experts the engine sends (``--r3``); its config says R3 is on, as a real
        # R3 server's does, by the flag set once the config is built (``_config_with_r3``).
        if ours.r3:
            _config_with_r3()
        dies = _die_after_step() > 0  # engine death: watch the engine, sample the mappings
        if dies:
            _watch_engine(ours.input)
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(vllm_argv)
        validate_parsed_serve_args(args)
        listen_address, sock = setup_server(args, reuse_port=False)
        samples: list[tuple[float, float]] = []
        stats: dict[str, Any] = {}
        sampler = StallStacks(samples) if ours.stall_stacks else None
        gc_pauses = GcPauses()

        async def serve() -> None:
            probe = asyncio.get_running_loop().create_task(_probe(samples))
            stats["rss_start_kb"] = _rss_kb()
            if dies:
                maps = asyncio.get_running_loop().create_task(
                    _sample_rows_mappings(stats.setdefault("rows_maps", []))
                )
            if sampler is not None:
                sampler.start()
            import gc

            gc.callbacks.append(gc_pauses)
            try:
                await run_server_worker(
                    listen_address,
                    sock,
                    args,
                    client_config={"input_address": ours.input, "output_address": ours.output},
                )
            finally:
                probe.cancel()
                if dies:
                    maps.cancel()

        try:
            uvloop.run(serve())
        finally:
            if dies:
                stats["rows_maps_end"] = _rows_mappings()
            stats["maxrss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            stats["prime_r3"] = _overlay_state()
            stats["samples"] = samples
            stats["gc_pauses"] = gc_pauses.pauses
            if sampler is not None:
                stats["stall_stacks"] = sampler.seen
            with open(ours.stats, "w") as f:
                json.dump(stats, f)
    return 0


# -- the client --------------------------------------------------------------------

#: The one field of a response that differs between two runs of the same wave.
_CREATED = re.compile(rb'"created":[0-9]+')


def normalised(body: bytes) -> bytes:
    """``body`` with its ``"created"`` wall-clock seconds replaced by 0."""
    return _CREATED.sub(b'"created":0', body)


def client_main(argv: Sequence[str]) -> int:
    """Send the wave and ``/health`` requests; record what came back."""
    import aiohttp

    p = argparse.ArgumentParser(prog="wave client")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--shape", required=True)  # JSON of Shape
    p.add_argument("--stream", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", required=True)
    p.add_argument("--bodies", default="")  # directory: keep every body (parity tests)
    args = p.parse_args(argv)
    shape = Shape(**json.loads(args.shape))
    base = f"http://127.0.0.1:{args.port}"

    async def run() -> dict[str, Any]:
        results: list[dict[str, Any]] = []
        timeout = aiohttp.ClientTimeout(total=args.timeout)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

            async def one(i: int, n: int, streaming: bool) -> None:
                body = {
                    "request_id": f"wave-{i}",
                    "token_ids": prompt_ids(shape, i),
                    "sampling_params": {
                        "max_tokens": shape.max_tokens,
                        "n": n,
                        "ignore_eos": True,
                        "temperature": 1.0,
                    },
                    "stream": streaming,
                }
                t0 = time.monotonic()
                entry: dict[str, Any] = {"i": i, "sent": t0}
                try:
                    async with session.post(f"{base}/inference/v1/generate", json=body) as r:
                        data = await r.read()
                    entry.update(
                        status=r.status,
                        bytes=len(data),
                        sha256=hashlib.sha256(normalised(data)).hexdigest(),
                        chunks=sse_events(data) if streaming else 1,
                    )
                    if args.bodies:
                        with open(os.path.join(args.bodies, f"{i}.body"), "wb") as f:
                            f.write(data)
                except Exception as e:  # noqa: BLE001 - every failure is a client error
                    entry.update(status=-1, error=f"{type(e).__name__}: {e}")
                entry["done"] = time.monotonic()
                results.append(entry)

            start = time.monotonic()
            plan = shape.plan(bool(args.stream))
            await asyncio.gather(*(one(i, n, st) for i, (n, st) in enumerate(plan)))
        return {"start": start, "end": time.monotonic(), "results": results}

    cpu0 = time.process_time()
    found = asyncio.run(run())
    found["cpu_s"] = time.process_time() - cpu0

    with open(args.out, "w") as f:
        json.dump(found, f)
    return 0


def sse_events(body: bytes) -> int:
    """The server-sent events of a streamed body, ``data: [DONE]`` not counted."""
    events = body.count(b"\n\ndata: ") + body.startswith(b"data: ")
    return events - body.endswith(b"data: [DONE]\n\n")


def health_main(argv: Sequence[str]) -> int:
    """``GET /health`` every HEALTH_S until SIGTERM, from a process of its own (the wave's
    client reads and hashes ~1 GB, which would delay its own /health requests)."""
    import http.client

    p = argparse.ArgumentParser(prog="wave health")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    health: list[tuple[float, float, int]] = []
    conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=120)
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            conn.request("GET", "/health")
            r = conn.getresponse()
            r.read()
            status = r.status
        except (OSError, http.client.HTTPException):
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=120)
            status = -1
        health.append((t0, time.monotonic() - t0, status))
        stop.wait(HEALTH_S)
    with open(args.out, "w") as f:
        json.dump(health, f)
    return 0


# -- the driver --------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def arm_env(arm: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_R3")}
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="WARNING")
    if arm in ("off", "upstream"):
        env["PRIME_R3"] = "0"
    if arm == "prime_gc":  # engine_gc's thresholds in the API server too
        env["PRIME_R3_ENGINE_GC_API_SERVER"] = "1"
    if arm == "prime_no_turns":  # what output_turns changes
        env["PRIME_R3_PATCHES"] = "-output_turns"
    if arm.startswith("prime-"):  # every patch but one: what that patch buys here
        env["PRIME_R3_PATCHES"] = "all," + arm.removeprefix("prime")
    if arm.startswith("prime_slice"):  # output_turns with another slice (0: every step)
        env["PRIME_R3_OUTPUT_TURNS_SLICE_MS"] = arm.removeprefix("prime_slice")
    env.update(extra or {})
    return env


def run_arm(
    arm: str,
    shape: Shape,
    *,
    stream: bool,
    timeout: float,
    step_ms: float,
    workdir: str,
    bodies: str = "",
    env_extra: dict[str, str] | None = None,
    stall_stacks: bool = False,
) -> dict[str, Any]:
    """One arm: engine stand-in, API server and client; returns its measurements."""
    r3 = int(arm != "off")
    sock_dir = tempfile.mkdtemp(prefix="zmq_", dir=workdir)
    inp, out = f"ipc://{sock_dir}/in", f"ipc://{sock_dir}/out"
    port = _free_port()
    max_model_len = shape.prompt_len + shape.max_tokens + 64
    max_num_seqs = max(shape.requests, 8)
    kinds = ("engine", "server", "client", "health")
    files = {k: os.path.join(workdir, f"{arm}.{k}.json") for k in kinds}
    env = arm_env(arm, env_extra)
    me = [sys.executable, "-m", "prime_r3.bench.wave"]
    common = ["--input", inp, "--output", out, "--max-model-len", str(max_model_len)]
    common += ["--max-num-seqs", str(max_num_seqs), "--r3", str(r3)]
    logs = {k: open(os.path.join(workdir, f"{arm}.{k}.log"), "w") for k in files}  # noqa: SIM115
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["server"] = subprocess.Popen(
            [*me, "server", *common, "--port", str(port), "--stats", files["server"]]
            + ["--stall-stacks", str(int(stall_stacks))],
            env=env,
            stdout=logs["server"],
            stderr=subprocess.STDOUT,
        )
        procs["engine"] = subprocess.Popen(
            [*me, "engine", *common, "--requests", str(shape.requests)]
            + ["--prompt-len", str(shape.prompt_len), "--max-tokens", str(shape.max_tokens)]
            + ["--step-ms", str(step_ms), "--stats", files["engine"]]
            + ["--timeout", str(timeout + START_S)],
            env=env,
            stdout=logs["engine"],
            stderr=subprocess.STDOUT,
        )
        _wait_healthy(port, procs, deadline=time.monotonic() + START_S)
        cpu = ProcessCpu(procs["server"].pid)
        cpu.start()
        procs["health"] = subprocess.Popen(
            [*me, "health", "--port", str(port), "--out", files["health"]],
            env=env,
            stdout=logs["health"],
            stderr=subprocess.STDOUT,
        )
        client = subprocess.run(
            [*me, "client", "--port", str(port), "--shape", json.dumps(asdict(shape))]
            + ["--stream", str(int(stream)), "--timeout", str(timeout), "--out", files["client"]]
            + (["--bodies", bodies] if bodies else []),
            env=env,
            timeout=timeout + 60,
            check=False,
            capture_output=True,
            text=True,
        )
        if client.returncode != 0:
            raise RuntimeError(f"{arm}: client failed: {client.stderr[-2000:]}")
        cpu.stop.set()
    finally:
        for name in ("health", "server", "engine"):
            proc = procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT if name == "server" else signal.SIGTERM)
        for name in ("health", "server", "engine"):
            proc = procs.get(name)
            if proc is not None:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for f in logs.values():
            f.close()
    loaded = {}
    for k, path in files.items():
        if not os.path.exists(path):
            log = open(os.path.join(workdir, f"{arm}.{k}.log")).read()[-3000:]  # noqa: SIM115
            raise RuntimeError(f"{arm}: the {k} wrote no stats; its log ends:\n{log}")
        with open(path) as f:
            loaded[k] = json.load(f)
    loaded["client"]["health"] = loaded.pop("health")
    return summarise(arm, shape, loaded["engine"], loaded["server"], loaded["client"], cpu)


class ProcessCpu(threading.Thread):
    """Another process's CPU time (user + system, all its threads) every 10 ms, read from
    ``/proc``: unlike the server's own probe, it keeps sampling while the loop stalls."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True, name="wave-cpu")
        self.path, self.samples = f"/proc/{pid}/stat", []
        self.tick = os.sysconf("SC_CLK_TCK")
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.01):
            try:
                with open(self.path) as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                return
            self.samples.append((time.monotonic(), (int(fields[11]) + int(fields[12])) / self.tick))

    def between(self, start: float, end: float) -> float:
        """CPU seconds used from ``start`` to ``end`` (the samples nearest inside)."""
        inside = [c for t, c in self.samples if start <= t <= end]
        return inside[-1] - inside[0] if len(inside) > 1 else float("nan")


def _wait_healthy(port: int, procs: dict[str, subprocess.Popen], deadline: float) -> None:
    import urllib.request

    while time.monotonic() < deadline:
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"the {name} exited ({proc.returncode}) before the wave")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the API server did not answer /health within {START_S} s")


def summarise(
    arm: str,
    shape: Shape,
    engine: dict[str, Any],
    server: dict[str, Any],
    client: dict[str, Any],
    cpu: ProcessCpu,
) -> dict[str, Any]:
    start, end = client["start"], client["end"]
    finish_from = engine.get("last_step", end)
    samples = server["samples"]
    wave = [s for s in samples if start <= s[0] <= end]
    finish = [s for s in samples if finish_from <= s[0] <= end]
    lags = [s[1] for s in wave]
    finish_lags = [s[1] for s in finish]
    gcs = [g for g in server.get("gc_pauses", []) if start <= g[0] <= end]
    results = client["results"]
    ok = [r for r in results if r.get("status") == 200]
    health = [h for h in client["health"] if start <= h[0] <= end]
    health_lat = [h[1] for h in health]
    return {
        "arm": arm,
        "responses": len(ok),
        "errors": len(results) - len(ok) + sum(1 for h in health if h[2] != 200),
        "error_kinds": sorted(
            {r.get("error", str(r.get("status")))[:80] for r in results if r.get("status") != 200}
        ),
        "stall_ms": 1000 * max(lags, default=float("nan")),
        "p99_lag_ms": 1000 * _pct(lags, 0.99),
        "finish_stall_ms": 1000 * max(finish_lags, default=float("nan")),
        "finish_p99_lag_ms": 1000 * _pct(finish_lags, 0.99),
        "health_max_ms": 1000 * max(health_lat, default=float("nan")),
        "health_p99_ms": 1000 * _pct(health_lat, 0.99),
        "cpu_s": cpu.between(start, end),
        "cpu_ms_per_response": 1000 * cpu.between(start, end) / max(len(ok), 1),
        "finish_cpu_ms_per_response": 1000 * cpu.between(finish_from, end) / max(len(ok), 1),
        "peak_rss_mb": server["maxrss_kb"] / 1024,
        "rss_start_mb": server.get("rss_start_kb", 0) / 1024,
        "bytes_per_response": statistics.median([r["bytes"] for r in ok]) if ok else 0,
        "chunks_per_response": statistics.median([r["chunks"] for r in ok]) if ok else 0,
        "client_cpu_ms_per_response": 1000 * client.get("cpu_s", float("nan")) / max(len(ok), 1),
        "wave_s": end - start,
        "finish_s": end - finish_from,
        "steps": engine.get("steps", 0),
        "sha256": [r.get("sha256") for r in sorted(results, key=lambda r: r["i"])],
        "prime_r3": server.get("prime_r3"),
        "packed_hop": engine.get("packed_hop"),
        "stall_stacks": _stacks_of_longest_stall(wave, server.get("stall_stacks", [])),
        "gc_max_ms": 1000 * max((g[2] for g in gcs), default=0.0),
        "gc_total_ms": 1000 * sum(g[2] for g in gcs),
    }


def _stacks_of_longest_stall(
    samples: list[Any], stacks: list[tuple[float, str]]
) -> list[tuple[int, str]]:
    """The stacks sampled during the longest stall, most frequent first."""
    if not samples or not stacks:
        return []
    woke, lag = max(samples, key=lambda s: s[1])
    counts: dict[str, int] = {}
    for t, key in stacks:
        if woke - lag - PROBE_S <= t <= woke:
            counts[key] = counts.get(key, 0) + 1
    return sorted(((v, k) for k, v in counts.items()), reverse=True)


COLUMNS = (
    ("stall_ms", "stall ms", "{:.0f}"),
    ("p99_lag_ms", "p99 lag", "{:.1f}"),
    ("finish_stall_ms", "fin stall", "{:.0f}"),
    ("finish_p99_lag_ms", "fin p99", "{:.1f}"),
    ("health_max_ms", "health max", "{:.0f}"),
    ("health_p99_ms", "health p99", "{:.0f}"),
    ("errors", "errors", "{:.0f}"),
    ("gc_max_ms", "gc max ms", "{:.0f}"),
    ("gc_total_ms", "gc total ms", "{:.0f}"),
    ("cpu_ms_per_response", "cpu ms/resp", "{:.1f}"),
    ("finish_cpu_ms_per_response", "fin cpu ms/resp", "{:.1f}"),
    ("peak_rss_mb", "peak RSS MB", "{:.0f}"),
    ("bytes_per_response", "bytes/resp", "{:.0f}"),
    ("chunks_per_response", "chunks/resp", "{:.0f}"),
    ("client_cpu_ms_per_response", "client cpu ms", "{:.1f}"),
    ("wave_s", "wave s", "{:.1f}"),
    ("finish_s", "finish s", "{:.2f}"),
)


def report(shape: Shape, stream: bool, rounds: list[dict[str, dict[str, Any]]]) -> str:
    arms = list(rounds[0])
    lines = [
        f"wave: shape={shape.name} samples={shape.requests} n={shape.n} "
        f"prompt={shape.prompt_len} max_tokens={shape.max_tokens} stream={stream} "
        f"rounds={len(rounds)} (medians; arms alternated)",
        f"{'arm':10}" + "".join(f"{title:>16}" for _, title, _ in COLUMNS),
    ]
    med: dict[str, dict[str, float]] = {}
    for arm in arms:
        med[arm] = {k: statistics.median(r[arm][k] for r in rounds) for k, _, _ in COLUMNS}
        lines.append(
            f"{arm:10}" + "".join(f"{fmt.format(med[arm][k]):>16}" for k, _, fmt in COLUMNS)
        )
    if "upstream" in med and "prime" in med:
        u, q = med["upstream"], med["prime"]
        for k in (
            "stall_ms",
            "finish_stall_ms",
            "cpu_ms_per_response",
            "finish_cpu_ms_per_response",
            "peak_rss_mb",
        ):
            ratio = u[k] / q[k] if q[k] else float("inf")
            lines.append(f"upstream/prime {k}: {u[k]:.1f} / {q[k]:.1f} = {ratio:.1f}x")
        if stream:
            lines.append(
                "streamed bodies: chunk boundaries depend on timing in both arms, so bytes "
                "are not compared here (tests/test_front_end_parity.py compares content)"
            )
        else:
            same = all(r["upstream"]["sha256"] == r["prime"]["sha256"] for r in rounds)
            lines.append(
                f"response bytes upstream == prime (every request, every round; 'created' "
                f"masked): {same}"
            )
        lines.append(f"prime arm's API server: {rounds[-1]['prime']['prime_r3']}")
        lines.append(f"prime arm's engine, packed_hop: {rounds[-1]['prime']['packed_hop']}")
    for i, r in enumerate(rounds):
        lines.append(
            f"round {i}: "
            + "  ".join(
                f"{arm} stall {r[arm]['stall_ms']:.0f} cpu/resp {r[arm]['cpu_ms_per_response']:.1f}"
                for arm in arms
            )
        )
        for arm in arms:
            for count, stack in r[arm]["stall_stacks"][:12]:
                lines.append(f"  {arm}'s longest stall, {count} x 10 ms in: {stack}")
            if r[arm]["error_kinds"]:
                lines.append(f"  {arm} errors: {r[arm]['error_kinds']}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", choices=("writeup", "grpo"), default="writeup")
    p.add_argument("--requests", type=int, default=100, help="samples in the wave")
    p.add_argument("--n", type=int, default=10, help="grpo: samples per prompt")
    p.add_argument("--prompt-len", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"from {','.join(ARMS)}")
    p.add_argument("--stream", action="store_true")
    p.add_argument(
        "--step-ms", type=float, default=0.0, help="engine step pacing (0: as fast as read)"
    )
    p.add_argument("--timeout", type=float, default=900, help="per arm, seconds")
    p.add_argument("--quick", action="store_true", help="8 samples x 256 tokens, 1 round")
    p.add_argument("--json", default="", help="also write the per-round results here")
    p.add_argument("--workdir", default="", help="keep logs and stats here (default: a temp dir)")
    p.add_argument(
        "--stall-stacks",
        action="store_true",
        help="sample the loop thread's stack while it is late; print the longest stall's",
    )


def _slice_arm(arm: str) -> bool:
    """``prime_slice<MS>``: ``prime`` with ``output_turns``' slice set to MS milliseconds."""
    ms = arm.removeprefix("prime_slice")
    return ms != arm and ms.replace(".", "", 1).isdigit() and float(ms) <= 1000


def _without_arm(arm: str) -> bool:
    """``prime-<PATCH>``: ``prime`` with every patch but PATCH, a registry name."""
    from prime_r3.patches import REGISTRY

    return arm.startswith("prime-") and arm.removeprefix("prime-") in {s.name for s in REGISTRY}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    roles = {"engine": engine_main, "server": server_main, "client": client_main}
    roles["health"] = health_main
    if argv and argv[0] in roles:
        return roles[argv[0]](argv[1:])
    p = argparse.ArgumentParser(prog="prime-r3 bench wave", description=__doc__.split("\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.rounds = 8, 1
        args.max_tokens = args.max_tokens or 256
        args.prompt_len = args.prompt_len or (16 if args.shape == "writeup" else 512)
        args.n = min(args.n, 4)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS and not _slice_arm(a) and not _without_arm(a)]
    if bad:
        raise SystemExit(
            f"--arms: {','.join(bad)} unknown; valid choices: {', '.join(ARMS)}, "
            "prime_slice<MS> (MS in 0..1000), prime-<PATCH> (every patch but PATCH)"
        )
    shape = make_shape(args)
    rounds = []
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="prime_r3_wave_")
        )
        os.makedirs(workdir, exist_ok=True)
        for i in range(args.rounds):
            order = arms if i % 2 == 0 else arms[::-1]
            rounds.append(
                {
                    arm: run_arm(
                        arm,
                        shape,
                        stream=args.stream,
                        timeout=args.timeout,
                        step_ms=args.step_ms,
                        workdir=workdir,
                        stall_stacks=args.stall_stacks,
                    )
                    for arm in order
                }
            )
            rounds[-1] = {arm: rounds[-1][arm] for arm in arms}
            print(f"round {i} done", file=sys.stderr, flush=True)
    text = report(shape, args.stream, rounds)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": asdict(shape), "stream": args.stream, "rounds": rounds}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
