"""One bench-like output-worker step through ``process_output``, arms interleaved in one process.

    .venv/bin/python scripts/bench_commit_step.py [--before REV] [--iterations 150] [-n 400]

Why: ``prime-r3 bench step-ab`` (whole bench loop, fresh interpreters) is the honest
end-to-end comparison, but on this shared machine its noise control (``begin_step``,
``prepare_output``, code neither arm changes) moves 10-30% between arms, more than a
change to one of batched_commit's passes can save. Here every arm runs the same step
from the same state, one after another within each iteration (order alternating), so
load drift hits them alike; ``before_again`` repeats ``before`` as the noise control.

The step: ``-n`` decodes (buffered tails of every length) and one prompt after a
prefix hit (496 tokens cached, 16 new, its output read back from the store: upstream's
fallback), as most of ``prime-r3 bench``'s multi-token requests are; every patch
applied, packed steps declared; then ``--flush-mb`` written, so the step reads upstream's
per-request objects from memory, not from a cache the setup just filled (the engine runs
a whole model step between two commits). Arms: ``new`` (this working tree), ``before``
and ``before_again`` (the ``_commit_output`` wrapper of git revision ``--before``: its
``prime_r3/fixes/batched_commit.py`` is exported as ``benchkit.export_revision`` exports a
revision and loaded beside this tree's under another module name, and the wrapper its
``_batched_commit`` builds is the one the arm's connector calls, over upstream's
``_commit_output``; everything else is this tree's). Each arm's connector calls its
wrapper through an instance attribute, the same call for every arm. Printed: medians of
main-thread CPU per step (us) and the median of the per-iteration ratio to ``before``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import MethodType, ModuleType
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import export_revision as _export  # noqa: E402 - the harness

BEFORE = "6921192"


def load_revision(ref: str, module: str, into: str) -> ModuleType:
    """``prime_r3/fixes/<module>.py`` of git revision ``ref``, exported into ``into``
    and imported as ``_before_<module>`` (its own globals; its ``prime_r3`` imports
    resolve to this tree's package, which the patch's helpers share)."""
    _export(ref, into)
    path = Path(into) / "prime_r3" / "fixes" / f"{module}.py"
    spec = importlib.util.spec_from_file_location(f"_before_{module}", path)
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = loaded  # its dataclasses look their module up there
    spec.loader.exec_module(loaded)
    return loaded


BLOCK, TOKEN_SHAPE, CACHED = 16, (46, 8), 496
WARMUP = 5  # iterations timed but not counted


def step_parser(doc: str, n_help: str) -> argparse.ArgumentParser:
    """The options of a one-step benchmark (one step, arms interleaved, the 'before' arms
    from a git revision)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=150)
    parser.add_argument("-n", type=int, default=400, help=n_help)
    parser.add_argument("--before", default=BEFORE, help="git revision of the 'before' arms")
    parser.add_argument(
        "--flush-mb",
        type=int,
        default=64,
        help="MiB written between a step's setup and its timing (0: none), so upstream's "
        "per-request objects are read cold, as between two engine steps",
    )
    return parser


def parse_step_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """``parser``'s arguments, ``--iterations`` checked at parse time."""
    args = parser.parse_args()
    if args.iterations <= WARMUP:
        parser.error(
            f"--iterations must be at least {WARMUP + 1} ({WARMUP} are warm-up), "
            f"got {args.iterations}"
        )
    return args


def step_shape(n: int) -> Any:
    """The connector both step benches build: room for ``n`` requests and some."""
    import numpy as np

    from tests import batched_harness as harness

    return harness.Shape(
        block=BLOCK,
        token_shape=TOKEN_SHAPE,
        dtype=np.uint8,
        max_num_seqs=n + 64,
        max_batched_tokens=2048,
        store_slots=8192,
    )


def time_arms(
    arms: dict[str, Any],
    iterations: int,
    flush_mb: int,
    setup: Callable[[], tuple[Any, Any]],
    swap: Callable[[Any], None],
    method: str,
    check: Callable[[Any, Any], None],
) -> dict[str, list[float]]:
    """Main-thread CPU (us) of ``connector.<method>(work)`` per arm, after the first
    ``WARMUP`` iterations: each iteration runs every arm once (order alternating), each
    on a fresh ``setup()``, with ``swap(arms[name])`` installing the arm and ``flush_mb``
    MiB written just before the timing (upstream's objects read from memory, as after a
    model step). ``check(connector, result)`` runs untimed; ``arms["new"]`` is swapped
    back in at the end. The method is looked up before the clock starts, so the timed
    interval holds the call alone."""
    import numpy as np

    names = list(arms)
    flush = np.zeros(flush_mb << 20, np.uint8)
    times: dict[str, list[float]] = {name: [] for name in names}
    for iteration in range(iterations):
        for name in names if iteration % 2 == 0 else names[::-1]:
            connector, work = setup()
            swap(arms[name])
            call = getattr(connector, method)
            flush += 1  # evicts the caches (a no-op with --flush-mb 0)
            began = time.thread_time_ns()
            result = call(work)
            spent = time.thread_time_ns() - began
            check(connector, result)
            connector.close()
            if iteration >= WARMUP:
                times[name].append(spent / 1e3)
    swap(arms["new"])
    return times


