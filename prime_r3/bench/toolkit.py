"""``prime-r3 bench NAME [ARGS]``: the benchmark toolkit's one entry point.

Bare ``prime-r3 bench`` is the main job (``prime_r3.bench.command``). Every other
benchmark is a script under the checkout's ``scripts/`` built on one harness
(``scripts/benchkit.py``: fresh interpreter per arm, rotated rounds, medians, the vLLM
release in the header, ``--json``), listed here by name and documented in
``scripts/README.md`` (what each measures, the command, the latest figures).
``prime-r3 bench NAME ARGS`` runs ``scripts/bench_<script>.py ARGS`` with this
interpreter, after one header line; ``prime-r3 bench list`` lists them.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Tool:
    name: str
    script: str
    measures: str


TOOLS = (
    Tool(
        "step-ab",
        "bench_step_ab.py",
        "whole step: R3 off / prime_r3 at --before REV / now / --tree",
    ),
    Tool("tree-parity", "bench_tree_parity.py", "rows of vLLM + patches/ vs installed upstream"),
    Tool("store-wait", "bench_store_wait.py", "output worker's wait for the store writer"),
    Tool(
        "engine-outputs",
        "bench_engine_outputs.py",
        "EngineCore -> client hop: upstream vs packed_hop vs 02",
    ),
    Tool("packing", "bench_packing.py", "worker -> EngineCore step output: dict vs packed"),
    Tool("commit", "bench_commit_step.py", "one process_output step: batched_commit vs a REV"),
    Tool("sched", "bench_sched.py", "EngineCore scheduler thread: where R3's cost goes"),
    Tool("store", "bench_store.py", "put on a full 450k-slot store: upstream vs patched"),
    Tool("writer", "bench_writer.py", "store writer thread at steady state, replayed puts"),
    Tool("api-gc", "bench_api_server_gc.py", "API server's R3 work under two GC thresholds"),
    Tool("wave", "bench_wave.py", "API server: a wave of long R3 responses finishing together"),
    Tool("finish", "bench_finish.py", "API server: one finished long response's R3 work"),
    Tool(
        "rows-stress",
        "bench_rows_stress.py",
        "API server: 10,000 long R3 requests in flight, memory, maps, parity",
    ),
)
BY_NAME = {tool.name: tool for tool in TOOLS}
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def is_tool_call(argv: Sequence[str]) -> bool:
    """Whether ``prime-r3 ARGV`` asks for a toolkit benchmark (``bench`` then a name)."""
    return len(argv) >= 2 and argv[0] == "bench" and not argv[1].startswith("-")


def listing() -> str:
    """One line per benchmark (the ``list`` output and ``prime-r3 bench --help``'s epilog)."""
    width = max(len(t.name) for t in TOOLS)
    lines = [f"  {'(none)':{width}}  the main job: R3 cost per engine step and row parity"]
    lines += [f"  {t.name:{width}}  {t.measures}" for t in TOOLS]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    """``argv`` = NAME [ARGS...]: run one benchmark; a one-line error for an unknown name."""
    name, args = argv[0], list(argv[1:])
    if name == "list":
        print("prime-r3 bench [NAME] [ARGS]; NAME --help for its options:")
        print(listing())
        return 0
    tool = BY_NAME.get(name)
    if tool is None:
        choices = ", ".join(["list", *BY_NAME])
        print(
            f"prime-r3 bench: unknown benchmark {name!r}; choose from: {choices}", file=sys.stderr
        )
        return 2
    script = SCRIPTS / tool.script
    if not script.is_file():
        print(
            f"prime-r3 bench {name}: {script} not found; the benchmarks run from a checkout "
            "of prime_r3 (the installed package has only the main job)",
            file=sys.stderr,
        )
        return 2
    if "-h" not in args and "--help" not in args:
        print(_benchkit().header_line(f"prime-r3 bench {name}"), flush=True)
    return subprocess.run([sys.executable, str(script), *args], cwd=SCRIPTS.parent).returncode


def _benchkit():  # noqa: ANN202 - scripts/benchkit.py, loaded by path (stdlib only)
    spec = importlib.util.spec_from_file_location("prime_r3_benchkit", SCRIPTS / "benchkit.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
