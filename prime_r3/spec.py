"""The shape of one registry record.

A patch is data first: what it targets, which vLLM it was verified on, the
fingerprint of each target's upstream source, and how to build its wrappers.
The machinery in ``prime_r3.layer`` reads these records; patch modules under
``prime_r3.fixes`` only declare them, so the guard and revert logic exists once.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

#: A wrapt wrapper: ``wrapper(wrapped, instance, args, kwargs) -> result``.
WrapperFn = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]
#: Builds a target's wrapper from the patch's parsed parameters.
WrapperFactory = Callable[[Mapping[str, Any]], WrapperFn]
#: ``Calling.PLAIN``: given the callable a layer wraps (upstream's function, or the next
#: layer down, always callable with the target's own arguments, ``self`` first for a
#: method), returns the plain function to install, with the target's own signature. The
#: function must hold that callable in its own closure (call it as a free variable):
#: the layer then can turn it into a pass-through in place if it must (see layer.py).
PlainFactory = Callable[[Callable[..., Any]], Callable[..., Any]]


class Calling(enum.Enum):
    """How a target's wrapper is called: the kind of object the layer installs.

    ``WRAPT`` (the default): a ``wrapt.FunctionWrapper`` around the inner object; the
    patch gives a ``WrapperFn`` and wrapt binds ``instance`` on every call. ``PLAIN``: the
    patch's factory returns a ``PlainFactory`` and the layer installs the function it
    makes as is. For targets called hundreds of times per engine step: a call through a
    ``FunctionWrapper`` method costs about ten times a plain function's (its per-call
    bound wrapper object), which at 1000 calls a step is most of what the body costs.
    Plain layers are recognised by identity (the layer's records), like wrapt ones.
    """

    WRAPT = "wrapt"
    PLAIN = "plain"


class Process(enum.Enum):
    """The vLLM processes a patch matters in (vLLM loads plugins in all of them)."""

    API_SERVER = "api_server"
    ENGINE_CORE = "engine_core"
    WORKER = "worker"


@dataclass(frozen=True)
class Param:
    """One per-patch setting, read from ``PRIME_R3_<PATCH>_<NAME>``."""

    name: str
    default: Any
    parse: Callable[[str], Any]
    help: str
    #: Human-readable description of accepted values, used in error messages.
    expects: str

    def env_var(self, patch_name: str) -> str:
        return f"PRIME_R3_{patch_name.upper()}_{self.name.upper()}"


@dataclass(frozen=True)
class Target:
    """One attribute a patch replaces with a wrapper of the original.

    ``module`` and ``attr`` say where the name is *looked up* (for a function
    imported with ``from x import y`` that is the importing module). The
    fingerprint is taken from the object's own source, wherever it is defined.
    """

    module: str
    attr: str
    #: sha256 prefixes of the upstream source this patch was verified against.
    fingerprints: frozenset[str]
    #: ``params -> WrapperFn`` for ``Calling.WRAPT``; ``params -> PlainFactory`` for
    #: ``Calling.PLAIN``.
    make_wrapper: Callable[[Mapping[str, Any]], WrapperFn | PlainFactory]
    #: The kind of wrapper installed (see ``Calling``); ``PLAIN`` needs a plain function
    #: target (a module function or a method defined with ``def``).
    calling: Calling = Calling.WRAPT

    def __post_init__(self) -> None:
        if not isinstance(self.calling, Calling):
            choices = ", ".join(f"Calling.{c.name}" for c in Calling)
            raise ValueError(
                f"Target {self.module}:{self.attr}: calling={self.calling!r} is not a "
                f"wrapper kind; valid choices: {choices}"
            )

    @property
    def key(self) -> str:
        return f"{self.module}:{self.attr}"


@dataclass(frozen=True)
class Anchor:
    """Upstream code a patch relies on without replacing it (e.g. a caller).

    Checked like a target: a changed anchor skips the patch.
    """

    module: str
    attr: str
    fingerprints: frozenset[str]
    #: PEP 440 specifier of the releases that have this code ("" = every release the
    #: patch covers): e.g. a method that one release split out of a caller we anchor.
    releases: str = ""

    @property
    def key(self) -> str:
        return f"{self.module}:{self.attr}"

    def exists_in(self, version: str | None) -> bool:
        """Whether the release ``version`` has this code, so it must be checked there."""
        if not self.releases or version is None:
            return True
        try:
            release = Version(Version(version).base_version)
        except InvalidVersion:
            return True  # unparsable: check it; the version guard skips the patch anyway
        return SpecifierSet(self.releases).contains(release, prereleases=True)


@dataclass(frozen=True)
class PatchSpec:
    """One registry record: everything needed to guard, apply and revert a patch."""

    name: str
    summary: str
    targets: tuple[Target, ...]
    #: PEP 440 specifier of the vLLM releases this patch is verified for.
    vllm_range: str
    processes: frozenset[Process]
    anchors: tuple[Anchor, ...] = ()
    params: tuple[Param, ...] = ()
    #: Release that carries the fix upstream; versions >= it skip with that reason.
    fixed_upstream_in: str | None = None
    #: Called after the patch's targets are removed (e.g. to undo a side effect).
    on_revert: Callable[[], None] | None = None
    #: Why the patch can take no effect in this process (a reason string), or None:
    #: checked with the guards, so such a process reports the patch skipped with it.
    no_effect_here: Callable[[], str | None] | None = None
    notes: str = field(default="")
    #: Why this patch has no upstream-form diff under ``patches/`` yet; empty when it has
    #: one for every release it applies to (``scripts/patches.py`` and
    #: ``tests/test_upstream_diffs.py`` hold every other registry patch to that). A
    #: string covers every release; ``(release, reason)`` pairs name the releases that
    #: still lack one (the others have theirs).
    diff_pending: str | tuple[tuple[str, str], ...] = ""
    #: The registry patch whose upstream-form diff also carries this fix (its upstream
    #: form is a change to that patch's code, so it has no diff of its own); empty
    #: when it has its own. ``scripts/patches.py`` checks that patch has a diff.
    diff_in: str = ""
    #: What the patch does in this process now, for ``status`` and the log (e.g. a
    #: patch that only takes effect once a handshake between processes succeeded);
    #: called while the patch is installed, its text appended to the outcome's reason.
    live_note: Callable[[], str] | None = None

    def __post_init__(self) -> None:
        # Refused here, not in scripts/patches.py: a record that is both carried and
        # pending, or carried by itself, would otherwise pass its checks silently.
        if self.diff_in and self.diff_pending:
            raise ValueError(
                f"patch {self.name!r}: diff_in={self.diff_in!r} and diff_pending="
                f"{self.diff_pending!r} are both set; a patch is either carried by "
                "another patch's diff or waiting for its own, set one of them"
            )
        if not isinstance(self.diff_pending, str) and not all(
            isinstance(pair, tuple)
            and len(pair) == 2
            and all(isinstance(x, str) and x for x in pair)
            for pair in self.diff_pending
        ):
            raise ValueError(
                f"patch {self.name!r}: diff_pending={self.diff_pending!r}; valid choices: "
                "a reason string (every release) or (release, reason) pairs of non-empty "
                "strings (the releases still without a diff)"
            )
        if self.diff_in == self.name:
            raise ValueError(
                f"patch {self.name!r}: diff_in={self.diff_in!r} names the patch itself; "
                "valid choices: another registry patch's name, or empty for its own diff"
            )

    def diff_pending_for(self, release: str) -> str:
        """Why there is no diff for ``release`` yet ("" when there is one)."""
        if isinstance(self.diff_pending, str):
            return self.diff_pending
        return dict(self.diff_pending).get(release, "")

    def anchors_for(self, version: str | None) -> tuple[Anchor, ...]:
        """The anchors the installed release has (see ``Anchor.releases``)."""
        return tuple(a for a in self.anchors if a.exists_in(version))

    def param(self, name: str) -> Param:
        for param in self.params:
            if param.name == name:
                return param
        raise KeyError(f"patch {self.name!r} has no parameter {name!r}")
