"""09-11's API-server code against the installed release's (the upstream-form diffs of
response_rows, response_b64 and response_json).

``tests/front_end_diff_scenarios.py`` runs on the installed vLLM and on a copy patched
with ``patches/`` (both ``PRIME_R3=0``): vLLM's real ``OutputProcessor`` (finished
routed experts: dtype, shape, bytes, flags; errors), ``numpy2base64`` (the strings) and
the generate route's response (the bodies) must be upstream's. ``test_wave_*``: the
small wave of ``tests/test_front_end_parity.py`` on vLLM's real API server (uvicorn,
its app and route, ``AsyncLLM``, the EngineCore stand-in on vLLM's sockets) served by
the patched tree: every body, streaming and not, as the installed release's.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prime_r3.bench import wave
from tests.test_front_end_parity import SHAPE, _routed_experts, _stream_content, run_parity_wave
from tests.test_upstream_diffs import RELEASE, ROOT, SITE, patches

#: the patched tree against the installed release (CI: default release only)
pytestmark = pytest.mark.tree_parity
ADDED = ("RoutedExpertsRows", "_routed_experts_base64", "GenerateJSONResponse")


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(patches.apply(SITE, RELEASE, tmp_path_factory.mktemp("front_end_vllm")))


def _env(tree: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_R3")}
    env.update(PRIME_R3="0", VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="ERROR")
    env["PYTHONPATH"] = os.pathsep.join([str(p) for p in (tree, ROOT) if p is not None])
    return env


def _scenarios(out: Path, tree: Path | None) -> dict[str, Any]:
    command = [sys.executable, "-m", "tests.front_end_diff_scenarios", str(out)]
    result = subprocess.run(
        command, cwd=ROOT, env=_env(tree), capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return pickle.loads(out.read_bytes())


@pytest.fixture(scope="module")
def runs(tree: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    tmp = tmp_path_factory.mktemp("front_end_scenarios")
    upstream = _scenarios(tmp / "upstream.pickle", None)
    diffs = _scenarios(tmp / "diffs.pickle", tree)
    assert Path(upstream["vllm_file"]).is_relative_to(SITE)
    assert Path(diffs["vllm_file"]).is_relative_to(tree)
    assert upstream["added"] == dict.fromkeys(ADDED, False)
    assert diffs["added"] == dict.fromkeys(ADDED, True)
    return upstream, diffs


def test_finished_routed_experts_are_upstreams(runs: tuple[dict, dict]) -> None:
    """09's RoutedExpertsRows in vLLM's real OutputProcessor: every output (token ids,
    finish and stop reasons) and every finished request's routed experts (dtype, shape,
    bytes, C-contiguous, writeable, owning its data) as upstream's concatenation, and
    upstream's errors, case by case."""
    upstream, diffs = runs
    assert list(diffs["rows"]) == list(upstream["rows"])
    for case, seen in upstream["rows"].items():
        assert diffs["rows"][case] == seen, case
    finished = {
        (case, s[1]): s[-1]
        for case, seen in upstream["rows"].items()
        for s in seen
        if len(s) == 7 and s[-1] is not None
    }
    arrays = list(finished.values())
    # Each its own writeable array; C-contiguous but where upstream's concatenation of
    # Fortran-ordered arrays keeps their order (the diff's fallback concatenates too).
    assert len(arrays) > 15 and all(a[6] and a[7] for a in arrays)
    assert [key for key, a in finished.items() if not a[5]] == [("odd_arrays", "fortran")]
    assert {a[2] for a in arrays} >= {"|u1", "<u2", "<i8", "<i4", "<i2", "<f4"}
    # The fallbacks reached upstream's errors at finish: mismatched rows, 0-d arrays.
    errors = {
        case: s[2][2]
        for case, seen in upstream["rows"].items()
        for s in seen
        if s[1] == "process_outputs"
    }
    assert sorted(errors) == ["row_shape_changes", "zero_dim", "zero_dim_later"], errors
    assert errors["row_shape_changes"].startswith("all the input array dimensions except")
    assert errors["zero_dim"] == "zero-dimensional arrays cannot be concatenated"
    assert errors["zero_dim_later"].startswith("all the input arrays must have same number")
    if RELEASE != "0.31.0":  # 0.32 drops tokens past a stop string in the step
        stop = [s for s in upstream["rows"]["stop_strings"] if len(s) == 7 and s[5]]
        assert {s[1] for s in stop} == {"mid", "end", "first"}


