"""Apply, revert and inspect the overlay: the only overlay code that writes to vLLM's modules.

A target is replaced by a ``wrapt.FunctionWrapper`` around the original, or, for a
``Target`` declaring ``Calling.PLAIN``, by a plain function the patch builds around it
(installed as is: no per-call binding object, for targets called per request per
step). Either way ``state`` records every layer installed, and following our layers
(``state.layers``) always leads to the upstream object. A patch with several targets
is applied all-or-nothing: if any step fails, the targets already replaced are
restored.

Several patches may wrap one target. Their wrappers then nest in registry order (the
earlier patch innermost) whatever order they were applied in, so the calls run in the
same order in every process; applying or reverting one rebuilds only the wrappers
outside its own. Nothing in a ``PatchSpec`` declares this: sharing a target is enough.

Targets in modules this process has not imported yet are not imported by us (that
would cost seconds and, for ``vllm.v1.worker.gpu_worker``, start helper processes in
the API server and EngineCore). They are installed by a post-import hook when vLLM
imports them, after the same guards; a guard failing then rolls back the patch's
other targets too. Until then the patch is reported as pending import.

That rollback can meet a layer of ours that another layer (another tool's wrapper) now
sits on, in a module imported before. Removing ours would drop theirs (they hold ours
and call it), and leaving ours working would leave the patch half-applied. So every
layer is built so that it can be made a pass-through in place: a wrapt layer gets a
switch wrapt reads on every call (``enabled=``, a list: empty means call the wrapped
object directly), a plain function gets a second code object that calls exactly the
callable it was built around (swapped in as its ``__code__``; the function object,
which the other layer holds, stays the same). The rollback makes every layer of the
patch a pass-through, removes each one it can reach through our own layers only, and
records the rest as inert with the reason: status reports the patch skipped,
``is_object_patched`` is False for them, and the next apply or revert removes each one
whose other layer has gone (status reports as if it had, changing nothing), and forgets
each one left in a module that is no longer the one in ``sys.modules`` (reloaded,
re-imported, removed): what stands there now was never ours.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import sys
import types
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import wrapt

from prime_r3 import config, guards, state
from prime_r3.spec import Anchor, Calling, PatchSpec, Target

logger = logging.getLogger("vllm.prime_r3")

APPLIED = "applied"
ALREADY = "already_applied"
WOULD_APPLY = "would_apply"
SKIPPED = "skipped"
DISABLED = "disabled"
PENDING = "pending_import"
REVERTED = "reverted"
NOT_ACTIVE = "not_active"
KEPT = "kept"


class PatchNotApplied(RuntimeError):
    """A patch the user asked for by name could not be applied."""

    def __init__(self, report: Report, names: Sequence[str]) -> None:
        self.report = report
        reasons = "; ".join(f"{o.name}: {o.reason}" for o in report.outcomes if o.name in names)
        super().__init__(f"prime_r3 could not apply requested patch(es): {reasons}")


@dataclass(frozen=True)
class Outcome:
    name: str
    state: str
    reason: str = ""
    vllm_range: str = ""
    processes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Report:
    vllm_version: str | None
    outcomes: tuple[Outcome, ...] = field(default_factory=tuple)

    def names(self, *states: str) -> list[str]:
        return [o.name for o in self.outcomes if o.state in states]

    @property
    def applied(self) -> list[str]:
        return self.names(APPLIED, ALREADY)

    @property
    def skipped(self) -> list[str]:
        return self.names(SKIPPED)

    def outcome(self, name: str) -> Outcome:
        for o in self.outcomes:
            if o.name == name:
                return o
        raise KeyError(name)

    def summary(self) -> str:
        """One readable line, as each process logs it: the active patches, those waiting
        for an import, skipped (with reasons) and disabled; a ``revert()`` report also
        names the patches reverted and those kept (with reasons)."""
        head = f"prime_r3 on vllm {self.vllm_version} (pid {os.getpid()})"
        if any(o.state in (REVERTED, NOT_ACTIVE, KEPT) for o in self.outcomes):
            parts = [f"{head}: revert"]  # says what went and what stays, not what runs
        else:
            active = ", ".join(self.names(APPLIED, ALREADY, WOULD_APPLY)) or "none"
            parts = [f"{head}: active: {active}"]
        pending = [f"{o.name} ({o.reason})" for o in self.outcomes if o.state == PENDING]
        if pending:
            parts.append("on import: " + "; ".join(pending))
        skipped = [f"{o.name} ({o.reason})" for o in self.outcomes if o.state == SKIPPED]
        if skipped:
            parts.append("skipped: " + "; ".join(skipped))
        disabled = self.names(DISABLED)
        if disabled:
            parts.append("disabled: " + ", ".join(disabled))
        reverted = [
            o.name + (f" ({o.reason})" if o.reason else "")
            for o in self.outcomes
            if o.state == REVERTED
        ]
        if reverted:
            parts.append("reverted: " + ", ".join(reverted))
        not_active = self.names(NOT_ACTIVE)
        if not_active:
            parts.append("not active: " + ", ".join(not_active))
        kept = [f"{o.name} ({o.reason})" for o in self.outcomes if o.state == KEPT]
        if kept:
            parts.append("kept: " + "; ".join(kept))
        return " | ".join(parts)

    def __str__(self) -> str:
        """``print(prime_r3.apply())`` shows :meth:`summary`; ``repr`` stays the dataclass's."""
        return self.summary()

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def registry() -> tuple[PatchSpec, ...]:
    from prime_r3.patches import REGISTRY

    return REGISTRY


