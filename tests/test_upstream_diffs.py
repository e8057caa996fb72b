"""patches/: each fix as an upstream-form diff, checked against the installed vLLM and the overlay.

What each release expects (``EXPECTED``): 0.31.0 and 0.32.0 carry one diff per registry
patch that has one (the six fixes, batched_commit, whose diff holds the output worker's
request state in arrays, and the API server's
response_rows, response_b64, response_json and output_turns); 0.33.0 carries the same but the store
patches 03-05, fixed upstream there (the registry says so, and a test ties the two). No
patch is without a diff today (``PENDING``; a record's ``diff_pending`` would say why).
batched_take and packed_hop have no diff of their own: packed_outputs' diff carries
their upstream form (``CARRIED``, the record's ``diff_in``).

The parity tests build one patched copy of the installed ``vllm`` package per session
(hard links, patched files copied; ``scripts/patches.py apply``), then run
``tests/diffs_scenarios.py`` twice in subprocesses: on the overlay (installed vLLM,
every applicable prime_r3 patch applied) and on the diffs (``PRIME_R3=0``, the patched
copy first on ``sys.path``). The scenarios drive vLLM's real code through the project's
parity harnesses; here the two runs must agree. Those tests, and the upstream-form
worker runs, are marked ``tree_parity`` (CI runs them on the default release only).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from prime_r3 import guards
from prime_r3.patches import REGISTRY

ROOT = Path(__file__).resolve().parents[1]
ALL = [
    "engine_gc",
    "packed_outputs",
    "store_eviction",
    "store_headroom",
    "store_growth",
    "batched_commit",
    "response_rows",
    "response_b64",
    "response_json",
    "output_turns",
]
EXPECTED = {
    "0.31.0": ALL,
    "0.32.0": ALL,
    "0.33.0": [
        "engine_gc",
        "packed_outputs",
        "batched_commit",
        "response_rows",
        "response_b64",
        "response_json",
        "output_turns",
    ],
}
SCENARIO_TIMEOUT = 900


def _load_script() -> Any:
    spec = importlib.util.spec_from_file_location(
        "diffs_patches_script", ROOT / "scripts/patches.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


patches = _load_script()
SITE = patches.installed_site()
RELEASE = patches.installed_release()


# -- the series and the registry ------------------------------------------------------------


def test_every_supported_release_has_its_series() -> None:
    releases = sorted(p.name.removeprefix("vllm-") for p in (ROOT / "patches").glob("vllm-*"))
    assert releases == sorted(EXPECTED)
    assert RELEASE in EXPECTED, f"no diffs for the installed vLLM {RELEASE}"


@pytest.mark.parametrize("release", sorted(EXPECTED))
def test_one_diff_per_applicable_registry_patch(release: str) -> None:
    diffs = patches.series(release)
    assert [d.name for d in diffs] == EXPECTED[release]
    assert patches.registry_names(release) == EXPECTED[release]
    assert patches.registry_mismatch(release, diffs) == []
    # Numbered by registry position (a pending patch keeps its number free).
    registry = [spec.name for spec in REGISTRY]
    assert [d.order for d in diffs] == [registry.index(d.name) + 1 for d in diffs]
    for diff in diffs:
        text = diff.path.read_text()
        assert f"prime_r3 registry patch: {diff.name} " in text  # the header names it
        assert f"(vLLM {release})" in text.splitlines()[0]
        assert all(f.startswith("vllm/") for f in diff.files)


#: Registry patches with no diff yet, per release (their record's ``diff_pending`` says
#: why): none today (batched_commit was pending on 0.33.0 until ported,
#: the API server's response patches until their diffs were written).
PENDING: dict[str, list[str]] = {release: [] for release in EXPECTED}
#: Registry patches whose upstream form is part of another patch's diff (``diff_in``).
CARRIED = {"batched_take": "packed_outputs", "packed_hop": "packed_outputs"}
REGISTRY_BY_NAME = {spec.name: spec for spec in REGISTRY}


@pytest.mark.parametrize("release", sorted(EXPECTED))
def test_patches_without_a_diff_are_named_in_their_record(release: str) -> None:
    """A patch may only go without a diff where its record says so, with a reason; the
    check then lists it, so the overlay-only fixes are visible, not silently missing."""
    pending = patches.registry_pending(release)
    assert sorted(pending) == sorted(PENDING[release])
    assert all(len(why) > 20 for why in pending.values())
    assert not set(pending) & {d.name for d in patches.series(release)}


@pytest.mark.parametrize("release", sorted(EXPECTED))
def test_patches_carried_by_another_diff_are_named_in_their_record(release: str) -> None:
    """batched_take's upstream form is packed_outputs' take_output: it has no diff of
    its own, its record names the diff that carries it, and the check lists it there."""
    assert patches.registry_carried(release) == CARRIED
    names = [d.name for d in patches.series(release)]
    assert all(carrier in names for carrier in CARRIED.values())
    assert not set(CARRIED) & set(names)
    assert not set(CARRIED) & set(patches.registry_pending(release))


def test_a_diff_for_a_carried_patch_or_a_missing_carrier_is_reported(tmp_path: Path) -> None:
    series_dir = tmp_path / "vllm-0.32.0"
    shutil.copytree(ROOT / "patches/vllm-0.32.0", series_dir)
    shutil.copy(series_dir / "05-store_growth.patch", series_dir / "07-batched_take.patch")
    problems = patches.registry_mismatch("0.32.0", patches.series("0.32.0", tmp_path))
    assert problems == [
        "diff 07-batched_take.patch exists but the registry says the packed_outputs diff carries it"
    ]
    (series_dir / "07-batched_take.patch").unlink()
    # Without 02, so without the diff that requires it (06).
    for name in ("02-packed_outputs", "06-batched_commit"):
        (series_dir / f"{name}.patch").unlink()
    problems = patches.registry_mismatch("0.32.0", patches.series("0.32.0", tmp_path))
    assert problems == [
        "registry patch 'packed_outputs' applies to 0.32.0 but has no diff",
        "registry patch 'batched_commit' applies to 0.32.0 but has no diff",
        "registry patch 'batched_take' is carried by the packed_outputs diff, which 0.32.0 lacks",
        "registry patch 'packed_hop' is carried by the packed_outputs diff, which 0.32.0 lacks",
    ]


def test_a_diff_pending_for_one_release_only_is_reported_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A record pending for one release (``(release, reason)`` pairs, as batched_commit's
    was for 0.33.0 before its port): that release's diff is reported, the others' not."""
    import prime_r3.patches

    reason = "its upstream form is not ported to 0.33.0 yet (a test's record)"
    registry = tuple(
        dataclasses.replace(spec, diff_pending=(("0.33.0", reason),))
        if spec.name == "batched_commit"
        else spec
        for spec in REGISTRY
    )
    monkeypatch.setattr(prime_r3.patches, "REGISTRY", registry)
    assert patches.registry_pending("0.33.0") == {"batched_commit": reason}
    assert patches.registry_pending("0.32.0") == {}
    problems = patches.registry_mismatch("0.33.0", patches.series("0.33.0"))
    assert problems == [
        f"diff 06-batched_commit.patch exists but the registry says it has none yet: {reason}"
    ]
    assert patches.registry_mismatch("0.32.0", patches.series("0.32.0")) == []


