"""packed_hop: the EngineCore -> client hop, overlay against upstream, real code both ends.

``tests/hop_scenarios.py`` runs vLLM's real ``process_output_sockets`` thread, a real ZMQ
socket, vLLM's real ``SyncMPClient`` and ``AsyncMPClient`` (their constructors and output
loops) and the real ``_handle_client_request`` for the handshake, once with the overlay
(``PRIME_R3_PATCHES=packed_hop``) and once with ``PRIME_R3=0``: what the clients get must
be identical field by field (types, bytes, dtype, shape, flags), from fewer frames.
"""

from __future__ import annotations

import functools
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import engine_outputs_scenarios as scenarios

ROOT = Path(__file__).resolve().parents[1]
PACKED = ("decode_400", "mixed", "uint16", "prefill")


def _start(out: Path, cases: str, env_vars: dict[str, str]) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_R3")}
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="ERROR", **env_vars)
    env["PYTHONPATH"] = str(ROOT)
    command = [sys.executable, "-m", "tests.hop_scenarios", str(out), cases]
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _finish(out: Path, process: subprocess.Popen[str]) -> dict[str, Any]:
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-6000:]
    return pickle.loads(out.read_bytes())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Three interpreters, run side by side (each is mostly its imports)."""
    tmp = tmp_path_factory.mktemp("hop")
    arms = {
        "overlay": (
            "both,mixed,engine_only,client_only,real_inputs",
            {"PRIME_R3_PATCHES": "packed_hop"},
        ),
        "upstream": ("both", {"PRIME_R3": "0"}),
        "disabled": ("both", {"PRIME_R3_PATCHES": "packed_outputs"}),
    }
    started = {arm: _start(tmp / f"{arm}.pickle", *spec) for arm, spec in arms.items()}
    found = {arm: _finish(tmp / f"{arm}.pickle", process) for arm, process in started.items()}
    return {
        "overlay": found["overlay"]["both"],
        "mixed": found["overlay"]["mixed"],
        "engine_only": found["overlay"]["engine_only"],
        "client_only": found["overlay"]["client_only"],
        "real_inputs": found["overlay"]["real_inputs"],
        "upstream": found["upstream"]["both"],
        "disabled": found["disabled"]["both"],
    }


@pytest.mark.parametrize("client", ["sync", "async"])
def test_the_clients_get_what_upstreams_clients_get(runs: dict, client: str) -> None:
    overlay, upstream = runs["overlay"], runs["upstream"]
    assert overlay[client]["declared"] == ["acknowledged"]
    got, want = overlay[client]["scenarios"], upstream[client]["scenarios"]
    assert list(got) == list(want) and len(want) >= 9
    for name in want:
        for key in ("outputs", "type", "output_types", "sent_left"):
            assert got[name][key] == want[name][key], (client, name, key)
        # An output the client keeps pins its own rows, never the step's.
        for mine, theirs in zip(got[name]["pinned"], want[name]["pinned"], strict=True):
            assert (mine is None) == (theirs is None) and (mine is None or mine <= theirs)
    counters = overlay[f"counters_{client}"]
    assert counters["packed_steps"] == counters["read_packed"] == len(PACKED)


@pytest.mark.parametrize("client", ["sync", "async"])
def test_a_declared_step_travels_in_a_few_frames(runs: dict, client: str) -> None:
    got = runs["overlay"][client]["scenarios"]
    want = runs["upstream"][client]["scenarios"]
    specs = dict(scenarios.scenarios())
    for name in want:
        (sent,), (before,) = got[name]["wire"], want[name]["wire"]
        if name not in PACKED:
            assert sent == before, name  # nothing to pack: upstream's bytes
            continue
        left = sum(
            s["routed_experts"] is not None and s["routed_experts"].nbytes >= 8192
            for s in specs[name]
        )
        assert len(sent) <= 3 + left and len(sent) < len(before), name
        assert all(frame in sent[1:] for frame in before[1:] if len(frame) >= 8192), name
    assert len(want["decode_400"]["wire"][0]) == 401 and len(got["decode_400"]["wire"][0]) == 3


def test_a_client_with_the_patch_off_gets_upstreams_frames(runs: dict) -> None:
    """PRIME_R3=0 (the whole overlay off) and the patch not selected: no declaration,
    and upstream's bytes for every scenario."""
    want = runs["upstream"]["sync"]["scenarios"]
    for arm in ("upstream", "disabled"):
        assert runs[arm]["sync"]["declared"] == [], arm
        assert runs[arm]["state"] == "disabled", arm
    for name, run in runs["disabled"]["sync"]["scenarios"].items():
        assert run["wire"] == want[name]["wire"], name


def test_an_engine_with_the_patch_sends_upstreams_frames_to_a_client_without_it(
    runs: dict,
) -> None:
    engine_only = runs["engine_only"]
    assert engine_only["sync"]["declared"] == []
    assert engine_only["counters_sync"]["packed_steps"] == 0
    assert engine_only["counters_sync"]["upstream_steps"]["undeclared"] >= 10
    want = runs["upstream"]["sync"]["scenarios"]
    for name, run in engine_only["sync"]["scenarios"].items():
        assert run["wire"] == want[name]["wire"] and run["outputs"] == want[name]["outputs"]


