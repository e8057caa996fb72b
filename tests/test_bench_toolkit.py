"""``prime-r3 bench NAME``: one entry point for every benchmark, one harness under them."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import pathlib
from typing import Any

import pytest

from prime_r3 import cli
from prime_r3.bench import toolkit

SCRIPTS = pathlib.Path(__file__).parents[1] / "scripts"


def _benchkit() -> Any:
    spec = importlib.util.spec_from_file_location("benchkit_under_test", SCRIPTS / "benchkit.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_benchmark_script_has_a_name_and_every_name_a_script() -> None:
    scripts = {p.name for p in SCRIPTS.glob("bench_*.py")}
    assert {t.script for t in toolkit.TOOLS} == scripts
    assert len(toolkit.BY_NAME) == len(toolkit.TOOLS)  # names are unique
    readme = (SCRIPTS / "README.md").read_text()
    for tool in toolkit.TOOLS:  # each documented, with its command
        assert f"prime-r3 bench {tool.name}" in readme, tool.name


def test_list_prints_one_line_per_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[2:]] == [t.name for t in toolkit.TOOLS]


def test_an_unknown_benchmark_is_a_one_line_error_naming_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["bench", "bogus", "-n", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "unknown benchmark 'bogus'" in err and "step-ab" in err and "list" in err


def test_bare_bench_keeps_the_main_jobs_flags() -> None:
    assert not toolkit.is_tool_call(["bench"])
    assert not toolkit.is_tool_call(["bench", "-n", "400", "--repeat", "3"])
    assert toolkit.is_tool_call(["bench", "store", "--slots", "10"])
    args = cli.build_parser().parse_args(["bench", "-n", "64", "--repeat", "2"])
    assert (args.concurrency, args.repeat) == (64, 2)


def test_a_benchmark_runs_its_script_with_its_arguments(
    capfd: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["bench", "store", "--help"]) == 0
    out = capfd.readouterr().out
    assert out.startswith("usage: bench_store.py") and "--live" in out


def test_rounds_rotate_so_every_arm_runs_in_every_position() -> None:
    kit = _benchkit()
    arms = ("off", "before", "after")
    orders = [kit.rotated(arms, r) for r in range(3)]
    assert orders == [["off", "before", "after"], ["before", "after", "off"],
                      ["after", "off", "before"]]  # fmt: skip
    for position in range(3):
        assert {order[position] for order in orders} == set(arms)


def test_json_names_the_vllm_release_and_the_arguments(tmp_path: pathlib.Path) -> None:
    kit = _benchkit()
    rows = {"a": [{"x": 1.0}, {"x": 3.0}, {"x": 2.0}]}
    path = tmp_path / "out.json"
    kit.write_json(str(path), "demo", {"n": 4}, {"medians": kit.medians(rows["a"], ["x"])})
    written = json.loads(path.read_text())
    assert written["header"]["vllm"] == importlib.metadata.version("vllm")
    assert written["benchmark"] == "demo" and written["args"] == {"n": 4}
    assert written["data"] == {"medians": {"x": 2.0}}
    line = kit.header_line("t", written["header"])
    assert line.startswith(f"t: vLLM {written['header']['vllm']}, Python ")


def test_without_a_checkout_a_benchmark_is_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(toolkit, "SCRIPTS", tmp_path)  # an installed package: no scripts/
    assert cli.main(["bench", "store"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bench_store.py not found" in err and "checkout" in err
