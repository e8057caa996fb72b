"""Print the fingerprint of every registry target and anchor.

    python scripts/fingerprint.py                      # the installed vLLM
    python scripts/fingerprint.py --root DIR [--root DIR ...]   # unpacked wheels

``--root`` points at a directory holding a ``vllm/`` source tree (e.g. an unzipped
``pip download --no-deps vllm==0.33.0`` wheel), so other releases can be verified
without installing them; the release is read from the tree's ``vllm-*.dist-info``.
Paste verified values into the patch's record. Each line ends with ``[fixed upstream in
X]`` / ``[outside RANGE]`` (the patch skips on that release by version, whatever the
source: checked first), ``[verified]`` or ``[NEW]`` (exit status 1). To port to a new
release, ``scripts/port.py`` says what changed since the last verified one.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from dataclasses import replace

from prime_r3 import fingerprint, guards
from prime_r3.patches import REGISTRY
from prime_r3.spec import Anchor, PatchSpec, Target


def tree_reader(root: str) -> fingerprint.Reader:
    """Read a module's text from a directory holding an unpacked ``vllm/`` tree."""

    def read(module_name: str) -> fingerprint.ModuleText:
        base = pathlib.Path(root, *module_name.split("."))
        for path, is_package in ((base.with_suffix(".py"), False), (base / "__init__.py", True)):
            if path.is_file():
                return fingerprint.ModuleText(path.read_text(), str(path), is_package)
        raise fingerprint.SourceUnavailable(f"no {module_name} under {root}")

    return read


def tree_release(root: str | None) -> str | None:
    """The vLLM release a tree holds, from its ``vllm-*.dist-info`` (None if unknown)."""
    if root is None:
        return guards.installed_vllm_version()
    for metadata in sorted(pathlib.Path(root).glob("vllm-*.dist-info/METADATA")):
        for line in metadata.read_text().splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return None


def verdict(spec: PatchSpec, item: Target | Anchor, digest: str, release: str | None) -> str:
    """``fixed upstream in X`` / ``outside RANGE``, else ``verified`` or ``NEW``.

    The version comes first, as in the guards: a patch fixed upstream in a release, or
    outside its range, skips there on the version alone, whatever its targets' source
    (a digest that matches is no verification of a release the range excludes). An
    unknown release (a tree without metadata) is judged by the digest alone.
    """
    reason = guards.check_version(spec, release) if release is not None else None
    if reason is not None and "fixed upstream" in reason:
        in_range = guards.check_version(replace(spec, fixed_upstream_in=None), release) is None
        if not in_range:  # past the range too: outside first, as every target there
            return f"outside {spec.vllm_range} (fixed upstream in {spec.fixed_upstream_in})"
        return f"fixed upstream in {spec.fixed_upstream_in}"
    if reason is not None and "outside the verified range" in reason:
        return f"outside {spec.vllm_range}"
    return "verified" if digest in item.fingerprints else "NEW"


def main(argv: list[str] | None = None) -> int:
    """Print one line per item and tree; exit 1 if any item needs verifying (``NEW``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", action="append", default=[], help="dir containing vllm/")
    args = parser.parse_args(argv)
    sources: list[tuple[str, fingerprint.Reader | None, str | None]] = [
        (root, tree_reader(root), tree_release(root)) for root in args.root
    ] or [("installed", None, tree_release(None))]
    new = 0
    for spec in REGISTRY:
        for item in (*spec.targets, *spec.anchors):
            for where, read, release in sources:
                if isinstance(item, Anchor) and not item.exists_in(release):
                    digest = "-"  # the release has no such code: nothing to verify
                    known = verdict(spec, item, digest, release)
                    known = "absent" if known == "NEW" else known
                else:
                    try:
                        digest = fingerprint.of_name(item.module, item.attr, read)
                    except fingerprint.SourceUnavailable as error:
                        digest = f"unavailable ({error})"
                    known = verdict(spec, item, digest, release)
                new += known == "NEW"
                print(f"{spec.name:16} {item.key:70} {digest}  {where} ({release})  [{known}]")
    return 1 if new else 0


if __name__ == "__main__":
    sys.exit(main())
