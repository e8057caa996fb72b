"""The API server's response patches (response_rows, response_b64, response_json).

``test_wave_*``: a small wave on vLLM's real API server (``prime_r3.bench.wave``: vLLM's
own ``run_server_worker``, app, routes, ``AsyncLLM`` and output processor; the EngineCore
stand-in sending real ``EngineCoreOutputs`` over vLLM's sockets), run once with
``PRIME_R3=0`` and once with the overlay as the plugin applies it. Requests with n=1 and
n=2 (a prompt's samples, each first output carrying the prompt's rows), streaming and
not: every HTTP body must be upstream's byte for byte (the wall-clock ``created`` field
masked), every decoded routed-experts array the rows the engine sent, and the overlay's
server must have applied the three patches and taken their fast paths.

The other tests hold each patch's fast path and fallbacks to upstream's own code, in
process: ``RowChunks`` against a list and ``np.concatenate``, ``encode`` against vLLM's
``numpy2base64``, ``render`` against Starlette's ``JSONResponse``.
"""

from __future__ import annotations

import base64
import io
import json
import mmap
import types
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from prime_r3.bench import wave
from prime_r3.fixes import response_b64, response_json, response_rows

#: Long enough (a chunk per token, and the prompt's) that every sample's rows are folded.
SHAPE = wave.Shape("parity", requests=12, n=2, prompt_len=300, max_tokens=70, mix=True)


def _bodies(directory: Path) -> dict[int, bytes]:
    return {int(p.stem): p.read_bytes() for p in directory.glob("*.body")}


def run_parity_wave(
    arm: str,
    work: Path,
    env_extra: dict[str, str] | None = None,
    shape: wave.Shape = SHAPE,
    stream: bool = False,
) -> dict[str, Any]:
    """One arm of a wave (the parity wave, ``SHAPE``, by default), every body kept."""
    bodies = work / "bodies"
    bodies.mkdir()
    summary = wave.run_arm(
        arm,
        shape,
        stream=stream,
        timeout=240,
        step_ms=0.0,
        workdir=str(work),
        bodies=str(bodies),
        env_extra=env_extra,
    )
    return {"summary": summary, "bodies": _bodies(bodies)}


