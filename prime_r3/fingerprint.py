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
import inspect
import sys
import textwrap
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
