"""Fingerprints of upstream source, so a patch never runs on code it was not verified on.

The fingerprint of a function or class is the sha256 of its source text (decorators
included, dedented), located by qualified name in the module's source with ``ast``.
The same function reads an installed module or a file from an unpacked wheel, so
``scripts/fingerprint.py`` can verify other vLLM releases without installing them.

:func:`locate` also says *where* a name is defined (file, ``ast`` node), which the
guards compare with a live object's code: a look-alike wrapper can copy a name, a
module and a docstring, never a code object compiled from that definition.
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
from dataclasses import dataclass
from functools import lru_cache

DIGEST_CHARS = 16

Node = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


class SourceUnavailable(LookupError):
    """The source of a target cannot be located."""


@dataclass(frozen=True)
class ModuleText:
    """A module's source as read from a file, and what relative imports need to know."""

    source: str
    #: The file it was read from ("" when there is none, e.g. a source string).
    path: str = ""
    #: True for a package's ``__init__``: its relative imports start from itself.
    is_package: bool = False


#: Maps a module name to its text; raises SourceUnavailable if there is none.
Reader = Callable[[str], ModuleText]


@dataclass(frozen=True)
class Definition:
    """Where upstream defines a name: the module, qualified name and ``ast`` node."""

    module: str
    qualname: str
    text: ModuleText
    node: Node

    @property
    def first_line(self) -> int:
        """First line, decorators included (what ``co_firstlineno`` is for a def)."""
        return min([self.node.lineno] + [d.lineno for d in self.node.decorator_list])

    def segment(self) -> str:
        lines = self.text.source.splitlines()[self.first_line - 1 : self.node.end_lineno]
        return textwrap.dedent("\n".join(lines))

    def fingerprint(self) -> str:
        return digest(self.segment())


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]


def find_node(module_source: str, qualname: str) -> Node:
    """The ``ast`` node defining ``qualname`` (e.g. ``Class.method``) in a module."""
    body: list[ast.stmt] = parse(module_source).body
    node: Node | None = None
    for part in qualname.split("."):
        node = None
        for stmt in body:
            if isinstance(stmt, Node) and stmt.name == part:
                node = stmt  # last definition wins, as at import time
        if node is None:
            raise SourceUnavailable(f"{qualname!r} is not defined in the module source")
        body = node.body
    assert node is not None
    return node


def segment(module_source: str, qualname: str) -> str:
    """Return the dedented source of ``qualname`` (e.g. ``Class.method``) in a module."""
    node = find_node(module_source, qualname)
    return Definition("", qualname, ModuleText(module_source), node).segment()


def of_source(module_source: str, qualname: str) -> str:
    return digest(segment(module_source, qualname))


def of_object(obj: object) -> str:
    """Fingerprint a live function or class from the file of the module it names.

    Trusts the object's ``__module__`` and ``__qualname__``; the guards use
    :func:`locate` instead, which does not.
    """
    module_name = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not module_name or not qualname or "<locals>" in qualname:
        raise SourceUnavailable(f"{obj!r} has no module-level qualified name")
    return of_source(module_source(module_name), qualname)


def of_name(module_name: str, qualname: str, read: Reader | None = None) -> str:
    """Fingerprint what ``module_name.qualname`` names, reading files, importing nothing."""
    return locate(module_name, qualname, read).fingerprint()


def locate(module_name: str, qualname: str, read: Reader | None = None) -> Definition:
    """Where ``module_name.qualname`` is defined, from source files, importing nothing.

    Follows ``from x import y`` at module level, so a function looked up in the module
    that imports it is found at its definition, as :func:`of_object` finds it once
    the module is imported. ``read`` maps a module name to its text (default: the
    installed file, located by ``find_spec``, which imports parent packages only);
    ``scripts/fingerprint.py`` passes one that reads an unpacked wheel.
    """
    read = read or read_installed
    for _ in range(8):  # import chains are short; stop on a cycle
        text = read(module_name)
        try:
            return Definition(module_name, qualname, text, find_node(text.source, qualname))
        except SourceUnavailable:
            head, dot, rest = qualname.partition(".")
            origin = imported_from(text, module_name, head)
            if origin is None:
                raise
            module_name, qualname = origin[0], origin[1] + dot + rest
    raise SourceUnavailable(f"{module_name}:{qualname}: import chain too long")


def read_installed(module_name: str) -> ModuleText:
    """Text of an installed module from its file, without importing the module itself."""
    module = sys.modules.get(module_name)
    if module is not None:  # through module_source, the one reader of imported modules
        path = _source_file(module_name)
        return ModuleText(module_source(module_name), path, hasattr(module, "__path__"))
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as error:
        raise SourceUnavailable(f"cannot locate {module_name}: {error}") from error
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise SourceUnavailable(f"no Python source for module {module_name}")
    is_package = spec.submodule_search_locations is not None
    return ModuleText(_read(module_name, spec.origin), spec.origin, is_package)


def imported_from(text: ModuleText, module_name: str, name: str) -> tuple[str, str] | None:
    """(module, original name) of a module-level ``from module import original as name``.

    A relative import's level 1 is the package the module belongs to; for a package's
    ``__init__`` that is the package itself, not its parent.
    """
    for stmt in parse(text.source).body:
        if not isinstance(stmt, ast.ImportFrom):
            continue
        for alias in stmt.names:
            if (alias.asname or alias.name) != name:
                continue
            base = stmt.module or ""
            if stmt.level:
                parts = module_name.split(".")
                keep = len(parts) - stmt.level + (1 if text.is_package else 0)
                if keep < 1:
                    return None  # beyond the top-level package: an ImportError upstream
                package = ".".join(parts[:keep])
                base = f"{package}.{base}" if base else package
            return base, alias.name
    return None


def module_source(module_name: str) -> str:
    """Source of a module, importing it if it is not imported yet."""
    if module_name not in sys.modules:
        importlib.import_module(module_name)
    return _read(module_name, _source_file(module_name))


def _source_file(module_name: str) -> str:
    try:
        return inspect.getsourcefile(sys.modules[module_name]) or ""
    except TypeError as error:  # a built-in module
        raise SourceUnavailable(f"no source for module {module_name}: {error}") from error


def _read(module_name: str, path: str) -> str:
    try:
        return _read_module(path)
    except OSError as error:
        raise SourceUnavailable(f"no source for module {module_name}: {error}") from error


@lru_cache(maxsize=64)
def _read_module(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read()


@lru_cache(maxsize=64)
def parse(module_source: str) -> ast.Module:
    return ast.parse(module_source)