@pytest.fixture(scope="module")
def waves(
    upstream_parity_wave: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    prime = run_parity_wave("prime", tmp_path_factory.mktemp("wave_prime"))
    return {"upstream": upstream_parity_wave, "prime": prime}


def _routed_experts(body: bytes, streaming: bool) -> dict[int, np.ndarray]:
    """Each choice's routed experts, decoded as a client does (``np.load`` of base64)."""
    if streaming:
        events = [
            json.loads(line[len(b"data: ") :])
            for line in body.split(b"\n\n")
            if line.startswith(b"data: ") and line != b"data: [DONE]"
        ]
        choices = [c for e in events for c in e["choices"]]
    else:
        choices = json.loads(body)["choices"]
    found: dict[int, np.ndarray] = {}
    for choice in choices:
        if choice.get("routed_experts") is not None:
            raw = base64.b64decode(choice["routed_experts"])
            assert choice["index"] not in found, "routed experts sent twice for one choice"
            found[choice["index"]] = np.load(io.BytesIO(raw), allow_pickle=False)
    return found


def _stream_content(body: bytes) -> dict[str, Any]:
    """A streamed body's content, whatever its chunk boundaries: per choice the tokens in
    order, the finish reason and the routed-experts string (its exact bytes); the rest of
    every event with the per-chunk fields taken out."""
    choices: dict[int, dict[str, Any]] = {}
    others = []
    for line in body.split(b"\n\n"):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            assert line in (b"", b"data: [DONE]"), line[:200]
            continue
        event = json.loads(line[len(b"data: ") :])
        for choice in event.pop("choices"):
            got = choices.setdefault(choice["index"], {"token_ids": [], "routed_experts": []})
            got["token_ids"] += choice.get("token_ids") or []
            if choice.get("routed_experts") is not None:
                got["routed_experts"].append(choice["routed_experts"])
            if choice.get("finish_reason") is not None:
                got["finish_reason"] = choice["finish_reason"]
        event.pop("usage", None) if event.get("usage") is None else None
        if event not in others:
            others.append(event)
    return {"choices": choices, "others": others}


def test_wave_bodies_are_upstreams_byte_for_byte(waves: dict[str, Any]) -> None:
    """Non-streaming bodies byte for byte. A streamed body's chunk boundaries depend on
    timing in both arms (the output collector merges deltas its consumer has not taken
    yet), so streamed bodies must carry the same content: tokens, finish reasons, events
    and each routed-experts string byte for byte."""
    upstream, prime = waves["upstream"]["bodies"], waves["prime"]["bodies"]
    plan = SHAPE.plan(False)
    assert sorted(upstream) == sorted(prime) == list(range(len(plan)))
    for i, (_, streaming) in enumerate(plan):
        if streaming:
            assert _stream_content(prime[i]) == _stream_content(upstream[i]), (i, plan[i])
        else:
            assert wave.normalised(prime[i]) == wave.normalised(upstream[i]), (i, plan[i])
    for arm in ("upstream", "prime"):
        assert waves[arm]["summary"]["errors"] == 0, waves[arm]["summary"]["error_kinds"]


def test_wave_routed_experts_are_the_rows_the_engine_sent(waves: dict[str, Any]) -> None:
    rows = wave.Rows()
    for arm in ("upstream", "prime"):
        for i, (n, streaming) in enumerate(SHAPE.plan(False)):
            got = _routed_experts(waves[arm]["bodies"][i], streaming)
            prompt = wave.prompt_ids(SHAPE, i)
            assert sorted(got) == list(range(n)), (arm, i)
            for child, array in got.items():
                expected = rows.expected(prompt, child, SHAPE.max_tokens)
                assert array.dtype == expected.dtype and array.shape == expected.shape
                assert np.array_equal(array, expected), (arm, i, child)


def test_wave_overlay_applied_its_fast_paths(waves: dict[str, Any]) -> None:
    """The overlay's server applied the four patches and served every sample by them;
    upstream's (PRIME_R3=0) applied none and counted nothing."""
    samples = SHAPE.requests
    non_streaming = sum(n for n, streaming in SHAPE.plan(False) if not streaming)
    prime = waves["prime"]["summary"]["prime_r3"]
    assert prime["states"] == dict.fromkeys(
        ("response_rows", "response_b64", "response_json", "output_turns"), "applied"
    )
    counters = prime["counters"]
    assert counters["response_rows"] == {"fast": samples, "short": 0, "fallback": {}}
    # Streamed or not, a sample's rows go out once, when it finishes, encoded off the loop.
    assert counters["response_b64"] == {"fast": samples, "off_loop": samples, "fallback": {}}
    assert counters["response_json"]["strings"] == non_streaming
    assert not counters["response_json"]["fallback"]
    # The output handler asked for every step (R3 on): it waited, or took a queued step
    # within its slice or after a turn.
    turns = counters["output_turns"]
    asked = turns["turns"] + turns["within"] + turns["waited"]
    assert turns["r3_off"] == 0 and asked >= SHAPE.max_tokens
    # The engine stand-in packed its decode steps for the declared client (packed_hop).
    assert waves["prime"]["summary"]["packed_hop"]["packed_steps"] >= SHAPE.max_tokens - 1
    assert waves["upstream"]["summary"]["packed_hop"] is None
    upstream = waves["upstream"]["summary"]["prime_r3"]
    assert set(upstream["states"].values()) == {"disabled"}
    assert upstream["counters"]["response_rows"] == {"fast": 0, "short": 0, "fallback": {}}


# -- response_rows ----------------------------------------------------------------------


def _rows(rng: np.random.Generator, n: int, dtype: Any = np.uint8) -> np.ndarray:
    return rng.integers(0, 100, size=(n, 5, 3)).astype(dtype)


def _same(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert np.array_equal(got, expected)


def _gather(chunks: list[np.ndarray]) -> response_rows.RowChunks:
    """A ``RowChunks`` that had ``chunks`` appended, as the output processor appends them."""
    gathered = response_rows.RowChunks()
    for chunk in chunks:
        gathered.append(chunk)
    return gathered


def _finish(chunks: response_rows.RowChunks, **state: Any) -> np.ndarray:
    """The finished output's rows: upstream's ``_new_completion_output`` (its
    concatenation of a non-empty list) under the wrapper, called as upstream calls it."""

    def upstream(token_ids: list[int], finish_reason: Any, stop_reason: Any) -> Any:
        rows = np.concatenate(chunks, axis=0) if chunks else None
        return types.SimpleNamespace(finish_reason=finish_reason, routed_experts=rows)

    instance = types.SimpleNamespace(routed_experts_chunks=chunks, **state)
    wrapper = response_rows._new_completion_output({})
    return wrapper(upstream, instance, ([7], "length", None), {}).routed_experts


def _upstreams_rows(chunks: response_rows.RowChunks) -> np.ndarray:
    """What upstream's concatenation would give now, without finishing: the folded rows,
    then the chunks in the list."""
    parts = [chunks.array()] if chunks.gathered else []
    return np.concatenate([*parts, *chunks], axis=0)


@pytest.fixture
def fold_every(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``fold_every(n, mapped_from)``: fold every ``n`` chunks, map from ``mapped_from``."""

    def set_(n: int, mapped_from: int = 1) -> None:
        monkeypatch.setattr(response_rows, "FOLD", n)
        monkeypatch.setattr(response_rows, "MAPPED_FROM", mapped_from)

    return set_


def test_row_chunks_fold_what_concatenate_would() -> None:
    rng = np.random.default_rng(0)
    chunks = [_rows(rng, 7)] + [_rows(rng, 1) for _ in range(2000)] + [_rows(rng, 0), _rows(rng, 3)]
    gathered = _gather(chunks)
    assert gathered.gathered and len(gathered) == (len(chunks) % response_rows.FOLD)
    gathered.fold()
    assert not gathered  # the list storage is empty once folded
    got = gathered.array()
    _same(got, np.concatenate(chunks, axis=0))
    assert got.flags.c_contiguous and got.flags.writeable


def test_short_requests_keep_upstreams_list() -> None:
    """Under ``FOLD`` chunks, or under ``MAPPED_FROM`` bytes at each fold, the chunks are
    upstream's list and its concatenation is the output's (an array of its own)."""
    rng = np.random.default_rng(1)
    few = [_rows(rng, 1) for _ in range(response_rows.FOLD - 1)]
    small = [_rows(rng, 1) for _ in range(3 * response_rows.FOLD)]  # 15 B a row
    assert 3 * response_rows.FOLD * 15 < response_rows.MAPPED_FROM
    response_rows.COUNTERS.reset()
    for chunks in (few, small):
        gathered = _gather(chunks)
        assert not gathered.gathered and list(gathered) == chunks
        out = _finish(gathered)
        _same(out, np.concatenate(chunks, axis=0))
        assert out.base is None and out.flags.owndata
    assert response_rows.COUNTERS.snapshot() == {"fast": 0, "short": 2, "fallback": {}}


def _mapping_of(array: np.ndarray) -> Any:
    base = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = base.base if isinstance(base, np.ndarray) else getattr(base, "obj", None)
    return base


@pytest.mark.parametrize("mapped_from", [64, 1 << 14])
def test_mapped_rows_are_handed_out_without_a_copy(fold_every: Any, mapped_from: int) -> None:
    """Past ``MAPPED_FROM`` the rows live in a mapping that grows in place and is handed
    out as the finished array's memory, shrunk to the rows' bytes: upstream's values,
    nothing else kept alive; a later chunk or trim spills and leaves that array as it was."""
    fold_every(response_rows.FOLD, mapped_from)
    rng = np.random.default_rng(4)
    chunks = [_rows(rng, 3)] + [_rows(rng, 1) for _ in range(3000)]
    gathered = _gather(chunks)
    assert gathered and gathered.gathered  # chunks not folded yet: the finish folds them
    out = _finish(gathered)
    expected = np.concatenate(chunks, axis=0)
    _same(out, expected)
    assert out.flags.c_contiguous and out.flags.writeable
    mapping = _mapping_of(out)
    assert isinstance(mapping, mmap.mmap) and len(mapping) == expected.nbytes
    response_rows.COUNTERS.reset()
    again = gathered.finished()  # a second finish: a copy of its own, as concatenate's
    _same(again, expected)
    assert not np.shares_memory(again, out)
    gathered[-1] = chunks[-1][:0]  # a trim once handed out
    gathered.append(chunks[0])
    assert dict(response_rows.COUNTERS.fallback) == {"setitem": 1}
    _same(np.concatenate(gathered, axis=0), np.concatenate([*chunks[:-1], chunks[0]], axis=0))
    _same(out, expected)  # the array handed out is unchanged


@pytest.mark.parametrize("mapped_from", [64, 1 << 12])
def test_revert_hands_rows_in_flight_back_to_upstreams_list(
    fold_every: Any, mapped_from: int
) -> None:
    """Reverted while requests are in flight (rows mapped, or not yet), upstream's own
    ``_new_completion_output`` (its ``if finished and self.routed_experts_chunks``, then
    ``np.concatenate``) still finds every request's rows, and no later chunk is folded
    (those after the revert would take either past ``MAPPED_FROM``)."""
    fold_every(8, mapped_from)
    rng = np.random.default_rng(6)
    chunks = [_rows(rng, 30)] + [_rows(rng, 1) for _ in range(100)]  # 1,950 bytes
    gathered = _gather(chunks)
    assert gathered.gathered == (mapped_from == 64)
    response_rows.SPEC.on_revert()
    more = [_rows(rng, 40) for _ in range(20)]
    for chunk in more:
        gathered.append(chunk)
    assert not gathered.gathered
    _same(np.concatenate(gathered, axis=0), np.concatenate(chunks + more, axis=0))


def test_revert_before_a_requests_first_chunk_sends_it_to_upstreams_list(fold_every: Any) -> None:
    fold_every(1)
    rng = np.random.default_rng(7)
    waiting = response_rows.RowChunks()  # a request whose first output has not come yet
    response_rows.SPEC.on_revert()
    chunks = [_rows(rng, 4), _rows(rng, 1)]
    for chunk in chunks:
        waiting.append(chunk)
    assert list(waiting) == chunks and not waiting.gathered


@pytest.mark.parametrize(
    "first",
    [
        pytest.param(lambda r: _rows(r, 3).astype(">i4"), id="byteswapped"),
        pytest.param(
            lambda r: np.zeros(3, np.dtype({"names": ["a"], "formats": ["u1"], "itemsize": 4})),
            id="padded",
        ),
        pytest.param(lambda r: np.zeros((3, 0, 8), np.uint8), id="zero_dim"),
        pytest.param(lambda r: np.zeros((3, 2), np.dtype([])), id="zero_itemsize"),
        pytest.param(lambda r: np.int64(3), id="zero_d"),
        pytest.param(lambda r: [[1, 2]], id="list"),
    ],
)
def test_first_chunks_concatenate_would_change_go_to_upstreams_list(
    fold_every: Any, first: Any
) -> None:
    """Upstream's concatenation of these has another dtype (canonical byte order, no
    padding), no rows to count by, or is not an array's: the fold leaves them to it."""
    fold_every(1)
    rng = np.random.default_rng(8)
    chunks = [first(rng), first(rng)]
    response_rows.COUNTERS.reset()
    gathered = _gather(chunks)
    assert not gathered.gathered and list(gathered) == chunks
    assert dict(response_rows.COUNTERS.fallback) == {"chunk": 1}


@pytest.mark.parametrize("mapped_from", [64, 1 << 18])
def test_copied_or_pickled_chunks_are_upstreams_list(fold_every: Any, mapped_from: int) -> None:
    import copy
    import pickle

    fold_every(8, mapped_from)
    rng = np.random.default_rng(9)
    chunks = [_rows(rng, 20)] + [_rows(rng, 1) for _ in range(30)]
    gathered = _gather(chunks)
    assert gathered.gathered == (mapped_from == 64) and gathered  # folded rows and a list
    for other in (
        copy.copy(gathered),
        copy.deepcopy(gathered),
        pickle.loads(pickle.dumps(gathered)),
    ):
        assert type(other) is list
        other.append(chunks[0])
        _same(np.concatenate(other, axis=0), np.concatenate([*chunks, chunks[0]], axis=0))
    _same(_upstreams_rows(gathered), np.concatenate(chunks, axis=0))  # the original's


def test_finished_outputs_past_the_mapping_budget_get_copies(
    monkeypatch: pytest.MonkeyPatch, fold_every: Any
) -> None:
    fold_every(1)
    monkeypatch.setattr(response_rows, "MAX_HANDED_OUT", len(response_rows._HANDED_OUT) + 1)
    rng = np.random.default_rng(10)
    response_rows.COUNTERS.reset()
    outs = []
    for _ in range(2):
        chunks = [_rows(rng, 40) for _ in range(3)]
        outs.append((_finish(_gather(chunks)), np.concatenate(chunks, axis=0)))
    for out, expected in outs:
        _same(out, expected)
    assert isinstance(_mapping_of(outs[0][0]), mmap.mmap)
    assert outs[1][0].flags.owndata and outs[1][0].base is None
    assert dict(response_rows.COUNTERS.fallback) == {"mappings_held": 1}


@pytest.mark.parametrize("fold", [1, 3, 64])
def test_mapped_rows_trim_and_spill_as_upstream(fold_every: Any, fold: int) -> None:
    """``[-1] = prefix`` on a chunk still in the list and on one just folded; then a chunk
    of another dtype: the list is upstream's, rows in the order they came."""
    fold_every(fold)
    rng = np.random.default_rng(5)
    chunks = [_rows(rng, 40)] + [_rows(rng, 2) for _ in range(200)]
    upstream = list(chunks)
    gathered = _gather(chunks)
    upstream[-1] = chunks[-1][:1]
    gathered[-1] = chunks[-1][:1]
    _same(_upstreams_rows(gathered), np.concatenate(upstream, axis=0))
    odd = _rows(rng, 2, np.uint16)
    response_rows.COUNTERS.reset()
    gathered.append(odd)
    upstream.append(odd)
    gathered.fold()  # as the finish does
    assert not gathered.gathered and dict(response_rows.COUNTERS.fallback) == {"chunk": 1}
    _same(np.concatenate(gathered, axis=0), np.concatenate(upstream, axis=0))


@pytest.mark.parametrize(
    ("odd", "spills"),
    [
        pytest.param(lambda r: _rows(r, 2, np.uint16), True, id="dtype"),
        pytest.param(lambda r: r.integers(0, 9, size=(2, 5, 4)).astype(np.uint8), True, id="shape"),
        pytest.param(lambda r: _rows(r, 2).view(np.ma.MaskedArray), True, id="subclass"),
        pytest.param(lambda r: np.asfortranarray(_rows(r, 4)), False, id="fortran"),
        pytest.param(lambda r: _rows(r, 8)[::2], False, id="strided"),
    ],
)
def test_row_chunks_fold_or_spill_to_upstreams_list(
    fold_every: Any, odd: Any, spills: bool
) -> None:
    """A chunk of another dtype, row shape or type spills (upstream's concatenation
    promotes, refuses or dispatches); a strided one is folded as concatenate copies it."""
    fold_every(1)
    rng = np.random.default_rng(1)
    chunks = [_rows(rng, 3), _rows(rng, 1), odd(rng), _rows(rng, 1)]
    response_rows.COUNTERS.reset()
    try:
        expected = np.concatenate(chunks, axis=0)
    except ValueError:
        expected = None
    gathered = _gather(chunks)
    assert gathered.gathered != spills
    assert sum(response_rows.COUNTERS.fallback.values()) == int(spills)
    if expected is None:
        with pytest.raises(ValueError):
            np.concatenate(gathered, axis=0)
    else:
        _same(_finish(gathered), expected)


def test_row_chunks_trim_the_last_chunk_as_upstream(fold_every: Any) -> None:
    """``[-1] = prefix`` (upstream's drop of tokens past a stop string) once folded (the
    rows rewound), and once the rows were handed out (spilled: the last chunk is still
    ``[-1]``)."""
    fold_every(1)
    rng = np.random.default_rng(2)
    chunks = [_rows(rng, 4), _rows(rng, 3), _rows(rng, 2)]
    upstream = list(chunks)
    gathered = _gather(chunks)
    upstream[-1] = chunks[-1][:1]
    gathered[-1] = chunks[-1][:1]
    _same(_upstreams_rows(gathered), np.concatenate(upstream, axis=0))
    handed_out = _finish(gathered)
    _same(handed_out, np.concatenate(upstream, axis=0))
    upstream[-1] = upstream[-1][:0]
    gathered[-1] = chunks[-1][:0]
    assert not gathered.gathered
    _same(np.concatenate(gathered, axis=0), np.concatenate(upstream, axis=0))
    assert handed_out.shape[0] == 8  # the array handed out is unchanged
    gathered.append(chunks[0])  # a plain list from then on
    upstream.append(chunks[0])
    _same(np.concatenate(gathered, axis=0), np.concatenate(upstream, axis=0))


def test_a_chunk_after_the_rows_were_handed_out_spills(fold_every: Any) -> None:
    """A finished request that gets more chunks (its state kept by a caller): the rows
    handed out stay as they were, and the list is upstream's with every row."""
    fold_every(2)
    rng = np.random.default_rng(12)
    chunks = [_rows(rng, 40) for _ in range(3)]
    gathered = _gather(chunks)
    out = _finish(gathered)
    response_rows.COUNTERS.reset()
    more = [_rows(rng, 1), _rows(rng, 1)]
    for chunk in more:
        gathered.append(chunk)
    assert dict(response_rows.COUNTERS.fallback) == {"handed_out": 1}
    _same(out, np.concatenate(chunks, axis=0))
    _same(np.concatenate(gathered, axis=0), np.concatenate(chunks + more, axis=0))


@pytest.mark.parametrize(
    "act",
    [
        lambda c: c.clear(),
        lambda c: c.pop(),
        lambda c: c.pop(0),
        lambda c: c.insert(0, c[-1]),
        lambda c: c.reverse(),
        lambda c: c.__delitem__(slice(0, 1)),
        lambda c: c.__imul__(2),
    ],
    ids=["clear", "pop", "pop0", "insert", "reverse", "del", "imul"],
)
def test_list_methods_act_on_upstreams_whole_list(fold_every: Any, act: Any) -> None:
    """Upstream calls none of these on the chunks; called on folded rows, each acts on
    upstream's whole list (the rows spill first) and returns what the list's would."""
    fold_every(4)
    rng = np.random.default_rng(13)
    chunks = [_rows(rng, 3) for _ in range(6)]  # 4 folded, 2 in the list
    gathered, upstream = _gather(chunks), list(chunks)
    assert gathered.gathered and len(gathered) == 2
    response_rows.COUNTERS.reset()
    got, expected = act(gathered), act(upstream)
    assert dict(response_rows.COUNTERS.fallback) == {"list_op": 1}
    assert not gathered.gathered and len(gathered) == len(upstream)
    if expected is None or expected is upstream:
        assert got is (None if expected is None else gathered)
    else:
        _same(got, expected)
    assert all(type(c) is np.ndarray for c in gathered)
    for mine, theirs in zip(gathered, upstream, strict=True):  # chunk for chunk
        _same(mine, theirs)
    if upstream:
        _same(np.concatenate(gathered, axis=0), np.concatenate(upstream, axis=0))


def test_row_chunks_other_assignments_spill_first(fold_every: Any) -> None:
    fold_every(1)
    rng = np.random.default_rng(3)
    chunks = [_rows(rng, 4), _rows(rng, 3)]
    gathered = _gather(chunks)
    assert gathered.gathered
    gathered[0] = chunks[0][:1]
    _same(np.concatenate(gathered, axis=0), np.concatenate([chunks[0][:1], chunks[1]], axis=0))
    with pytest.raises(IndexError):
        response_rows.RowChunks()[-1] = chunks[0]  # as an empty list


# -- response_b64 -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.random.default_rng(0).integers(0, 256, (1000, 46, 8), dtype=np.uint8),
        lambda: np.zeros((0, 46, 8), np.uint8),
        lambda: np.arange(6, dtype=np.uint16).reshape(2, 3),
        lambda: np.array(7, np.int32),
        lambda: np.random.default_rng(1).random((3, 4)),
        lambda: np.arange(12, dtype=">i4").reshape(3, 4),
        lambda: np.arange(12).reshape(3, 4).T,
        lambda: np.arange(20)[::3],
        lambda: np.array([b"ab", b"c"]),
        lambda: np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]),
        lambda: np.ma.masked_array([1, 2, 3]),
    ],
)
def test_b64_is_upstreams_string(make: Any) -> None:
    from vllm.utils.serial_utils import numpy2base64

    array = make()
    assert response_b64.encode(array, numpy2base64) == numpy2base64(array)


