"""R3's cost on the EngineCore -> client hop (``vllm serve``): upstream, prime_r3, 02's diff.

    .venv/bin/python scripts/bench_engine_outputs.py [-n 400,1000] [--rounds 3] [--steps 100]
        [--arms upstream,prime_r3,diffs]

``prime-r3 bench`` stops at the scheduler's outputs; under ``vllm serve`` every step's
``EngineCoreOutputs`` then goes from EngineCore's output thread to the client's. With R3
each output carries an array of its own, which the encoder hooks and zmq sends as a
frame of its own, and the client decodes one by one. This prints, per N, the thread CPU
per step of the EngineCore side (``pack_routed_experts`` where the tree has it, vLLM's
``MsgpackEncoder.encode_into`` and ``EngineCoreProc._send_msg_tracking_payload`` over a
real ipc socket) and of the client side (``recv_multipart``, ``MsgpackDecoder.decode``,
``unpack_routed_experts`` where the tree has it), for a decode step of N outputs (one
token each, 46 layers x top-8, uint8) with and without routed experts. The call order
is the output threads' (``tests/engine_outputs_scenarios.py`` runs the threads
themselves for parity). Arms, each a fresh interpreter, ``--rounds`` rounds in rotated order:
``upstream`` (the installed vLLM, ``PRIME_R3=0``), ``prime_r3`` (the overlay's
``packed_hop``, applied by ``prime_r3.layer.apply``: the EngineCore side calls the
installed ``encode_into`` layer in an output thread whose every client declared, as
``process_output_sockets`` sets it up after the handshake; the client side decodes with
the decoder ``MPClient.__init__``'s layer installs) and ``diffs`` (a copy patched with
``patches/``). R3's increment = with - without, per round; medians, and the ratio
upstream / arm (``tests/test_packed_hop.py`` runs the overlay's real threads for parity).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def measure(sizes: list[int], steps: int) -> dict[str, Any]:
    """In this interpreter: medians (us) per N and side, with and without R3 (``steps``),
    and which prime_r3 and vllm packages ran (``package``, ``vllm``)."""
    import gc
    import time

    import numpy as np
    import zmq
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    gc.disable()
    ctx = zmq.Context()
    socket_dir = tempfile.TemporaryDirectory(prefix="prime_r3_hop_")
    path = f"ipc://{socket_dir.name}/hop"
    push = ctx.socket(zmq.PUSH)
    push.bind(path)
    pull = ctx.socket(zmq.PULL)
    pull.connect(path)
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    packs = hasattr(EngineCoreOutputs, "pack_routed_experts")
    if os.environ.get("PRIME_R3") != "0":
        from vllm.v1.engine import core_client  # noqa: F401 - the client side's targets

        from prime_r3 import layer
        from prime_r3.fixes import packed_hop

        state = layer.apply(names=["packed_hop"]).outcome("packed_hop").state
        assert state == layer.APPLIED, state
        # The output thread's record once its one client declared (the handshake).
        engine = type("EngineCoreProc", (), {})()  # the record is keyed weakly on it
        record = packed_hop._record(engine)
        record.clients, record.declared = 1, {0}
        record.update()
        packed_hop._thread.record = record
        decoder = packed_hop.reading_decoder(decoder)
    rng = np.random.default_rng(0)
    result: dict[str, dict[str, float]] = {}
    for n in sizes:
        for r3 in (False, True):
            engine, client = [], []
            for _ in range(steps):
                outputs = EngineCoreOutputs(
                    outputs=[
                        EngineCoreOutput(
                            request_id=f"chatcmpl-{i:08d}",
                            new_token_ids=[7],
                            routed_experts=rng.integers(0, 128, (1, 46, 8), dtype=np.uint8)
                            if r3
                            else None,
                        )
                        for i in range(n)
                    ]
                )
                t0 = time.thread_time_ns()
                if packs:
                    outputs.pack_routed_experts()
                buffers = encoder.encode_into(outputs, bytearray())
                EngineCoreProc._send_msg_tracking_payload(push, buffers)
                t1 = time.thread_time_ns()
                frames = pull.recv_multipart(copy=False)
                got = decoder.decode(frames)
                if packs:
                    got.unpack_routed_experts()
                t2 = time.thread_time_ns()
                engine.append(t1 - t0)
                client.append(t2 - t1)
                del outputs, buffers, frames, got
            result[f"{n}:{int(r3)}"] = {
                "engine": statistics.median(engine) / 1e3,
                "client": statistics.median(client) / 1e3,
            }
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()
    socket_dir.cleanup()
    import vllm

    import prime_r3

    return {
        "steps": result,
        "package": str(Path(prime_r3.__file__).resolve().parent),
        "vllm": str(Path(vllm.__file__).parent.absolute()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", default="400,1000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--arms", default="upstream,prime_r3,diffs")
    parser.add_argument("--json", metavar="PATH", help="write header and rounds ('-': stdout)")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [int(x) for x in args.n.split(",")]
    if args.measure:
        print(json.dumps(measure(sizes, args.steps)))
        return
    sys.path.insert(0, str(ROOT / "scripts"))
    import vllm
    from benchkit import rotated, run_child, write_json

    import patches  # scripts/patches.py

    chosen = args.arms.split(",")
    if chosen[0] != "upstream" or not set(chosen) <= {"upstream", "prime_r3", "diffs"}:
        parser.error(f"--arms={args.arms!r}: upstream first, then any of prime_r3, diffs")
    # upstream and diffs run vLLM's code alone (the overlay off); prime_r3 runs packed_hop.
    for var in [v for v in os.environ if v.startswith("PRIME_R3")]:
        del os.environ[var]
    os.environ.update(PRIME_R3="0", VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="ERROR")
    site = Path(vllm.__file__).resolve().parents[1]
    arms = tuple(chosen)
    overlay = {"PRIME_R3": "1", "PRIME_R3_PATCHES": "packed_hop"}
    rounds: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="prime_r3_engine_outputs_") as tmp:
        tree = str(patches.apply(site, vllm.__version__, Path(tmp) / "tree"))
        trees = {"upstream": None, "prime_r3": None, "diffs": tree}
        argv = ["--measure", "-n", args.n, "--steps", str(args.steps)]
        for r in range(args.rounds):
            for arm in rotated(arms, r):
                env = overlay if arm == "prime_r3" else None
                row = run_child(__file__, argv, str(ROOT), arm, trees[arm], env)
                rounds[arm].append(row["steps"])
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    write_json(args.json, "engine-outputs", vars(args), rounds)
    print(f"vLLM {vllm.__version__}, {args.rounds} rounds x {args.steps} steps, us per step")
    print(f"{'N':>5} {'side':7} {'arm':9} {'R3 off':>8} {'R3 on':>8} {'increment':>10}")
    for n in sizes:
        for side in ("engine", "client"):
            increments = {}
            for arm in arms:
                off = [x[f"{n}:0"][side] for x in rounds[arm]]
                on = [x[f"{n}:1"][side] for x in rounds[arm]]
                increments[arm] = [b - a for a, b in zip(off, on, strict=True)]
                print(
                    f"{n:>5} {side:7} {arm:9} {statistics.median(off):8.0f} "
                    f"{statistics.median(on):8.0f} {statistics.median(increments[arm]):10.0f}"
                )
            for arm in arms[1:]:
                ratios = [
                    u / d for u, d in zip(increments["upstream"], increments[arm], strict=True)
                ]
                print(
                    f"{n:>5} {side:7} increment upstream/{arm} per round: "
                    + " ".join(f"{x:.2f}" for x in ratios)
                    + f", median {statistics.median(ratios):.2f}x"
                )


if __name__ == "__main__":
    main()
