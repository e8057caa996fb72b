"""Shared test setup: CPU platform, and no patch state leaking between tests."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest  # noqa: E402

import prime_r3  # noqa: E402
from prime_r3.guards import installed_vllm_version  # noqa: E402

# Two costs every process that imports vLLM would pay here (the suite starts many, and
# they inherit this environment), neither touching what a test checks:
# - humming (a quantization kernel package vLLM 0.31-0.33 import) spawns two interpreters
#   per import to build its CUDA launchers in the background (~15 s of CPU; they fail on
#   a CPU torch); this is the package's own switch for that.
# - vLLM caches a model class's inspection in VLLM_CACHE_ROOT/modelinfos, one file per
#   class for every release; each release writes other fields, so runs on two releases
#   (CI's lanes) void each other's file and a process that misses inspects the model in a
#   fresh subprocess (~20 s). One cache root per release (and build) keeps each valid.
os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")
os.environ.setdefault(
    "VLLM_CACHE_ROOT",
    os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
        "vllm",
        "prime_r3-tests",
        installed_vllm_version() or "none",
    ),
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Remove every PRIME_R3* variable so a test sees only what it sets."""
    for var in list(os.environ):
        if var.startswith("PRIME_R3"):
            monkeypatch.delenv(var)
    return monkeypatch


@pytest.fixture
def reverted(clean_env: pytest.MonkeyPatch):  # noqa: ANN201
    """Start and end with no prime_r3 patch installed."""
    prime_r3.revert()
    yield clean_env
    prime_r3.revert()


@pytest.fixture(scope="session")
def upstream_parity_wave(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The front-end parity wave served by the installed release, ``PRIME_R3=0``: run once
    for ``test_front_end_parity`` (against the overlay) and ``test_front_end_diffs``
    (against the patched tree)."""
    from tests.test_front_end_parity import run_parity_wave

    return run_parity_wave("upstream", tmp_path_factory.mktemp("wave_upstream"))