def test_b64_falls_back_where_np_save_is_not_header_plus_c_bytes() -> None:
    from vllm.utils.serial_utils import numpy2base64

    response_b64.COUNTERS.reset()
    for array in (np.arange(6).reshape(2, 3).T, np.arange(3, dtype=">i2"), np.ma.masked_array([1])):
        response_b64.encode(array, numpy2base64)
    assert response_b64.COUNTERS.snapshot() == {
        "fast": 0,
        "off_loop": 0,
        "fallback": {"layout": 1, "byteorder": 1, "not_ndarray": 1},
    }
    with pytest.raises(ValueError, match="Object arrays cannot be saved"):
        response_b64.encode(np.array([object()]), numpy2base64)  # upstream's own error


# -- response_json ------------------------------------------------------------------------


def _upstream_body(content: Any) -> bytes:
    from starlette.responses import JSONResponse

    return JSONResponse(content=content).body


def _render(content: Any) -> bytes:
    from starlette.responses import JSONResponse

    return response_json.render(content, JSONResponse(content=None).render)


def _b64(n: int, seed: int = 0) -> str:
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    return base64.b64encode(raw).decode("ascii")


def test_json_body_is_upstreams_bytes() -> None:
    long = _b64(200_000)
    content = {
        "request_id": "r-é",
        "choices": [
            {"index": 0, "routed_experts": long, "token_ids": list(range(500)), "t": 'a"\n\\'},
            {"index": 1, "routed_experts": _b64(30)},
            {"index": 2, "routed_experts": _b64(100_000, 1), "logprobs": {"x": 1.5e-7}},
            {"index": 3, "routed_experts": None},
        ],
        "usage": {"prompt_tokens": 3},
    }
    before = json.dumps(content)
    response_json.COUNTERS.reset()
    assert _render(content) == _upstream_body(content)
    assert response_json.COUNTERS.snapshot() == {
        "fast": 1,
        "strings": 2,
        "off_loop": 0,
        "fallback": {},
    }
    assert json.dumps(content) == before  # the content is never modified


