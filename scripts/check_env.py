"""Print what an environment lacks (space-separated words), nothing when it is right.

``check_env.py ROOT RELEASE TORCH``: reads package metadata only, so the check costs
milliseconds, not a vLLM import. ``verified`` is missing until verify_env.py has run the
release's modules on this torch after an install.
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


def missing(root: pathlib.Path, release: str, torch_version: str) -> list[str]:
    out = []
    torch = _version("torch") or ""
    if torch.split("+")[0] != torch_version:
        out.append("torch")
    if _version("vllm") != release:
        out.append("vllm")
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
    if out or not marker.exists() or marker.read_text().split() != [release, torch_version]:
        out.append("verified")
    return out


if __name__ == "__main__":
    print(" ".join(missing(pathlib.Path(sys.argv[1]).resolve(), sys.argv[2], sys.argv[3])))
