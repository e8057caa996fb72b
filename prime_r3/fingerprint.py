"""Fingerprints of upstream source, so a patch never runs on code it was not verified on.

The fingerprint of a function or class is the sha256 of its source text (decorators
included, dedented), located by qualified name in the module's source with ``ast``.
The same function reads an installed module or a file from an unpacked wheel, so
``scripts/fingerprint.py`` can verify other vLLM releases without installing them.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
import sys
import textwrap
from collections.abc import Callable
from functools import lru_cache

DIGEST_CHARS = 16


class SourceUnavailable(LookupError):
    """The source of a target cannot be located."""


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]


def segment(module_source: str, qualname: str) -> str:
    """Return the dedented source of ``qualname`` (e.g. ``Class.method``) in a module."""
    tree = _parse(module_source)
    body: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = None
        for stmt in body:
            if (
                isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                and stmt.name == part
            ):
                node = stmt  # last definition wins, as at import time
        if node is None:
            raise SourceUnavailable(f"{qualname!r} is not defined in the module source")
        body = node.body  # type: ignore[attr-defined]
    assert node is not None
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])  # type: ignore[attr-defined]
    lines = module_source.splitlines()[first - 1 : node.end_lineno]  # type: ignore[attr-defined]
    return textwrap.dedent("\n".join(lines))


def of_source(module_source: str, qualname: str) -> str:
    return digest(segment(module_source, qualname))


def of_object(obj: object) -> str:
    """Fingerprint a live function or class from the file of the module that defines it."""
    module_name = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not module_name or not qualname or "<locals>" in qualname:
        raise SourceUnavailable(f"{obj!r} has no module-level qualified name")
    return of_source(module_source(module_name), qualname)


def of_name(module_name: str, qualname: str, read: Callable[[str], str] | None = None) -> str:
    """Fingerprint what ``module_name.qualname`` names, reading files, importing nothing.

    Follows ``from x import y`` at module level, so a function looked up in the module
    that imports it gets the fingerprint of its definition, as :func:`of_object` gives
    once the module is imported. ``read`` maps a module name to its source (default:
    the installed file, located by ``find_spec``, which imports parent packages only);
    ``scripts/fingerprint.py`` passes one that reads an unpacked wheel.
    """
    read = read or file_source
    for _ in range(8):  # import chains are short; stop on a cycle
        source = read(module_name)
        try:
            return of_source(source, qualname)
        except SourceUnavailable:
            head, dot, rest = qualname.partition(".")
            origin = _imported_from(source, module_name, head)
            if origin is None:
                raise
            module_name, qualname = origin[0], origin[1] + dot + rest
    raise SourceUnavailable(f"{module_name}:{qualname}: import chain too long")


def file_source(module_name: str) -> str:
    """Source of a module from its file, without importing the module itself."""
    module = sys.modules.get(module_name)
    if module is not None:
        return module_source(module_name)
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as error:
        raise SourceUnavailable(f"cannot locate {module_name}: {error}") from error
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise SourceUnavailable(f"no Python source for module {module_name}")
    try:
        return _read_module(spec.origin)
    except OSError as error:
        raise SourceUnavailable(f"no source for module {module_name}: {error}") from error


def _imported_from(source: str, module_name: str, name: str) -> tuple[str, str] | None:
    """(module, original name) of a module-level ``from module import original as name``."""
    for stmt in _parse(source).body:
        if not isinstance(stmt, ast.ImportFrom):
            continue
        for alias in stmt.names:
            if (alias.asname or alias.name) != name:
                continue
            base = stmt.module or ""
            if stmt.level:
                package = module_name.rsplit(".", stmt.level)[0]
                base = f"{package}.{base}" if base else package
            return base, alias.name
    return None


def module_source(module_name: str) -> str:
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    try:
        return _read_module(inspect.getsourcefile(module) or "")
    except (OSError, TypeError) as error:
        raise SourceUnavailable(f"no source for module {module_name}: {error}") from error


@lru_cache(maxsize=64)
def _read_module(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read()


@lru_cache(maxsize=64)
def _parse(module_source: str) -> ast.Module:
    return ast.parse(module_source)