@pytest.mark.parametrize(
    "content",
    [
        {"choices": [{"routed_experts": 'x"' * 40_000}]},
        {"choices": [{"routed_experts": "é" * 70_000}]},
        {"choices": [{"routed_experts": _b64(60_000)[:-1] + "\n"}]},
        {"error": {"code": 400}},
        [1, 2],
        {"choices": "none"},
    ],
)
def test_json_other_content_is_upstreams(content: Any) -> None:
    assert _render(content) == _upstream_body(content)


def _through_app(make: Any, content: Any) -> httpx.Response:
    """``content`` answered by ``make(content=...)`` from a FastAPI route, over ASGI."""
    import asyncio

    import fastapi

    app = fastapi.FastAPI()

    @app.post("/r")
    async def route() -> Any:
        return make(content=content)

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/r")

    return asyncio.run(go())


def _spliced_json_response() -> Any:
    from starlette.responses import JSONResponse

    wrapper = response_json._json_response({})
    return lambda **kw: wrapper(JSONResponse, None, (), kw)


@pytest.mark.parametrize(
    ("content", "off_loop"),
    [
        pytest.param({"choices": [{"index": 0, "routed_experts": _b64(120_000)}]}, 1, id="long"),
        pytest.param({"choices": [{"index": 0, "routed_experts": _b64(30)}]}, 0, id="short"),
        pytest.param(
            {"choices": [{"routed_experts": _b64(120_000), "x": float("nan")}]}, 0, id="error"
        ),
    ],
)
def test_json_response_sends_upstreams_status_headers_and_body(content: Any, off_loop: int) -> None:
    """Through a real FastAPI route: status, headers and body are upstream's, a long
    string's body rendered off the loop, a render error answered as upstream's."""
    from starlette.responses import JSONResponse

    response_json.COUNTERS.reset()
    ours = _through_app(_spliced_json_response(), content)
    upstream = _through_app(JSONResponse, content)
    assert (ours.status_code, ours.headers.raw, ours.content) == (
        upstream.status_code,
        upstream.headers.raw,
        upstream.content,
    )
    off_loop = response_json.COUNTERS.snapshot()["off_loop"]
    assert off_loop == (
        1 if "long" in str(content) or len(str(content)) > 1000 and ours.status_code == 200 else 0
    )


