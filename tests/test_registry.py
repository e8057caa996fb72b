"""The registry and the fix modules agree, and every record is complete and verified."""

from __future__ import annotations

import importlib
import pathlib
import pkgutil
import runpy
import sys

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import prime_r3.fixes
from prime_r3 import fingerprint, guards, layer
from prime_r3.patches import REGISTRY
from prime_r3.spec import PatchSpec


def _declared_specs() -> list[PatchSpec]:
    specs = []
    for info in pkgutil.iter_modules(prime_r3.fixes.__path__):
        module = importlib.import_module(f"prime_r3.fixes.{info.name}")
        specs.extend(v for v in vars(module).values() if isinstance(v, PatchSpec))
    return specs


def test_every_declared_patch_is_registered_once() -> None:
    declared = _declared_specs()
    assert declared, "no fix modules found"
    assert {id(s) for s in declared} == {id(s) for s in REGISTRY}
    names = [s.name for s in REGISTRY]
    assert len(names) == len(set(names))


def test_records_are_complete() -> None:
    for spec in REGISTRY:
        assert spec.name.isidentifier() and spec.summary and spec.targets, spec.name
        assert spec.processes and spec.vllm_range, spec.name
        for item in (*spec.targets, *spec.anchors):
            assert item.fingerprints, f"{spec.name}: {item.key} has no verified fingerprint"
        env_vars = [p.env_var(spec.name) for p in spec.params]
        assert len(env_vars) == len(set(env_vars))


#: What each supported release is expected to carry upstream already (read in its
#: store.py: referenced keys stay out of the LRU, the arena grows, headroom is sized).
FIXED_UPSTREAM = {
    "0.31.0": set(),
    "0.32.0": set(),
    "0.33.0": {"store_eviction", "store_headroom", "store_growth"},
}


def _installed() -> tuple[str, Version]:
    version = guards.installed_vllm_version()
    assert version is not None, "vllm is not installed"
    release = Version(Version(version).base_version)
    assert str(release) in FIXED_UPSTREAM, f"vllm {version} is not a supported release"
    return version, release


def _fixed_upstream(spec: PatchSpec, release: Version) -> bool:
    return spec.fixed_upstream_in is not None and release >= Version(spec.fixed_upstream_in)


def test_installed_release_matches_a_verified_fingerprint_for_every_target_and_anchor() -> None:
    """Read from the installed release's files: every patch meant to apply here verifies.

    A mismatch means the release changed code a patch relies on: re-verify the patch
    and add the value printed by scripts/fingerprint.py.
    """
    version, release = _installed()
    checked = 0
    for spec in REGISTRY:
        if _fixed_upstream(spec, release):
            continue
        assert SpecifierSet(spec.vllm_range).contains(release), (spec.name, spec.vllm_range)
        for item in (*spec.targets, *spec.anchors_for(version)):
            found = fingerprint.of_name(item.module, item.attr)
            assert found in item.fingerprints, f"vllm {version}: {spec.name}: {item.key} is {found}"
            checked += 1
    assert checked, f"no patch applies to vllm {version}"


def test_patches_fixed_upstream_in_the_installed_release_skip_naming_it() -> None:
    version, release = _installed()
    fixed = {s.name for s in REGISTRY if _fixed_upstream(s, release)}
    assert fixed == FIXED_UPSTREAM[str(release)]
    for outcome in layer.status(environ={}).outcomes:
        if outcome.name in fixed:
            spec = next(s for s in REGISTRY if s.name == outcome.name)
            assert outcome.state == layer.SKIPPED
            assert outcome.reason == (
                f"vllm {version} has this fix upstream (fixed upstream in {spec.fixed_upstream_in})"
            )
        else:
            assert outcome.state in (layer.WOULD_APPLY, layer.APPLIED), outcome


def test_fingerprint_script_reads_a_source_tree_like_the_installed_vllm(capsys) -> None:  # noqa: ANN001
    """scripts/fingerprint.py --root on the installed tree, read as files: all verified,
    except the patches this release fixed upstream, which it names."""
    import vllm

    _, release = _installed()
    script = runpy.run_path(str(pathlib.Path(__file__).parents[1] / "scripts/fingerprint.py"))
    root = str(pathlib.Path(vllm.__file__).parents[1])
    assert script["main"](["--root", root]) == 0
    lines = capsys.readouterr().out.splitlines()
    # An item of a patch fixed upstream may still match (code it never changed).
    expected = [
        ("[absent]",)  # an anchor of code this release does not have (Anchor.releases)
        if item not in (*spec.targets, *spec.anchors_for(str(release)))
        else ("[verified]", f"[fixed upstream in {spec.fixed_upstream_in}]")
        if spec.name in FIXED_UPSTREAM[str(release)]
        else ("[verified]",)
        for spec in REGISTRY
        for item in (*spec.targets, *spec.anchors)
    ]
    assert len(lines) == len(expected), lines
    for line, verdicts in zip(lines, expected, strict=True):
        assert f"{root} ({release})" in line and line.endswith(verdicts), line