def print_medians(times: dict[str, list[float]]) -> None:
    """Per arm, the median and the median of the per-iteration ratio to ``before``."""
    for name, values in times.items():
        paired = statistics.median(a / b for a, b in zip(values, times["before"], strict=True))
        print(f"{name:>12}: median {statistics.median(values):8.1f}   paired/before {paired:.3f}")


def main() -> None:
    parser = step_parser(__doc__, "decodes in the step")
    args = parse_step_args(parser)

    import numpy as np

    import prime_r3

    prime_r3.apply(log=False)
    from vllm.distributed.aux_output_connector import worker
    from vllm.distributed.aux_output_connector.connector import (
        AuxOutputConnectorMetadata,
        PackedBlockHashes,
    )
    from vllm.distributed.aux_output_connector.store import BlockObject

    from prime_r3.fixes import batched_commit
    from prime_r3.packed import FORMAT_VERSION, READS_MARK
    from tests import batched_harness as harness

    n = args.n
    shape = step_shape(n)
    rng = np.random.default_rng(0)
    hashes = [i.to_bytes(8, "little") for i in range(CACHED // BLOCK + 1)]
    keys = [f"vllm-artifact/0/{h.hex()}" for h in hashes]
    block_nbytes = BLOCK * int(np.prod(TOKEN_SHAPE))

    upstream_commit = harness.upstream("_commit_output")
    current: dict[str, Any] = {}

    def setup() -> tuple[Any, Any]:
        connector = harness.make_connector(shape, reference=False)
        inner = MethodType(upstream_commit, connector)

        def commit_output(pending: Any) -> Any:  # the arm's wrapper, as the layer calls it
            return current["wrapper"](inner, connector, (pending,), {})

        connector._commit_output = commit_output
        ids = [f"d{i}" for i in range(n)]
        starts = [600 + i for i in range(n)]
        metadata = AuxOutputConnectorMetadata(
            0,
            {**dict(zip(ids, starts, strict=True)), "p": 0},
            {"p": PackedBlockHashes(b"".join(hashes), 8)},
            (),
        )
        setattr(metadata, READS_MARK, FORMAT_VERSION)
        cached = keys[: CACHED // BLOCK]
        payloads = rng.integers(0, 128, (len(cached), block_nbytes), dtype=np.uint8)
        connector._store.put(
            [BlockObject(k, p.tobytes()) for k, p in zip(cached, payloads, strict=True)],
            retain_keys=cached,
        )
        connector.begin_step(metadata)
        for request_id, start in zip(ids, starts, strict=True):
            request = connector._requests[request_id]
            request.capture_cursor = request.scheduled_cursor = request.emit_cursor = start
            if start % BLOCK:
                rows = np.zeros((start % BLOCK, *TOKEN_SHAPE), np.uint8)
                connector._buffer.capture(request_id, start - start % BLOCK, rows)
        for request_id in [*ids, "p"]:
            connector._requests[request_id].pending_outputs += 1
        pending = worker.PendingAuxOutput(
            connector=connector,
            request_ids=[*ids, "p"],
            token_starts=np.array([*starts, CACHED], np.int32),
            query_start_loc=np.array([*range(n + 1), n + BLOCK], np.int32),
            routed_experts_gpu=None,  # type: ignore[arg-type]
            routed_experts=rng.integers(0, 128, (n + BLOCK, *TOKEN_SHAPE), dtype=np.uint8),
            num_sampled=np.ones(n + 1, np.int32),
            num_rejected=np.zeros(n + 1, np.int32),
        )
        connector._pending_outputs.append(pending)
        return connector, pending

    with tempfile.TemporaryDirectory(prefix="prime_r3_before_") as into:
        before = load_revision(args.before, "batched_commit", into)._batched_commit({})
    new = batched_commit._batched_commit({})
    arms = {"new": new, "before": before, "before_again": before}

    def swap(arm: Any) -> None:
        current["wrapper"] = arm

    def check(connector: Any, outputs: Any) -> None:
        assert len(outputs) == n + 1

    times = time_arms(arms, args.iterations, args.flush_mb, setup, swap, "process_output", check)
    print(
        f"{args.iterations - WARMUP} iterations, {n} decodes + 1 prefix-hit prompt, "
        f"process_output main-thread CPU (us); before = {args.before}"
    )
    print_medians(times)


if __name__ == "__main__":
    main()
