"""Environment toggles, parsed in one place.

``PRIME_R3``          on/off for the whole overlay (default on).
``PRIME_R3_PATCHES``  ``all`` (default), a comma list of names, ``-name`` to drop one.
``PRIME_R3_<PATCH>_<PARAM>``  per-patch parameters declared in the registry.
``PRIME_R3_PYTHON``   read by ``scripts/ensure_env.sh`` only (known, so exporting it is
                      not mistaken for a typo, but it changes nothing in the overlay).

Anything malformed raises :class:`ConfigError` naming the variable, the bad value and
the valid choices. The plugin lets it propagate, so vLLM refuses to start instead of
running with a configuration the user did not mean.

Ray workers (see :func:`export_for_ray_workers`): the settings of the process that
starts vLLM (the head) win on every node, because EngineCore and its workers must run
the same overlay; a node's own ``PRIME_R3*`` values are replaced, with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from prime_r3.spec import PatchSpec

ENABLE_VAR = "PRIME_R3"
PATCHES_VAR = "PRIME_R3_PATCHES"
PREFIX = "PRIME_R3_"

#: Variables read by the setup scripts, not by the overlay. Known so that exporting one
#: (as ``scripts/ensure_env.sh`` invites) does not fail every process as an unknown setting.
SETUP_VARS: Mapping[str, str] = {
    "PRIME_R3_PYTHON": "interpreter scripts/ensure_env.sh creates the environments with",
}

#: Written by the plugin: the head's overlay settings, the machine and the process that
#: wrote them, so a Ray worker outside that process's tree runs with the head's values
#: (see settings_environ).
HEAD_VAR = "PRIME_R3_FROM_HEAD"
#: vLLM's documented, additive list of extra prefixes its Ray executors copy to workers
#: (``vllm/ray/ray_env.py``, identical in 0.31, 0.32 and 0.33).
RAY_PREFIXES_VAR = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
RAY_PREFIX = ENABLE_VAR

logger = logging.getLogger("vllm.prime_r3")

#: Largest value ``gc.set_threshold`` accepts: its arguments are C ``int``s, so anything
#: above raises ``OverflowError`` (in EngineCore's init, after the model loaded).
C_INT_MAX = 2**31 - 1

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class ConfigError(ValueError):
    """A prime_r3 environment variable has a value we refuse to guess about."""


@dataclass(frozen=True)
class SettingValue:
    """One variable as parsed: what the overlay uses and where it came from."""

    var: str
    #: The parsed value in force (for a setup variable: the raw text, or None).
    value: Any
    default: Any
    #: True if the environment set it (a blank value counts as unset, i.e. default).
    from_env: bool
    help: str


@dataclass(frozen=True)
class Settings:
    enabled: bool
    #: Patch names the environment selects, in registry order.
    selected: tuple[str, ...]
    #: Names listed explicitly (not via ``all``): skipping one of these is an error.
    requested: frozenset[str]
    #: Parsed parameters per patch name.
    params: Mapping[str, Mapping[str, Any]]
    #: Every known variable with its value and source, for ``prime-r3 status``.
    values: tuple[SettingValue, ...] = ()


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r}")


def parse_int_tuple(
    count: int, minimum: int = 0, maximum: int = C_INT_MAX
) -> Callable[[str], tuple[int, ...]]:
    """``count`` comma-separated integers, each in ``minimum..maximum``.

    The range is checked here, when the environment is parsed, so a value the consumer
    would reject later (``gc.set_threshold`` takes C ints) fails before vLLM starts.
    """

    def parse(text: str) -> tuple[int, ...]:
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != count:
            raise ValueError(f"expected {count} comma-separated integers, got {len(parts)}")
        values = []
        for part in parts:
            try:
                value = int(part.replace("_", ""))
            except ValueError:
                raise ValueError(f"{part!r} is not an integer") from None
            if not minimum <= value <= maximum:
                raise ValueError(f"{value} is outside the valid range {minimum}..{maximum}")
            values.append(value)
        return tuple(values)

    return parse


def parse_float_in_range(minimum: float, maximum: float) -> Callable[[str], float]:
    """A number in ``minimum..maximum`` (so never nan or infinite).

    Checked here, when the environment is parsed, so a value the consumer would only
    fail on later (a store arena too large to map) stops vLLM before it starts.
    """

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not a number") from None
        if not minimum <= value <= maximum:
            raise ValueError(f"{value} is outside the valid range {minimum:g}..{maximum:g}")
        return value

    return parse


def from_env(registry: Sequence[PatchSpec], environ: Mapping[str, str] | None = None) -> Settings:
    """Read every prime_r3 variable; raise ConfigError on the first bad one."""
    env = os.environ if environ is None else environ
    names = [spec.name for spec in registry]

    enabled = True
    raw_enable = env.get(ENABLE_VAR)
    if raw_enable is not None and raw_enable.strip() != "":
        try:
            enabled = parse_bool(raw_enable)
        except ValueError:
            raise ConfigError(
                f"{ENABLE_VAR}={raw_enable!r} is not valid; use one of {', '.join(_TRUE + _FALSE)}"
            ) from None

    raw_patches = env.get(PATCHES_VAR)
    selected, requested = _parse_selection(raw_patches, names)
    params = {spec.name: _parse_params(spec, env) for spec in registry}
    _reject_unknown_vars(registry, env)

    def given(var: str) -> bool:
        raw = env.get(var)
        return raw is not None and raw.strip() != ""

    values = [
        SettingValue(ENABLE_VAR, enabled, True, given(ENABLE_VAR), "whole overlay on/off"),
        SettingValue(
            PATCHES_VAR, ",".join(selected), "all", given(PATCHES_VAR), "patches selected"
        ),
    ]
    for spec in registry:
        for param in spec.params:
            var = param.env_var(spec.name)
            value = params[spec.name][param.name]
            values.append(SettingValue(var, value, param.default, given(var), param.help))
    for var, help_ in SETUP_VARS.items():
        values.append(SettingValue(var, env.get(var), None, given(var), help_))
    return Settings(enabled, selected, requested, params, tuple(values))


def _parse_selection(raw: str | None, names: list[str]) -> tuple[tuple[str, ...], frozenset[str]]:
    if raw is None or raw.strip() == "" or raw.strip().lower() == "all":
        return tuple(names), frozenset()
    tokens = [t.strip() for t in raw.split(",")]
    if any(t == "" for t in tokens):
        raise ConfigError(
            f"{PATCHES_VAR}={raw!r} has an empty item; valid names: {_choices(names)}"
        )
    positive = [t for t in tokens if not t.startswith("-")]
    chosen: set[str] = set() if positive else set(names)
    requested: set[str] = set()
    for token in tokens:
        drop = token.startswith("-")
        name = token[1:].strip() if drop else token
        if name.lower() == "all" and not drop:
            chosen.update(names)
            continue
        if name not in names:
            raise ConfigError(
                f"{PATCHES_VAR}={raw!r}: unknown patch {name!r}; valid names: {_choices(names)}"
            )
        if drop:
            chosen.discard(name)
            requested.discard(name)
        else:
            chosen.add(name)
            requested.add(name)
    return tuple(n for n in names if n in chosen), frozenset(requested)


def _parse_params(spec: PatchSpec, env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for param in spec.params:
        var = param.env_var(spec.name)
        raw = env.get(var)
        if raw is None or raw.strip() == "":
            values[param.name] = param.default
            continue
        try:
            values[param.name] = param.parse(raw)
        except ValueError as error:
            raise ConfigError(
                f"{var}={raw!r} is not valid: {error}; expected {param.expects}"
            ) from None
    return values


def _reject_unknown_vars(registry: Sequence[PatchSpec], env: Mapping[str, str]) -> None:
    known = {ENABLE_VAR, PATCHES_VAR, HEAD_VAR, *SETUP_VARS} | {
        param.env_var(spec.name) for spec in registry for param in spec.params
    }
    for var in sorted(env):
        if var.startswith(PREFIX) and var not in known:
            raise ConfigError(
                f"{var} is not a prime_r3 setting (a typo would silently change nothing); "
                f"known variables: {', '.join(sorted(known))}"
            )


def _choices(names: list[str]) -> str:
    return ", ".join(["all", *names]) + " (prefix a name with '-' to drop it)"


# -- Ray workers: the head's settings everywhere -------------------------------------


def _is_overlay_var(name: str) -> bool:
    """A variable that configures the overlay (not a setup-script one, not the carrier)."""
    return (name == ENABLE_VAR or name.startswith(PREFIX)) and name not in (
        HEAD_VAR,
        *SETUP_VARS,
    )


def machine_id() -> str:
    """Identifies this machine: the kernel's boot id, shared by every process and
    container on one host and different on another; the host name where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def _stat(pid: int) -> tuple[int, int] | None:
    """``(parent pid, start time)`` of ``pid`` from ``/proc``; None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _process_id(pid: int) -> list[int] | None:
    """``[pid, start time]``: one process, even after its pid is reused; None without /proc."""
    stat = _stat(pid)
    return None if stat is None else [pid, stat[1]]


def _descends_from(process: list[int]) -> bool | None:
    """Whether this process is ``process`` (``[pid, start time]``) or runs below it;
    None where the ancestry cannot be read."""
    pid = os.getpid()
    for _ in range(4096):
        stat = _stat(pid)
        if stat is None:
            return None
        if pid == process[0]:
            return stat[1] == process[1]
        if stat[0] <= 0:
            return False
        pid = stat[0]
    return None


def _carrier_applies(carrier: Mapping[str, Any]) -> bool:
    """The head's settings win here: this process runs on another machine than the
    process that wrote ``carrier``, or on the same one but outside its tree (a Ray worker
    of a cluster started elsewhere). A process below the writer (its spawned children,
    whatever their environment) and one whose ancestry cannot be read keep their own."""
    if carrier["machine"] != machine_id():
        return True
    process = carrier.get("process")
    return process is not None and _descends_from(process) is False


def settings_environ(environ: Mapping[str, str] | None = None) -> tuple[Mapping[str, str], str]:
    """The environment this process takes its settings from, and a note if not its own.

    Its own, unless :data:`HEAD_VAR` says the head's settings win here
    (:func:`_carrier_applies`): then this is a Ray worker (vLLM copied the variable to
    it) and the head's overlay variables replace the node's own. RayExecutorV2 copies the
    head's environment with ``setdefault``, so without this a node that exports
    ``PRIME_R3*`` itself (e.g. in the shell that ran ``ray start``, on this machine or
    another) would silently run another overlay than EngineCore. A process the head's
    tree starts itself keeps its own environment: a script that starts a child with
    other ``PRIME_R3*`` values means it.
    """
    env = os.environ if environ is None else environ
    raw = env.get(HEAD_VAR)
    if raw is None or raw.strip() == "":
        return env, ""
    try:
        carrier = json.loads(raw)
        machine, head_env = carrier["machine"], carrier["env"]
        process = carrier.get("process")
        if not isinstance(machine, str) or not isinstance(head_env, dict):
            raise TypeError("machine must be a string and env an object")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in head_env.items()):
            raise TypeError("env must map names to strings")
        if process is not None and not (
            isinstance(process, list) and len(process) == 2 and all(type(n) is int for n in process)
        ):
            raise TypeError("process must be [pid, start time]")
    except (ValueError, KeyError, TypeError) as error:
        raise ConfigError(
            f"{HEAD_VAR}={raw!r} is not valid: {error}; it is written by prime_r3's plugin as "
            '{"machine": ..., "process": [pid, start], "env": {...}}; unset it'
        ) from None
    if not _carrier_applies(carrier):
        return env, ""
    own = {k: v for k, v in env.items() if _is_overlay_var(k)}
    head = {k: v for k, v in head_env.items() if _is_overlay_var(k)}
    merged = {k: v for k, v in env.items() if not _is_overlay_var(k)}
    merged.update(head)
    differ = sorted(k for k in own.keys() | head.keys() if own.get(k) != head.get(k))
    note = ""
    if differ:
        shown = ", ".join(f"{k}={own.get(k)!r} -> {head.get(k)!r}" for k in differ)
        note = f"this node's own values replaced by the head's: {shown}"
    return merged, note


def export_for_ray_workers(
    settings_env: Mapping[str, str], environ: MutableMapping[str, str] | None = None
) -> None:
    """Make the overlay's settings reach every Ray worker, with the head's values winning.

    1. Adds ``PRIME_R3`` to ``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY``, vLLM's additive
       list of extra prefixes (kept as the user wrote it, ours appended): the legacy
       ``RayDistributedExecutor`` (0.31/0.32) copies only listed prefixes and overwrites
       the worker's values; the Ray data-parallel EngineCore actors get them as
       ``runtime_env`` variables, which also override the node's.
    2. Writes :data:`HEAD_VAR` (this machine, this process and these settings) unless
       this process itself runs with a head's settings (then it is left as is, so the
       whole tree below one head agrees). ``RayExecutorV2`` copies the whole environment
       with ``setdefault``; the carrier is how a Ray worker learns the head's values where
       its own would win (:func:`settings_environ`).
    """
    env = os.environ if environ is None else environ
    listed = env.get(RAY_PREFIXES_VAR, "")
    if RAY_PREFIX not in {p.strip() for p in listed.split(",")}:
        env[RAY_PREFIXES_VAR] = f"{listed},{RAY_PREFIX}" if listed.strip() else RAY_PREFIX
    raw = env.get(HEAD_VAR)
    if raw:
        try:
            if _carrier_applies(json.loads(raw)):
                return  # a worker of a head's: keep the head's settings for our children
        except (ValueError, KeyError, TypeError, IndexError):
            pass  # malformed: settings_environ() already refused it; overwrite
    own = {k: v for k, v in settings_env.items() if _is_overlay_var(k)}
    carrier = {"machine": machine_id(), "process": _process_id(os.getpid()), "env": own}
    env[HEAD_VAR] = json.dumps(carrier, sort_keys=True)
