"""02's EngineCore -> client hop: a step's routed experts travel as one array.

``tests/engine_outputs_scenarios.py`` runs vLLM's real EngineCore output thread, a real
ZMQ socket and the real ``SyncMPClient`` output thread, once on the installed release
and once on a copy patched with ``patches/``; the client must get what upstream's gets,
field by field (routed experts by bytes, dtype, shape and flags), from fewer frames.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import engine_outputs_scenarios as scenarios
from tests.test_upstream_diffs import RELEASE, ROOT, SITE, patches

#: the patched tree against the installed release (CI: default release only)
pytestmark = pytest.mark.tree_parity
PACKED = ("decode_400", "mixed", "uint16", "prefill")
AS_UPSTREAM = ("mixed_dtypes", "mixed_shapes", "one_with_rows", "none", "empty", "large")


def _run(out: Path, tree: Path | None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_R3")}
    env.update(PRIME_R3="0", VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="ERROR")
    env["PYTHONPATH"] = os.pathsep.join([str(p) for p in (tree, ROOT) if p is not None])
    command = [sys.executable, "-m", "tests.engine_outputs_scenarios", str(out)]
    result = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(out, "rb") as f:
        return pickle.load(f)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(patches.apply(SITE, RELEASE, tmp_path_factory.mktemp("engine_hop_vllm")))


@pytest.fixture(scope="module")
def results(tree: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    tmp = tmp_path_factory.mktemp("engine_hop")
    return _run(tmp / "upstream.pickle", None), _run(tmp / "diffs.pickle", tree)


@pytest.fixture(scope="module")
def runs(results: tuple[dict, dict]) -> tuple[dict, dict]:
    """Each tree's scenarios through the real output threads."""
    return results[0]["scenarios"], results[1]["scenarios"]


def test_the_client_gets_what_upstreams_client_gets(runs: tuple[dict, dict]) -> None:
    upstream, diffs = runs
    assert list(diffs) == list(upstream)
    for name in upstream:
        got = diffs[name]["outputs"]
        # The one new field is the packed form's; the client never sees it set.
        assert got[1].pop("packed_routed_experts") is None, name
        assert not diffs[name]["packed_left"], name
        assert got == upstream[name]["outputs"], name


def test_a_client_output_keeps_no_more_alive_than_upstreams(runs: tuple[dict, dict]) -> None:
    """An output the client keeps (its request's chunks, until the request finishes) pins
    at most what upstream's pinned: its own rows, never the step's packed rows."""
    upstream, diffs = runs
    for name in upstream:
        pinned, before = diffs[name]["pinned"], upstream[name]["pinned"]
        assert len(pinned) == len(before), name
        for got, limit in zip(pinned, before, strict=True):
            assert (got is None) == (limit is None), name
            assert got is None or got <= limit, (name, got, limit)


def test_a_step_with_routed_experts_travels_in_a_few_frames(runs: tuple[dict, dict]) -> None:
    upstream, diffs = runs
    specs = dict(scenarios.scenarios())
    for name in PACKED:
        (sent,) = diffs[name]["wire"]
        (before,) = upstream[name]["wire"]
        # Arrays of 8 KiB or more (a prefill's rows) keep a frame each, as upstream's.
        left = sum(
            spec["routed_experts"] is not None and spec["routed_experts"].nbytes >= 8192
            for spec in specs[name]
        )
        # The message, the row counts and the rows, whatever the number of outputs.
        assert len(sent) <= 3 + left and len(sent) < len(before), (name, len(sent), left)
        # ... and go out as upstream's frames, not copied into the packed rows.
        assert all(frame in sent[1:] for frame in before[1:] if len(frame) >= 8192), name
    assert len(upstream["decode_400"]["wire"][0]) == 401
    assert len(diffs["decode_400"]["wire"][0]) <= 3


def test_a_step_left_as_it_is_goes_out_as_upstreams_plus_one_nil(
    runs: tuple[dict, dict],
) -> None:
    """Mixed dtypes or per-token shapes, one output with rows, none: nothing is packed,
    and the wire differs from upstream's only by the new trailing field (nil)."""
    upstream, diffs = runs
    for name in AS_UPSTREAM:
        (sent,) = diffs[name]["wire"]
        (before,) = upstream[name]["wire"]
        assert sent[1:] == before[1:], name
        head, body = before[0][0], before[0][1:]
        assert 0x90 <= head < 0x9F, name  # a fixarray: EngineCoreOutputs' fields
        assert sent[0] == bytes([head + 1]) + body + b"\xc0", name


def test_a_malformed_packed_pair_is_refused_by_name(results: tuple[dict, dict]) -> None:
    """Counts that do not describe the rows (another layout, a bug) raise a ValueError
    naming the packed routed experts, which the client's output loop hands to
    get_output, as it does a message it cannot decode: never rows given to the wrong
    outputs, or dropped."""
    upstream, diffs = results
    assert upstream["malformed"] is None  # the installed release has no packed form
    malformed = diffs["malformed"]
    assert set(malformed) == {name for name, *_ in scenarios.malformed_pairs()}
    for name, (kind, message) in malformed.items():
        assert kind == "ValueError", (name, kind, message)
        assert message.startswith("packed routed experts"), (name, message)


def test_both_client_output_loops_unpack_what_they_decode(tree: Path) -> None:
    """The sync client's loop runs in the scenarios; the asyncio client's has the same
    two lines (``AsyncMPClient``, every DP client)."""
    source = (tree / "vllm/v1/engine/core_client.py").read_text()
    decodes = re.findall(r"decoder\.decode\(frames\)\n(.*)\n", source)
    assert len(decodes) == 2
    assert all(line.strip() == "outputs.unpack_routed_experts()" for line in decodes)
    core = (tree / "vllm/v1/engine/core.py").read_text()
    assert core.count("outputs.pack_routed_experts()") == 1
