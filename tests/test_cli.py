"""``prime-r3 status`` on the installed vLLM."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

BIN = pathlib.Path(sys.executable).with_name("prime-r3")


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_R3")}
    return subprocess.run(
        [str(BIN), *args], capture_output=True, text=True, env={**clean, **env}, timeout=300
    )


#: What `prime-r3 status` says on each supported release (the store fixes are upstream
#: in 0.33, read in its source).
_STORE = ("store_eviction", "store_headroom", "store_growth")
_BATCHED = ("batched_commit", "batched_take")
_FRONT_END = ("packed_hop", "response_rows", "response_b64", "response_json", "output_turns")
EXPECTED_STATES = {
    "0.31.0": dict.fromkeys(
        ("engine_gc", "packed_outputs", *_STORE, *_BATCHED, *_FRONT_END), "would_apply"
    ),
    "0.32.0": dict.fromkeys(
        ("engine_gc", "packed_outputs", *_STORE, *_BATCHED, *_FRONT_END), "would_apply"
    ),
    "0.33.0": {
        "engine_gc": "would_apply",
        "packed_outputs": "would_apply",
        **dict.fromkeys(_STORE, "skipped"),
        **dict.fromkeys((*_BATCHED, *_FRONT_END), "would_apply"),
    },
}


#: One environment for the runs below (each run imports vLLM: tens of seconds apiece): a
#: patch dropped, a parameter set, and the setup scripts' variable exported, as
#: ensure_env.sh invites.
_ENV = {
    "PRIME_R3_PATCHES": "-engine_gc",
    "PRIME_R3_ENGINE_GC_THRESHOLDS": "40000,15,90",
    "PRIME_R3_PYTHON": "/x/py",
}


def test_status_json_lists_every_patch_and_setting_on_this_release() -> None:
    import vllm

    result = _run("status", "--json", **_ENV)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["vllm_version"] == vllm.__version__
    states = {o["name"]: o for o in report["outcomes"]}
    assert states["engine_gc"]["vllm_range"] == ">=0.31,<0.34"
    expected = {**EXPECTED_STATES[vllm.__version__], "engine_gc": "disabled"}
    assert {n: o["state"] for n, o in states.items()} == expected
    settings = {s["var"]: s for s in report["settings"]}
    assert settings["PRIME_R3_ENGINE_GC_THRESHOLDS"] == {
        "var": "PRIME_R3_ENGINE_GC_THRESHOLDS",
        "value": [40000, 15, 90],
        "default": [50000, 20, 100],
        "source": "env",
        "overlay": True,
    }
    assert settings["PRIME_R3_STORE_HEADROOM_FACTOR"]["source"] == "default"
    assert settings["PRIME_R3_PYTHON"]["value"] == "/x/py"
    assert settings["PRIME_R3_PYTHON"]["overlay"] is False


def test_status_text_says_what_is_disabled_and_where_each_setting_comes_from() -> None:
    result = _run("status", **_ENV)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    line = next(ln for ln in lines if ln.split()[:1] == ["engine_gc"])
    assert "disabled by env" in line
    line = next(ln for ln in lines if "PRIME_R3_ENGINE_GC_THRESHOLDS" in ln)
    assert "40000,15,90" in line and "(from env)" in line
    line = next(ln for ln in lines if "PRIME_R3_ENGINE_GC_API_SERVER" in ln)
    assert "False" in line and "(default)" in line


def test_status_bad_env_exits_2_with_message() -> None:
    result = _run("status", PRIME_R3="perhaps")
    assert result.returncode == 2
    assert "PRIME_R3='perhaps'" in result.stderr


def test_status_out_of_range_threshold_exits_2_naming_variable_value_and_range() -> None:
    result = _run("status", PRIME_R3_ENGINE_GC_THRESHOLDS="99999999999,1,1")
    assert result.returncode == 2
    assert "PRIME_R3_ENGINE_GC_THRESHOLDS='99999999999,1,1'" in result.stderr
    assert "0..2147483647" in result.stderr
