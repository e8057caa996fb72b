"""output_turns on a streamed wave: the turns keep upstream's coalescing of a backlog.

A small streamed wave on vLLM's real API server (``prime_r3.bench.wave``), its engine
stand-in sending steps as fast as the server reads them, so the server is behind the
engine for the whole wave: upstream's output handler works each backlog off in one turn
of the loop and a stream's collector merges it into one chunk. The overlay gives the loop
a turn once a slice (100 ms) of a backlog is worked off, so a stream gets at most about
one chunk per 100 ms of the server's work more than upstream's; a turn before every
waiting step (slice 0, the patch before slices) sends about one chunk per step. The
measure is the mechanism (chunks per response); slices are wall time, so the margin is
wide: a quarter of the steps, where the server works off a step here in about 1 ms (a
chunk per ~100 steps from the slices), so it holds for a server up to ~25x slower.
"""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from prime_r3.bench import wave
from tests.test_front_end_parity import _stream_content, run_parity_wave

SHAPE = wave.Shape("chunks", requests=16, n=1, prompt_len=16, max_tokens=400)
MARGIN = SHAPE.max_tokens // 4


@pytest.fixture(scope="module")
def streamed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return {
        arm: run_parity_wave(
            arm, tmp_path_factory.mktemp(f"stream_{arm}"), shape=SHAPE, stream=True
        )
        for arm in ("upstream", "prime", "prime_slice0")
    }


def _chunks(bodies: dict[int, bytes]) -> float:
    return statistics.median(wave.sse_events(body) for body in bodies.values())


def test_streamed_content_is_upstreams(streamed: dict[str, dict[str, Any]]) -> None:
    upstream = streamed["upstream"]["bodies"]
    assert sorted(upstream) == list(range(SHAPE.requests))
    for arm in ("prime", "prime_slice0"):
        assert streamed[arm]["summary"]["errors"] == 0, streamed[arm]["summary"]["error_kinds"]
        assert sorted(streamed[arm]["bodies"]) == sorted(upstream)
        for i, body in streamed[arm]["bodies"].items():
            assert _stream_content(body) == _stream_content(upstream[i]), (arm, i)


def test_a_stream_behind_the_engine_gets_about_upstreams_chunks(
    streamed: dict[str, dict[str, Any]],
) -> None:
    upstream = _chunks(streamed["upstream"]["bodies"])
    prime = _chunks(streamed["prime"]["bodies"])
    per_step = _chunks(streamed["prime_slice0"]["bodies"])
    # The wave ran behind the engine: upstream merged steps (far fewer chunks than steps).
    assert upstream < SHAPE.max_tokens / 4, upstream
    assert prime <= upstream + MARGIN, (prime, upstream)
    # The guard can fail: a turn before every waiting step exceeds it.
    assert per_step > upstream + MARGIN, (per_step, upstream)
    turns = streamed["prime"]["summary"]["prime_r3"]["counters"]["output_turns"]
    assert turns["within"] > 0 and turns["r3_off"] == 0, turns