def apply(
    names: Iterable[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    log: bool = True,
) -> Report:
    """Apply the selected patches; idempotent. Raises ConfigError / PatchNotApplied.

    ``names`` overrides ``PRIME_R3_PATCHES``; a named patch that cannot be applied
    raises (after every other patch was handled), a default one is skipped and logged.
    """
    specs = registry()
    settings = config.from_env(specs, environ)
    requested: frozenset[str] = settings.requested
    selected: Sequence[str] = settings.selected
    if names is not None:
        requested = frozenset(_known(names, specs))
        selected = [s.name for s in specs if s.name in requested]
    version = guards.installed_vllm_version()
    outcomes = []
    with state.lock():
        _sweep_inert()
        for spec in specs:
            if not settings.enabled:
                outcomes.append(_outcome(spec, DISABLED, f"{config.ENABLE_VAR}=0"))
            elif spec.name not in selected:
                outcomes.append(_outcome(spec, DISABLED, f"not selected by {config.PATCHES_VAR}"))
            elif (in_force := _in_force(spec, ALREADY)) is not None:
                outcomes.append(in_force)
            elif (inert := _inert_outcome(spec)) is not None:
                outcomes.append(inert)  # its pass-through still sits under another layer
            else:
                params = settings.params[spec.name]
                outcomes.append(_apply_spec(spec, version, params, spec.name in requested))
    report = Report(version, tuple(outcomes))
    if log:
        _log_line(report.summary())
    failed = [o.name for o in outcomes if o.name in requested and o.state == SKIPPED]
    if failed:
        raise PatchNotApplied(report, failed)
    return report


def revert(names: Iterable[str] | None = None) -> Report:
    """Remove prime_r3's wrappers, restoring the exact original objects.

    Reverting one of several patches on a target removes just its wrapper; the others
    stay in force around upstream's object. A target that another layer has since
    wrapped again is left in place (removing it would drop that layer too); its patch
    stays active and is reported as kept.

    A patch an import hook rolled back may have left pass-throughs under other layers
    (see the module's docstring): those that can go now are removed (reported
    reverted), the others stay (reported kept, with the reason). ``on_revert`` runs
    after the records are gone, so a failing one leaves no record saying the patch is
    in force (a pending import hook would then complete a patch whose other targets
    are gone); its error is logged and put in the outcome's reason.
    """
    specs = registry()
    wanted = set(_known(names, specs)) if names is not None else {s.name for s in specs}
    outcomes = []
    _flush_deferred_line()  # the line of what was applied, before it is reverted
    with state.lock():
        had_inert = {name for name, _, _ in state.inert_entries()}
        _sweep_inert()
        for spec in reversed(specs):
            if spec.name not in wanted:
                continue
            if (inert := _inert_outcome(spec)) is not None:
                outcomes.append(_outcome(spec, KEPT, inert.reason))
                continue
            wrappers = state.active_wrappers(spec.name)
            if wrappers is None:
                gone = spec.name in had_inert  # its pass-throughs were just removed
                outcomes.append(_outcome(spec, REVERTED if gone else NOT_ACTIVE))
                continue
            reason = _uninstall(spec, wrappers)
            if reason:
                outcomes.append(_outcome(spec, KEPT, reason))
            else:
                outcomes.append(_outcome(spec, REVERTED, _run_on_revert(spec)))
    return Report(guards.installed_vllm_version(), tuple(reversed(outcomes)))


def status(environ: Mapping[str, str] | None = None) -> Report:
    """What apply() would do in this process now, without changing anything.

    apply() first removes the pass-throughs no other layer sits on any more
    (``_sweep_inert``); status does not (it writes to no module: it is what tools and
    monitoring threads call while vLLM runs) but reports as if it had, so it names only
    the pass-throughs still under another layer in the module now imported, and a
    patch with none left is reported as apply() would then find it.
    """
    specs = registry()
    settings = config.from_env(specs, environ)
    version = guards.installed_vllm_version()
    outcomes = []
    for spec in specs:
        if (in_force := _in_force(spec, APPLIED)) is not None:
            outcomes.append(in_force)
        elif (inert := _inert_outcome(spec, predict_sweep=True)) is not None:
            outcomes.append(inert)
        elif not settings.enabled:
            outcomes.append(_outcome(spec, DISABLED, f"{config.ENABLE_VAR}=0"))
        elif spec.name not in settings.selected:
            outcomes.append(_outcome(spec, DISABLED, f"not selected by {config.PATCHES_VAR}"))
        else:
            reason = _check(spec, version)
            outcomes.append(
                _outcome(spec, SKIPPED, reason)
                if reason
                else _outcome(spec, WOULD_APPLY, _stack_note(spec))
            )
    return Report(version, tuple(outcomes))


def is_object_patched(obj: Any) -> bool:
    return state.is_object_patched(obj)


def get_original(module: str, attr: str) -> Any:
    return state.get_original(module, attr)


# -- internals -------------------------------------------------------------------

#: The process line apply() could not show yet, and vLLM's logging configuration
#: function it waits for (see ``_log_line``): ``[line, module, upstream function]``.
_deferred_line: list[Any] = []


def _log_line(line: str) -> None:
    """Log the process line now, or right after vLLM configures its logging.

    vLLM 0.32 configures its logging lazily: the front end (``vllm serve``'s API server,
    the offline ``LLM`` process) loads plugins before it does, when no handler would show
    an INFO record (Python's last resort shows warnings only). There the line waits for
    ``vllm.logger._configure_vllm_root_logger``, the function every vLLM logging
    configuration runs (``configure_logging`` calls it through the module), and is
    logged once right after it returns; the function is then put back. Where a handler
    already takes the record, or vLLM does not have that function, it is logged now.
    A later apply's line replaces a line still waiting; revert logs it first.
    """
    if logger.hasHandlers():
        logger.info(line)
        return
    if _deferred_line:
        _deferred_line[0] = line
        return
    module = sys.modules.get("vllm.logger")
    upstream = getattr(module, "__dict__", {}).get("_configure_vllm_root_logger")
    if not isinstance(upstream, types.FunctionType) or upstream.__module__ != "vllm.logger":
        logger.info(line)
        return

    def then_log_the_line(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        try:
            return wrapped(*args, **kwargs)
        finally:
            _flush_deferred_line()

    _deferred_line[:] = [line, module, upstream]
    module._configure_vllm_root_logger = wrapt.FunctionWrapper(upstream, then_log_the_line)


def _flush_deferred_line() -> None:
    if not _deferred_line:
        return
    line, module, upstream = _deferred_line
    _deferred_line.clear()
    current = module.__dict__.get("_configure_vllm_root_logger")
    if isinstance(current, wrapt.FunctionWrapper) and current.__wrapped__ is upstream:
        module._configure_vllm_root_logger = upstream
    logger.info(line)


def _known(names: Iterable[str], specs: Sequence[PatchSpec]) -> list[str]:
    valid = [s.name for s in specs]
    result = []
    for name in names:
        if name not in valid:
            raise config.ConfigError(f"unknown patch {name!r}; valid names: {', '.join(valid)}")
        result.append(name)
    return result


def _outcome(spec: PatchSpec, status_: str, reason: str = "") -> Outcome:
    return Outcome(
        spec.name,
        status_,
        reason,
        spec.vllm_range,
        tuple(sorted(p.value for p in spec.processes)),
    )


def _check(spec: PatchSpec, version: str | None) -> str | None:
    """Every guard of the patch; modules not loaded yet are checked from their files."""
    reason = guards.check_version(spec, version)
    if reason:
        return reason
    if spec.no_effect_here is not None and (reason := spec.no_effect_here()):
        return reason
    return _check_items((*spec.targets, *spec.anchors_for(version)))


def _check_items(items: Sequence[Target | Anchor], from_files: Iterable[str] = ()) -> str | None:
    """Guard ``items``; those in ``from_files`` are checked from their files only.

    An import hook passes the modules still awaited: one may be in ``sys.modules``
    half-executed (it imports the module whose hook runs now), its names not yet
    defined; its own hook checks it live once it is complete.
    """
    unfinished = set(from_files)
    for item in items:
        try:
            if item.module in unfinished:
                reason = guards.check_unimported(item)
            else:
                reason = guards.check(item)
        except Exception as error:  # noqa: BLE001 - a guard that breaks means "skip"
            reason = f"guard of {item.key} failed: {type(error).__name__}: {error}"
        if reason:
            return reason
    return None


def _in_force(spec: PatchSpec, installed: str) -> Outcome | None:
    """The outcome of a patch already in force here (fully, or pending import), else None."""
    if state.active_wrappers(spec.name) is None:
        return None
    waiting = state.pending_modules(spec.name)
    if waiting:
        return _outcome(spec, PENDING, _waiting_reason(waiting))
    notes = [_stack_note(spec, live=True), _live_note(spec)]
    return _outcome(spec, installed, "; ".join(n for n in notes if n))


def _live_note(spec: PatchSpec) -> str:
    """The patch's own account of what it does in this process (``live_note``)."""
    if spec.live_note is None:
        return ""
    try:
        return spec.live_note()
    except Exception as error:  # noqa: BLE001 - status must not break on a note
        return f"live note failed: {type(error).__name__}: {error}"


def _inert_outcome(spec: PatchSpec, predict_sweep: bool = False) -> Outcome | None:
    """``spec`` skipped because an import hook rolled it back leaving pass-throughs
    under other layers (None if it left none). ``predict_sweep`` (status): leave out
    those ``_sweep_inert`` would remove or forget now, without doing it."""
    reason = state.inert_reason(spec.name)
    if reason is None:
        return None
    # Where pass-throughs stay now: an apply or revert may have removed some since.
    left = state.inert_layers(spec.name)
    if predict_sweep:
        left = {k: v for k, v in left.items() if _inert_place(spec.name, k, v)[0] == _KEEP}
        if not left:
            return None
    return _outcome(spec, SKIPPED, f"{reason} ({_left_note(left)})")


def _left_note(left: Iterable[str]) -> str:
    """What a rollback by an import hook left of a patch (``_retire``)."""
    if not left:
        return "its other targets were rolled back"
    return (
        f"its other targets were rolled back; at {', '.join(sorted(left))} a layer that is "
        "not prime_r3's sits on ours, so ours stays under it as a pass-through that calls "
        "exactly what it wrapped (removing it would break that layer)"
    )


def _stack_note(spec: PatchSpec, live: bool = False) -> str:
    """Which registry patches share a target with ``spec`` (``live``: whose wrapper is
    installed there now), and on which side of it their wrappers go ("" if none): the
    nesting follows from the registry alone."""
    notes = []
    for target in spec.targets:
        others = [
            s.name
            for s in registry()
            if s.name != spec.name
            and any(t.key == target.key for t in s.targets)
            and (not live or target.key in (state.active_wrappers(s.name) or {}))
        ]
        if not others:
            continue
        rank = _rank(spec.name)
        sides = [
            f"{side} {', '.join(names)}"
            for side, names in (
                ("outside", [n for n in others if _rank(n) < rank]),
                ("inside", [n for n in others if _rank(n) > rank]),
            )
            if names
        ]
        notes.append(f"{target.attr} stacked {' and '.join(sides)}")
    return "; ".join(notes)


def _waiting_reason(modules: Iterable[str] | None) -> str:
    return "waits for import of " + ", ".join(sorted(modules or ()))


def _apply_spec(
    spec: PatchSpec, version: str | None, params: Mapping[str, Any], requested: bool
) -> Outcome:
    """Check every guard now; install targets whose modules are loaded, hook the rest.

    Targets and anchors of modules not loaded yet are verified from their files up
    front, so a changed upstream skips the whole patch here, before any of its targets
    can run. Their live objects are verified when each module is imported (an anchor's
    module too, though it holds nothing to install): a layer that replaced one by then
    rolls the whole patch back.
    """
    reason = _check(spec, version)
    if reason:
        return _outcome(spec, SKIPPED, reason)
    anchors = spec.anchors_for(version)
    modules = list(dict.fromkeys(t.module for t in (*spec.targets, *anchors)))
    ready = [m for m in modules if m in sys.modules]
    waiting = [m for m in modules if m not in sys.modules]
    if ready:
        reason = _install_units(spec, ready, params)  # guards already ran just above
        if reason:
            return _outcome(spec, SKIPPED, reason)
    if not waiting:
        return _outcome(spec, APPLIED)
    token = object()
    state.set_pending(spec.name, token, set(waiting))
    for module in waiting:
        hook = functools.partial(_on_import, spec, version, token, module, params, requested)
        wrapt.register_post_import_hook(hook, module)
    return _outcome(spec, PENDING, _waiting_reason(waiting))


def _on_import(
    spec: PatchSpec,
    version: str | None,
    token: object,
    module: str,
    params: Mapping[str, Any],
    requested: bool,
    _module_object: object,
) -> None:
    """Post-import hook: guard this module's live objects and install its targets,
    or roll the whole patch back (``_retire``): no target of it keeps doing its work."""
    with state.lock():
        waiting = state.pending_modules(spec.name, token)
        if waiting is None or module not in waiting:
            return  # reverted, or re-applied since this hook was registered
        try:
            _sweep_inert()  # pass-throughs whose other layer left: never in a chain we build
            # The live objects are guarded again: another layer may have replaced one
            # since apply() checked the file.
            unit = _unit_items(spec, version, [module])
            reason = _check_items(unit, waiting - {module}) or _install_units(
                spec, [module], params
            )
        except Exception as error:  # noqa: BLE001 - never break vLLM's import
            reason = f"{type(error).__name__}: {error}"
        if reason is None:
            waiting.discard(module)
            if not waiting:
                state.clear_pending(spec.name)
            logger.debug("prime_r3: %s installed on import of %s", spec.name, module)
            return
        try:
            note = _retire(spec, f"on import of {module}: {reason}")
        except Exception as error:  # noqa: BLE001 - never break vLLM's import
            note = f"rolling it back failed: {type(error).__name__}: {error}"
    # Never raise from an import hook: it would abort vLLM's import half-way and skip
    # other patches' hooks on the same module. The guards already ran at apply() (from
    # the files), so reaching here means the module changed between apply and import.
    level = logging.ERROR if requested else logging.WARNING
    message = "prime_r3: %s skipped on import of %s: %s (%s)"
    logger.log(level, message, spec.name, module, reason, note)


def _retire(spec: PatchSpec, reason: str) -> str:
    """Roll ``spec`` back from an import hook so that none of its targets does its work.

    Every installed layer of it is made a pass-through first (it cannot fail: each
    layer was built able to), then each one reachable through our own layers is removed
    (other patches' layers outside it rebuilt around what it wrapped). One under a
    layer that is not prime_r3's stays, recorded as inert with ``reason``: removing it
    would drop that other layer, which holds ours and calls it. Why not keep the patch
    whole instead: the module just imported failed its guards, so its targets cannot be
    installed, and the patch's work on only some targets is what the guards exist to
    prevent. Why not take ours out from under the other layer: that means writing to
    its object (its ``__wrapped__``, or a closure we cannot reach), which is not ours.
    Returns what happened to the other targets, for the log; status builds the same note
    from the pass-throughs still recorded when asked (an apply or revert may have removed
    some since).
    """
    layers = state.active_wrappers(spec.name) or {}
    for layer in layers.values():
        _make_pass_through(layer)
    homes = {key: _module_home(key.partition(":")[0]) for key in layers}
    state.make_inert(spec.name, reason, {k: v for k, v in homes.items() if v is not None})
    _sweep_inert()
    note = _left_note(state.inert_layers(spec.name))
    failed = _run_on_revert(spec)
    return f"{note}; {failed}" if failed else note


def _run_on_revert(spec: PatchSpec) -> str:
    """Run ``spec.on_revert`` (its records already gone); "" or why it failed, logged."""
    if spec.on_revert is None:
        return ""
    try:
        spec.on_revert()
    except Exception as error:  # noqa: BLE001 - the layers are gone already: report it
        why = f"on_revert failed: {type(error).__name__}: {error}"
        logger.error("prime_r3: %s %s", spec.name, why)
        return why
    return ""


#: What ``_sweep_inert`` does with a pass-through (``_inert_place``).
_KEEP, _FORGET, _REMOVE = "keep", "forget", "remove"


def _module_home(module: str) -> tuple[Any, Any] | None:
    """The module object now in ``sys.modules`` and its ``__spec__``, weakly: a
    re-import puts another module object there, and ``importlib.reload`` re-executes
    the same object but gives it a new ``__spec__`` (and new functions and classes)."""
    obj = sys.modules.get(module)
    if obj is None:
        return None
    spec = getattr(obj, "__spec__", None)
    try:
        return weakref.ref(obj), (weakref.ref(spec) if spec is not None else None)
    except TypeError:  # a module stand-in that takes no weak reference
        return None


def _home_is_current(module: str, home: tuple[Any, Any]) -> bool:
    obj = sys.modules.get(module)
    module_ref, spec_ref = home
    if obj is None or obj is not module_ref():
        return False
    spec = getattr(obj, "__spec__", None)
    return spec is None if spec_ref is None else spec is spec_ref()


def _inert_place(name: str, key: str, layer: Any) -> tuple[str, Any]:
    """What the sweep does with ``name``'s pass-through ``layer`` at ``key``; reads only.

    ``_FORGET``: it is no longer in its target; only its record goes. Either the other
    layer was taken off together with ours (the chain is ours alone down to upstream's
    saved object), or the module it was left in is not the one in ``sys.modules`` any
    more (re-imported, reloaded, or removed): what stands there now was never ours, so
    no other layer sits on ours there. ``_REMOVE`` with (resolved target, our layers,
    its position among them, what they wrap): our own layers alone sit on it.
    ``_KEEP``: a layer that is not ours sits on it (or its module is not imported and
    its place is unknown: never import a module to tidy up).
    """
    target = _target_of(name, key)
    home = state.inert_home(name, key)
    if target is None:
        return _KEEP, None
    if home is not None and not _home_is_current(target.module, home):
        return _FORGET, None
    if target.module not in sys.modules:
        return _KEEP, None
    resolved = guards.resolve(target)
    if isinstance(resolved, str):
        return _KEEP, None
    found, base = state.layers(resolved.raw)
    position = next((i for i, (_, w) in enumerate(found) if w is layer), None)
    if position is None:
        return (_FORGET, None) if base is state.saved_original(key) else (_KEEP, None)
    return _REMOVE, (resolved, found, position, base)


def _sweep_inert() -> None:
    """Remove every pass-through (``state.make_inert``) that no layer but ours sits on,
    and forget those no longer in their target (``_inert_place``)."""
    for name, key, layer in state.inert_entries():
        if state.inert_layers(name).get(key) is not layer:
            continue  # removed with another one just now
        place, where = _inert_place(name, key, layer)
        if place == _FORGET:
            state.drop_inert(name, key)
        if place != _REMOVE:
            continue
        resolved, found, position, base = where
        try:
            top, rebuilt = _rewrap(state.inner_of(layer), found[:position], key, base)
        except Exception as error:  # noqa: BLE001 - a plain factory that fails: keep it
            logger.warning("prime_r3: pass-through of %s at %s kept: %s", name, key, error)
            continue
        setattr(resolved.owner, resolved.name, top)
        _record_rebuilt(key, rebuilt)
        state.drop_inert(name, key)
        logger.debug("prime_r3: pass-through of %s removed from %s", name, key)


def _target_of(name: str, key: str) -> Target | None:
    for spec in registry():
        if spec.name == name:
            return next((t for t in spec.targets if t.key == key), None)
    return None


def _record_rebuilt(key: str, rebuilt: Mapping[str, tuple[Any, Any | None] | None]) -> None:
    """Record the layers ``_rewrap`` rebuilt at ``key``, and forget the pass-throughs it
    dropped (None)."""
    for other, layer in rebuilt.items():
        if layer is None:
            state.drop_inert(other, key)
        else:
            state.replace_wrapper(other, key, *layer)


def _unit_items(
    spec: PatchSpec, version: str | None, modules: Sequence[str]
) -> tuple[Target | Anchor, ...]:
    """What to guard when ``modules`` are imported: their targets and every anchor.

    Targets elsewhere are already ours or still waiting; every anchor is checked
    again (live if its module is loaded, else from its file), as another layer may
    have replaced one since apply().
    """
    targets = [t for t in spec.targets if t.module in modules]
    return (*targets, *spec.anchors_for(version))


def _install_units(
    spec: PatchSpec, modules: Sequence[str], params: Mapping[str, Any]
) -> str | None:
    """Wrap every target in ``modules`` or none (guarded by the caller); return a
    reason on failure.

    Every new chain is built before any is installed, and the records (ours and those
    of other patches whose wrappers were rebuilt outside ours) are written only once
    all are in place, so a failure puts back exactly the objects that were there.
    """
    targets = [t for t in spec.targets if t.module in modules]
    planned: list[_Stack] = []
    done: list[tuple[Any, str, Any]] = []
    try:
        for target in targets:
            resolved = guards.resolve(target)
            if isinstance(resolved, str):
                raise LookupError(resolved)
            made = target.make_wrapper(params)
            _check_made(target, made)
            builder = _Builder(target.calling, made, isinstance(resolved.owner, type))
            planned.append(_insert(spec.name, target, resolved, builder))
        for plan in planned:
            setattr(plan.resolved.owner, plan.resolved.name, plan.top)
            done.append((plan.resolved.owner, plan.resolved.name, plan.resolved.raw))
    except Exception as error:  # noqa: BLE001 - roll back whatever happened
        for owner, name, previous in reversed(done):
            setattr(owner, name, previous)
        logger.warning("prime_r3: %s rolled back: %s", spec.name, error)
        return f"apply failed and was rolled back: {type(error).__name__}: {error}"
    wrappers, functions, inners = {}, {}, {}
    for plan in planned:
        state.save_original(plan.key, plan.original)
        wrappers[plan.key], inner = plan.rebuilt.pop(spec.name)
        if inner is not None:
            inners[plan.key] = inner
        functions[plan.key] = plan.builder
        _record_rebuilt(plan.key, plan.rebuilt)
    state.add_wrappers(spec.name, wrappers, functions, inners)
    return None


@dataclass
class _Stack:
    """One target's new chain, built before anything is installed."""

    key: str
    resolved: guards.Resolved
    #: The object to install: the whole chain, outermost wrapper.
    top: Any
    #: The wrappers built for it, by patch (the new one, and those rebuilt outside it),
    #: each with what it calls if it is a plain function (``_Builder.build``); None for
    #: a pass-through outside it that the new chain drops.
    rebuilt: dict[str, tuple[Any, Any | None] | None]
    #: Upstream's object under every wrapper.
    original: Any
    #: The new patch's builder (kept to rebuild its wrapper later).
    builder: _Builder


@dataclass(frozen=True)
class _Builder:
    """What makes one patch's layer on one target around a given inner object.

    Kept in ``state`` so a layer can be rebuilt around another inner object (a patch
    under it came or went) without asking the patch again.
    """

    calling: Calling
    #: The patch's wrapt wrapper function, or its ``PlainFactory``.
    made: Any
    #: The target is an attribute of a class (a method), not of a module.
    on_class: bool

    def build(self, inner: Any, upstream: Any) -> tuple[Any, Any | None]:
        """The layer around ``inner`` (``upstream``: upstream's object under every
        layer), and ``inner`` again if the layer is a plain function (what ``state``
        records as under it), else None."""
        if self.calling is Calling.WRAPT:
            switch = [True]  # emptied by _make_pass_through; wrapt tests its truth per call
            layer = wrapt.FunctionWrapper(inner, self.made, enabled=switch)
            if getattr(layer, "_self_enabled", None) is not switch:
                raise TypeError("this wrapt keeps no switch prime_r3 can reach (_self_enabled)")
            return layer, None
        return _plain_layer(self.made, inner, upstream, self.on_class), inner


#: Our plain layers -> the code that makes each a pass-through (weak: dies with it).
_PASS_THROUGH: weakref.WeakKeyDictionary[types.FunctionType, types.CodeType] = (
    weakref.WeakKeyDictionary()
)
_ARGS, _KWARGS = "prime_r3_args", "prime_r3_kwargs"


def _pass_through_code(function: types.FunctionType, call: Any) -> types.CodeType:
    """A code object for ``function`` that calls ``call`` with the arguments it gets
    and returns its result, nothing else; swapped in when the layer must stay as a
    pass-through.

    A function's closure cannot change, so the code must use the same cells: it is
    compiled with ``function``'s free variables (same names, so the same order) and
    calls the one of them that holds ``call``. A function that does not hold ``call``
    in its own closure cannot be made a pass-through, so it is refused when built.
    """
    names = function.__code__.co_freevars
    cells = function.__closure__ or ()
    index = None
    for i, cell in enumerate(cells):
        try:
            if cell.cell_contents is call:
                index = i
                break
        except ValueError:  # an empty cell
            continue
    if index is None or {_ARGS, _KWARGS} & set(names):
        raise TypeError(
            f"a Calling.PLAIN function must call the callable it is given from its own "
            f"closure (so prime_r3 can make it a pass-through); {function.__qualname__} "
            f"does not hold it there"
        )
    source = (
        "def cells():\n"
        f"    {' = '.join(names)} = None\n"
        f"    def pass_through(*{_ARGS}, **{_KWARGS}):\n"
        "        if False:\n"
        f"            ({', '.join(names)},)\n"
        f"        return {names[index]}(*{_ARGS}, **{_KWARGS})\n"
        "    return pass_through\n"
    )
    # Taken from the compiled constants, never executed: executing it would leave a
    # namespace <-> function reference cycle per build, freed only by the cyclic
    # collector (which engine_gc slows down and vLLM's gc.freeze() can pin).
    module = compile(source, "<prime_r3 pass-through>", "exec")
    cells = next(c for c in module.co_consts if isinstance(c, types.CodeType))
    code = next(c for c in cells.co_consts if isinstance(c, types.CodeType))
    if code.co_freevars != names:
        raise TypeError(f"{function.__qualname__}: cannot build its pass-through")
    return code.replace(co_name=function.__code__.co_name, co_qualname=function.__qualname__)


def _make_pass_through(layer: Any) -> None:
    """Make our installed ``layer`` call exactly what it wraps, in place (see the
    module's docstring): the object stays, as another layer may hold it."""
    if isinstance(layer, wrapt.FunctionWrapper):
        switch = layer._self_enabled
        if type(switch) is not list:
            raise TypeError(f"{layer!r} has no switch")
        switch.clear()
    else:
        layer.__code__ = _PASS_THROUGH[layer]


#: What wrapt passes a wrapper on every call, positionally.
_WRAPT_CALL = (None, None, (), {})


def _check_made(target: Target, made: Any) -> None:
    """Refuse a ``make_wrapper`` product of the other kind than ``target.calling``.

    wrapt calls a wrapper only when the target is called, so a ``PlainFactory`` left
    on a ``Calling.WRAPT`` target (``calling=`` forgotten) would install and raise
    inside vLLM's loop. The product's signature tells the kinds apart without a
    second declaration to forget: a wrapt wrapper takes ``(wrapped, instance, args,
    kwargs)``, a ``PlainFactory`` takes the one callable it wraps.
    """
    if target.calling is Calling.WRAPT:
        call, wants = _WRAPT_CALL, "a wrapt wrapper (wrapped, instance, args, kwargs)"
    else:
        call, wants = (None,), "a PlainFactory taking the callable it wraps"
    try:
        inspect.signature(made).bind(*call)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"{target.key}: calling={target.calling.value} needs make_wrapper to return "
            f"{wants}, got {made!r} ({error})"
        ) from None


def _signature_mismatch(function: Any, upstream: Any) -> str | None:
    """How ``function``'s parameters differ from upstream's innermost function's
    (names, kinds, defaults; annotations aside), None if they do not.

    A plain layer is called as upstream's function is, so a different parameter list
    fails (or worse, binds differently) only when vLLM calls it. Upstream's own
    decorator layers are followed to the function they wrap; ``function``'s are not
    (a factory's ``functools.wraps`` would show upstream's signature instead of its own).
    """

    def shape(signature: inspect.Signature) -> list[tuple[str, Any, Any]]:
        return [(p.name, p.kind, p.default) for p in signature.parameters.values()]

    ours = shape(inspect.signature(function, follow_wrapped=False))
    theirs = shape(inspect.signature(inspect.unwrap(upstream), follow_wrapped=False))
    if len(ours) == len(theirs) and all(
        a[:2] == b[:2] and (a[2] is b[2] or (type(a[2]) is type(b[2]) and a[2] == b[2]))
        for a, b in zip(ours, theirs, strict=True)
    ):
        return None
    return (
        f"{inspect.signature(function, follow_wrapped=False)} differs from upstream's "
        f"{inspect.signature(inspect.unwrap(upstream), follow_wrapped=False)}"
    )


def _plain_layer(factory: Any, inner: Any, upstream: Any, on_class: bool) -> types.FunctionType:
    """The patch's plain function around ``inner``, ready to install as is.

    The factory gets a callable taking the target's own arguments (``self`` first for
    a method), which calls ``inner`` the way an attribute lookup would: a plain
    function (upstream's, or another plain layer) directly; a wrapt layer of ours
    bound to the instance first, so its wrapper sees ``instance`` as when it is the
    class attribute. The function must be new (not ``inner``, nor any object ``state``
    records) and take upstream's parameters. The result carries ``inner``'s names and
    attributes (its ``__dict__``: upstream's markers stay visible, as through a wrapt
    proxy, copied once) and ``__wrapped__`` = ``inner``, for introspection only: the
    layer records (by identity) what it calls.
    """
    call = inner
    if on_class and type(inner) is not types.FunctionType:
        bind = inner.__get__

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return bind(self, type(self))(*args, **kwargs)

    function = factory(call)
    if type(function) is not types.FunctionType:
        raise TypeError(
            f"a Calling.PLAIN factory must return a new plain function, got "
            f"{type(function).__name__}"
        )
    if function is inner or state.is_recorded(function):
        raise TypeError(
            f"a Calling.PLAIN factory must return a new plain function, got "
            f"{function.__qualname__}, an object prime_r3 already records"
        )
    mismatch = _signature_mismatch(function, upstream)
    if mismatch is not None:
        raise TypeError(f"the Calling.PLAIN function's parameters {mismatch}")
    _PASS_THROUGH[function] = _pass_through_code(function, call)
    return functools.update_wrapper(function, inner)


def _rank(name: str) -> int:
    """A patch's place in a stack on one target: registry order, the first innermost.

    A fixed order (not the order of apply calls) makes the nesting, and so the call
    order, the same in every process, whichever patches came and went before.
    """
    names = [s.name for s in registry()]
    return names.index(name) if name in names else len(names)


def _insert(name: str, target: Target, resolved: guards.Resolved, builder: _Builder) -> _Stack:
    """``name``'s wrapper put in its registry place among the patches already wrapping
    the target's current object.

    Wrappers inside the new one are kept as they are; those outside it are rebuilt
    around it from their patches' wrapper functions. The guards only let a target
    through whose current object is upstream's or our unbroken chain around it.
    """
    found, original = state.layers(resolved.raw)
    if found and state.unwrap_ours(resolved.raw) is None:
        raise LookupError(f"{target.key}: a layer that is not prime_r3's is under our wrappers")
    why = guards.needs_function(target, type(original).__name__)  # the guards' backstop
    if why is not None:
        raise LookupError(why)
    rank = _rank(name)
    outside = 0
    while outside < len(found) and _rank(found[outside][0]) > rank:
        outside += 1
    inner = found[outside][1] if outside < len(found) else original
    layer = builder.build(inner, original)
    top, rebuilt = _rewrap(layer[0], found[:outside], target.key, original)
    return _Stack(target.key, resolved, top, {name: layer, **rebuilt}, original, builder)


def _rewrap(
    inner: Any, outside: Sequence[tuple[str, Any]], key: str, upstream: Any
) -> tuple[Any, dict[str, tuple[Any, Any | None] | None]]:
    """Wrap ``inner`` again in the patches of ``outside`` (outermost first, as found),
    each with the builder it installed; the new top and the layers by patch. A
    pass-through among them is dropped (None), not rebuilt: it does nothing."""
    rebuilt: dict[str, tuple[Any, Any | None] | None] = {}
    for other, layer in reversed(outside):
        if state.is_inert(layer):
            rebuilt[other] = None
            continue
        made = state.wrapper_function(other, key).build(inner, upstream)
        rebuilt[other] = made
        inner = made[0]
    return inner, rebuilt


def _uninstall(spec: PatchSpec, wrappers: Mapping[str, Any]) -> str | None:
    """Remove exactly ``spec``'s wrappers, every target or none; the reason if kept.
    (The caller runs ``spec.on_revert`` once this returned None.)

    Other patches' wrappers outside ours are rebuilt around what ours wrapped (their
    wrapper functions unchanged), those inside are untouched: the rest of the stack
    stays in force, in registry order. Our wrapper must be reachable from the live
    object through our own wrappers only; a foreign layer above it would be dropped
    by the rebuild, so the patch is then left in place.
    """
    by_key = {t.key: t for t in spec.targets}
    planned = []
    for key, wrapper in wrappers.items():
        resolved = guards.resolve(by_key[key])
        found, original = state.layers(None if isinstance(resolved, str) else resolved.raw)
        position = next((i for i, (_, w) in enumerate(found) if w is wrapper), None)
        if isinstance(resolved, str) or position is None:
            return f"{key} was re-wrapped by another layer; prime_r3's layer left in place"
        try:
            top, rebuilt = _rewrap(state.inner_of(wrapper), found[:position], key, original)
        except Exception as error:  # noqa: BLE001 - a plain factory that fails: keep ours
            return f"{key}: rebuilding the layers outside ours failed ({error}); left in place"
        planned.append((resolved, key, top, rebuilt))
    for resolved, key, top, rebuilt in planned:
        setattr(resolved.owner, resolved.name, top)
        _record_rebuilt(key, rebuilt)
    state.forget(spec.name)  # the caller runs on_revert, after this
    return None
