"""Apply, revert and inspect the overlay: the only overlay code that writes to vLLM's modules.

Every target is replaced by a ``wrapt.FunctionWrapper`` around the original, so
``__wrapped__`` always holds the upstream object. A patch with several targets is
applied all-or-nothing: if any step fails, the targets already replaced are restored.

Targets in modules this process has not imported yet are not imported by us (that
would cost seconds and, for ``vllm.v1.worker.gpu_worker``, start helper processes in
the API server and EngineCore). They are installed by a post-import hook when vLLM
imports them, after the same guards; a guard failing then rolls back the patch's
other targets too. Until then the patch is reported as pending import.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import wrapt

from prime_r3 import config, guards, state
from prime_r3.spec import Anchor, PatchSpec, Target

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
        active = ", ".join(self.names(APPLIED, ALREADY, WOULD_APPLY)) or "none"
        parts = [f"prime_r3 on vllm {self.vllm_version} (pid {os.getpid()}): active: {active}"]
        pending = [f"{o.name} ({o.reason})" for o in self.outcomes if o.state == PENDING]
        if pending:
            parts.append("on import: " + "; ".join(pending))
        skipped = [f"{o.name} ({o.reason})" for o in self.outcomes if o.state == SKIPPED]
        if skipped:
            parts.append("skipped: " + "; ".join(skipped))
        disabled = self.names(DISABLED)
        if disabled:
            parts.append("disabled: " + ", ".join(disabled))
        return " | ".join(parts)

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
        for spec in specs:
            if not settings.enabled:
                outcomes.append(_outcome(spec, DISABLED, f"{config.ENABLE_VAR}=0"))
            elif spec.name not in selected:
                outcomes.append(_outcome(spec, DISABLED, f"not selected by {config.PATCHES_VAR}"))
            elif (in_force := _in_force(spec, ALREADY)) is not None:
                outcomes.append(in_force)
            else:
                params = settings.params[spec.name]
                outcomes.append(_apply_spec(spec, version, params, spec.name in requested))
    report = Report(version, tuple(outcomes))
    if log:
        logger.info(report.summary())
    failed = [o.name for o in outcomes if o.name in requested and o.state == SKIPPED]
    if failed:
        raise PatchNotApplied(report, failed)
    return report


def revert(names: Iterable[str] | None = None) -> Report:
    """Remove prime_r3's wrappers, restoring the exact original objects.

    A target that another layer has since wrapped again is left in place (removing
    it would drop that layer too); its patch stays active and is reported as kept.
    """
    specs = registry()
    wanted = set(_known(names, specs)) if names is not None else {s.name for s in specs}
    outcomes = []
    with state.lock():
        for spec in reversed(specs):
            if spec.name not in wanted:
                continue
            wrappers = state.active_wrappers(spec.name)
            if wrappers is None:
                outcomes.append(_outcome(spec, NOT_ACTIVE))
                continue
            reason = _uninstall(spec, wrappers)
            outcomes.append(_outcome(spec, KEPT, reason) if reason else _outcome(spec, REVERTED))
    return Report(guards.installed_vllm_version(), tuple(reversed(outcomes)))


def status(environ: Mapping[str, str] | None = None) -> Report:
    """What apply() would do in this process now, without changing anything."""
    specs = registry()
    settings = config.from_env(specs, environ)
    version = guards.installed_vllm_version()
    outcomes = []
    for spec in specs:
        if (in_force := _in_force(spec, APPLIED)) is not None:
            outcomes.append(in_force)
        elif not settings.enabled:
            outcomes.append(_outcome(spec, DISABLED, f"{config.ENABLE_VAR}=0"))
        elif spec.name not in settings.selected:
            outcomes.append(_outcome(spec, DISABLED, f"not selected by {config.PATCHES_VAR}"))
        else:
            reason = _check(spec, version)
            outcomes.append(
                _outcome(spec, SKIPPED, reason) if reason else _outcome(spec, WOULD_APPLY)
            )
    return Report(version, tuple(outcomes))


def is_object_patched(obj: Any) -> bool:
    return state.is_object_patched(obj)


def get_original(module: str, attr: str) -> Any:
    return state.get_original(module, attr)


# -- internals -------------------------------------------------------------------


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
    return _check_items((*spec.targets, *spec.anchors))


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
    return _outcome(spec, installed)


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
    modules = list(dict.fromkeys(t.module for t in (*spec.targets, *spec.anchors)))
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
        hook = functools.partial(_on_import, spec, token, module, params, requested)
        wrapt.register_post_import_hook(hook, module)
    return _outcome(spec, PENDING, _waiting_reason(waiting))


def _on_import(
    spec: PatchSpec,
    token: object,
    module: str,
    params: Mapping[str, Any],
    requested: bool,
    _module_object: object,
) -> None:
    """Post-import hook: guard this module's live objects and install its targets,
    or roll the whole patch back."""
    with state.lock():
        waiting = state.pending_modules(spec.name, token)
        if waiting is None or module not in waiting:
            return  # reverted, or re-applied since this hook was registered
        try:
            # The live objects are guarded again: another layer may have replaced one
            # since apply() checked the file.
            unit = _unit_items(spec, [module])
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
        kept = _uninstall(spec, state.active_wrappers(spec.name) or {})
        if kept:  # another layer sits on ours: keep the record so revert can report it
            state.clear_pending(spec.name)
    # Never raise from an import hook: it would abort vLLM's import half-way and skip
    # other patches' hooks on the same module. The guards already ran at apply() (from
    # the files), so reaching here means the module changed between apply and import.
    level = logging.ERROR if requested else logging.WARNING
    logger.log(
        level,
        "prime_r3: %s skipped on import of %s: %s (%s)",
        spec.name,
        module,
        reason,
        kept or "its other targets were rolled back",
    )


def _unit_items(spec: PatchSpec, modules: Sequence[str]) -> tuple[Target | Anchor, ...]:
    """What to guard when ``modules`` are imported: their targets and every anchor.

    Targets elsewhere are already ours or still waiting; every anchor is checked
    again (live if its module is loaded, else from its file), as another layer may
    have replaced one since apply().
    """
    return (*[t for t in spec.targets if t.module in modules], *spec.anchors)


def _install_units(
    spec: PatchSpec, modules: Sequence[str], params: Mapping[str, Any]
) -> str | None:
    """Replace every target in ``modules`` or none (guarded by the caller); return a
    reason on failure."""
    targets = [t for t in spec.targets if t.module in modules]
    done: list[tuple[Any, str, Any]] = []
    wrappers: dict[str, Any] = {}
    try:
        for target in targets:
            resolved = guards.resolve(target)
            if isinstance(resolved, str):
                raise LookupError(resolved)
            original = resolved.raw
            wrapper = wrapt.FunctionWrapper(original, target.make_wrapper(params))
            setattr(resolved.owner, resolved.name, wrapper)
            done.append((resolved.owner, resolved.name, original))
            state.save_original(target.key, original)
            wrappers[target.key] = wrapper
    except Exception as error:  # noqa: BLE001 - roll back whatever happened
        for owner, name, original in reversed(done):
            setattr(owner, name, original)
        logger.warning("prime_r3: %s rolled back: %s", spec.name, error)
        return f"apply failed and was rolled back: {type(error).__name__}: {error}"
    state.add_wrappers(spec.name, wrappers)
    return None


def _uninstall(spec: PatchSpec, wrappers: Mapping[str, Any]) -> str | None:
    by_key = {t.key: t for t in spec.targets}
    located = []
    for key, wrapper in wrappers.items():
        resolved = guards.resolve(by_key[key])
        current = None if isinstance(resolved, str) else resolved.raw
        if current is not wrapper:
            return f"{key} was re-wrapped by another layer; prime_r3's layer left in place"
        located.append((resolved, key))
    for resolved, key in located:
        setattr(resolved.owner, resolved.name, state.get_original(*key.split(":", 1)))
    if spec.on_revert is not None:
        spec.on_revert()
    state.forget(spec.name)
    return None