def _loud(records: list[tuple[str, str, str, str | None]]) -> list[Any]:
    """Records above INFO, or with a traceback."""
    return [r for r in records if r[1] not in ("DEBUG", "INFO") or r[3] is not None]


def test_an_engine_without_the_patch_logs_nothing_for_a_declared_client(runs: dict) -> None:
    """A mixed install: a client with the overlay declares to an EngineCore without it
    (vLLM's real input thread, upstream's request handling and output thread). The
    engine logs no error, warning or traceback and answers the client's next call; the
    client gets upstream's frames and outputs, and logs nothing louder than INFO."""
    got = runs["client_only"]["sync"]
    assert got["decoder"] == "ReadingDecoder" and got["engine_state"] != "applied"
    assert _loud(got["records"]) == []
    assert got["answers"] == ["pong"] and got["input_thread_alive"]
    assert got["declared"] == ["sent"]  # such an engine never answers the declaration
    want = runs["upstream"]["sync"]["scenarios"]
    assert list(got["scenarios"]) == list(want)
    for name, run in got["scenarios"].items():
        assert run["wire"] == want[name]["wire"] and run["outputs"] == want[name]["outputs"]
    counters = runs["client_only"]["counters_sync"]
    assert counters["read_packed"] == 0 and counters["read_upstream"] >= len(want)


def test_the_declaration_reaches_an_engine_through_vllms_input_thread(runs: dict) -> None:
    """Client and engine with the overlay, the engine reading its socket with vLLM's
    real input thread: the declaration is acknowledged and the decode steps packed."""
    got = runs["real_inputs"]["sync"]
    assert got["engine_state"] == "applied" and _loud(got["records"]) == []
    assert got["answers"] == ["pong"] and got["declared"] == ["acknowledged"]
    counters = runs["real_inputs"]["counters_sync"]
    assert counters["packed_steps"] == counters["read_packed"] == len(PACKED)
    want = runs["upstream"]["sync"]["scenarios"]
    assert list(got["scenarios"]) == list(want)
    for name, run in got["scenarios"].items():
        assert run["outputs"] == want[name]["outputs"], name


def test_a_mixed_deployment_falls_back_to_upstream_for_every_client(runs: dict) -> None:
    """Two clients on one engine, one declared: the engine packs for neither (the
    declared client reads upstream's messages as they are), and the other client's
    frames are upstream's."""
    mixed, want = runs["mixed"], runs["upstream"]["sync"]["scenarios"]
    assert mixed["sync"]["declared"] == ["acknowledged"]
    assert mixed["counters_sync"]["packed_steps"] == 0
    for name, run in mixed["sync"]["scenarios"].items():
        assert run["wire"] == want[name]["wire"] and run["outputs"] == want[name]["outputs"]
    assert mixed["sync"]["other_frames"] == want["decode_400"]["wire"][0]
    assert "1 of 2 client(s) declared" in mixed["status_note"]


def test_status_says_what_the_hop_does_in_the_process(runs: dict) -> None:
    note = runs["overlay"]["status_note"]
    assert "1 of 1 client(s) declared, packing" in note and "engine 0 acknowledged" in note


def test_a_malformed_packed_pair_is_refused_by_name(runs: dict) -> None:
    malformed = runs["overlay"]["malformed"]
    assert set(malformed) == {name for name, *_ in scenarios.malformed_pairs()}
    for name, (kind, message) in malformed.items():
        assert kind == "ValueError", (name, kind, message)
        assert message.startswith("packed routed experts"), (name, message)


# -- in this process: revert, foreign layers ------------------------------------------------


def _targets() -> list[tuple[Any, str, Any]]:
    import importlib

    from prime_r3.fixes import packed_hop

    found = []
    for target in packed_hop.SPEC.targets:
        owner_name, _, attr = target.attr.rpartition(".")
        owner = getattr(importlib.import_module(target.module), owner_name)
        found.append((owner, attr, owner.__dict__[attr]))
    return found


def test_revert_restores_upstreams_objects() -> None:
    from prime_r3 import layer

    before = _targets()
    try:
        report = layer.apply(names=["packed_hop"], environ={})
        assert report.outcome("packed_hop").state == layer.APPLIED
        assert all(owner.__dict__[attr] is not orig for owner, attr, orig in before)
    finally:
        layer.revert(["packed_hop"])
    assert all(owner.__dict__[attr] is orig for owner, attr, orig in before)


