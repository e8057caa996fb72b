"""Many long R3 requests in flight through vLLM's real ``OutputProcessor``: upstream's rows.

The small form of ``prime-r3 bench rows-stress`` (``scripts/bench_rows_stress.py``, whose
``drive`` runs here): 300 requests added to the real ``OutputProcessor`` with their real
``RequestOutputCollector``s, every request's rows past 256 KiB (and response_rows'
``MAPPED_FROM``) while all are in flight, finishing at seeded random steps in a random
order within each step, some aborted after passing 256 KiB. response_rows' caps are set to
64 in flight and 32 handed out, so most requests meet the first and, with every finished
output kept, the mapped ones meet the second. Checked: every finished and aborted request's
``routed_experts`` equal (dtype, shape, bytes) to upstream's in the same process, no
error, response_rows' mappings (its own count and the kernel's VMAs) never above the
caps, and each cap's fallback counted.

Memory (peak RSS and Pss against upstream's) is left to the benchmark: both arms run
here in one process one after the other, so the second inherits the first's heap
(glibc keeps freed heap pages resident and reuses them) and neither peak is what a
fresh process would show; the benchmark runs each arm in a fresh interpreter.
"""

from __future__ import annotations

import gc
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

import prime_r3
from prime_r3.fixes import response_rows

ROOT = Path(__file__).resolve().parents[1]
CAP = 64  # mappings in flight
HELD = 32  # mappings handed out
REQUESTS = 300
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)"
)


def _bench() -> Any:
    path = ROOT / "scripts" / "bench_rows_stress.py"
    spec = importlib.util.spec_from_file_location("bench_rows_stress_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_thousands_in_flight_get_upstreams_rows_within_the_caps(
    reverted: pytest.MonkeyPatch,
) -> None:
    bench = _bench()
    # 512 prompt rows (188 KiB, past MAPPED_FROM) then one row per step: every request
    # folds its first FOLD chunks into a mapping at the same step, passes 256 KiB after
    # step 201 and ends by step ~272; 10% aborted past 256 KiB.
    plan = bench.make_plan(REQUESTS, 1 << 18, 46, 8, prompt=512, spread=0.1, abort=0.1, seed=3)
    assert plan.prompt * 46 * 8 >= response_rows.MAPPED_FROM
    folded_at = response_rows.FOLD - 1  # the step of every request's first fold
    assert folded_at < plan.crossing <= min(plan.ends)
    rows_at_crossing = plan.prompt + plan.crossing  # the first row count past 256 KiB
    assert (rows_at_crossing - 1) * 368 <= 1 << 18 < rows_at_crossing * 368
    aborted = sum(1 for a in plan.aborts if a)
    assert 10 <= aborted < REQUESTS // 4
    assert len(set(plan.ends)) > 50  # finishes spread over many steps

    upstream = bench.drive(plan, sample_every=1000)
    assert upstream["errors"] == [], upstream["errors"][:3]
    assert len(upstream["digests"]) == REQUESTS
    assert (upstream["finished"], upstream["aborted"]) == (REQUESTS - aborted, aborted)

    state = prime_r3.apply(["response_rows"], log=False).outcome("response_rows").state
    assert state == "applied"
    reverted.setattr(response_rows, "MAX_IN_FLIGHT", CAP)
    reverted.setattr(response_rows, "MAX_HANDED_OUT", HELD)
    gc.collect()
    response_rows.COUNTERS.reset()
    start_vmas = bench.rows_vmas()
    assert len(response_rows._IN_FLIGHT) == len(response_rows._HANDED_OUT) == 0
    seen = {"in_flight": 0, "handed_out": 0, "vmas": 0}

    def check(step: int) -> None:
        in_flight, handed = len(response_rows._IN_FLIGHT), len(response_rows._HANDED_OUT)
        assert in_flight <= CAP and handed <= HELD, (step, in_flight, handed)
        seen["in_flight"] = max(seen["in_flight"], in_flight)
        seen["handed_out"] = max(seen["handed_out"], handed)
        if step % 16 == 0 or folded_at <= step <= folded_at + 2:
            vmas = bench.rows_vmas() - start_vmas  # the kernel's view (may merge)
            assert vmas <= in_flight + handed, (step, vmas, in_flight, handed)
            seen["vmas"] = max(seen["vmas"], vmas)

    prime = bench.drive(plan, sample_every=4, keep_finished=True, on_sample=check)
    assert prime["errors"] == [], prime["errors"][:3]
    assert prime["digests"] == upstream["digests"]  # every request's rows: upstream's
    assert (prime["finished"], prime["aborted"]) == (upstream["finished"], upstream["aborted"])
    counts = response_rows.COUNTERS.snapshot()
    print(f"prime: {counts}, peaks {seen}")
    # Each request finished from the buffer (fast) or spilled at the cap in flight.
    assert counts["fast"] + counts["fallback"]["mappings_in_flight"] == REQUESTS
    # The cap in flight: all requests fold at the same step, none finishes there; only CAP
    # map, the rest keep upstream's list.
    assert counts["fallback"].get("mappings_in_flight", 0) == REQUESTS - CAP
    assert seen["in_flight"] == CAP and seen["vmas"] > 0
    # The cap on handed-out mappings: every output kept, so past HELD a finish gets a copy.
    assert seen["handed_out"] == HELD
    assert counts["fallback"].get("mappings_held", 0) > 0
    assert set(counts["fallback"]) <= {"mappings_in_flight", "mappings_held"}, counts
    gc.collect()
    assert len(response_rows._IN_FLIGHT) == len(response_rows._HANDED_OUT) == 0
