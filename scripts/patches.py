"""The prime_r3 fixes as source diffs against vLLM: check, apply, show.

    python scripts/patches.py check              # does the installed vLLM match the diffs?
    python scripts/patches.py apply --out DIR    # DIR/vllm = installed vllm + the diffs
    python scripts/patches.py apply --in-place   # patch the installed vllm (image builds)
    python scripts/patches.py diff               # what the diffs change in the installed vllm

Run it with the Python of the environment whose vLLM you mean (it reads that vLLM's
files without importing it). ``patches/vllm-<release>/NN-<name>.patch`` holds one diff
per registry patch that applies to the release (same name as in ``prime_r3.patches``),
with paths relative to vLLM's repository root (``a/vllm/...``); they apply in name
order with ``patch -p1``. An installed wheel has only the ``vllm/`` package, so the
repository root maps onto site-packages. Each diff's header records the sha256 of every
file it touches as the release ships it (``Source-sha256: <hex>  vllm/...``): ``check``
fails loudly, naming the file, when the installed source is neither that file nor that
file with the whole series applied (upstream moved, or something else changed it).
A diff written on top of another one names it in its header (``Requires: NN-<name>``,
an earlier diff of the same series): it applies after what it requires, alone or in
the series, and a missing or later requirement is an error.

A diff may also change vLLM's own tests (``b/tests/...``), where a fix changes an
internal those tests build or read, as the upstream pull request would: the same
``Source-sha256`` lines record the release's test files (as its sdist ships them).
An installed tree has no ``tests/``: ``check``, ``diff`` and ``apply`` work on the
``vllm/`` part, and ``apply --tests SDIST`` also writes ``DIR/tests``, the sdist's
tests with the diffs' test changes (``scripts/vllm_tests.py`` runs those in tree mode).
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PATCHES = ROOT / "patches"
_NAME = re.compile(r"^(\d\d)-([a-z0-9_]+)\.patch$")
_SOURCE = re.compile(r"^Source-sha256: ([0-9a-f]{64})  ((?:vllm|tests)/\S+)$", re.M)
_REQUIRES = re.compile(r"^Requires:(.*)$", re.M)
_REQUIREMENT = re.compile(r"^\d\d-[a-z0-9_]+$")
#: where a diff's changes to vLLM's own tests live (repository-relative)
TESTS = "tests/"


class PatchError(RuntimeError):
    """A diff does not fit the tree it is meant for (or the series is malformed)."""


@dataclass(frozen=True)
class Diff:
    """One ``NN-<name>.patch`` file."""

    path: Path
    order: int
    name: str
    #: repository-relative path -> sha256 of that file as the release ships it
    sources: dict[str, str]
    #: ``NN-<name>`` of the earlier diffs this one is written on top of
    requires: tuple[str, ...] = ()

    @property
    def files(self) -> list[str]:
        """The vLLM package files the diff changes (``vllm/...``)."""
        return sorted(f for f in self.sources if not f.startswith(TESTS))

    @property
    def test_files(self) -> list[str]:
        """vLLM's own test files the diff changes (``tests/...``, not installed)."""
        return sorted(f for f in self.sources if f.startswith(TESTS))

    def part(self, tests: bool) -> str:
        """The diff's text for its package files only, or its test files only."""
        text = self.path.read_text()
        head, *sections = re.split(r"(?m)^(?=--- a/)", text)
        keep = [s for s in sections if s.startswith(f"--- a/{TESTS}") == tests]
        return head + "".join(keep)


def read_diff(path: Path) -> Diff:
    match = _NAME.match(path.name)
    if match is None:
        raise PatchError(f"{path}: name must be NN-<registry name>.patch")
    text = path.read_text()
    sources = {file: digest for digest, file in _SOURCE.findall(text)}
    touched = set(re.findall(r"^\+\+\+ b/(\S+)", text, re.M))
    outside = sorted(f for f in touched if not f.startswith(("vllm/", TESTS)))
    if outside:
        raise PatchError(f"{path}: touches {outside}, outside vllm/ and tests/")
    if not touched or touched != set(sources):
        raise PatchError(
            f"{path}: touches {sorted(touched)} but records Source-sha256 for {sorted(sources)}"
        )
    header = text.split("\n--- a/", 1)[0]
    requires: list[str] = []
    for line in _REQUIRES.findall(header):
        names = line.split()
        bad = [n for n in names if not _REQUIREMENT.match(n)] or ([] if names else [line])
        if bad:
            raise PatchError(
                f"{path}: Requires: {bad[0]!r} is not a diff name (NN-<registry name>, "
                "without .patch, space-separated)"
            )
        requires += names
    return Diff(path, int(match.group(1)), match.group(2), sources, tuple(requires))