def test_a_foreign_wrapped_target_is_skipped_with_a_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.serial_utils import MsgpackEncoder

    from prime_r3 import layer

    upstream = MsgpackEncoder.__dict__["encode_into"]

    @functools.wraps(upstream)
    def foreign(self, obj, buf):  # noqa: ANN001, ANN202 - another tool's layer
        return upstream(self, obj, buf)

    monkeypatch.setattr(MsgpackEncoder, "encode_into", foreign)
    before = _targets()
    try:
        with pytest.raises(layer.PatchNotApplied) as raised:
            layer.apply(names=["packed_hop"], environ={})
        outcome = raised.value.report.outcome("packed_hop")
        assert outcome.state == layer.SKIPPED, outcome
        assert "MsgpackEncoder.encode_into is not upstream's plain object" in outcome.reason
        # Never half-applied: every target is as it was.
        assert all(owner.__dict__[attr] is orig for owner, attr, orig in before)
    finally:
        layer.revert(["packed_hop"])


@pytest.mark.parametrize("kind", ["WAKEUP", "UTILITY"])
def test_an_engine_with_the_patch_answers_the_declaration(kind: str) -> None:
    """The declaration as clients of this build send it (WAKEUP) and as earlier ones did
    (a utility call): recorded and answered like a utility call. Upstream's own WAKEUP
    (None) and a WAKEUP with something else stay upstream's: no answer, no record."""
    import vllm.v1.engine.core_client  # noqa: F401 - every module of the patch imported
    from vllm.v1.engine import EngineCoreRequestType

    from prime_r3 import layer
    from prime_r3.fixes import packed_hop
    from tests.hop_scenarios import _real_engine

    engine = _real_engine()
    declaration = [3, 77, packed_hop.METHOD, [packed_hop.FORMAT_VERSION]]
    try:
        report = layer.apply(names=["packed_hop"], environ={})
        assert report.outcome("packed_hop").state == layer.APPLIED
        handle = engine._handle_client_request
        handle(EngineCoreRequestType.WAKEUP, None)
        handle(EngineCoreRequestType.WAKEUP, [3, 78, "something else", []])
        assert engine.output_queue.empty() and not packed_hop._record(engine).declared
        handle(EngineCoreRequestType[kind], declaration)
        client, outputs = engine.output_queue.get_nowait()
        reply = outputs.utility_output
        assert client == 3 and reply.call_id == 77 and reply.failure_message is None
        assert reply.result.result == packed_hop.FORMAT_VERSION
        assert packed_hop._record(engine).declared == {3}
    finally:
        layer.revert(["packed_hop"])


# -- in this process: the record, the packed form ----------------------------------------


class _GrowsWhileIterated(dict):
    """A dict another thread adds a key to while it is being iterated."""

    def items(self):  # noqa: ANN201 - dict's
        for i, item in enumerate(super().items()):
            self[f"added {i}"] = 1
            yield item


def test_status_never_iterates_counts_another_thread_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """live_note runs on the status caller's thread while the output thread adds a
    reason and the client's output loop a declaration state: it reads copies."""
    from prime_r3.fixes import packed_hop

    counters = packed_hop.COUNTERS
    monkeypatch.setattr(counters, "upstream_steps", _GrowsWhileIterated(undeclared=2, as_is=1))
    monkeypatch.setattr(counters, "declarations", _GrowsWhileIterated({"engine 0": "sent"}))
    monkeypatch.setattr(counters, "packed_steps", 3)
    note = packed_hop.live_note()
    assert "sent 3 packed step(s), upstream's: as_is 1, undeclared 2" in note
    assert "client: engine 0 sent" in note


def _packed_step_bytes() -> tuple[Any, list[bytes]]:
    import numpy as np
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackEncoder

    from prime_r3.fixes import packed_hop

    rng = np.random.default_rng(3)
    outputs = EngineCoreOutputs(
        engine_index=5,
        outputs=[
            EngineCoreOutput(
                request_id=f"r{i}",
                new_token_ids=[i],
                routed_experts=rng.integers(0, 9, (1, 46, 8), dtype=np.uint8),
            )
            for i in range(4)
        ],
    )
    packed = packed_hop.pack(outputs)
    assert packed is not None
    message, taken, arrays = packed
    try:
        frames = [bytes(b) for b in MsgpackEncoder().encode_into(message, bytearray())]
    finally:
        packed_hop.restore(taken, arrays)
    return outputs, frames


def test_upstreams_decoder_refuses_a_packed_step() -> None:
    """A decoder that never declared (upstream's) fails loudly on a packed step instead
    of handing out its outputs without their rows; the reading decoder reads it."""
    import msgspec
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder

    from prime_r3.fixes import packed_hop

    outputs, frames = _packed_step_bytes()
    with pytest.raises(msgspec.ValidationError, match=r"\$\[0\]"):
        MsgpackDecoder(EngineCoreOutputs).decode(frames)
    got = packed_hop.reading_decoder(MsgpackDecoder(EngineCoreOutputs)).decode(frames)
    assert type(got) is EngineCoreOutputs and got.engine_index == 5
    assert [o.routed_experts.tobytes() for o in got.outputs] == [
        o.routed_experts.tobytes() for o in outputs.outputs
    ]