def test_json_response_read_before_sending_renders_at_once() -> None:
    """``body`` / ``headers`` read before the send: rendered then, as upstream's
    constructor would have; the send then sends that, and nothing is rendered twice."""
    from starlette.responses import JSONResponse

    content = {"choices": [{"index": 0, "routed_experts": _b64(120_000)}]}
    response_json.COUNTERS.reset()
    ours = _spliced_json_response()(content=content, headers={"x-a": "1"})
    upstream = JSONResponse(content=content, headers={"x-a": "1"})
    assert ours.headers.raw == upstream.headers.raw
    assert ours.body == upstream.body
    assert response_json.COUNTERS.snapshot()["fast"] == 1
    with pytest.raises(AttributeError):
        ours.not_an_attribute  # noqa: B018


def _sent(response: Any, on_send: Any = None) -> list[dict[str, Any]]:
    """The ASGI messages ``response`` sends (``on_send`` called at each)."""
    import asyncio

    messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request"}

    async def send(message: dict[str, Any]) -> None:
        if on_send is not None:
            on_send()
        messages.append(message)

    asyncio.run(response({"type": "http"}, receive, send))
    return messages


def test_json_response_raises_upstreams_render_error_in_its_constructor() -> None:
    """As upstream's, where the route's decorators (vLLM's load_aware_call) see it."""
    from starlette.responses import JSONResponse

    content = {"choices": [{"routed_experts": _b64(120_000), "x": float("nan")}]}
    with pytest.raises(ValueError) as upstream:
        JSONResponse(content=content)
    with pytest.raises(ValueError) as ours:
        _spliced_json_response()(content=content)
    assert str(ours.value) == str(upstream.value)


