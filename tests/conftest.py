"""Shared test setup: CPU platform, and no patch state leaking between tests."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest  # noqa: E402

import prime_r3  # noqa: E402


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