def with_requirements(diff: Diff, diffs: Sequence[Diff]) -> list[Diff]:
    """``diff`` after everything it requires (transitively), in series order."""
    by_name = {d.path.stem: d for d in diffs}
    needed: dict[str, Diff] = {}

    def visit(current: Diff) -> None:
        for name in current.requires:
            required = by_name.get(name)
            if required is None:
                raise PatchError(f"{current.path.name} requires {name}, not in its series")
            if required.order >= current.order:
                raise PatchError(f"{current.path.name} requires {name}, which comes later")
            if name not in needed:
                needed[name] = required
                visit(required)

    visit(diff)
    return sorted(needed.values(), key=lambda d: d.order) + [diff]


def series(release: str, patches_dir: Path = PATCHES) -> list[Diff]:
    """The release's diffs in apply (name) order; raises if there are none, or if a
    diff requires one that is missing or comes after it."""
    directory = patches_dir / f"vllm-{release}"
    if not directory.is_dir():
        known = sorted(p.name.removeprefix("vllm-") for p in patches_dir.glob("vllm-*"))
        raise PatchError(f"no diffs for vLLM {release} under {patches_dir}; have {known}")
    diffs = [read_diff(path) for path in sorted(directory.glob("*.patch"))]
    orders = [d.order for d in diffs]
    if len(set(orders)) != len(orders):
        raise PatchError(f"{directory}: two diffs share a number: {orders}")
    for diff in diffs:
        with_requirements(diff, diffs)
    return diffs


def _applicable(release: str) -> list[Any]:
    """The registry's records that apply to ``release`` (in range, not fixed upstream),
    in registry order; the registry is imported from this checkout."""
    sys.path.insert(0, str(ROOT))
    try:
        from prime_r3.guards import check_version
        from prime_r3.patches import REGISTRY
    finally:
        sys.path.remove(str(ROOT))
    return [spec for spec in REGISTRY if check_version(spec, release) is None]


def registry_names(release: str) -> list[str]:
    """Registry patches that apply to ``release`` and have a diff of their own, in order."""
    return [
        spec.name
        for spec in _applicable(release)
        if not spec.diff_pending_for(release) and not spec.diff_in
    ]


def registry_pending(release: str) -> dict[str, str]:
    """Registry patches that apply to ``release`` but have no diff yet, and why (the
    record's ``diff_pending``): the overlay carries them alone for now."""
    return {
        spec.name: spec.diff_pending_for(release)
        for spec in _applicable(release)
        if spec.diff_pending_for(release)
    }


def registry_carried(release: str) -> dict[str, str]:
    """Registry patches that apply to ``release`` and whose upstream form is part of
    another patch's diff (the record's ``diff_in``): name -> that patch's name."""
    return {spec.name: spec.diff_in for spec in _applicable(release) if spec.diff_in}


def registry_mismatch(release: str, diffs: Sequence[Diff]) -> list[str]:
    """Problems linking diffs and registry: one diff per applicable patch, in registry order."""
    expected = registry_names(release)
    names = [d.name for d in diffs]
    problems = [
        f"registry patch {n!r} applies to {release} but has no diff"
        for n in expected
        if n not in names
    ]
    carried = registry_carried(release)
    problems += [
        f"registry patch {n!r} is carried by the {carrier} diff, which {release} lacks"
        for n, carrier in carried.items()
        if carrier not in names or carrier not in expected
    ]
    pending = registry_pending(release)
    problems += [
        f"diff {d.path.name} exists but the registry says it has none yet: {pending[d.name]}"
        if d.name in pending
        else f"diff {d.path.name} exists but the registry says the {carried[d.name]} diff "
        "carries it"
        if d.name in carried
        else f"diff {d.path.name} has no registry patch that applies to {release}"
        for d in diffs
        if d.name not in expected
    ]
    if not problems and names != expected:
        problems.append(f"diffs are ordered {names}, the registry {expected}")
    return problems


# -- the installed tree ---------------------------------------------------------------


