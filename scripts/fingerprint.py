"""Print the fingerprint of every registry target and anchor.

    python scripts/fingerprint.py                      # the installed vLLM
    python scripts/fingerprint.py --root DIR [--root DIR ...]   # unpacked wheels

``--root`` points at a directory holding a ``vllm/`` source tree (e.g. an unzipped
``pip download --no-deps vllm==0.33.0`` wheel), so other releases can be verified
without installing them. Paste verified values into the patch's record.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from prime_r3 import fingerprint
from prime_r3.patches import REGISTRY


def _defined_in(module: str, attr: str) -> tuple[str, str]:
    """Module and qualname where the looked-up object is defined (installed vLLM)."""
    import importlib

    owner = importlib.import_module(module)
    obj = owner
    for part in attr.split("."):
        obj = getattr(obj, part)
    obj = getattr(obj, "__wrapped__", obj)
    return obj.__module__, obj.__qualname__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", action="append", default=[], help="dir containing vllm/")
    args = parser.parse_args(argv)
    for spec in REGISTRY:
        for item in (*spec.targets, *spec.anchors):
            module, qualname = _defined_in(item.module, item.attr)
            found = []
            if not args.root:
                found.append(
                    (
                        "installed",
                        fingerprint.of_source(fingerprint.module_source(module), qualname),
                    )
                )
            for root in args.root:
                path = pathlib.Path(root, *module.split(".")).with_suffix(".py")
                try:
                    digest = fingerprint.of_source(path.read_text(), qualname)
                except (OSError, fingerprint.SourceUnavailable) as error:
                    digest = f"unavailable ({error})"
                found.append((root, digest))
            known = "verified" if all(d in item.fingerprints for _, d in found) else "NEW"
            for where, digest in found:
                print(f"{spec.name:16} {item.key:70} {digest}  {where}  [{known}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
