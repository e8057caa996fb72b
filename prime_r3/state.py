"""Process-wide record of what prime_r3 replaced, kept here and never on vLLM's modules.

Originals are saved when a target is wrapped, and the guards only ever let prime_r3
wrap upstream's plain object, possibly under a chain of its own wrappers (never another
layer's), so a saved original is always upstream's: ``revert`` restores it by identity,
however often apply and revert alternate. Saving at each install (not
first-write-wins) keeps that true when a module is reloaded and its functions are new
objects.

Several patches may wrap one target: the live object is then a chain of our wrappers,
each recorded here under its patch, around upstream's object. Each patch's builder
(its wrapper function and kind) is kept too, so the layer can rebuild the wrappers
outside one it removes or inserts without asking the patch again.

Ours are told apart by identity only: an object is one of our layers when it *is* an
object recorded here, never because of an attribute it carries (anyone can copy
``__wrapped__`` or a name). Under a wrapt layer lies its live ``__wrapped__`` (what
the proxy calls). Under a plain-function layer (``Calling.PLAIN``) lies the inner
object recorded when it was built: the function calls that object from its closure,
so its ``__wrapped__`` attribute, which anyone may re-point, is not what the walk
reads. One exception: a lock-free reader holding a plain layer that another thread
is replacing or removing right then (its record already names the successor, or is
gone) reads that old layer's ``__wrapped__``, which the layer set to the same inner
object; a re-pointed one is seen only in that moment, for a layer that is leaving.

A patch an import hook had to roll back while another layer sat on one of its layers
keeps that layer as an *inert* pass-through (``make_inert``): still ours for walking a
chain (it calls exactly what it wraps, so ``unwrap_ours`` sees through it), but no
longer patched (``is_object_patched``, ``wrapped_by``, ``active_wrappers`` leave it
out) and recorded with the reason and the module it was left in, until the layer can
remove it, or finds that module replaced (the record is then stale).
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.RLock()
#: "module:attr" -> the object that was there before prime_r3 first patched it.
_originals: dict[str, Any] = {}
#: patch name -> {"module:attr": the wrapper prime_r3 installed}.
_active: dict[str, dict[str, Any]] = {}
#: patch name -> {"module:attr": what builds that wrapper again around another object}.
_functions: dict[str, dict[str, Any]] = {}
#: patch name -> {"module:attr": (its plain-function layer, the object that layer calls)}.
_inners: dict[str, dict[str, tuple[Any, Any]]] = {}
#: patch name -> (token, modules whose import will install the rest of the patch).
_pending: dict[str, tuple[object, set[str]]] = {}
#: patch name -> {"module:attr": its layer left there as a pass-through} (see make_inert).
_inert: dict[str, dict[str, Any]] = {}
#: patch name -> why it was rolled back (the module and the cause).
_inert_reasons: dict[str, str] = {}
#: patch name -> {"module:attr": the module the pass-through was left in, as the layer
#: identifies it (weak references: a re-imported module's old object may go)}.
_inert_homes: dict[str, dict[str, Any]] = {}

#: A ``__wrapped__`` chain longer than this is a cycle, not a stack of patches.
_MAX_LAYERS = 64


def lock() -> threading.RLock:
    return _lock


def save_original(key: str, obj: Any) -> None:
    """Remember ``obj``, the verified upstream object, as the original of ``key``."""
    _originals[key] = obj


def saved_original(key: str) -> Any | None:
    """The upstream object saved for ``"module:attr"`` (None if never patched)."""
    return _originals.get(key)


def get_original(module: str, attr: str) -> Any:
    """The upstream object prime_r3 found at ``module:attr`` (KeyError if never patched)."""
    return _originals[f"{module}:{attr}"]


def add_wrappers(
    name: str,
    wrappers: dict[str, Any],
    functions: dict[str, Any],
    inners: dict[str, Any] | None = None,
) -> None:
    """Record the wrappers ``name`` installed, what builds each again, and for its
    plain-function layers the object each calls (``inners``)."""
    # The inner is recorded (paired with its layer) before the wrapper: a reader that
    # finds the wrapper (no lock) then finds what is under it too.
    if inners:
        _inners.setdefault(name, {}).update((k, (wrappers[k], v)) for k, v in inners.items())
    _active.setdefault(name, {}).update(wrappers)
    _functions.setdefault(name, {}).update(functions)


def replace_wrapper(name: str, key: str, wrapper: Any, inner: Any | None = None) -> None:
    """``name``'s wrapper at ``key`` was rebuilt (a patch under it came or went);
    ``inner``: what it calls, for a plain-function layer (None for a wrapt one)."""
    if inner is not None:
        _inners.setdefault(name, {})[key] = (wrapper, inner)
    _active[name][key] = wrapper


def wrapper_function(name: str, key: str) -> Any:
    """What builds ``name``'s wrapper at ``key`` again, around another inner object."""
    return _functions[name][key]


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
    _functions.pop(name, None)
    _inners.pop(name, None)
    _pending.pop(name, None)


