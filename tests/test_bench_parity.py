"""prime-r3 bench: vLLM's real R3 path gives bitwise-identical rows with and without prime_r3.

The workload is sized so the KV cache overflows: requests are preempted and resumed,
the routed-experts store is full and evicting, and RL-style repeated prompts hit the
prefix cache. The test asserts those paths were taken, so parity is checked where it
can actually break. The run ends with some preempted requests finished and others still
in flight (as the default bench ends): parity compares the finished ones' rows and the
others' partial row streams.
"""

from __future__ import annotations

import numpy as np
import pytest

from prime_r3.bench import arms, command, parity
from prime_r3.bench.loop import RowPrinter
from prime_r3.bench.workload import BenchConfig
from prime_r3.guards import installed_vllm_version
from prime_r3.patches import REGISTRY

#: Long enough that vLLM 0.33 releases keys and preempted requests finish, short enough that
#: others are still in flight at the end.
SMALL = BenchConfig(
    concurrency=24,
    steps=120,
    warmup=0,
    prefix_len=32,
    problem_len=48,
    samples_per_prompt=4,
    max_tokens=96,
    min_tokens=8,
    kv_blocks=60,
    max_num_batched_tokens=256,
)


@pytest.fixture(scope="module")
def applicable() -> tuple[str, ...]:
    """Every patch the installed release takes (test_bench_command states which)."""
    return tuple(command.applicable_patches()[1])


#: ``--without``'s arm in the full run: every patch but packed_outputs, so batched_take
#: (which reads only packed steps) is in force and hands every request to upstream.
LEFT_OUT = "packed_outputs"


def _run(cfg: BenchConfig, applicable: tuple[str, ...], left_out: tuple[str, ...] = ()) -> dict:
    # The bench's own arms (r3_off has no rows to compare).
    run = [arm for arm in arms.default_arms(applicable, (), left_out) if arm.r3]
    return arms.run_arms(run, cfg, timeout=600)


@pytest.fixture(scope="module")
def results(applicable: tuple[str, ...]) -> dict:
    return _run(SMALL, applicable, (LEFT_OUT,))


def test_arms_ran_clean(results: dict, applicable: tuple[str, ...]) -> None:
    for name, result in results.items():
        assert result.get("error") is None, f"{name}: {result.get('error')}"
    assert results["r3_upstream"]["active_patches"] == []
    assert set(results["r3_prime"]["active_patches"]) == set(applicable)
    assert set(applicable) <= {spec.name for spec in REGISTRY}
    # --without's arm ran every other patch, and not the one left out.
    assert set(results[f"r3_prime[-{LEFT_OUT}]"]["active_patches"]) == set(applicable) - {LEFT_OUT}


def test_an_arm_without_packed_outputs_sends_upstreams_dicts(results: dict) -> None:
    """Left out of the rest, packed_outputs' share shows: batched_take, still applied,
    finds no packed step and hands every request to upstream's take_output (its counter,
    from the arm's own process); with it, the same requests go by the slice."""
    without = results[f"r3_prime[-{LEFT_OUT}]"]["fast_path"]["batched_take"]
    assert without["fast_requests"] == 0
    assert without["fallback_requests"] > 0
    assert without["fallback_reasons"] == {"not_packed": without["fallback_requests"]}
    assert results[f"r3_prime[-{LEFT_OUT}]"]["handshake"] is None
    full = results["r3_prime"]["fast_path"]["batched_take"]
    assert full["fast_requests"] > 0


def test_rows_bitwise_identical_across_preemption_and_prefix_hits(results: dict) -> None:
    every = command.check_parity(results)
    assert set(every) == {"r3_prime", f"r3_prime[-{LEFT_OUT}]"}
    assert every[f"r3_prime[-{LEFT_OUT}]"] == every["r3_prime"]  # same requests, same rows
    checked = every["r3_prime"]
    assert checked["requests"] > 0 and checked["rows"] > 0
    # The interesting paths really happened among the compared requests.
    assert checked["preempted_requests"] > 0
    assert checked["prefix_hit_requests"] > 0
    window = results["r3_upstream"]["window"]
    assert window["released"] > 0, "no store key lost its last reference"
    if installed_vllm_version() in ("0.31.0", "0.32.0"):
        # The store is sized to the KV cache and keys live until requests finish: it fills.
        assert window["evictions"] > 0, "the store never filled; parity not tested under eviction"
    else:
        # 0.33 releases a key when the KV cache drops its block (released_block_hashes), so
        # at this size its store never fills; parity is tested across those releases.
        assert installed_vllm_version() == "0.33.0"


