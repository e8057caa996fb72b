"""Print what .venv lacks (space-separated words), nothing when it is right.

Reads package metadata only, so the check costs milliseconds, not a vLLM import.
"""

from __future__ import annotations

import importlib.metadata as md
import pathlib
import sys


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def missing(root: pathlib.Path) -> list[str]:
    out = []
    torch = _version("torch") or ""
    if not torch.startswith("2.13.0"):
        out.append("torch")
    if _version("vllm") != "0.32.0":
        out.append("vllm")
    if any(
        _version(n) is None
        for n in ("wrapt", "numpy", "packaging", "pytest", "ruff", "tqdm", "matplotlib")
    ):
        out.append("tools")
    dist_ok = _version("prime-r3") is not None and any(
        ep.value.startswith("prime_r3.") for ep in md.entry_points(group="vllm.general_plugins")
    )
    spec = None if not dist_ok else __import__("importlib.util").util.find_spec("prime_r3")
    if spec is None or spec.origin is None or root not in pathlib.Path(spec.origin).parents:
        out.append("prime_r3")
    if any(_version(n) is not None for n in ("torchvision", "torchaudio", "torchcodec")):
        out.append("broken-torch-extras")
    return out


if __name__ == "__main__":
    print(" ".join(missing(pathlib.Path(sys.argv[1]).resolve())))