def installed_site() -> Path:
    """The directory holding the installed ``vllm/`` package, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError(f"vllm is not installed for {sys.executable}")
    return Path(list(spec.submodule_search_locations)[0]).parent


def installed_release() -> str:
    version = importlib.metadata.version("vllm")
    return re.match(r"\d+(\.\d+)*", version).group(0)  # type: ignore[union-attr]


def _sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def _run_patch(
    diff: Diff,
    root: Path,
    *,
    reverse: bool = False,
    dry_run: bool = False,
    tests: bool = False,
) -> None:
    """``patch -p1`` of the diff's package part (``tests``: its test part) with no
    fuzz, no backups and no prompts; raises with patch's output."""
    if tests and not diff.test_files:
        return
    command = ["patch", "-p1", "--batch", "--fuzz=0", "--no-backup-if-mismatch", "-r", "-"]
    command += ["--reverse"] if reverse else ["--forward"]
    command += ["--dry-run"] if dry_run else []
    try:
        result = subprocess.run(
            command,
            cwd=root,
            input=diff.part(tests),
            capture_output=True,
            text=True,
            check=False,
        )
    except FileNotFoundError:
        raise PatchError("GNU patch is needed (apt-get install patch)") from None
    if result.returncode != 0:
        how = "reverse" if reverse else "forward"
        raise PatchError(
            f"{diff.path.name} does not apply ({how}) under {root}:\n{result.stdout}{result.stderr}"
        )


def _copy_files(site: Path, files: Sequence[str], dest: Path) -> None:
    for file in files:
        target = dest / file
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(site / file, target)


@dataclass
class Status:
    release: str
    site: Path
    #: "pristine" (the release's files: the diffs apply), "applied" (the tree carries
    #: the whole series), or "moved" (neither: see ``problems``)
    state: str
    problems: list[str]


def status(site: Path, release: str, patches_dir: Path = PATCHES) -> Status:
    """Whether the tree at ``site`` is the release's source, already patched, or neither."""
    diffs = series(release, patches_dir)
    files = sorted({f for d in diffs for f in d.files})
    pristine = {}
    for diff in diffs:  # a file's recorded hash must agree across the diffs touching it
        for file in diff.files:
            digest = diff.sources[file]
            if pristine.setdefault(file, digest) != digest:
                raise PatchError(f"{diff.path.name}: Source-sha256 of {file} disagrees")
    found = {file: _sha256(site / file) for file in files}
    moved = [f for f in files if found[f] != pristine[f]]
    with tempfile.TemporaryDirectory(prefix="prime_r3_patches_") as tmp:
        work = Path(tmp)
        missing = [f for f in files if found[f] is None]
        if missing:
            return Status(release, site, "moved", [f"{f}: missing under {site}" for f in missing])
        _copy_files(site, files, work)
        if not moved:
            try:
                for diff in diffs:
                    _run_patch(diff, work)
            except PatchError as error:
                return Status(release, site, "moved", [str(error)])
            return Status(release, site, "pristine", [])
        try:  # already patched? undo the series and compare with the release's files
            for diff in reversed(diffs):
                _run_patch(diff, work, reverse=True)
        except PatchError:
            pass
        else:
            if all(_sha256(work / f) == pristine[f] for f in files):
                return Status(release, site, "applied", [])
    problems = [
        f"{f}: sha256 {found[f]} under {site}, the diffs were written against {pristine[f]} "
        f"(vLLM {release} as released) - upstream moved or the file was changed; "
        "re-verify the fix there and regenerate the diff"
        for f in moved
    ]
    return Status(release, site, "moved", problems)


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def apply(
    site: Path,
    release: str,
    out: Path,
    patches_dir: Path = PATCHES,
    tests_from: Path | None = None,
) -> Path:
    """``out/vllm`` = the installed package with the release's diffs applied.

    Untouched files are hard links to the installed ones (copies across filesystems);
    every file a diff touches is a private copy, so the installed tree never changes.
    Refuses a tree that is not the release's source. With ``tests_from`` (a directory
    holding the release's ``tests/``, e.g. its unpacked sdist), ``out/tests`` is that
    ``tests/`` with the diffs' test changes, made the same way. Returns ``out``.
    """
    found = status(site, release, patches_dir)
    if found.state != "pristine":
        raise PatchError(f"vLLM at {site} is {found.state}: " + "; ".join(found.problems))
    diffs = series(release, patches_dir)
    shutil.copytree(
        site / "vllm",
        out / "vllm",
        copy_function=_link_or_copy,
        dirs_exist_ok=False,
    )
    for file in sorted({f for d in diffs for f in d.files}):
        target = out / file
        target.unlink()
        shutil.copyfile(site / file, target)
    for diff in diffs:
        _run_patch(diff, out)
    if tests_from is not None:
        apply_tests(tests_from, release, out, patches_dir)
    return out