_FAKE_PACKAGE = {
    "r3fake/__init__.py": "",
    "r3fake/impl.py": "def helper(x):\n    return x + 1\n",
    "r3fake/pkg/__init__.py": (
        "from .leaf import Thing\nfrom ..impl import helper as outer\nfrom . import leaf\n"
    ),
    "r3fake/pkg/leaf.py": "class Thing:\n    def go(self):\n        return 1\n",
    "r3fake/pkg/mod.py": "from .leaf import Thing as Other\n",
}


def _wheel_reader(root: pathlib.Path) -> fingerprint.Reader:
    script = runpy.run_path(str(pathlib.Path(__file__).parents[1] / "scripts/fingerprint.py"))
    return script["tree_reader"](str(root))


@pytest.mark.parametrize("how", ["files", "imported", "wheel_reader"])
def test_relative_import_in_a_package_init_starts_from_the_package_itself(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """``from .leaf import Thing`` in ``r3fake/pkg/__init__.py`` is ``r3fake.pkg.leaf``."""
    for name, text in _FAKE_PACKAGE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.split(".")[0] == "r3fake"]:
        monkeypatch.delitem(sys.modules, name)
    read = _wheel_reader(tmp_path) if how == "wheel_reader" else None
    if how == "imported":
        monkeypatch.setitem(sys.modules, "r3fake.pkg", importlib.import_module("r3fake.pkg"))
    leaf = (tmp_path / "r3fake/pkg/leaf.py").read_text()
    impl = (tmp_path / "r3fake/impl.py").read_text()
    cases = {
        ("r3fake.pkg", "Thing"): ("r3fake.pkg.leaf", "Thing", leaf),
        ("r3fake.pkg", "Thing.go"): ("r3fake.pkg.leaf", "Thing.go", leaf),
        ("r3fake.pkg", "outer"): ("r3fake.impl", "helper", impl),
        ("r3fake.pkg.mod", "Other"): ("r3fake.pkg.leaf", "Thing", leaf),  # not a package
    }
    for (module, qualname), (where, defined, source) in cases.items():
        found = fingerprint.locate(module, qualname, read)
        assert (found.module, found.qualname) == (where, defined)
        assert fingerprint.of_name(module, qualname, read) == fingerprint.of_source(source, defined)
    for name in [m for m in sys.modules if m.split(".")[0] == "r3fake"]:
        sys.modules.pop(name)


def test_relative_import_in_a_real_vllm_package_init() -> None:
    """vllm/v1/executor/__init__.py: ``from .abstract import Executor`` (0.31-0.33)."""
    import vllm

    found = fingerprint.locate("vllm.v1.executor", "Executor")
    assert found.module == "vllm.v1.executor.abstract"
    abstract = pathlib.Path(vllm.__file__).parent / "v1/executor/abstract.py"
    assert found.fingerprint() == fingerprint.of_source(abstract.read_text(), "Executor")
    from vllm.v1.executor import UniProcExecutor

    assert fingerprint.of_name("vllm.v1.executor", "UniProcExecutor") == (
        fingerprint.of_object(UniProcExecutor)
    )


def test_a_release_scoped_anchor_is_checked_only_where_that_release_has_it(
    reverted,  # noqa: ANN001
) -> None:
    """engine_gc's 0.33-only anchor (the warm-up body 0.33 split out, which holds the
    freeze): checked on 0.33, where a changed body skips the patch; absent elsewhere."""
    import dataclasses

    spec = next(s for s in REGISTRY if s.name == "engine_gc")
    body = next(a for a in spec.anchors if a.attr == "Worker._compile_or_warm_up_model")
    version, release = _installed()
    on_033 = str(release) == "0.33.0"
    assert body.exists_in(version) is on_033
    assert (body in spec.anchors_for(version)) is on_033
    if not on_033:  # the scope is right: the method really is absent there
        with pytest.raises(fingerprint.SourceUnavailable):
            fingerprint.locate(body.module, body.attr)
    changed = dataclasses.replace(body, fingerprints=frozenset({"0" * 16}))
    patched = dataclasses.replace(
        spec, anchors=tuple(changed if a is body else a for a in spec.anchors)
    )
    reason = layer._check(patched, version)  # noqa: SLF001
    if on_033:
        assert reason is not None and body.key in reason
    else:
        assert reason is None
