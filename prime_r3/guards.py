"""Fail-closed checks: a patch applies only to a vLLM and target source it was verified on.

Each check returns ``None`` when it passes or a reason string that says which check
failed; the layer turns a reason into a logged skip and leaves the target untouched.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from dataclasses import dataclass
from typing import Any

import wrapt
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from prime_r3 import fingerprint
from prime_r3.spec import Anchor, PatchSpec, Target


def installed_vllm_version() -> str | None:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


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
    """Guard a live object: its source is a verified one and nobody replaced it."""
    function = resolved.function
    try:
        found = fingerprint.of_object(function)
    except fingerprint.SourceUnavailable as error:
        return f"target {target.key} source unavailable: {error}"
    reason = _compare(target, found)
    if reason is None and isinstance(target, Target) and not _is_plain_upstream(function):
        return f"target {target.key} is already replaced by another layer ({function!r})"
    return reason


def check_unimported(target: Target | Anchor) -> str | None:
    """Guard a target in a module not imported yet, from its file, importing nothing."""
    try:
        found = fingerprint.of_name(target.module, target.attr)
    except fingerprint.SourceUnavailable as error:
        return f"target {target.key} source unavailable: {error}"
    return _compare(target, found)


def check(target: Target | Anchor) -> str | None:
    """Every source guard of one item; never imports a module that is not loaded."""
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


def _is_plain_upstream(function: Any) -> bool:
    """True if ``function``'s code lives in the file of the module it claims to be from.

    A wrapper installed by someone else (wrapt proxy, functools.wraps closure) fails
    this even when it copied the original's name, so we never stack on a layer whose
    behaviour we have not verified.
    """
    code = getattr(function, "__code__", None)
    if code is None or isinstance(function, wrapt.ObjectProxy):
        return False
    module = sys.modules.get(getattr(function, "__module__", "") or "")
    source_file = getattr(module, "__file__", None)
    try:
        return source_file is not None and os.path.samefile(code.co_filename, source_file)
    except OSError:  # a file is gone (e.g. an image shipping only .pyc): cannot tell
        return False