def apply_tests(source: Path, release: str, out: Path, patches_dir: Path = PATCHES) -> Path:
    """``out/tests`` = ``source/tests`` (the release's own tests) with the release's
    diffs' test changes; refuses test files that are not the release's."""
    diffs = series(release, patches_dir)
    files = sorted({f for d in diffs for f in d.test_files})
    recorded = {f: d.sources[f] for d in diffs for f in d.test_files}
    moved = [f for f in files if _sha256(source / f) != recorded[f]]
    if moved:
        raise PatchError(
            f"tests under {source} are not vLLM {release}'s: "
            + ", ".join(
                f"{f} (sha256 {_sha256(source / f)}, diffs want {recorded[f]})" for f in moved
            )
        )
    shutil.copytree(source / "tests", out / "tests", copy_function=_link_or_copy)
    for file in files:
        target = out / file
        target.unlink()
        shutil.copyfile(source / file, target)
    for diff in diffs:
        _run_patch(diff, out, tests=True)
    return out


def apply_in_place(site: Path, release: str, patches_dir: Path = PATCHES) -> None:
    """Patch the installed files themselves (for image builds); refuses a moved tree."""
    found = status(site, release, patches_dir)
    if found.state == "applied":
        return
    if found.state != "pristine":
        raise PatchError(f"vLLM at {site} is {found.state}: " + "; ".join(found.problems))
    for diff in series(release, patches_dir):
        _run_patch(diff, site)


def combined_diff(site: Path, release: str, patches_dir: Path = PATCHES) -> str:
    """The unified diff from the installed files to the installed files + the series."""
    diffs = series(release, patches_dir)
    files = sorted({f for d in diffs for f in d.files})
    with tempfile.TemporaryDirectory(prefix="prime_r3_patches_") as tmp:
        work = Path(tmp)
        _copy_files(site, files, work)
        for diff in diffs:
            _run_patch(diff, work)
        chunks = [
            "".join(
                difflib.unified_diff(
                    (site / f).read_text().splitlines(keepends=True),
                    (work / f).read_text().splitlines(keepends=True),
                    f"a/{f}",
                    f"b/{f}",
                )
            )
            for f in files
        ]
    return "".join(chunks)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["check", "apply", "diff"])
    parser.add_argument("--site", type=Path, help="directory holding vllm/ (default: installed)")
    parser.add_argument("--release", help="vLLM release of the diffs (default: installed)")
    parser.add_argument("--out", type=Path, help="apply: write DIR/vllm (a patched copy)")
    parser.add_argument("--in-place", action="store_true", help="apply: patch the tree itself")
    parser.add_argument(
        "--tests",
        type=Path,
        metavar="SDIST",
        help="apply --out: also write DIR/tests, SDIST/tests with the diffs' test changes",
    )
    args = parser.parse_args(argv)
    site = args.site or installed_site()
    release = args.release or installed_release()
    try:
        diffs = series(release)
        problems = registry_mismatch(release, diffs)
        if problems:
            raise PatchError("; ".join(problems))
        if args.command == "check":
            found = status(site, release)
            for diff in diffs:
                size = diff.path.stat().st_size
                needs = f"  (requires {', '.join(diff.requires)})" if diff.requires else ""
                tests = f"; tests: {', '.join(diff.test_files)}" if diff.test_files else ""
                print(f"{diff.path.name:28} {size:6d} B  {', '.join(diff.files)}{tests}{needs}")
            files = {d.name: d.path.name for d in diffs}
            for name, carrier in registry_carried(release).items():
                print(f"{name:28} in {files[carrier]} (part of the {carrier} diff)")
            for name, why in registry_pending(release).items():
                print(f"{name:28} no diff yet (overlay only): {why}")
            print(f"vLLM {release} at {site}: {found.state}")
            for problem in found.problems:
                print(f"  {problem}")
            return 0 if found.state in ("pristine", "applied") else 1
        if args.command == "apply":
            if args.in_place == (args.out is not None):
                parser.error("apply needs exactly one of --out DIR and --in-place")
            if args.tests is not None and args.out is None:
                parser.error("apply --tests needs --out DIR")
            if args.in_place:
                apply_in_place(site, release)
                print(f"vLLM {release} at {site}: patched in place")
            else:
                apply(site, release, args.out, tests_from=args.tests)
                print(f"{args.out}/vllm: vLLM {release} with {len(diffs)} diffs applied")
                if args.tests is not None:
                    changed = sorted({f for d in diffs for f in d.test_files})
                    print(f"{args.out}/tests: {args.tests}/tests, changed: {changed}")
            return 0
        sys.stdout.write(combined_diff(site, release))
        return 0
    except PatchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