def test_parity_names_request_and_first_differing_row(results: dict) -> None:
    base = results["r3_upstream"]
    tampered = {**base, "digests": dict(base["digests"])}
    request_id = sorted(tampered["digests"])[0]
    sha, prints, rows = tampered["digests"][request_id]
    prints = np.array(prints, copy=True)
    prints[3] ^= np.uint64(1)
    tampered["digests"][request_id] = ("0" * 64, prints, rows)
    with pytest.raises(parity.ParityError, match=rf"request {request_id}: .* row 3 "):
        parity.compare(base, tampered, ("a", "b"))


def test_parity_compares_preempted_requests_in_flight_at_the_end(results: dict) -> None:
    for name, result in results.items():
        assert result.get("error") is None, f"{name}: {result.get('error')}"
    base = results["r3_upstream"]
    flags = base["flags"]
    # Preempted requests both finished and still running.
    assert any(flags[r][0] for r in base["digests"])
    assert any(flags[r][0] for r in base["in_flight"])
    checked = command.check_parity(results)["r3_prime"]
    assert checked["preempted_requests"] > 0
    assert checked["in_flight_requests"] == len(base["in_flight"]) > 0
    assert checked["finished_requests"] == len(base["digests"]) > 0
    assert checked["requests"] == checked["finished_requests"] + checked["in_flight_requests"]
    rows = [d[2] for d in (*base["digests"].values(), *base["in_flight"].values())]
    assert checked["rows"] == sum(rows)
    line = command._parity_line({"ok": True, "checked": {"r3_prime": checked}})
    assert (
        f"r3_prime: {checked['finished_requests']} finished + "
        f"{checked['in_flight_requests']} in flight / {checked['rows']} rows identical "
        f"({checked['preempted_requests']} preempted, " in line
    )


def test_parity_names_an_in_flight_preempted_request_whose_rows_differ(
    results: dict,
) -> None:
    base, other = results["r3_upstream"], results["r3_prime"]
    request_id = next(r for r in sorted(other["in_flight"]) if base["flags"][r][0])
    sha, prints, rows = other["in_flight"][request_id]
    prints = np.array(prints, copy=True)
    prints[-1] ^= np.uint64(1)
    tampered = {**other, "in_flight": {**other["in_flight"], request_id: ("0" * 64, prints, rows)}}
    match = rf"request {request_id} \(in flight\): .* first differing row {rows - 1} "
    with pytest.raises(parity.ParityError, match=match):
        parity.compare(base, tampered, ("a", "b"))
    # A stream cut short (same rows so far, fewer of them) is a mismatch too.
    cut = {**other, "in_flight": {**other["in_flight"], request_id: (sha, prints[:-1], rows - 1)}}
    with pytest.raises(parity.ParityError, match=rf"first differing row {rows - 1} "):
        parity.compare(base, cut, ("a", "b"))


def test_parity_requires_the_same_requests_in_flight(results: dict) -> None:
    base, other = results["r3_upstream"], results["r3_prime"]
    request_id = sorted(other["in_flight"])[0]
    dropped = {**other, "in_flight": dict(other["in_flight"])}
    del dropped["in_flight"][request_id]
    with pytest.raises(parity.ParityError, match=rf"1 request\(s\) in flight .* {request_id} "):
        parity.compare(base, dropped, ("a", "b"))


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_row_printer_gives_an_empty_chunk_no_prints(dtype: type) -> None:
    """``routed_experts_prompt_start`` beyond the prompt hands a request zero rows."""
    printer = RowPrinter(3 * 5 * np.dtype(dtype).itemsize)
    rows = np.random.default_rng(0).integers(0, 100, (4, 3, 5)).astype(dtype)
    empty = printer(rows[:0])
    assert empty.dtype == np.uint64 and empty.shape == (0,)
    whole = printer(rows)
    assert len(whole) == 4 and len(set(whole.tolist())) == 4
    chunks = [printer(rows[:2]), empty, printer(rows[2:])]
    assert np.array_equal(np.concatenate(chunks), whole)


def test_fast_path_section_shows_packed_outputs_handshake(
    results: dict, applicable: tuple[str, ...]
) -> None:
    """packed_outputs' handshake counts (steps EngineCore declared it reads the packed
    form, steps withheld by reason) appear beside the batched patches' counts."""
    assert "packed_outputs" in applicable  # every supported release takes it
    handshake = results["r3_prime"]["handshake"]
    assert handshake == {"declared_steps": SMALL.steps, "withheld_steps": 0, "withheld_reasons": {}}
    assert results["r3_upstream"]["handshake"] is None  # nothing counted where it is off
    lines = command._fast_path_lines(results).splitlines()
    line = f"  r3_prime packed_outputs: {SMALL.steps} steps declared packed / 0 withheld"
    assert f"{line} (none withheld)" in lines, lines
