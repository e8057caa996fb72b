"""scripts/share_env_files.py: identical third-party files become one, nothing else changes."""

from __future__ import annotations

import importlib.util
import pathlib
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _script() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(
        "share_env_files", ROOT / "scripts/share_env_files.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _venv(root: pathlib.Path, name: str, files: dict[str, bytes], verified: bool) -> pathlib.Path:
    venv = root / name
    site = venv / "lib/python3.11/site-packages"
    for rel, data in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)
    if verified:
        (venv / "prime_r3-verified").write_text("0.32.0 2.13.0\n")
    return venv


def _inode(path: pathlib.Path) -> int:
    return path.stat().st_ino


def test_identical_files_are_linked_and_the_rest_left_alone(tmp_path: pathlib.Path) -> None:
    script = _script()
    common = {
        "torch/lib/libtorch.so": b"\x7fELF" + b"t" * 5000,
        "triton/__init__.py": b"version = 1\n",
        "vllm/store.py": b"same in both releases\n",  # vllm/ is never shared
        "prime_r3.pth": b"/checkout\n",
    }
    _venv(tmp_path, ".venv", {**common, "numpy/core.py": b"numpy 2.1\n"}, verified=True)
    _venv(tmp_path, ".venv-0.30.0", dict(common), verified=False)  # never finished: ignored
    new = _venv(tmp_path, ".venv-0.31.0", {**common, "numpy/core.py": b"numpy 2.2\n"}, False)

    assert script.main([str(tmp_path), str(new)]) == 0

    site = new / "lib/python3.11/site-packages"
    base = tmp_path / ".venv/lib/python3.11/site-packages"
    for rel in ("torch/lib/libtorch.so", "triton/__init__.py"):
        assert _inode(site / rel) == _inode(base / rel)
        assert (site / rel).read_bytes() == common[rel]
    for rel in ("vllm/store.py", "prime_r3.pth", "numpy/core.py"):
        assert _inode(site / rel) != _inode(base / rel)
    assert (site / "numpy/core.py").read_bytes() == b"numpy 2.2\n"
    unverified = tmp_path / ".venv-0.30.0/lib/python3.11/site-packages/torch/lib/libtorch.so"
    assert _inode(unverified) != _inode(base / "torch/lib/libtorch.so")
    assert not list(site.rglob("*.prime_r3-link"))
    # A second run finds everything already shared.
    assert script.share(new, script.siblings(tmp_path, new)) == (0, 0)


def test_a_leftover_link_or_a_refused_link_never_fails_the_setup(tmp_path: pathlib.Path) -> None:
    """An interrupted run leaves ``.NAME.prime_r3-link``; a sibling on another disk
    refuses links (EXDEV). Neither may fail an environment that is already complete
    (found by review: FileExistsError, then ensure_env.sh exited 1)."""
    script = _script()
    data = {"torch/a.py": b"x = 1\n", "torch/b.py": b"y = 2\n"}
    _venv(tmp_path, ".venv", data, verified=True)
    new = _venv(tmp_path, ".venv-0.31.0", data, verified=False)
    site = new / "lib/python3.11/site-packages"
    (site / "torch/.a.py.prime_r3-link").write_bytes(b"stale")
    assert script.main([str(tmp_path), str(new)]) == 0
    base = tmp_path / ".venv/lib/python3.11/site-packages"
    assert _inode(site / "torch/a.py") == _inode(base / "torch/a.py")
    assert not list(site.rglob("*.prime_r3-link"))

    other = _venv(tmp_path, ".venv-0.33.0", data, verified=False)
    real_link = script.os.link

    def refuse(src, dst):  # noqa: ANN001, ANN202
        raise OSError(18, "Invalid cross-device link")

    script.os.link = refuse
    try:
        assert script.main([str(tmp_path), str(other)]) == 0
    finally:
        script.os.link = real_link
    other_site = other / "lib/python3.11/site-packages"
    assert (other_site / "torch/a.py").read_bytes() == data["torch/a.py"]
    assert _inode(other_site / "torch/a.py") != _inode(base / "torch/a.py")
    assert not list(other_site.rglob("*.prime_r3-link"))