def test_base64_strings_are_upstreams(runs: tuple[dict, dict]) -> None:
    """10's numpy2base64: the same string (or error) for every kind of array."""
    upstream, diffs = runs
    assert diffs["b64"] == upstream["b64"]
    assert upstream["b64"]["object"][0] == "error"
    assert sum(result[0] == "ok" for result in upstream["b64"].values()) >= 18


def test_generate_bodies_are_upstreams(runs: tuple[dict, dict]) -> None:
    """11's GenerateJSONResponse, built by the route: upstream's body (or error) for every
    response, and for content of every other shape rendered by the same class."""
    upstream, diffs = runs
    assert upstream["json"]["response_class"] == "starlette.responses.JSONResponse"
    assert diffs["json"]["response_class"].endswith("api_router.GenerateJSONResponse")
    assert diffs["json"]["route"] == upstream["json"]["route"]
    assert diffs["json"]["render"] == upstream["json"]["render"]
    assert upstream["json"]["route"]["nan"][0] == "error"
    assert upstream["json"]["render"]["unserialisable"][0] == "error"


# -- the wave on vLLM's real API server -------------------------------------------------


@pytest.fixture(scope="module")
def waves(
    tree: Path, upstream_parity_wave: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """The parity wave, served by the installed release and by the patched tree."""
    extra = {"PYTHONPATH": os.pathsep.join([str(tree), str(ROOT)])}
    probe = subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__file__)"],
        env=wave.arm_env("upstream", extra),
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(probe.stdout.strip()).is_relative_to(tree), probe.stdout
    diffs = run_parity_wave("upstream", tmp_path_factory.mktemp("wave_diffs"), extra)
    return {"upstream": upstream_parity_wave, "diffs": diffs}


def test_wave_bodies_of_the_patched_server_are_upstreams(waves: dict[str, Any]) -> None:
    """Non-streaming bodies byte for byte; streamed ones by content (tokens, finish
    reasons, events, each routed-experts string byte for byte: their chunk boundaries
    depend on timing in both arms)."""
    upstream, diffs = waves["upstream"]["bodies"], waves["diffs"]["bodies"]
    plan = SHAPE.plan(False)
    assert sorted(upstream) == sorted(diffs) == list(range(len(plan)))
    assert any(streaming for _, streaming in plan) and not all(s for _, s in plan)
    for i, (_, streaming) in enumerate(plan):
        if streaming:
            assert _stream_content(diffs[i]) == _stream_content(upstream[i]), (i, plan[i])
        else:
            assert wave.normalised(diffs[i]) == wave.normalised(upstream[i]), (i, plan[i])
    for arm in ("upstream", "diffs"):
        assert waves[arm]["summary"]["errors"] == 0, waves[arm]["summary"]["error_kinds"]
        assert set(waves[arm]["summary"]["prime_r3"]["states"].values()) == {"disabled"}


def test_wave_routed_experts_of_the_patched_server_are_the_engines_rows(
    waves: dict[str, Any],
) -> None:
    """Each sample's decoded routed experts are the rows the engine sent; every string is
    at least 64 KiB, so 13 encodes it off the loop and 14 writes it into the body as is."""
    rows = wave.Rows()
    for i, (n, streaming) in enumerate(SHAPE.plan(False)):
        got = _routed_experts(waves["diffs"]["bodies"][i], streaming)
        prompt = wave.prompt_ids(SHAPE, i)
        assert sorted(got) == list(range(n)), i
        for child, array in got.items():
            expected = rows.expected(prompt, child, SHAPE.max_tokens)
            assert array.dtype == expected.dtype and array.shape == expected.shape
            assert np.array_equal(array, expected), (i, child)
            assert expected.nbytes >= 1 << 16