def test_json_response_keeps_no_content_while_sending() -> None:
    import gc
    import weakref

    class Tracked(dict):
        pass

    usage = Tracked(prompt_tokens=3)  # a part of the content that can be watched
    content = {"choices": [{"index": 0, "routed_experts": _b64(120_000)}], "usage": usage}
    alive = weakref.ref(usage)
    response = _spliced_json_response()(content=content)
    del content, usage
    assert alive() is not None  # kept until the render, off the loop
    seen = []
    _sent(response, lambda: (gc.collect(), seen.append(alive() is not None)))
    assert seen == [False, False]
    assert response_json.COUNTERS.snapshot()["off_loop"] >= 1


def test_json_response_headers_are_those_of_its_construction() -> None:
    """Status or media type changed after construction, ``raw_headers`` / ``body`` set:
    what upstream's constructor fixed, and what the assignments then replaced."""
    from starlette.responses import JSONResponse

    content = {"choices": [{"index": 0, "routed_experts": _b64(120_000)}]}
    for make in (JSONResponse, _spliced_json_response()):
        changed = make(content=content)
        changed.status_code, changed.media_type = 204, "text/plain"
        replaced = make(content=content)
        replaced.raw_headers, replaced.body = [(b"x-only", b"1")], b"{}"
        got = [_sent(changed), _sent(replaced)]
        if make is JSONResponse:
            expected = got
    assert got == expected


