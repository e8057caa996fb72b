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


def test_status_json_lists_every_patch_as_would_apply_on_0_32() -> None:
    result = _run("status", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["vllm_version"] == "0.32.0"
    states = {o["name"]: o for o in report["outcomes"]}
    assert states["engine_gc"]["state"] == "would_apply"
    assert states["engine_gc"]["vllm_range"] == ">=0.31,<0.34"
    expected = {"engine_gc", "packed_outputs", "store_eviction", "store_headroom", "store_growth"}
    assert set(states) == expected
    assert {o["state"] for o in states.values()} == {"would_apply"}


def test_status_text_and_env_disabled() -> None:
    result = _run("status", PRIME_R3_PATCHES="-engine_gc")
    assert result.returncode == 0, result.stderr
    line = next(ln for ln in result.stdout.splitlines() if "engine_gc" in ln)
    assert "disabled by env" in line


def test_status_bad_env_exits_2_with_message() -> None:
    result = _run("status", PRIME_R3="perhaps")
    assert result.returncode == 2
    assert "PRIME_R3='perhaps'" in result.stderr