def test_store_patches_are_fixed_upstream_in_033() -> None:
    for spec in REGISTRY:
        reason = guards.check_version(spec, "0.33.0")
        if (
            spec.name in EXPECTED["0.33.0"]
            or spec.name in PENDING["0.33.0"]
            or spec.name in CARRIED
        ):
            assert reason is None
        else:
            assert reason is not None and "fixed upstream" in reason, spec.name


def test_a_missing_or_extra_diff_is_reported(tmp_path: Path) -> None:
    series_dir = tmp_path / "vllm-0.32.0"
    shutil.copytree(ROOT / "patches/vllm-0.32.0", series_dir)
    (series_dir / "03-store_eviction.patch").unlink()
    shutil.copy(series_dir / "05-store_growth.patch", series_dir / "13-store_shrink.patch")
    problems = patches.registry_mismatch("0.32.0", patches.series("0.32.0", tmp_path))
    assert problems == [
        "registry patch 'store_eviction' applies to 0.32.0 but has no diff",
        "diff 13-store_shrink.patch has no registry patch that applies to 0.32.0",
    ]


def _with_header_line(path: Path, line: str) -> None:
    head, body = path.read_text().split("\n--- a/", 1)
    path.write_text(f"{head}\n{line}\n--- a/{body}")


@pytest.mark.parametrize(
    "requires",
    ["Requires: 02-packed_outputs.patch", "Requires: packed_outputs", "Requires:"],
)
def test_a_malformed_requirement_is_refused(tmp_path: Path, requires: str) -> None:
    series_dir = tmp_path / "vllm-0.32.0"
    shutil.copytree(ROOT / "patches/vllm-0.32.0", series_dir)
    _with_header_line(series_dir / "05-store_growth.patch", requires)
    with pytest.raises(patches.PatchError, match="Requires: .* is not a diff name"):
        patches.series("0.32.0", tmp_path)


@pytest.mark.parametrize(
    ("requires", "why"),
    [("03-store_shrink", "not in its series"), ("06-batched_commit", "comes later")],
)
def test_a_missing_or_later_requirement_is_refused(tmp_path: Path, requires: str, why: str) -> None:
    series_dir = tmp_path / "vllm-0.32.0"
    shutil.copytree(ROOT / "patches/vllm-0.32.0", series_dir)
    _with_header_line(series_dir / "05-store_growth.patch", f"Requires: {requires}")
    expected = f"05-store_growth.patch requires {requires}.*{why}"
    with pytest.raises(patches.PatchError, match=expected):
        patches.series("0.32.0", tmp_path)
    cli = [sys.executable, str(ROOT / "scripts/patches.py"), "check"]
    # The CLI reads the repository's series, which stays well-formed.
    assert subprocess.run(cli, capture_output=True, text=True, check=False).returncode == 0


