"""Other layers that replace an upstream function, the ways real ones do it.

Each builder takes the upstream function and returns what another library (a tracer,
a profiler, an RL framework's hot-fix) would put in its place. All of them keep
``__module__`` and ``__qualname__`` pointing at upstream, so only a guard that looks
at the code itself can tell them apart from the original.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import wrapt


def with_functools_wraps(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def traced(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    return traced


def with_wrapt(original: Callable[..., Any]) -> Any:
    return wrapt.FunctionWrapper(original, lambda wrapped, instance, a, k: wrapped(*a, **k))


def look_alike(original: Callable[..., Any]) -> Callable[..., Any]:
    """A replacement, not a wrapper: no ``__wrapped__``, names copied by hand."""

    def replacement(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    replacement.__module__ = original.__module__
    replacement.__qualname__ = original.__qualname__
    replacement.__name__ = original.__name__
    return replacement


def compiled_in_upstream_file(original: Callable[..., Any]) -> Callable[..., Any]:
    """A wraps-style wrapper whose code claims upstream's file (as exec'd hot-fixes do)."""
    source = (
        "import functools\n"
        "def make(original):\n"
        "    @functools.wraps(original)\n"
        "    def wrapper(*args, **kwargs):\n"
        "        return original(*args, **kwargs)\n"
        "    return wrapper\n"
    )
    namespace: dict[str, Any] = {}
    exec(compile(source, inspect.getsourcefile(original) or "", "exec"), namespace)  # noqa: S102
    wrapper = namespace["make"](original)
    del wrapper.__wrapped__  # hide the chain too: only the code location gives it away
    return wrapper


FUNCTION_LAYERS = {
    "functools.wraps": with_functools_wraps,
    "wrapt": with_wrapt,
    "look-alike": look_alike,
    "wraps compiled in the upstream file": compiled_in_upstream_file,
}
