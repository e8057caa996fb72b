"""How many randomised episodes the differential harnesses run on the installed release.

All of them on the default release (``PRIME_R3_DEFAULT_RELEASE`` in ``scripts/release.sh``,
``.venv/``, what ``scripts/test.sh`` runs without ``VLLM_VERSION``); a quarter on the other
releases, whose CI jobs run the whole suite too and must fit CI's time beside them. The
quarter is the first seeds of the full set, so every release runs the same episodes as the
others, and each test's own coverage check (every case of the scheduler model reached)
holds on it.
"""

from __future__ import annotations

import pathlib
import re

from prime_r3 import guards

_RELEASE_SH = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "release.sh"
DEFAULT_RELEASE = re.search(
    r'^PRIME_R3_DEFAULT_RELEASE="([^"]+)"$', _RELEASE_SH.read_text(), re.MULTILINE
)[1]
FULL = guards.installed_vllm_release() == DEFAULT_RELEASE


def share(full: int) -> int:
    """``full`` on the default release, else a quarter of it (at least 1)."""
    return full if FULL else max(1, full // 4)