@pytest.mark.parametrize("release", sorted(EXPECTED))
def test_requirements_are_declared_where_a_diff_needs_them(release: str) -> None:
    """06 is written on top of 02 (the packed output type); the rest stand alone.
    ``with_requirements`` orders what one diff needs before it."""
    diffs = patches.series(release)
    requires = {d.name: d.requires for d in diffs if d.requires}
    if "batched_commit" in EXPECTED[release]:
        assert requires == {"batched_commit": ("02-packed_outputs",)}
        commit = next(d for d in diffs if d.name == "batched_commit")
        assert [d.name for d in patches.with_requirements(commit, diffs)] == [
            "packed_outputs",
            "batched_commit",
        ]
    else:
        assert requires == {}


# -- applying to the installed release --------------------------------------------------------


def test_diffs_apply_cleanly_to_the_installed_release() -> None:
    found = patches.status(SITE, RELEASE)
    assert (found.state, found.problems) == ("pristine", [])


def test_each_diff_also_applies_alone(tmp_path: Path) -> None:
    """Like PRIME_R3_PATCHES for the overlay, any one fix can be built in by itself,
    together with the diffs it declares it is written on top of (``Requires:``)."""
    diffs = patches.series(RELEASE)
    for diff in diffs:
        needed = patches.with_requirements(diff, diffs)
        work = tmp_path / diff.name
        for file in {f for d in needed for f in d.files}:
            (work / file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(SITE / file, work / file)
        for each in needed:
            patches._run_patch(each, work)


def test_a_diff_that_needs_another_does_not_apply_without_it(tmp_path: Path) -> None:
    """The ``Requires:`` lines are needed: 06 does not apply to the release's files."""
    needing = [d for d in patches.series(RELEASE) if d.requires]
    if "batched_commit" not in EXPECTED[RELEASE]:
        assert needing == []
        pytest.skip(f"no diff of vLLM {RELEASE} requires another")
    for diff in needing:
        work = tmp_path / diff.name
        for file in diff.files:
            (work / file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(SITE / file, work / file)
        with pytest.raises(patches.PatchError, match="does not apply"):
            patches._run_patch(diff, work)


@pytest.fixture(scope="session")
def patched_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One patched copy of the installed vllm package per session."""
    return patches.apply(SITE, RELEASE, tmp_path_factory.mktemp("patched_vllm"))


def test_patched_tree_carries_the_series_and_the_install_is_untouched(patched_tree: Path) -> None:
    assert patches.status(patched_tree, RELEASE).state == "applied"
    assert patches.status(SITE, RELEASE).state == "pristine"
    for diff in patches.series(RELEASE):
        for file in diff.files:
            assert not os.path.samefile(SITE / file, patched_tree / file)


def test_check_fails_loudly_when_upstream_moves(tmp_path: Path) -> None:
    diffs = patches.series(RELEASE)
    moved = diffs[-1].files[0]
    for file in {f for d in diffs for f in d.files}:
        (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SITE / file, tmp_path / file)
    with (tmp_path / moved).open("a") as handle:
        handle.write("\n# upstream changed this file\n")
    found = patches.status(tmp_path, RELEASE)
    assert found.state == "moved"
    assert len(found.problems) == 1 and found.problems[0].startswith(f"{moved}: sha256 ")
    with pytest.raises(patches.PatchError, match="moved"):
        patches.apply(tmp_path, RELEASE, tmp_path / "out")
    cli = [sys.executable, str(ROOT / "scripts/patches.py"), "check", "--site", str(tmp_path)]
    result = subprocess.run(cli, capture_output=True, text=True, check=False)
    assert result.returncode == 1 and moved in result.stdout and "moved" in result.stdout


def test_check_cli_on_the_installed_tree() -> None:
    cli = [sys.executable, str(ROOT / "scripts/patches.py"), "check"]
    result = subprocess.run(cli, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert f"vLLM {RELEASE} at {SITE}: pristine" in result.stdout
    for diff in patches.series(RELEASE):
        assert diff.path.name in result.stdout
    for name, carrier in CARRIED.items():
        diff = next(d for d in patches.series(RELEASE) if d.name == carrier)
        assert f"{name:28} in {diff.path.name} (part of the {carrier} diff)" in result.stdout


# -- changes to vLLM's own tests, carried in the diffs --------------------------------------

#: diff -> the vLLM test files it changes, per release: 06 changes the line of
#: test_store.py's _make_worker that builds the worker's request state by hand; 09 the
#: lines of test_output_processor.py that build a RequestState's routed experts by hand
#: (``__new__``, then ``routed_experts_chunks = []``) or append to them.
TEST_CHANGES = {
    release: {
        "batched_commit": ["tests/distributed/aux_output_connector/test_store.py"],
        "response_rows": ["tests/v1/engine/test_output_processor.py"],
    }
    for release in EXPECTED
}
#: 09's test lines: the import, each hand-built state (one in 0.31's tests, three
#: later), then the two appends of test_routed_experts_are_accumulated_until_finish.
_ROWS_BUILT = [
    "-    state.routed_experts_chunks = []",
    "+    state.routed_experts_rows = RoutedExpertsRows()",
]
_ROWS_APPENDS = [
    f"{sign}    state.routed_experts_{name}.append({chunk}_chunk)"
    for chunk in ("prompt", "decode")
    for sign, name in (("-", "chunks"), ("+", "rows"))
]
ROWS_TEST_LINES = {
    "0.31.0": ["+    RoutedExpertsRows,", *_ROWS_BUILT, *_ROWS_APPENDS],
    "0.32.0": ["+    RoutedExpertsRows,", *_ROWS_BUILT * 2, *_ROWS_APPENDS, *_ROWS_BUILT],
}
ROWS_TEST_LINES["0.33.0"] = ROWS_TEST_LINES["0.32.0"]


def _test_lines(diff: Any) -> list[str]:
    """The changed lines of the diff's test part."""
    part = diff.part(tests=True).split("\n--- a/", 1)
    return [
        line
        for line in (part[1].splitlines() if len(part) > 1 else [])
        if line[:1] in ("+", "-") and not line.startswith(("+++ ", "--- "))
    ]


@pytest.mark.parametrize("release", sorted(EXPECTED))
def test_test_changes_are_named_and_loosen_no_assertion(release: str) -> None:
    """A diff changes vLLM's tests only where they build or read an internal the fix
    changes: the listed files, and no changed line asserts, raises, skips or xfails."""
    diffs = patches.series(release)
    assert {d.name: d.test_files for d in diffs if d.test_files} == TEST_CHANGES[release]
    for diff in diffs:
        lines = _test_lines(diff)
        assert bool(lines) == bool(diff.test_files), diff.name
        for line in lines:
            assert not re.search(r"\bassert|pytest\.(raises|skip|xfail|mark)|\bdel\b", line), (
                diff.name,
                line,
            )
    by_name = {d.name: d for d in diffs}
    assert _test_lines(by_name["batched_commit"]) == [
        "+    _WorkerRequests,",
        "-    worker._requests = {}",
        "+    worker._requests = _WorkerRequests()",
    ]
    assert _test_lines(by_name["response_rows"]) == ROWS_TEST_LINES[release]


def test_the_installed_tree_ignores_a_diffs_test_part() -> None:
    """status/apply on the installed package (no tests/): the package part alone."""
    diffs = [d for d in patches.series(RELEASE) if d.test_files]
    for diff in diffs:
        part = diff.part(tests=False)
        assert "+++ b/tests/" not in part and "+++ b/vllm/" in part
        assert diff.part(tests=True).count("+++ b/") == len(diff.test_files)
        assert set(diff.files).isdisjoint(diff.test_files)


def _fake_release(tmp_path: Path, test_source: str) -> tuple[Path, Path, Path]:
    """A site with vllm/x.py, a sdist with tests/test_x.py, and one diff changing both."""
    site, sdist, series_dir = tmp_path / "site", tmp_path / "sdist", tmp_path / "p/vllm-0.32.0"
    (site / "vllm").mkdir(parents=True)
    (sdist / "tests").mkdir(parents=True)
    series_dir.mkdir(parents=True)
    (site / "vllm/x.py").write_text("a = 1\n")
    (sdist / "tests/test_x.py").write_text(test_source)
    (sdist / "tests/test_y.py").write_text("untouched = True\n")
    digest = {f: hashlib.sha256(p.read_bytes()).hexdigest() for f, p in [
        ("vllm/x.py", site / "vllm/x.py"),
        ("tests/test_x.py", sdist / "tests/test_x.py"),
    ]}  # fmt: skip
    (series_dir / "01-engine_gc.patch").write_text(
        "[x] a fix (vLLM 0.32.0)\n\n"
        f"Source-sha256: {digest['vllm/x.py']}  vllm/x.py\n"
        f"Source-sha256: {digest['tests/test_x.py']}  tests/test_x.py\n\n"
        "--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1 +1 @@\n-a = 1\n+a = 2\n"
        "--- a/tests/test_x.py\n+++ b/tests/test_x.py\n@@ -1 +1 @@\n-built = {}\n"
        "+built = Built()\n"
    )
    return site, sdist, tmp_path / "p"


def test_apply_with_tests_writes_the_changed_tests_beside_the_package(tmp_path: Path) -> None:
    site, sdist, patches_dir = _fake_release(tmp_path, "built = {}\n")
    assert patches.status(site, "0.32.0", patches_dir).state == "pristine"
    out = patches.apply(site, "0.32.0", tmp_path / "out", patches_dir, tests_from=sdist)
    assert (out / "vllm/x.py").read_text() == "a = 2\n"
    assert (out / "tests/test_x.py").read_text() == "built = Built()\n"
    assert (out / "tests/test_y.py").read_text() == "untouched = True\n"
    assert (sdist / "tests/test_x.py").read_text() == "built = {}\n"  # sdist untouched
    assert (site / "vllm/x.py").read_text() == "a = 1\n"
    assert patches.status(out, "0.32.0", patches_dir).state == "applied"
    # Without --tests: the package part only, no tests/ written.
    plain = patches.apply(site, "0.32.0", tmp_path / "plain", patches_dir)
    assert (plain / "vllm/x.py").read_text() == "a = 2\n" and not (plain / "tests").exists()


def test_apply_with_tests_refuses_another_releases_tests(tmp_path: Path) -> None:
    site, sdist, patches_dir = _fake_release(tmp_path, "built = {}\n")
    (sdist / "tests/test_x.py").write_text("built = {}  # changed\n")
    with pytest.raises(patches.PatchError, match=r"tests/test_x.py \(sha256 .*diffs want"):
        patches.apply(site, "0.32.0", tmp_path / "out", patches_dir, tests_from=sdist)


def test_a_diff_outside_vllm_and_tests_is_refused(tmp_path: Path) -> None:
    series_dir = tmp_path / "vllm-0.32.0"
    series_dir.mkdir()
    (series_dir / "01-engine_gc.patch").write_text(
        f"x\n\nSource-sha256: {'0' * 64}  vllm/x.py\n\n"
        "--- a/setup.py\n+++ b/setup.py\n@@ -1 +1 @@\n-a\n+b\n"
    )
    with pytest.raises(
        patches.PatchError, match=r"touches \['setup.py'\], outside vllm/ and tests/"
    ):
        patches.series("0.32.0", tmp_path)


# -- parity: the patched tree (overlay off) against the overlay --------------------------------


def _run_scenarios(mode: str, out: Path, patched: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PRIME_R3", "VLLM_GC_"))}
    env.pop("VLLM_AUX_OUTPUT_STORE_HEADROOM", None)
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env["VLLM_LOGGING_LEVEL"] = "ERROR"  # growth warnings would bury a failure's traceback
    path = [str(ROOT)]
    if mode == "diffs":
        env["PRIME_R3"] = "0"
        path.insert(0, str(patched))
    env["PYTHONPATH"] = os.pathsep.join(path)
    command = [sys.executable, "-m", "tests.diffs_scenarios", mode, str(out), "--site", str(SITE)]
    command += ["--patched", str(patched)]
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.fixture(scope="session")
def results(patched_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both runs, side by side (started together: each is mostly its own imports)."""
    tmp = tmp_path_factory.mktemp("scenarios")
    runs = {
        mode: _run_scenarios(mode, tmp / f"{mode}.pickle", patched_tree)
        for mode in ("overlay", "diffs")
    }
    found = {}
    for mode, process in runs.items():
        output, _ = process.communicate(timeout=SCENARIO_TIMEOUT)
        assert process.returncode == 0, f"{mode} scenarios failed:\n{output[-6000:]}"
        found[mode] = pickle.loads((tmp / f"{mode}.pickle").read_bytes())
        print(f"{mode} scenarios, seconds: {found[mode]['meta']['seconds']}")
    return found


def _applies(name: str) -> bool:
    return name in EXPECTED[RELEASE]


def _pair(results: dict[str, Any], scenario: str, patch: str) -> tuple[Any, Any]:
    overlay, diffs = results["overlay"][scenario], results["diffs"][scenario]
    if not _applies(patch):
        assert overlay == diffs == {"not_applicable": patch}
        pytest.skip(f"{patch} is fixed upstream in vLLM {RELEASE}: no diff, no overlay")
    return overlay, diffs


@pytest.mark.tree_parity
def test_the_runs_used_the_intended_trees(results: dict[str, Any], patched_tree: Path) -> None:
    overlay, diffs = results["overlay"]["meta"], results["diffs"]["meta"]
    assert overlay["applied"] == sorted(EXPECTED[RELEASE] + PENDING[RELEASE] + list(CARRIED))
    assert Path(overlay["vllm_file"]).is_relative_to(SITE)
    assert diffs["applied"] == []
    assert Path(diffs["vllm_file"]).is_relative_to(patched_tree)


@pytest.mark.tree_parity
def test_store_victims_and_growth_match(results: dict[str, Any]) -> None:
    """store_harness.run_sequence: every op checked against the release's own store."""
    overlay, diffs = _pair(results, "store_sequences", "store_growth")
    assert diffs["per_seed"] == overlay["per_seed"]
    no_room = sum(c["no_room"] for c in diffs["per_seed"])
    assert no_room > 50 and sum(c["grown"] for c in diffs["per_seed"]) == no_room


@pytest.mark.tree_parity
def test_store_pile_up_rotation_matches(results: dict[str, Any]) -> None:
    """The whole LRU (referenced keys' positions too) after a pile-up, pass and release."""
    overlay, diffs = _pair(results, "store_pile_up", "store_eviction")
    assert diffs == overlay
    first = diffs["states"][0]
    assert not first[0][0].startswith("r")  # the referenced pile-up left the front
    assert [k for k, _ in first[-800:]] == [f"r{i}" for i in range(800)]


@pytest.mark.tree_parity
def test_headroom_sizing_matches(results: dict[str, Any]) -> None:
    overlay, diffs = _pair(results, "headroom", "store_headroom")
    assert diffs["sizes"] == overlay["sizes"]
    # 10 KV blocks x 2 hashes per block: 20 objects upstream, 40 by default here.
    assert diffs["sizes"][(None, None, 10)][0] == 40
    assert diffs["sizes"][("1.5", None, 7)][0] == 21
    assert diffs["sizes"][(None, 1000, 10)][0] == 1000 // diffs["sizes"][(None, 1000, 10)][1]
    assert diffs["rejected"] == overlay["rejected"] == dict.fromkeys(diffs["rejected"], True)
    assert diffs["grown"] == overlay["grown"]
    slots, grown_slots, _, _ = diffs["grown"]
    assert slots == 8 and grown_slots == 2 * slots + 3  # max(needed, 2x)


def _outcomes(report: list[tuple[Any, Any]]) -> list[Any]:
    return [outcome for outcome, _ in report]


@pytest.mark.tree_parity
def test_packed_rows_match_through_the_real_worker_and_take_output(results: dict[str, Any]) -> None:
    overlay, diffs = _pair(results, "packed_worker", "packed_outputs")
    assert len(diffs["steps"]) == len(overlay["steps"]) == len(overlay["upstream"])
    for ours, theirs, upstream in zip(
        diffs["steps"], overlay["steps"], overlay["upstream"], strict=True
    ):
        assert ours["type"] == "vllm.distributed.aux_output_connector.connector.PackedAuxOutputs"
        assert ours["ids"] == theirs["ids"] == upstream["ids"]
        for transport in ("direct", "pickled"):
            assert _outcomes(ours[transport]) == _outcomes(theirs[transport])
            assert _outcomes(ours[transport]) == _outcomes(upstream[transport])
            for (_, kept), (_, kept_upstream) in zip(
                ours[transport], upstream[transport], strict=True
            ):
                if kept_upstream is None:
                    continue
                # Rows own no more memory than upstream's, and are writable where it is.
                assert kept[0] <= kept_upstream[0]
                assert kept[1] or not kept_upstream[1]


@pytest.mark.tree_parity
def test_packed_rows_match_through_the_message_queue(results: dict[str, Any]) -> None:
    overlay, diffs = _pair(results, "packed_message_queue", "packed_outputs")
    assert len(diffs["reports"]) == 2 * (4 + 5)  # 4 generated steps, 5 worker steps, twice
    for ours, theirs in zip(diffs["reports"], overlay["reports"], strict=True):
        # Same rows, and each result pins what the overlay's does (batched_take there:
        # its request's own array), writable.
        assert ours == theirs
        for outcome, kept in ours:
            if outcome[0] == "rows":
                assert kept[0] >= len(outcome[3]) and kept[1]


TAKE_MEMORY_N = 400


@pytest.mark.tree_parity
def test_a_taken_step_holds_its_rows_once_as_on_the_overlay(results: dict[str, Any]) -> None:
    """batched_take's upstream form, in 02's take_output: a received step taken request
    by request gives upstream's rows (the release's take_output on upstream's dict), each
    result is its request's own array (all its rows) or a view of it (fewer), pinning
    that request's rows only, as on the overlay; from the first take on the step holds
    its rows once (plus its int64 starts and offsets), and the step with every result
    kept holds no more than upstream's dict with its results. Before, 02's take returned
    a copy and the step kept its packed rows: with the results kept, about twice
    upstream's bytes on a decode step."""
    overlay, diffs = _pair(results, "packed_take_memory", "packed_outputs")
    hops = {(hop, kind) for hop in ("mq", "ray") for kind in ("decode", "mixed")}
    assert diffs.keys() == overlay.keys() == hops
    allowance = 8 * (2 * TAKE_MEMORY_N + 1)
    for key, ours in diffs.items():
        theirs = overlay[key]
        assert ours["results"] == theirs["results"], key
        for same, shape, dtype, _, pinned, pinned_upstream, writable in ours["results"]:
            assert same and shape and dtype and writable, key
            assert pinned <= pinned_upstream, key
        assert {kind for _, _, _, kind, *_ in ours["results"]} == {"array", "view"}, key
        assert ours["upstream_held"] >= ours["row_bytes"]
        assert ours["held"] == theirs["held"], key
        assert all(held <= ours["upstream_held"] + allowance for held in ours["held"]), key
        assert ours["with_results"] <= ours["upstream_with_results"] + allowance, key
        assert ours["packed_rows_dropped"] and theirs["packed_rows_dropped"], key
        assert ours["repickled_same_rows"] and theirs["repickled_same_rows"], key


@pytest.mark.tree_parity
def test_ray_detach_matches(results: dict[str, Any]) -> None:
    overlay, diffs = _pair(results, "ray_detach", "packed_outputs")
    if RELEASE == "0.33.0":
        assert diffs == overlay == {"skipped": "this vLLM has no Ray zero-copy detach"}
        return
    assert "skipped" not in diffs, diffs
    assert _outcomes(diffs["report"]) == _outcomes(overlay["report"])


@pytest.mark.tree_parity
def test_gc_thresholds_match(results: dict[str, Any]) -> None:
    """Worker warm-ups, EngineCore freezes and shutdowns, the API server: same thresholds."""
    overlay, diffs = _pair(results, "gc", "engine_gc")
    assert "set_gc_thresholds(engine=True)" in diffs["engine_core_segment"]
    assert diffs["trace"] == overlay["trace"]  # step, thresholds, freezes so far
    steps = {step: thresholds for step, thresholds, _ in diffs["trace"]}
    ours, cpython = (50_000, 20, 100), (700, 10, 10)
    assert steps["defaults: worker warm-up"] == ours
    assert steps["defaults: worker re-warm-up after the user changed thresholds"] == (1234, 5, 6)
    assert steps["defaults: EngineCore A: shutdown, B still running"] == ours
    assert steps["defaults: EngineCore A: shutdown again"] == ours
    assert steps["defaults: EngineCore B: shutdown, the last one"] == cpython
    assert steps["defaults: EngineCore C: shutdown after the user changed thresholds"] == (
        1111,
        2,
        3,
    )
    assert steps["defaults: API server lifespan"] == cpython
    assert steps["40000,15,90 and API server: API server lifespan"] == (40_000, 15, 90)
    freezes = [f for _, _, f in diffs["trace"][:9]]
    assert freezes == [1, 2, 3, 4, 4, 4, 4, 5, 6]  # upstream's freezes only, none added

    def accepted(values: dict[str, Any]) -> dict[str, bool]:
        return {k: not str(v).startswith("rejected") for k, v in values.items()}

    # The same values are accepted and rejected (naming the variable), except the empty
    # value: the overlay reads it as unset (its defaults), the diff as "keep CPython's".
    common = [v for v in diffs["values"] if v != ""]
    assert {v: accepted(diffs["values"])[v] for v in common} == {
        v: accepted(overlay["values"])[v] for v in common
    }
    rejected = [v for v, ok in accepted(diffs["values"]).items() if not ok]
    assert "2147483648,1,1" in rejected and "-1,2,3" in rejected
    for value in rejected:
        assert diffs["values"][value] == overlay["values"][value]
        assert diffs["values"][value] == "rejected: names the variable: True"
    before, after = diffs["values"][""]
    assert before == after  # empty: CPython's thresholds kept
    assert diffs["values"]["50_000,20,100"][1] == (50_000, 20, 100)


@pytest.mark.tree_parity
def test_overlay_skips_every_patch_on_the_patched_tree(results: dict[str, Any]) -> None:
    """Installing prime_r3 into an image built with the diffs cannot apply a fix twice."""
    outcomes = results["diffs"]["meta"]["overlay_if_enabled"]
    for name in EXPECTED[RELEASE] + list(CARRIED):  # batched_take: 02 rewrote take_output
        state, reason = outcomes[name]
        assert state == "skipped" and reason.startswith("target source changed"), (name, reason)


# -- parity: the upstream-form worker connector against the installed release's -----------

#: tests/test_batched_commit.py's differential workload: 200 seeds x 300 steps (two
#: processes of 100 seeds), then 8 seeds x 150 steps at block sizes 1, 2, 3 and 8 with
#: roomy pools and pools of 5 and 9 free slots that run dry.
UPSTREAM_FORM_RUNS = {
    "ci_0": ("ci", "0:100", 300),
    "ci_1": ("ci", "100:200", 300),
    "small": ("small", "0:8", 150),
    "crafted": ("crafted", "0:0", 0),
}
UPSTREAM_FORM_TIMEOUT = 2400


@pytest.fixture(scope="session")
def upstream_form(patched_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """tests/upstream_form_parity.py runs (the patched tree's connector against the
    installed one), two at a time."""
    if "batched_commit" not in EXPECTED[RELEASE]:
        pytest.skip(f"no upstream-form diff of batched_commit for vLLM {RELEASE} yet")
    tmp = tmp_path_factory.mktemp("upstream_form")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PRIME_R3", "VLLM_GC_"))}
    env.update(PRIME_R3="0", VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="ERROR")
    env["PYTHONPATH"] = os.pathsep.join([str(patched_tree), str(ROOT)])
    found: dict[str, Any] = {}
    names = list(UPSTREAM_FORM_RUNS)
    for pair in (names[:2], names[2:]):
        running = {}
        for name in pair:
            shapes, seeds, steps = UPSTREAM_FORM_RUNS[name]
            command = [sys.executable, "-m", "tests.upstream_form_parity", str(tmp / name)]
            command += ["--site", str(SITE), "--shapes", shapes, "--seeds", seeds]
            command += ["--steps", str(steps)]
            running[name] = subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        for name, process in running.items():
            output, _ = process.communicate(timeout=UPSTREAM_FORM_TIMEOUT)
            assert process.returncode == 0, f"{name} differs:\n{output[-6000:]}"
            found[name] = pickle.loads((tmp / name).read_bytes())
    return found


@pytest.mark.tree_parity
def test_upstream_form_worker_matches_the_installed_one(
    upstream_form: dict[str, Any], patched_tree: Path
) -> None:
    """06's connector against the release's own (tests/batched_harness.py, every step:
    outputs, take_output bytes, errors, worker state and slots, store calls and store),
    with both its paths driven: decode runs committed at once and the loop body."""
    ci = [upstream_form["ci_0"], upstream_form["ci_1"]]
    for run in [*ci, upstream_form["small"]]:
        assert Path(run["patched_file"]).is_relative_to(patched_tree)
        assert Path(run["pristine_file"]).is_relative_to(SITE)
        assert run["paths"]["decodes_at_once"] > 0 and run["paths"]["loop_captures"] > 0
    assert sum(run["episodes"] for run in ci) == 200
    steps = sum(run["steps"] for run in ci)
    assert steps > 200 * 300 // 2 and sum(run["checks"] for run in ci) > steps
    from tests.batched_harness import CASES  # imports vLLM: only where it is needed

    seen = {case: sum(run["seen"].get(case, 0) for run in ci) for case in CASES}
    assert all(seen.values()), seen
    # 0.33's begin_step retains and releases the keys of the block hashes its metadata
    # carries (in the namespace it leaves, at a generation change): the scheduler model
    # sends them there, and only there (older metadata has no such fields).
    kv_cases = ("retained_block_hashes", "released_block_hashes", "released_at_generation_change")
    for run in [*ci, upstream_form["small"]]:
        kv = [run["seen"].get(case, 0) for case in kv_cases]
        assert all(kv) if RELEASE == "0.33.0" else not any(kv), (RELEASE, kv)
    # The dry pools end episodes on upstream's error, raised alike on both sides.
    small = upstream_form["small"]
    assert small["episodes"] == 8 * 12
    assert small["ends"].get(("AssertionError", "auxiliary output block pool is exhausted"), 0)


@pytest.mark.tree_parity
def test_upstream_form_worker_matches_on_steps_the_workload_never_makes(
    upstream_form: dict[str, Any],
) -> None:
    """Crafted steps, each compared on both sides (error, outputs, worker state)."""
    ends = upstream_form["crafted"]
    assert ends["emit_ahead"][0] == (
        "AssertionError",
        "auxiliary output Scheduler emit cursor moved ahead",
    )
    assert "n1" in ends["emit_ahead"][1][1] and "n2" not in ends["emit_ahead"][1][1]
    assert ends["unknown_in_prepare"][0] == ("KeyError", "'x'")
    assert ends["repeated"][0] == ("AssertionError", "auxiliary output capture moved backwards")
    outputs, state = ends["mixed_then_teardown"]
    assert [request_id for request_id, *_ in outputs] == ["a", "c", "b"]
    assert "a" not in state[1]  # torn down by the step that covered it
    # A one-token request past the step's rows is no plain decode: the loop body slices
    # nothing for it and the next request's negative count raises, as upstream's does.
    assert ends["decode_past_rows"][0] == (
        "AssertionError",
        "auxiliary output request token count must be positive",
    )
    # Decode blocks completed before their keys: every third request had its key and
    # published the block; the others hold one block each until the next begin_step.
    outputs, state = ends["decode_7"]
    assert len(outputs) == 48
    held = {request_id: len(fields[1]) for request_id, fields in state[1].items()}
    assert held == {f"r{index}": int(index % 3 != 0) for index in range(48)}
    _, state = ends["keys_after_blocks"]
    assert not any(fields[1] for fields in state[1].values())
    # A worker row reused after a torn-down request's tail: the newcomer's decode opens
    # its own tail (token 4, one row); the other request's completed block waits for its key.
    outputs, state = ends["row_reused"]
    assert [(request_id, start) for request_id, start, *_ in outputs] == [("b", 3), ("c", 4)]
    assert state[1]["c"][-1][:2] == (4, 1) and "a" not in state[1]
    assert len(state[1]["b"][1]) == 1 and state[1]["b"][-1] is None
    # A request torn down between begin_step and prepare_output is unknown to
    # prepare_output, as upstream's lookup finds.
    assert "a" not in ends["freed_before_prepare"][1][1]
    assert ends["batch_row_freed"][0] == ("KeyError", "'a'")
    # A block whose key came with a begin_step that then raised is published by the next
    # commit's visit to its request (a plain one-token decode), as upstream's loop does.
    assert len(ends["block_before_key"][1][1]["a"][1]) == 1
    assert ends["raising_begin"][0] == ("KeyError", "'zz'")
    assert not ends["visit_after_raise"][1][1]["a"][1]