def test_json_a_placeholder_in_the_content_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A content that happens to hold the placeholder's text renders as upstream's."""
    monkeypatch.setattr(response_json.secrets, "token_hex", lambda n=None: "ab")
    content = {"choices": [{"routed_experts": _b64(100_000)}], "x": "prime-r3-splice-ab-0"}
    response_json.COUNTERS.reset()
    assert _render(content) == _upstream_body(content)
    assert response_json.COUNTERS.snapshot()["fallback"] == {"placeholder": 1}


def test_b64_off_loop_passes_outputs_on_and_hands_the_same_string() -> None:
    """``encoded_off_loop`` yields what it gets; the string made in the executor is the
    one ``numpy2base64`` is then given for that array, equal to upstream's; an entry goes
    with its array."""
    import asyncio
    from types import SimpleNamespace

    from vllm.utils.serial_utils import numpy2base64

    big = np.random.default_rng(0).integers(0, 256, (400, 46, 8), dtype=np.uint8)
    small = np.zeros((2, 46, 8), np.uint8)
    results = [
        SimpleNamespace(finished=False, outputs=[SimpleNamespace(routed_experts=None)]),
        SimpleNamespace(
            finished=True, outputs=[SimpleNamespace(routed_experts=a) for a in (big, small)]
        ),
    ]

    async def source():  # noqa: ANN202
        for r in results:
            yield r

    async def run() -> list[Any]:
        return [r async for r in response_b64.encoded_off_loop(source())]

    response_b64.COUNTERS.reset()
    assert asyncio.run(run()) == results
    assert list(response_b64._ENCODED) == [id(big)]  # the small one is encoded inline
    assert response_b64.encode(big, numpy2base64) == numpy2base64(big)
    assert response_b64.COUNTERS.snapshot()["off_loop"] == 1 and not response_b64._ENCODED
    asyncio.run(run())
    # The worker thread drops its work item (which holds the array) only after it sets the
    # result; a no-op behind it on the one thread means it has.
    response_b64.off_loop_executor().submit(lambda: None).result()
    del results[1], big
    assert not response_b64._ENCODED  # gone with its array
