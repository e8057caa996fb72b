"""prime-r3 bench on any supported release: which patches its r3_prime arm runs, and its CLI.

Each release's expectation is stated here and checked against that release's real code
through the same guards apply() runs (no version string is faked).
"""

from __future__ import annotations

import argparse
import io
import pathlib
import tomllib

import pytest

from prime_r3 import cli
from prime_r3.bench import command
from prime_r3.guards import installed_vllm_version
from prime_r3.patches import REGISTRY

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALL = [spec.name for spec in REGISTRY]
STORE = ["store_eviction", "store_headroom", "store_growth"]
#: What the r3_prime arm runs on each supported release.
EXPECTED_APPLIES = {
    "0.31.0": ALL,
    "0.32.0": ALL,
    "0.33.0": [name for name in ALL if name not in STORE],
}


def _bench_args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["bench", *argv])


def test_r3_prime_runs_every_patch_the_installed_release_takes(clean_env) -> None:  # noqa: ANN001
    version, applies, skipped = command.applicable_patches()
    assert version == installed_vllm_version()
    assert version in EXPECTED_APPLIES, f"vllm {version} is not a supported release"
    assert applies == EXPECTED_APPLIES[version]
    assert sorted(skipped) == sorted(set(ALL) - set(applies))
    for name in skipped:  # 0.33: each store patch names the upstream fix
        assert skipped[name] == f"vllm {version} has this fix upstream (fixed upstream in 0.33)"


def test_the_users_patch_selection_does_not_shrink_the_prime_arm(clean_env) -> None:  # noqa: ANN001
    clean_env.setenv("PRIME_R3_PATCHES", "engine_gc")
    clean_env.setenv("PRIME_R3", "0")
    assert command.applicable_patches()[1] == EXPECTED_APPLIES[installed_vllm_version()]


def test_each_means_every_applicable_patch() -> None:
    applies = ["a", "b"]
    assert command._select("each", applies, {"c": "why"}, ["a", "b", "c"]) == ["a", "b"]
    assert command._select("b", applies, {"c": "why"}, ["a", "b", "c"]) == ["b"]
    assert command._select("c", applies, {"c": "why"}, ["a", "b", "c"]).endswith("c (why)")
    assert command._select("b,a,b", applies, {}, ["a", "b"]) == ["b", "a"]  # one arm each


def test_without_adds_one_arm_per_patch_left_out_of_the_rest() -> None:
    from prime_r3.bench import arms as arms_mod

    arms = arms_mod.default_arms(["a", "b", "c"], ["a"], ["b", "c"])
    assert [(arm.name, arm.patches) for arm in arms] == [
        ("r3_off", None),
        ("r3_upstream", None),
        ("r3_prime", ("a", "b", "c")),
        ("r3_prime[a]", ("a",)),
        ("r3_prime[-b]", ("a", "c")),
        ("r3_prime[-c]", ("a", "b")),
    ]
    assert all(arm.r3 for arm in arms[1:])


