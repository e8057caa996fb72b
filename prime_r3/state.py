"""Process-wide record of what prime_r3 replaced, kept here and never on vLLM's modules.

Originals are saved when a target is wrapped, and the guards only ever let prime_r3
wrap the plain upstream object (never its own wrapper, never another layer's), so a
saved original is always upstream's: ``revert`` restores it by identity, however
often apply and revert alternate. Saving at each install (not first-write-wins) keeps
that true when a module is reloaded and its functions are new objects.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.RLock()
#: "module:attr" -> the object that was there before prime_r3 first patched it.
_originals: dict[str, Any] = {}
#: patch name -> {"module:attr": the wrapper prime_r3 installed}.
_active: dict[str, dict[str, Any]] = {}
#: patch name -> (token, modules whose import will install the rest of the patch).
_pending: dict[str, tuple[object, set[str]]] = {}


def lock() -> threading.RLock:
    return _lock


def save_original(key: str, obj: Any) -> None:
    """Remember ``obj``, the verified upstream object, as the original of ``key``."""
    _originals[key] = obj


def get_original(module: str, attr: str) -> Any:
    """The upstream object prime_r3 found at ``module:attr`` (KeyError if never patched)."""
    return _originals[f"{module}:{attr}"]


def add_wrappers(name: str, wrappers: dict[str, Any]) -> None:
    _active.setdefault(name, {}).update(wrappers)


def active_wrappers(name: str) -> dict[str, Any] | None:
    """Wrappers installed for ``name`` (None if the patch is neither active nor pending)."""
    if name not in _active and name not in _pending:
        return None
    return dict(_active.get(name, {}))


def set_pending(name: str, token: object, modules: set[str]) -> None:
    _pending[name] = (token, set(modules))


def pending_modules(name: str, token: object | None = None) -> set[str] | None:
    """Modules still awaited by ``name`` (None if nothing is pending or the token is stale)."""
    entry = _pending.get(name)
    if entry is None or (token is not None and entry[0] is not token):
        return None
    return entry[1]


def clear_pending(name: str) -> None:
    """Every target of ``name`` is installed: nothing left to wait for."""
    _pending.pop(name, None)


def forget(name: str) -> None:
    """Drop every record of ``name``: a stale import hook then finds nothing to do."""
    _active.pop(name, None)
    _pending.pop(name, None)


def is_object_patched(obj: Any) -> bool:
    """True if ``obj`` is a wrapper prime_r3 currently has installed."""
    return any(obj is w for wrappers in _active.values() for w in wrappers.values())
