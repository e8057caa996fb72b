"""prime-r3 bench's effect table: interleaved arms take turns, and the table pairs them.

The interleaved runner is driven with a stand-in child that speaks the real child's
protocol (``"turn"`` before each slice, waits on its gate, ``"done"`` with per-step
meters) and records when each of its slices ran: the slices of different arms must never
overlap, and each slice's order must be the arms rotated by one. The effect table is
checked on meters whose effects are known by construction.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from prime_r3.bench import arms as arms_mod
from prime_r3.bench import command, report
from prime_r3.bench.workload import BenchConfig
from prime_r3.patches import REGISTRY

CFG = BenchConfig(steps=12, warmup=3)
PHASES = ("sched", "aux_begin", "aux_process", "transport", "writer", "gc", "model", "client")


def stand_in_child(arm: arms_mod.Arm, cfg: BenchConfig, out: Any, gate: Any, slices: int) -> None:
    """Runs ``cfg.total_steps`` 'steps' of 2 ms wall each, as the real child paces them."""
    starts = set(arms_mod.slice_starts(cfg, slices))
    spans: list[tuple[float, float]] = []
    for step in range(cfg.total_steps):
        if step in starts:
            out.put(("turn", step))
            gate.acquire()
            spans.append((time.monotonic(), 0.0))
        time.sleep(0.002)
        if spans:
            spans[-1] = (spans[-1][0], time.monotonic())
    per_step = {name: [0.001] * cfg.total_steps for name in (*PHASES, "cpu", "wall")}
    out.put(("done", {"per_step": per_step, "spans": spans}))


def test_interleaved_arms_take_turns_one_slice_at_a_time() -> None:
    arms = [arms_mod.Arm(name, r3=True) for name in ("a", "b", "c")]
    results = arms_mod.run_interleaved(arms, CFG, 4, timeout=60, target=stand_in_child)
    assert sorted(results) == ["a", "b", "c"]
    spans = {name: result["spans"] for name, result in results.items()}
    assert all(len(s) == 4 for s in spans.values())
    every = sorted(
        (start, end, name, k) for name, s in spans.items() for k, (start, end) in enumerate(s)
    )
    for (_, end, *_), (start, *_) in zip(every, every[1:], strict=False):
        assert end <= start  # one arm at a time
    # Slice k runs the arms rotated by k: a,b,c / b,c,a / c,a,b / a,b,c.
    order = [name for _, _, name, _ in every]
    assert order == list("abcbcacababc")
    assert [k for *_, k in every] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3


def _result(engine: float, phases: dict[str, float]) -> dict[str, Any]:
    """Per-step meters (seconds) whose engine CPU per step is ``engine`` ms."""
    n = CFG.total_steps
    per_step = {name: np.zeros(n) for name in (*PHASES, "cpu", "wall")}
    for name, ms in phases.items():
        per_step[name][:] = ms / 1e3
    per_step["cpu"][:] = engine / 1e3 - per_step["writer"]  # engine = cpu - model - client + writer
    return {"per_step": {k: v.tolist() for k, v in per_step.items()}}


def test_the_effect_is_measured_where_the_patch_acts_and_stated_per_step() -> None:
    base = {"sched": 4.0, "transport": 1.0, "writer": 0.5, "gc": 0.0}
    rounds = {
        "r3_prime": _result(10.0, base),
        "r3_prime_again": _result(10.0, base),
        # Without batched_take: +0.5 ms in transport, where it acts, and +2 ms of noise
        # in sched, which its row does not read.
        "r3_prime[-batched_take]": _result(12.5, {**base, "transport": 1.5, "sched": 6.0}),
    }
    pairs = []
    for k in range(3):
        cuts = {n: report.per_slice(r, CFG, 3) for n, r in rounds.items()}
        pairs.append({n: {ph: v[k] for ph, v in c.items()} for n, c in cuts.items()})
    rows = {(r["patch"], tuple(r["phases"])): r for r in report.effects(pairs)}
    take = rows[("batched_take", ("transport",))]
    assert take["share"] == pytest.approx(0.05) and take["whole"] == pytest.approx(1.25)
    assert take["pairs"] == 3
    again = rows[("(A/A)", ("transport",))]
    assert again["share"] == pytest.approx(0.0) and again["whole"] == pytest.approx(1.0)
    text = report.effects_table(report.effects(pairs))
    assert "batched_take" in text and "+5.0%" in text


def test_every_patch_the_engine_loop_runs_says_where_it_acts() -> None:
    """The bench has no API server: its patches (and packed_hop's hop) act elsewhere."""
    api_server = {"packed_hop", "response_rows", "response_b64", "response_json", "output_turns"}
    assert set(report.ACTS_IN) == {s.name for s in REGISTRY} - api_server
    assert all(set(phases) <= set(report._SLICED) for phases in report.ACTS_IN.values())


@pytest.mark.parametrize("slices", ["-1", "999"])
def test_slices_outside_the_window_are_refused(slices: str, capsys) -> None:  # noqa: ANN001
    from prime_r3 import cli

    args = cli.build_parser().parse_args(["bench", "--steps", "50", "--slices", slices])
    assert command.main(args) == 2
    assert f"--slices {slices}: must be in 0..50" in capsys.readouterr().err


def test_again_adds_the_aa_arm_with_every_patch() -> None:
    arms = arms_mod.default_arms(["x", "y"], left_out=["y"], again=True)
    assert [a.name for a in arms] == [
        "r3_off",
        "r3_upstream",
        "r3_prime",
        "r3_prime_again",
        "r3_prime[-y]",
    ]
    assert arms[3].patches == arms[2].patches == ("x", "y")
