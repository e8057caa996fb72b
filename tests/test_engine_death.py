"""An engine killed in the middle of a wave: upstream's errors, no hang, no rows mapping left.

A wave on vLLM's real API server (``prime_r3.bench.wave``: vLLM's own ``run_server_worker``,
``AsyncLLM`` and output processor, the EngineCore stand-in sending real
``EngineCoreOutputs`` over vLLM's sockets), R3 on, run once with ``PRIME_R3=0``
(``upstream``) and once with the overlay (``prime``), both at once. The stand-in SIGKILLs
itself after ``DIE_AFTER`` steps (``wave.DIE_AFTER_STEP_ENV``), when every sample's rows
are past ``response_rows.MAPPED_FROM``, so the overlay holds one mapping per sample. The
API server watches the engine's process as ``vllm serve`` with one API server does
(vLLM's own ``start_engine_core_monitor`` and ``monitor_engine_liveness``), so the death
fails every request in flight with ``EngineDeadError`` and vLLM then stops the server.

Asserted for both arms: every request ends, long before the client's timeout, with
vLLM's error (non-streaming: HTTP 500 and its error body; streaming: HTTP 200, the tokens
sent so far, then vLLM's error event and ``[DONE]``), and prime's outcome is upstream's.
The API server reports (``wave._rows_mappings``, sampled every 0.1 s and once more as it
exits) its rows mappings as the kernel shows them and as response_rows counts them: the
prime arm had one per sample in flight before the death, and none is left at the end;
upstream never has any.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from prime_r3.bench import wave
from prime_r3.fixes import response_rows

#: 16 samples: HTTP requests of n=1 and n=2, streaming and not (``Shape.mix``).
SHAPE = wave.Shape("death", requests=16, n=2, prompt_len=16, max_tokens=4096, mix=True)
#: Steps sent before the engine dies: each sample then has the prompt's rows and one row
#: per later step (46 x 8 uint8 a row), folded into a mapping from step 63 on (FOLD chunks,
#: past MAPPED_FROM).
DIE_AFTER = 1200
ROW_BYTES = wave.LAYERS * wave.TOPK
#: The client's own timeout (a hang would end there) and how soon after the death every
#: request must have ended.
CLIENT_TIMEOUT_S = 180
ENDED_WITHIN_S = 30
#: vLLM's error for a request in flight when the engine died (its exception handler's
#: JSON for ``EngineDeadError``; a stream's error event carries the same fields); the
#: message is the release's own (0.33: "The server had an error while processing your
#: request."), and prime's must be upstream's (``test_prime_clients_see_upstreams_outcome``).
DEAD = {"type": "InternalServerError", "param": None, "code": 500}


def _run(arm: str, work: Path) -> dict[str, Any]:
    bodies = work / "bodies"
    bodies.mkdir(parents=True)
    summary = wave.run_arm(
        arm,
        SHAPE,
        stream=False,
        timeout=CLIENT_TIMEOUT_S,
        step_ms=2.0,  # ~1 s of steps with every sample's rows mapped before the death
        workdir=str(work),
        bodies=str(bodies),
        env_extra={wave.DIE_AFTER_STEP_ENV: str(DIE_AFTER)},
    )
    loaded = {k: json.loads((work / f"{arm}.{k}.json").read_text()) for k in ("client", "engine")}
    server = json.loads((work / f"{arm}.server.json").read_text())
    return {
        "summary": summary,
        "results": {r["i"]: r for r in loaded["client"]["results"]},
        "engine": loaded["engine"],
        "rows_maps": server["rows_maps"],
        "rows_maps_end": server["rows_maps_end"],
        "bodies": {int(p.stem): p.read_bytes() for p in bodies.glob("*.body")},
    }


@pytest.fixture(scope="module")
def arms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Both arms at once (each its own API server, engine stand-in and client)."""
    with ThreadPoolExecutor(2) as pool:
        futures = {
            arm: pool.submit(_run, arm, tmp_path_factory.mktemp(f"death_{arm}"))
            for arm in ("upstream", "prime")
        }
        return {arm: future.result() for arm, future in futures.items()}


def _events(body: bytes) -> list[Any]:
    """A streamed body's server-sent events, ``[DONE]`` as the string."""
    events = []
    for block in body.split(b"\n\n"):
        if block:
            assert block.startswith(b"data: "), block[:200]
            data = block[len(b"data: ") :]
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


