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
