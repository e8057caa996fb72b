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
from collections.abc import Callable

from prime_r3 import fingerprint
from prime_r3.patches import REGISTRY


def _wheel_reader(root: str) -> Callable[[str], str]:
    """Read a module's source from a directory holding an unpacked ``vllm/`` tree."""

    def read(module_name: str) -> str:
        base = pathlib.Path(root, *module_name.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path.read_text()
        raise fingerprint.SourceUnavailable(f"no {module_name} under {root}")

    return read


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", action="append", default=[], help="dir containing vllm/")
    args = parser.parse_args(argv)
    sources: list[tuple[str, Callable[[str], str] | None]] = [
        (root, _wheel_reader(root)) for root in args.root
    ] or [("installed", None)]
    for spec in REGISTRY:
        for item in (*spec.targets, *spec.anchors):
            found = []
            for where, read in sources:
                try:
                    digest = fingerprint.of_name(item.module, item.attr, read)
                except fingerprint.SourceUnavailable as error:
                    digest = f"unavailable ({error})"
                found.append((where, digest))
            known = "verified" if all(d in item.fingerprints for _, d in found) else "NEW"
            for where, digest in found:
                print(f"{spec.name:16} {item.key:70} {digest}  {where}  [{known}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
