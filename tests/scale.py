"""How many randomised episodes the differential harnesses run on the installed release.

All of them on the default release (0.32.0, ``.venv/``, what ``scripts/test.sh`` runs
without ``VLLM_VERSION``); a quarter on the other releases, whose CI jobs run the whole
suite too and must fit CI's time beside them. The quarter is the first seeds of the
full set, so every release runs the same episodes as the others, and each test's own
coverage check (every case of the scheduler model reached) holds on it.
"""

from __future__ import annotations

from prime_r3 import guards

DEFAULT_RELEASE = "0.32.0"
FULL = (guards.installed_vllm_version() or "").split("+")[0] == DEFAULT_RELEASE


def share(full: int) -> int:
    """``full`` on the default release, else a quarter of it (at least 1)."""
    return full if FULL else max(1, full // 4)