def outcome(arm: dict[str, Any]) -> list[dict[str, Any]]:
    """What each HTTP request's client saw, whatever the timing: status, and the body
    (non-streaming) or the stream's events past its token deltas (streaming)."""
    seen = []
    for i, (n, streaming) in enumerate(SHAPE.plan(False)):
        result = arm["results"][i]
        entry: dict[str, Any] = {"i": i, "n": n, "stream": streaming, "status": result["status"]}
        body = arm["bodies"].get(i)
        if body is None:
            entry["error"] = result.get("error")
        elif streaming:
            events = _events(body)
            deltas = [e for e in events if isinstance(e, dict) and "choices" in e]
            entry["after_tokens"] = events[len(deltas) :]
            entry["choices"] = sorted({c["index"] for e in deltas for c in e["choices"]})
        else:
            entry["body"] = json.loads(body)
        seen.append(entry)
    return seen


def test_every_request_ends_with_vllms_error(arms: dict[str, dict[str, Any]]) -> None:
    for name, arm in arms.items():
        assert arm["engine"]["steps"] == DIE_AFTER, name
        died = arm["engine"]["died"]
        assert len(arm["results"]) == len(SHAPE.plan(False)), name
        for i, result in arm["results"].items():
            assert "error" not in result, (name, i, result.get("error"))  # no client timeout
            assert result["done"] - died < ENDED_WITHIN_S, (name, i)
        errors = []
        for entry in outcome(arm):
            if entry["stream"]:
                # Headers went out with the first tokens; the error follows them.
                assert entry["status"] == 200, (name, entry)
                assert len(entry["after_tokens"]) == 2, (name, entry)
                assert entry["after_tokens"][1] == "[DONE]", (name, entry)
                assert entry["choices"] == list(range(entry["n"])), (name, entry)
                errors.append(entry["after_tokens"][0])
            else:
                assert entry["status"] == 500, (name, entry)
                errors.append(entry["body"])
        # One error for every request: vLLM's for a dead engine.
        assert all(e == errors[0] for e in errors), (name, errors)
        assert list(errors[0]) == ["error"], (name, errors[0])
        error = errors[0]["error"]
        assert {k: error[k] for k in DEAD} == DEAD and error["message"], (name, error)


def test_streams_carry_the_tokens_sent_and_no_rows(arms: dict[str, dict[str, Any]]) -> None:
    """Each streamed choice got the engine's tokens in order, a prefix of what it sent
    (how many reached the client before the death is timing), no finish and no rows."""
    for name, arm in arms.items():
        for i, (n, streaming) in enumerate(SHAPE.plan(False)):
            if not streaming:
                continue
            got: dict[int, list[int]] = {c: [] for c in range(n)}
            for event in _events(arm["bodies"][i]):
                for choice in event.get("choices", []) if isinstance(event, dict) else []:
                    assert choice["finish_reason"] is None and choice["routed_experts"] is None
                    got[choice["index"]] += choice["token_ids"]
            prompt = wave.prompt_ids(SHAPE, i)
            for child, tokens in got.items():
                sample = wave.sample_number(prompt, child)
                sent = [wave.token(sample, step) for step in range(DIE_AFTER)]
                assert tokens and tokens == sent[: len(tokens)], (name, i, child, len(tokens))


def test_prime_clients_see_upstreams_outcome(arms: dict[str, dict[str, Any]]) -> None:
    assert outcome(arms["prime"]) == outcome(arms["upstream"])


def test_no_rows_mapping_outlives_the_death(arms: dict[str, dict[str, Any]]) -> None:
    """Samples: [time, VMAs, rows VMAs, their KiB, response_rows in flight, handed out]."""
    rows_at_death = SHAPE.prompt_len + DIE_AFTER - 1
    assert rows_at_death * ROW_BYTES > response_rows.MAPPED_FROM
    for name, arm in arms.items():
        samples, end = arm["rows_maps"], arm["rows_maps_end"]
        baseline = samples[0]
        assert baseline[2:] == [0, 0, 0, 0], (name, baseline)
        # As the server exits (vLLM stops it once the engine is dead): back to baseline.
        assert end[2:] == [0, 0, 0, 0], (name, end)
        before = [s for s in samples if s[0] < arm["engine"]["died"]]
        if name == "upstream":
            assert all(s[2:] == [0, 0, 0, 0] for s in samples), name
        else:
            # Every sample's rows were in a mapping of its own before the death, and the
            # kernel showed them (each of at least MAPPED_FROM; neighbours may merge).
            peak = max(before, key=lambda s: s[4])
            assert peak[4] == SHAPE.requests, samples
            assert 0 < peak[2] <= peak[4], samples
            assert peak[3] >= peak[4] * response_rows.MAPPED_FROM // 1024, samples
