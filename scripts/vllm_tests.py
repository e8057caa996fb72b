"""vLLM's own R3 / AuxOutput unit tests, from the release's sdist, on the overlay and on the diffs.

    python scripts/vllm_tests.py                 # both modes, installed vLLM's release
    python scripts/vllm_tests.py --mode overlay  # or: --mode tree
    python scripts/vllm_tests.py --mode tree -- -x -k store   # extra arguments go to pytest

Run it with the Python of the environment whose vLLM you mean. ``.ci/run`` runs it after
each release's suite, in both modes (``CI_VLLM_TESTS=overlay`` or ``tree`` runs one).
Two modes, each one pytest process on vLLM's test files:

- ``overlay``: the installed vLLM with prime_r3 applied in the test process (``apply()``
  before pytest starts, defaults as under ``vllm serve``) and, through the
  ``vllm.general_plugins`` entry point and the inherited environment, in every vLLM
  process a test spawns.
- ``tree``: a copy of the installed ``vllm`` package patched with
  ``patches/vllm-<release>/*.patch`` (``scripts/patches.py apply``, the copy tests/
  test_upstream_diffs.py builds), first on ``sys.path``, with ``PRIME_R3=0``; the
  tests run from a copy of the sdist's ``tests/`` with the diffs' test changes
  (``apply --tests``: a diff that changes an internal vLLM's tests build by hand
  changes those lines too, as its upstream pull request would).

The sdist is fetched once per release with pip's ordinary client (``pip download
--no-deps --no-binary :all:``; pip builds an sdist's metadata before it keeps it, so the
build runs without isolation, with ``VLLM_TARGET_DEVICE=empty`` and the version pinned by
``VLLM_VERSION_OVERRIDE`` so the metadata matches the name, and with vLLM's two pure-Python
build requirements pip lacks here installed into the cache by ``pip install --target``).
Only ``tests/`` and ``pyproject.toml`` are kept, in ``.cache/vllm-tests/<release>/`` (git
-ignored); the sdist itself is deleted. pytest runs there with ``--rootdir`` on it, so
vLLM's own ``[tool.pytest.ini_options]`` applies, not prime_r3's.

Which tests (``FILES``, ``MIXED``): every test of the files that exist for R3 / AuxOutput
(the connector's store, the capture/worker connector, its config, the Ray executor's
output detach, which copies the aux outputs) and of the scale-out routers' file (the
generate route's module, registered on a real app), and, from the scheduler, async
scheduler, output processor, request-bounds, detokenizer and serial-utils files, the
tests whose own source names routed experts, aux outputs or ``numpy2base64`` (found by
parsing the file, so each release's additions are picked up). Those are the tests that
drive the code the patches replace: the connector, its store, the worker's capture, the
scheduler's aux-output handshake, the output processor / Ray detach that consume the
rows, and the API server's encoding of them. The generate route's own tests
(``tests/entrypoints/scale_out/token_in_token_out/``) are not in the set: they are
asyncio tests (pytest-asyncio, which this env lacks) and those that return routed
experts start a server on a hub model with a GPU.

Conftest files: vLLM's ``tests/conftest.py`` imports the model-test stack (tblib,
transformers' auto classes, PIL, the hub client), none of which these unit tests use, and
tblib is not a vLLM dependency. pytest runs with ``--noconftest``: no conftest of the tree
is loaded. The one fixture the chosen tests would take from a conftest
(``dummy_test_vectors``, tests/v1/engine/conftest.py) loads a tokenizer from the hub, so
the tests that use it are deselected below anyway.

``DESELECTED`` names, with the reason, tests that need what this machine lacks (a GPU,
the Hugging Face hub, the network). ``EXPECTED_FAILURES[release][mode]`` names tests whose
behaviour a fix changes on purpose (the store's capacity and growth), with the reason;
they run as strict xfails, so the run fails when one starts passing, and fails when any
other test fails. An expected failure the tree does not collect is an error too (the
list went stale). The tree-mode lists are owned by the diffs (patches/): whoever changes
a diff updates them. A test that hangs prints its stack after 300 s
(``faulthandler_timeout``): a test that reaches for the hub retries for minutes here.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "vllm-tests"
MODES = ("overlay", "tree")

#: whole files: they exist for R3 / AuxOutput (a file missing from a release is skipped)
FILES = [
    "tests/config/test_aux_output_config.py",
    "tests/distributed/aux_output_connector",
    "tests/model_executor/test_routed_experts_capture.py",
    "tests/v1/executor/test_ray_utils.py",
    # The scale-out routers: the generate route's module (api_router.py, 11's file) is
    # imported and its routes registered and validated on a real FastAPI app.
    "tests/entrypoints/scale_out/test_factories.py",
]
#: files mixing R3 tests with others: only tests whose source matches ``_R3``
MIXED = [
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_async_scheduler.py",
    "tests/v1/engine/test_output_processor.py",
    "tests/v1/streaming_input/test_scheduler_streaming.py",
    "tests/test_request_input_bounds.py",
    "tests/detokenizer/test_stop_string_while_stop_model_terminates.py",
    "tests/utils_/test_serial_utils.py",
]
#: what a chosen test's source names: routed experts, aux outputs, or the function that
#: encodes the routed experts of a response (numpy2base64, 10's)
_R3 = re.compile(
    r"\b(routed_experts\w*|return_routed_experts|aux_output\w*|AuxOutput\w*|RoutedExperts\w*"
    r"|numpy2base64)"
)

_HUB = (
    "needs the Hugging Face hub: tests/v1/core/utils.create_scheduler builds "
    "ModelConfig('facebook/opt-125m'), which fetches its config"
)
_ASYNC = (
    "an asyncio test: needs pytest-asyncio, which vLLM's test requirements carry and this env lacks"
)
_PINNED = "needs an accelerator: builds tensors with pin_memory=True (no pinned allocator on CPU)"

#: node id (a test function's id covers all its parameters) -> why it does not run here
DESELECTED: dict[str, str] = {
    **{
        f"tests/v1/core/test_scheduler.py::{name}": _HUB
        for name in (
            "test_routed_experts_prompt_start_at_prompt_end",
            "test_routed_experts_hashes_follow_scheduled_tokens",
            "test_prefix_hit_is_capped_at_retained_auxiliary_outputs",
            "test_evicted_blocks_release_their_auxiliary_outputs_past_capacity",
            "test_finish_request",
            "test_preemption_processes_stale_aux_output",
            "test_scheduler_reset_prefix_cache",
            "test_aux_output_reset_follows_kv_reset_result",
            "test_abort_request_when_structured_output_fsm_cannot_advance",
            "test_hybrid_divergent_hit_fallback_is_capped_at_retained_auxiliary_outputs",
        )
    },
    "tests/v1/core/test_async_scheduler.py::"
    "test_abort_request_when_structured_output_fsm_cannot_advance": _HUB,
    "tests/v1/engine/test_output_processor.py::test_request_output_collector": _ASYNC,
    "tests/v1/executor/test_ray_utils.py::"
    "test_detach_zero_copy_from_model_runner_output_copies_only_numpy_views": _PINNED,
}

#: release -> mode -> node id -> why the fix makes it fail on purpose
_GROWS = (
    "store_growth: the store grows instead of raising BlockObjectStoreError "
    "when a batch does not fit (what 0.33 does)"
)
_HEADROOM = (
    "store_headroom (04's diff): the worker's default store holds twice the KV cache's "
    "blocks (VLLM_AUX_OUTPUT_STORE_HEADROOM=2), so max_bytes is 5120, not upstream's 2560"
)
#: the diffs' tree-mode list (owned with patches/): 0.31/0.32 carry 04 and 05
_TREE_031_032 = {
    "tests/distributed/aux_output_connector/test_store.py::"
    "test_store_rejects_oversized_batch_without_partial_write": _GROWS,
    "tests/model_executor/test_routed_experts_capture.py::"
    "test_aux_output_worker_connector_default_capacity": _HEADROOM,
}
EXPECTED_FAILURES: dict[str, dict[str, dict[str, str]]] = {
    "0.31.0": {
        "overlay": {
            "tests/distributed/aux_output_connector/test_store.py::"
            "test_store_rejects_oversized_batch_without_partial_write": _GROWS,
        },
        "tree": dict(_TREE_031_032),
    },
    "0.32.0": {
        "overlay": {
            "tests/distributed/aux_output_connector/test_store.py::"
            "test_store_rejects_oversized_batch_without_partial_write": _GROWS,
        },
        "tree": dict(_TREE_031_032),
    },
    "0.33.0": {"overlay": {}, "tree": {}},
}


def installed_release() -> str:
    version = importlib.metadata.version("vllm")
    return re.match(r"\d+(\.\d+)*", version).group(0)  # type: ignore[union-attr]


# -- the sdist's tests ------------------------------------------------------------------------


def _pip(*args: str, env: dict[str, str] | None = None) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, env=env)


def _has_build_tools(tools: Path) -> bool:
    return (tools / "setuptools_rust").is_dir() and (tools / "setuptools_scm").is_dir()


def fetch_tests(release: str, cache: Path = CACHE) -> Path:
    """``cache/<release>`` holding the release's ``tests/`` and ``pyproject.toml``;
    fetched on first use, reused after."""
    target = cache / release
    done = target / ".complete"
    if done.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"vllm-{release}-", dir=cache) as tmp:
        work = Path(tmp)
        tools = cache / "build-tools"
        if not _has_build_tools(tools):
            # Installed in the fetch's own directory, then renamed into place (CI's two lanes
            # may fetch at once); a leftover or another fetch's tools there: this fetch
            # uses its own.
            fresh = work / "build-tools"
            _pip("install", "-q", "--target", str(fresh), "setuptools-rust", "setuptools-scm")
            with contextlib.suppress(OSError):
                fresh.rename(tools)
            if not _has_build_tools(tools):
                tools = fresh
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(tools), env.get("PYTHONPATH", "")]).rstrip(":")
        env["VLLM_TARGET_DEVICE"] = "empty"
        env["VLLM_VERSION_OVERRIDE"] = release
        _pip(
            "download", "-q", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
            "-d", str(work), f"vllm=={release}", env=env,
        )  # fmt: skip
        (sdist,) = work.glob(f"vllm-{release}.tar.gz")
        prefix = f"vllm-{release}/"
        extracted = work / "tree"
        with tarfile.open(sdist) as archive:
            members = [
                m
                for m in archive.getmembers()
                if m.name.startswith(prefix + "tests/") or m.name == prefix + "pyproject.toml"
            ]
            archive.extractall(extracted, members=members, filter="data")
        if target.exists():
            shutil.rmtree(target)
        (extracted / f"vllm-{release}").rename(target)
    done.write_text(f"vLLM {release} sdist: tests/ and pyproject.toml\n")
    return target


def _r3_tests(path: Path) -> list[str]:
    """Names of the top-level test functions (and test methods, ``Class::name``) whose
    source matches ``_R3``."""
    source = path.read_text()
    found = []
    for node in ast.parse(source).body:
        scope = node.body if isinstance(node, ast.ClassDef) else [node]
        prefix = f"{node.name}::" if isinstance(node, ast.ClassDef) else ""
        for item in scope:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name.startswith(
                "test"
            ):
                if _R3.search(ast.get_source_segment(source, item) or ""):
                    found.append(prefix + item.name)
    return found


def selection(tree: Path) -> list[str]:
    """The pytest arguments naming the chosen tests in ``tree`` (a release's sdist)."""
    chosen = [f for f in FILES if (tree / f).exists()]
    for file in MIXED:
        if (tree / file).is_file():
            chosen += [f"{file}::{name}" for name in _r3_tests(tree / file)]
    return chosen


# -- the pytest plugin (runs in the test process) ---------------------------------------------


def _matches(nodeid: str, name: str) -> bool:
    return nodeid == name or nodeid.startswith(name + "[")


class Expectations:
    """Deselects ``deselected`` and marks ``expected`` as strict xfails, by node id; a
    listed name no collected test matches is an error."""

    def __init__(self, deselected: dict[str, str], expected: dict[str, str]) -> None:
        self.deselected = deselected
        self.expected = expected

    def pytest_collection_modifyitems(self, config: Any, items: list[Any]) -> None:
        import pytest

        unused = set(self.expected)
        keep, dropped = [], []
        for item in items:
            if any(_matches(item.nodeid, name) for name in self.deselected):
                dropped.append(item)
                continue
            for name, why in self.expected.items():
                if _matches(item.nodeid, name):
                    unused.discard(name)
                    item.add_marker(pytest.mark.xfail(reason=why, strict=True))
            keep.append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep
        if unused:  # the release's list names a test its tree does not have
            raise pytest.UsageError(
                "vllm_tests: expected failures that were not collected (list stale?): "
                + ", ".join(sorted(unused))
            )

    def pytest_report_header(self, config: Any) -> list[str]:
        lines = [f"vllm_tests: deselected {name}: {why}" for name, why in self.deselected.items()]
        lines += [f"vllm_tests: expected to fail {n}: {why}" for n, why in self.expected.items()]
        return lines


def _child(mode: str, release: str, args: Sequence[str]) -> int:
    """The test process: apply the overlay (overlay mode), then pytest with the lists."""
    import pytest

    if mode == "overlay":
        import prime_r3

        prime_r3.apply()
    expected = EXPECTED_FAILURES.get(release, {}).get(mode, {})
    code = int(pytest.main(list(args), plugins=[Expectations(DESELECTED, expected)]))
    if mode == "overlay":
        import prime_r3

        print("vllm_tests: " + prime_r3.status().summary())
    return code


def run(mode: str, release: str, tree: Path, extra: Sequence[str]) -> int:
    """One mode's pytest process on the tests in ``tree``; returns its exit code."""
    env = dict(os.environ)
    path = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    with tempfile.TemporaryDirectory(prefix="prime_r3_vllm_tests_") as tmp:
        if mode == "tree":
            # tmp/vllm: the patched package; tmp/tests: the sdist's tests with the
            # diffs' test changes (where a diff changes an internal they build).
            patch = [sys.executable, str(ROOT / "scripts" / "patches.py"), "apply"]
            patch += ["--out", tmp, "--tests", str(tree)]
            subprocess.run(patch, check=True)
            shutil.copyfile(tree / "pyproject.toml", Path(tmp) / "pyproject.toml")
            path.insert(0, tmp)
            env["PRIME_R3"] = "0"
            tree = Path(tmp)
        else:
            env.pop("PRIME_R3", None)
        env["PYTHONPATH"] = os.pathsep.join(path)
        args = ["-q", "-p", "no:cacheprovider", "--noconftest", "--rootdir", str(tree)]
        args += ["-o", "faulthandler_timeout=300"]  # a hung test prints its stack
        args += selection(tree) + list(extra)
        print(f"=== vLLM {release} own tests, {mode} mode ===", flush=True)
        command = [sys.executable, __file__, "_child", mode, release, *args]
        return subprocess.run(command, cwd=tree, env=env, check=False).returncode


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_child"]:
        return _child(argv[1], argv[2], argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=[*MODES, "both"], default="both")
    parser.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments")
    args = parser.parse_args(argv)
    release = installed_release()
    tree = fetch_tests(release)
    modes = MODES if args.mode == "both" else (args.mode,)
    codes = {mode: run(mode, release, tree, args.pytest_args) for mode in modes}
    for mode, code in codes.items():
        print(f"=== vLLM {release} own tests, {mode} mode: {'ok' if code == 0 else 'FAILED'} ===")
    return 0 if all(code == 0 for code in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