def make_inert(name: str, reason: str, homes: dict[str, Any] | None = None) -> dict[str, Any]:
    """``name`` was rolled back: its installed layers, already made pass-throughs by
    the layer, are recorded as inert (nothing of ``name`` is active or pending any
    more); returns them. The layer then removes those it can (``drop_inert``).
    ``homes``: per key, the module it sits in, as the layer identifies it
    (``inert_home``), so a record outliving its module (reloaded, re-imported) is
    recognised as stale."""
    layers = dict(_active.get(name, {}))
    if not layers:  # nothing installed yet: nothing left behind either
        forget(name)
        return layers
    # Recorded inert before they stop being active: a lock-free reader finds them as
    # ours (inert or not) at every moment.
    _inert[name] = layers
    _inert_reasons[name] = reason
    _inert_homes[name] = {k: v for k, v in (homes or {}).items() if k in layers}
    _active.pop(name, None)
    _functions.pop(name, None)
    _pending.pop(name, None)
    pairs = _inners.get(name, {})
    for key in [k for k, (layer, _) in pairs.items() if layers.get(k) is not layer]:
        del pairs[key]
    return layers


def inert_layers(name: str) -> dict[str, Any]:
    """``name``'s layers left as pass-throughs ({} if none)."""
    return dict(_inert.get(name, {}))


def inert_reason(name: str) -> str | None:
    """Why ``name`` was rolled back leaving pass-throughs (None if it left none)."""
    return _inert_reasons.get(name) if _inert.get(name) else None


def inert_home(name: str, key: str) -> Any | None:
    """The module ``name``'s pass-through at ``key`` was left in (None if unknown)."""
    return _inert_homes.get(name, {}).get(key)


def inert_entries() -> list[tuple[str, str, Any]]:
    """Every pass-through layer recorded, as (patch, "module:attr", layer)."""
    return [(n, k, layer) for n, layers in tuple(_inert.items()) for k, layer in layers.items()]


def drop_inert(name: str, key: str) -> None:
    """``name``'s pass-through at ``key`` was removed; the last one takes every record
    of ``name`` with it."""
    layers = _inert.get(name, {})
    layers.pop(key, None)
    _inners.get(name, {}).pop(key, None)
    _inert_homes.get(name, {}).pop(key, None)
    if not layers:
        _inert.pop(name, None)
        _inert_reasons.pop(name, None)
        _inert_homes.pop(name, None)
        _inners.pop(name, None)


def is_inert(obj: Any) -> bool:
    """True if ``obj`` is (by identity) a layer of ours left as a pass-through."""
    return _find(obj, _inert) is not None


def is_ours(obj: Any) -> bool:
    """True if ``obj`` is a layer of ours, in force or a pass-through."""
    return _find_any(obj) is not None


