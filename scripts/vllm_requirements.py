"""Print a vLLM wheel's requirements, minus the torch family, as a pip requirements file.

ensure_env.sh installs these, then the wheel itself with ``--no-deps``, so that every
supported release runs on the CPU build of torch that lies on this machine's disk (see
ensure_env.sh for why) and never pulls torchvision, torchaudio or torchcodec, which fail
to load beside it. Requirements that only apply to an extra are left out too.
"""

from __future__ import annotations

import re
import sys
import zipfile

TORCH_FAMILY = {"torch", "torchvision", "torchaudio", "torchcodec"}


def requirements(wheel: str) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(name).decode()
    out = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = line.split(":", 1)[1].strip()
        if re.search(r"\bextra\s*==", requirement):
            continue
        project = re.match(r"[A-Za-z0-9._-]+", requirement)
        if project and project.group(0).lower().replace("_", "-") in TORCH_FAMILY:
            continue
        out.append(requirement)
    return out


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1])))
