"""One bench-like ``begin_step`` of the output worker, arms interleaved in one process.

    .venv/bin/python scripts/bench_begin_step.py [--before REV] [--iterations 150] [-n 400]

The sibling of ``bench_commit_step.py`` for batched_begin (``prime-r3 bench``'s
``aux_begin``), for the same reason: whole-bench A/B runs move more between arms than
one pass over the requests can save. Every arm runs the same step from the same state,
one after another within each iteration (order alternating), so load drift hits them
alike; ``before_again`` repeats ``before`` as the noise control.

The step, as a synchronous ``prime-r3 bench`` decode step: ``-n`` requests the worker
knows, each scheduled at its emit cursor (nothing in flight), a sixteenth of them with
one new block hash, and one new request at the end; every patch applied. Between the
setup and the timing ``--flush-mb`` is written, so upstream's per-request objects are
read from memory, as after a model step. Arms: ``new`` (this working tree), ``before``
and ``before_again`` (``batched_begin._trim`` of git revision ``--before``, exported and
loaded beside this tree's as ``bench_commit_step.load_revision`` does, swapped in for
the arm). Printed: medians of main-thread CPU per ``begin_step`` (us) and the median of
the per-iteration ratio to ``before``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_commit_step import (  # noqa: E402 - shared with it
    BLOCK,
    WARMUP,
    load_revision,
    parse_step_args,
    print_medians,
    step_parser,
    step_shape,
    time_arms,
)


def main() -> None:
    args = parse_step_args(step_parser(__doc__, "known requests in the step"))

    import prime_r3

    prime_r3.apply(log=False)
    from vllm.distributed.aux_output_connector.connector import (
        AuxOutputConnectorMetadata,
        PackedBlockHashes,
    )

    from prime_r3.fixes import batched_begin
    from tests import batched_harness as harness

    n = args.n
    shape = step_shape(n)

    def setup() -> tuple[Any, Any]:
        connector = harness.make_connector(shape, reference=False)
        ids = [f"d{i}" for i in range(n)]
        starts = [600 + i for i in range(n)]
        connector.begin_step(
            AuxOutputConnectorMetadata(0, dict(zip(ids, starts, strict=True)), {}, ())
        )
        for request_id, start in zip(ids, starts, strict=True):
            request = connector._requests[request_id]
            request.capture_cursor = request.scheduled_cursor = request.emit_cursor = start
        # The next step: every request one token on (the scheduler's fresh ints), a
        # sixteenth with a new block hash, one new request.
        hashes = {
            request_id: PackedBlockHashes(i.to_bytes(8, "little"), 8)
            for i, request_id in enumerate(ids)
            if i % BLOCK == 0
        }
        requests = {request_id: start + 1 for request_id, start in zip(ids, starts, strict=True)}
        for request_id, start in zip(ids, starts, strict=True):
            connector._requests[request_id].emit_cursor = start + 1
        requests["p"] = 0
        return connector, AuxOutputConnectorMetadata(0, requests, hashes, ())

    with tempfile.TemporaryDirectory(prefix="prime_r3_before_") as into:
        before = load_revision(args.before, "batched_begin", into)._trim
    arms = {"new": batched_begin._trim, "before": before, "before_again": before}

    def swap(trim: Any) -> None:
        batched_begin._trim = trim

    def check(connector: Any, _: Any) -> None:
        assert len(connector._requests) == n + 1

    times = time_arms(arms, args.iterations, args.flush_mb, setup, swap, "begin_step", check)
    print(
        f"{args.iterations - WARMUP} iterations, {n} known requests + 1 new, "
        f"begin_step main-thread CPU (us); before = {args.before}"
    )
    print_medians(times)


if __name__ == "__main__":
    main()
