"""The registry and the fix modules agree, and every record is complete and verified."""

from __future__ import annotations

import importlib
import pkgutil

import prime_r3.fixes
from prime_r3 import fingerprint, guards
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


def test_installed_vllm_matches_a_verified_fingerprint_for_every_target() -> None:
    """On the pinned vLLM every target must verify; a mismatch means re-verify the patch."""
    assert guards.installed_vllm_version() == "0.32.0"
    for spec in REGISTRY:
        for item in (*spec.targets, *spec.anchors):
            resolved = guards.resolve(item)
            assert not isinstance(resolved, str), resolved
            found = fingerprint.of_object(resolved.function)
            assert found in item.fingerprints, f"{spec.name}: {item.key} is {found}"


def test_store_patches_skip_on_0_33_as_fixed_upstream(monkeypatch) -> None:  # noqa: ANN001
    """vLLM 0.33 keeps referenced keys out of the LRU and grows the arena (read in its wheel)."""
    from prime_r3 import layer

    monkeypatch.setattr(guards, "installed_vllm_version", lambda: "0.33.0")
    for o in layer.status(environ={}).outcomes:
        if o.name.startswith("store_"):
            assert o.state == layer.SKIPPED
            assert o.reason == "vllm 0.33.0 has this fix upstream (fixed upstream in 0.33)"
        else:  # engine_gc and packed_outputs are still needed on 0.33
            assert o.state == layer.WOULD_APPLY, o


def test_fingerprint_script_reads_a_source_tree_like_the_installed_vllm(capsys) -> None:  # noqa: ANN001
    """scripts/fingerprint.py --root on the installed tree, read as files: all verified."""
    import pathlib
    import runpy

    import vllm

    script = runpy.run_path(str(pathlib.Path(__file__).parents[1] / "scripts/fingerprint.py"))
    root = str(pathlib.Path(vllm.__file__).parents[1])
    assert script["main"](["--root", root]) == 0
    lines = capsys.readouterr().out.splitlines()
    items = sum(len(s.targets) + len(s.anchors) for s in REGISTRY)
    assert len(lines) == items and all(line.endswith("[verified]") for line in lines), lines
