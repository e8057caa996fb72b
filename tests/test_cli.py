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


def test_status_json_lists_every_patch_with_its_state_on_this_release() -> None:
    import vllm

    result = _run("status", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["vllm_version"] == vllm.__version__
    states = {o["name"]: o for o in report["outcomes"]}
    assert states["engine_gc"]["vllm_range"] == ">=0.31,<0.34"
    assert {n: o["state"] for n, o in states.items()} == EXPECTED_STATES[vllm.__version__]


def test_status_text_and_env_disabled() -> None:
    result = _run("status", PRIME_R3_PATCHES="-engine_gc")
    assert result.returncode == 0, result.stderr
    line = next(ln for ln in result.stdout.splitlines() if "engine_gc" in ln)
    assert "disabled by env" in line


def test_status_bad_env_exits_2_with_message() -> None:
    result = _run("status", PRIME_R3="perhaps")
    assert result.returncode == 2
    assert "PRIME_R3='perhaps'" in result.stderr


def test_status_reports_every_setting_with_value_and_source() -> None:
    result = _run(
        "status", "--json", PRIME_R3_ENGINE_GC_THRESHOLDS="40000,15,90", PRIME_R3_PYTHON="/x/py"
    )
    assert result.returncode == 0, result.stderr
    settings = {s["var"]: s for s in json.loads(result.stdout)["settings"]}
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

    text = _run("status", PRIME_R3_ENGINE_GC_THRESHOLDS="40000,15,90").stdout
    line = next(ln for ln in text.splitlines() if "PRIME_R3_ENGINE_GC_THRESHOLDS" in ln)
    assert "40000,15,90" in line and "(from env)" in line
    line = next(ln for ln in text.splitlines() if "PRIME_R3_ENGINE_GC_API_SERVER" in ln)
    assert "False" in line and "(default)" in line


def test_status_with_setup_script_variable_exported_works() -> None:
    """ensure_env.sh invites exporting PRIME_R3_PYTHON; that must not break status."""
    result = _run("status", PRIME_R3_PYTHON="/usr/bin/python3.11")
    assert result.returncode == 0, result.stderr


def test_status_out_of_range_threshold_exits_2_naming_variable_value_and_range() -> None:
    result = _run("status", PRIME_R3_ENGINE_GC_THRESHOLDS="99999999999,1,1")
    assert result.returncode == 2
    assert "PRIME_R3_ENGINE_GC_THRESHOLDS='99999999999,1,1'" in result.stderr
    assert "0..2147483647" in result.stderr
