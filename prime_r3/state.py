"""Process-wide record of what prime_r3 replaced, kept here and never on vLLM's modules.

Originals are saved first-write-wins (as gevent's ``monkey`` does): whatever was in
place the first time prime_r3 touched an attribute is what ``revert`` restores,
by identity, however often apply and revert alternate.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.RLock()
#: "module:attr" -> the object that was there before prime_r3 first patched it.
_originals: dict[str, Any] = {}
#: patch name -> {"module:attr": the wrapper prime_r3 installed}.
_active: dict[str, dict[str, Any]] = {}


def lock() -> threading.RLock:
    return _lock


def save_original(key: str, obj: Any) -> Any:
    """Remember ``obj`` as the original of ``key`` unless one is already saved."""
    return _originals.setdefault(key, obj)


def get_original(module: str, attr: str) -> Any:
    """The upstream object prime_r3 found at ``module:attr`` (KeyError if never patched)."""
    return _originals[f"{module}:{attr}"]


def mark_active(name: str, wrappers: dict[str, Any]) -> None:
    _active[name] = dict(wrappers)


def mark_inactive(name: str) -> None:
    _active.pop(name, None)


def active_wrappers(name: str) -> dict[str, Any] | None:
    wrappers = _active.get(name)
    return None if wrappers is None else dict(wrappers)


def active_names() -> list[str]:
    return list(_active)


def is_object_patched(obj: Any) -> bool:
    """True if ``obj`` is a wrapper prime_r3 currently has installed."""
    return any(obj is w for wrappers in _active.values() for w in wrappers.values())
