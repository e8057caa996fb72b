"""Start, drive and stop one engine (``prime_r3.e2e.driver``) from the parent process."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from prime_r3.e2e import engine as eng


class EngineError(RuntimeError):
    """The engine died, timed out or answered with an error (its log's tail attached)."""


class Engine:
    """A driver process and its vLLM engine; use as a context manager (always stopped)."""

    def __init__(
        self,
        name: str,
        model: str | os.PathLike[str],
        *,
        r3: bool,
        env: dict[str, str] | None = None,
        args: dict[str, Any] | None = None,
        workdir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.name = name
        self.workdir = pathlib.Path(workdir or tempfile.mkdtemp(prefix=f"prime_r3_e2e_{name}_"))
        self.probe_dir = self.workdir / f"{name}.probe"
        self.probe_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / f"{name}.log"
        kwargs = dict(eng.ENGINE_ARGS)
        kwargs.update(model=str(model), enable_return_routed_experts=r3)
        kwargs.update(args or {})
        self.kwargs = kwargs
        self.env = eng.engine_env(self.probe_dir, **(env or {}))
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_s: float | None = None
        self._buffer = b""

    def start(self, timeout: float = 600) -> Engine:
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "prime_r3.e2e.driver", json.dumps(self.kwargs)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=self.env,
                start_new_session=True,  # its own process group: stopped whole, by its pid
            )
        finally:
            log.close()
        reply = self._read(timeout)
        self.start_s = reply["start_s"]
        return self

    def __enter__(self) -> Engine:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(text[-lines:])

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineError(
                        f"{self.name}: no reply in {timeout:.0f} s\n{self.log_tail()}"
                    )
                if sel.select(min(left, 1.0)):
                    chunk = os.read(fd, 1 << 20)
                    if not chunk:
                        code = self.proc.wait(timeout=30)
                        raise EngineError(f"{self.name}: exited ({code})\n{self.log_tail()}")
                    self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        reply = json.loads(line)
        if "error" in reply:
            raise EngineError(f"{self.name}: {reply['error']}\n{self.log_tail()}")
        return reply

    def call(self, cmd: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        return self._read(timeout)

    def run(
        self,
        requests: list[dict[str, Any]],
        abort: dict[str, int] | None = None,
        timeout: float = 600,
    ) -> dict[str, Any]:
        return self.call(
            {"op": "run", "requests": requests, "abort": abort, "timeout": timeout}, timeout + 30
        )

    def processes(self) -> list[eng.ProcessState]:
        return eng.read_processes(self.probe_dir)

    def stop(self, timeout: float = 60) -> int | None:
        """Ask the driver to shut its engine down; kill its process group if it does not."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        with contextlib.suppress(Exception):
            assert proc.stdin is not None
            proc.stdin.write(b'{"op": "exit"}\n')
            proc.stdin.close()
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait(timeout=30)
        finally:
            _kill_group_leftovers(proc.pid)


def _kill_group_leftovers(pgid: int) -> None:
    """Kill what is left of the driver's own process group (an engine child that
    outlived it): only that group, which the driver's session started."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@contextlib.contextmanager
def engines(*items: Engine) -> Iterator[tuple[Engine, ...]]:
    """Start several engines one after another; stop them all however the block ends."""
    try:
        for e in items:
            e.start()
        yield items
    finally:
        for e in items:
            e.stop()


def mismatches(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Where two runs of the same requests differ (token ids, routed experts, finished)."""
    out = []
    ra, rb = a["results"], b["results"]
    if len(ra) != len(rb):
        return [f"{len(ra)} vs {len(rb)} requests"]
    for x, y in zip(ra, rb, strict=True):
        if x["finished"] != y["finished"]:
            out.append(f"{x['id']}: finished {x['finished']} vs {y['finished']}")
        elif len(x["samples"]) != len(y["samples"]):
            out.append(f"{x['id']}: {len(x['samples'])} vs {len(y['samples'])} samples")
        else:
            for k, (s, t) in enumerate(zip(x["samples"], y["samples"], strict=True)):
                for key in ("token_ids", "routed_experts"):
                    if s[key] != t[key]:
                        out.append(f"{x['id']}[{k}]: {key} differ")
    return out
