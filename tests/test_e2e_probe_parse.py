"""prime_r3.e2e.engine reads a process's state from its own records (no engine needed)."""

from __future__ import annotations

import pathlib

from prime_r3.e2e.engine import parse_probe, role_of, visible_lines

SUMMARY = (
    "prime_r3 on vllm 0.32.0+cpu (pid 7): active: batched_take | on import: packed_outputs "
    "(waits for import of a.connector, a.worker); store_headroom (waits for import of a.store); "
    "engine_gc (waits for import of a.core) | skipped: store_growth (vllm 0.32.0+cpu has it; x)"
)


def _write(tmp: pathlib.Path, name: str, *messages: str) -> pathlib.Path:
    path = tmp / "7.log"
    path.write_text("".join(f"7\t{name}\t{m}\n" for m in messages))
    return path


def test_installs_on_import_complete_a_patch_or_leave_it_partly_in_force(
    tmp_path: pathlib.Path,
) -> None:
    state = parse_probe(
        _write(
            tmp_path,
            "VllmWorker-0",
            SUMMARY,
            "prime_r3: packed_outputs installed on import of a.connector",
            "prime_r3: store_headroom installed on import of a.store",
            "prime_r3: engine_gc skipped on import of a.core: changed (rolled back)",
        )
    )
    assert (state.pid, state.role, state.version, state.summaries) == (7, "worker", "0.32.0+cpu", 1)
    assert state.active == ["batched_take", "store_headroom"]
    assert state.pending == {"packed_outputs": {"a.worker"}}
    assert state.installed == {"packed_outputs": {"a.connector"}}
    assert state.skipped == [
        "store_growth (vllm 0.32.0+cpu has it; x)",
        "engine_gc (changed (rolled back))",
    ]
    assert "in force on the modules it imported: packed_outputs (connector)" in state.describe()


def test_roles_and_visible_lines(tmp_path: pathlib.Path) -> None:
    names = ("MainProcess", "EngineCore_DP0", "EngineCore", "VllmWorker-0")
    assert [role_of(n) for n in names] == ["front-end", "engine_core", "engine_core", "worker"]
    log = tmp_path / "vllm.log"
    other = SUMMARY.replace("pid 7", "pid 8")
    log.write_text(f"(Worker pid=7) INFO [layer.py:1] {SUMMARY}\nx\n(EngineCore pid=8) {other}\n")
    assert visible_lines(log) == {7: 1, 8: 1}


def test_a_fork_with_records_but_no_line_is_reported_as_such(tmp_path: pathlib.Path) -> None:
    state = parse_probe(
        _write(tmp_path, "MainProcess", "prime_r3: batched_take installed on import of a.request")
    )
    assert state.role == "forked" and state.summaries == 0
    assert "inherited from its parent" in state.describe()