def _find_any(obj: Any) -> tuple[str, str] | None:
    """(patch, "module:attr") of our layer ``obj``, in force or inert (None if not ours)."""
    return _find(obj) or _find(obj, _inert)


def _find(obj: Any, records: dict[str, dict[str, Any]] | None = None) -> tuple[str, str] | None:
    """(patch, "module:attr") of the installed wrapper ``obj`` is (None if not ours).

    Identity only (``is``): a wrapt proxy compares equal to what it wraps, so no
    dict lookup or ``==`` may decide this. Read without the lock (batched_commit and
    packed_outputs ask every step, on the worker's output thread and in EngineCore):
    it walks snapshots, each taken by one C-level ``tuple()`` that no other thread can
    interleave (the GIL is held and no Python code runs for str keys), so an apply,
    revert or import hook changing the records on another thread cannot make it raise
    mid-iteration. ``records``: another table of the same shape (``_inert``).
    """
    for name, wrappers in tuple((_active if records is None else records).items()):
        for key, wrapper in tuple(wrappers.items()):
            if obj is wrapper:
                return name, key
    return None


def _under(name: str, key: str, obj: Any) -> Any:
    """What our layer ``obj`` (``name``'s at ``key``) calls: the recorded inner of a
    plain-function layer, the live ``__wrapped__`` of a wrapt one (and of a plain
    layer being replaced on another thread right now: see the module's docstring)."""
    pair = _inners.get(name, {}).get(key)
    return pair[1] if pair is not None and pair[0] is obj else obj.__wrapped__


def is_recorded(obj: Any) -> bool:
    """True if ``obj`` is (by identity) any object recorded here: an installed layer,
    what a plain layer calls, or a saved upstream original."""
    if _find_any(obj) is not None or any(obj is o for o in tuple(_originals.values())):
        return True
    return any(
        obj is layer or obj is inner
        for pairs in tuple(_inners.values())
        for layer, inner in tuple(pairs.values())
    )


def inner_of(obj: Any) -> Any:
    """The object under our layer ``obj`` (what it calls, also for a pass-through);
    ``obj`` itself if not ours."""
    found = _find_any(obj)
    return obj if found is None else _under(*found, obj)


def is_object_patched(obj: Any) -> bool:
    """True if ``obj`` is a wrapper prime_r3 currently has in force (any layer of a
    stack); a pass-through left by a rolled-back patch is not (it patches nothing)."""
    return _find(obj) is not None


def layers(obj: Any) -> tuple[list[tuple[str, Any]], Any]:
    """Our wrappers from ``obj`` inwards, outermost first, as (patch, wrapper), and the
    object under the last of them (``obj`` itself if it is not ours). Pass-throughs
    (``is_inert``) are among them: they are ours and call exactly what they wrap.

    The walk stops at the first object that is not one of our installed wrappers: what
    lies under a foreign layer is not ours to rebuild.
    """
    found: list[tuple[str, Any]] = []
    while len(found) < _MAX_LAYERS and (where := _find_any(obj)) is not None:
        found.append((where[0], obj))
        obj = _under(*where, obj)
    return found, obj


def wrapped_by(obj: Any) -> tuple[str, ...]:
    """The patches whose wrappers ``obj`` is made of and in force, outermost first, down
    to the first object that is not ours (empty if ``obj`` is not ours); pass-throughs
    are left out (their patch does nothing there)."""
    return tuple(name for name, layer in layers(obj)[0] if not is_inert(layer))


def unwrap_ours(obj: Any) -> Any | None:
    """Upstream's object under our wrappers at ``obj`` (``obj`` if it is not ours); None
    if our wrappers end in anything but a saved upstream original, i.e. a foreign layer
    sits between them.

    For checks of "is this upstream's function, possibly patched by us": compare the
    result with upstream's object by identity. It looks at one attribute's raw object
    (``inspect.getattr_static``), not at a bound method.
    """
    found, inner = layers(obj)
    if found and not any(inner is original for original in tuple(_originals.values())):
        return None
    return inner