@pytest.mark.parametrize("flag", ["--patches", "--without"])
def test_a_bad_name_is_a_one_line_error_naming_the_flag(clean_env, capsys, flag) -> None:  # noqa: ANN001
    """Refused before any arm runs, in one line naming the flag, the value and the known
    names (0.31/0.32 take every patch: an unknown name is their only refusal) or, on a
    release that cannot take a patch, why."""
    assert command.main(_bench_args(flag, "engine_gc,bogus")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith(f"prime-r3 bench: {flag} engine_gc,bogus: unknown patch(es) bogus; ")
    assert f"known: {', '.join(ALL)}" in err
    version = installed_vllm_version()
    blocked = [name for name in ALL if name not in EXPECTED_APPLIES[version]]
    if blocked:  # 0.33: a patch fixed upstream can be neither run alone nor left out
        assert command.main(_bench_args(flag, blocked[0])) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0, err
        assert (
            f"{flag} {blocked[0]}: cannot apply to the installed vLLM: "
            f"{blocked[0]} (vllm {version} has this fix upstream" in err
        )


def test_help_shows_the_default_of_every_option() -> None:
    parser = cli.build_parser()
    bench = parser._subparsers._group_actions[0].choices["bench"]  # noqa: SLF001
    text = bench.format_help().replace("\n", " ")
    for action in bench._actions:  # noqa: SLF001
        if action.dest == "help":
            continue
        assert action.help, f"{action.dest} has no help"
        assert "(default:" in bench._get_formatter()._expand_help(action) or (  # noqa: SLF001
            "%(default)" in action.help
        ), action.dest
    assert "(default: 400)" in " ".join(text.split())


class _Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_progress_off_a_terminal_prints_a_few_plain_lines() -> None:
    stream = _Pipe()
    progress = command.Progress(total=3000, stream=stream, every_s=3600)
    for arm in ("r3_off", "r3_upstream", "r3_prime"):
        for _ in range(100):
            progress.update(arm, 10)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    # One line when each arm starts, one at the end; nothing per update.
    assert len(lines) == 4, lines
    assert lines[-1].startswith("prime-r3 bench: r3_prime: 3000/3000 steps")


def test_plot_without_matplotlib_says_how_to_install(clean_env, capsys, monkeypatch) -> None:  # noqa: ANN001
    real = command.importlib.util.find_spec
    monkeypatch.setattr(
        command.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    assert command.main(_bench_args("--plot", "x.png")) == 2
    assert "pip install 'prime-r3[bench]'" in capsys.readouterr().err


@pytest.mark.parametrize("dependency", ["tqdm", "matplotlib"])
def test_bench_only_dependencies_are_an_extra(dependency: str) -> None:
    """An overlay installed into an inference image must not pull matplotlib."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(r.startswith(dependency) for r in project["dependencies"])
    assert any(r.startswith(dependency) for r in project["optional-dependencies"]["bench"])


def test_a_bench_arm_leaves_no_model_directory_behind(
    tmp_path: pathlib.Path, reverted: pytest.MonkeyPatch
) -> None:
    """Every arm of every round builds a vLLM config from a temporary model directory;
    it used to stay in /tmp (thousands on a machine that ran the bench for a while).

    ``reverted``: building the config loads vLLM's general plugins, so prime_r3's plugin
    applies the overlay in this process; what it applied (engine_gc pending import) is
    reverted after, or a later test (test_registry's) finds it in force."""
    monkeypatch = reverted
    import tempfile

    from prime_r3.bench import vllm_setup
    from prime_r3.bench.workload import BenchConfig

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cfg = BenchConfig(concurrency=8, layers=5, topk=3, experts=16)
    vllm_config = vllm_setup.build_vllm_config(cfg, r3=True)
    hf = vllm_config.model_config.hf_config
    assert (hf.num_hidden_layers, hf.num_experts_per_tok, hf.num_local_experts) == (5, 3, 16)
    assert sorted(tmp_path.glob("prime_r3_bench_*")) == []  # (torch may put its own here)


def _fake_result(cpu_s: float, cfg_steps: int) -> dict:
    """The shape ``loop.run`` returns, every phase at ``cpu_s`` per step (for the report)."""
    from prime_r3.bench.loop import PHASES

    per_step = {name: [cpu_s] * cfg_steps for name in (*PHASES, "wall", "cpu")}
    per_step["model"] = per_step["client"] = per_step["writer"] = [0.0] * cfg_steps
    window = {"preemptions": 0, "prefix_hit_tokens": 0, "finished": 0, "evictions": 0}
    return {
        "error": None,
        "per_step": per_step,
        "gc_counts": [[0, 0, 0]] * cfg_steps,
        "window": window,
        "store_slots": 1,
        "store_size": 0,
        "store_peak_referenced": 0,
    }


def test_repeated_rounds_rotate_the_arm_order_and_report_in_display_order(
    clean_env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The last arm of a round ran ~12% slow (sched and transp too): a position effect.

    The arm runner here is a stand-in that charges exactly that (+12% to whichever arm
    runs last in its round, each arm otherwise at its own cost): with one fixed order the
    last arm's median carried it; rotated, each arm is last at most once in three rounds,
    so every median is the arm's own cost. The table lists the arms in the fixed display
    order (r3_off, r3_upstream, r3_prime, then the per-patch arms) whatever order ran.
    """
    from prime_r3.bench import arms as arms_mod

    applies = EXPECTED_APPLIES[installed_vllm_version()]
    per_patch = applies[:2]
    display = [a.name for a in arms_mod.default_arms(applies, per_patch)]
    cost = {name: 1e-3 * (i + 1) for i, name in enumerate(display)}
    orders: list[list[str]] = []

    def run_arms(order, cfg, on_progress=None):  # noqa: ANN001, ANN202
        orders.append([arm.name for arm in order])
        return {
            arm.name: _fake_result(cost[arm.name] * (1.12 if i == len(order) - 1 else 1.0), 20)
            for i, arm in enumerate(order)
        }

    monkeypatch.setattr(arms_mod, "run_arms", run_arms)
    args = ("--patches", ",".join(per_patch), "--repeat", "3", "--no-parity")
    args += ("--steps", "10", "--warmup", "10")
    assert command.main(_bench_args(*args)) == 0
    assert len(orders) == 3
    assert all(sorted(order) == sorted(display) for order in orders)
    assert len({tuple(order) for order in orders}) == 3  # the order varies per round
    lasts = [order[-1] for order in orders]
    assert len(set(lasts)) == 3  # no arm last twice
    firsts = [order[0] for order in orders]
    assert len(set(firsts)) == 3

    out = capsys.readouterr()
    table = out.out.splitlines()
    start = next(i for i, line in enumerate(table) if line.lstrip().startswith("arm "))
    listed = [line.split()[0] for line in table[start + 2 : start + 2 + len(display)]]
    assert listed == display
    for line in table[start + 2 : start + 2 + len(display)]:
        name, _, cpu_ms = line.split()[:3]
        # The median of each arm is its own cost: the +12% of its one last place is gone.
        assert float(cpu_ms) == pytest.approx(cost[name] * 1e3, abs=0.006), line
    for number, order in enumerate(orders, 1):
        assert f"round {number}: {', '.join(order)}" in out.out
        assert f"round {number}: {', '.join(order)}" in out.err  # as each round starts


def test_one_round_runs_the_arms_in_display_order() -> None:
    from prime_r3.bench import arms as arms_mod

    arms = arms_mod.default_arms(["a", "b"], ["a"])
    assert command.arm_orders(arms, 1) == [arms]
    assert command.arm_orders([], 2) == [[], []]


def test_withheld_packed_steps_are_listed_by_reason() -> None:
    """The counts come from packed_outputs' own counter (as an arm's run snapshots it)."""
    from prime_r3.fixes.packed_outputs import handshake_counters

    counters = handshake_counters()
    counters.declared_steps = 7
    for reason in ("take_output", "take_output", "engine_step"):
        counters.add("withheld_reasons", reason, total="withheld_steps")
    results = {"r3_upstream": {"handshake": None}, "r3_prime": {"handshake": counters.snapshot()}}
    assert command._fast_path_lines(results).splitlines() == [
        "fast path vs upstream (first round, measured window):",
        "  r3_prime packed_outputs: 7 steps declared packed / 3 withheld "
        "(engine_step 1, take_output 2)",
    ]


def test_fast_path_counts_are_listed_by_patch() -> None:
    """Each counting patch's line: fast requests, upstream's requests and their reasons,
    from the patch's own counter (as an arm's run snapshots it)."""
    from prime_r3.fixes.batched_commit import Counters

    commit, other = Counters(), Counters()
    commit.add(5, {})
    commit.add(3, {"multi_token": 1})
    other.add(4, {"not_packed": 2})
    fast_path = {"batched_commit": commit.snapshot(), "batched_take": other.snapshot()}
    results = {"r3_prime": {"handshake": None, "fast_path": fast_path}}
    assert command._fast_path_lines(results).splitlines() == [
        "fast path vs upstream (first round, measured window):",
        "  r3_prime batched_commit: 8 fast / 1 upstream requests over 2 steps (multi_token 1)",
        "  r3_prime batched_take: 4 fast / 2 upstream requests over 1 steps (not_packed 2)",
    ]
