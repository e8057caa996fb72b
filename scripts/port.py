"""Port prime_r3 to a new vLLM release: what changed upstream since the last verified one.

    python scripts/port.py --root DIR                 # DIR: the new release's unpacked wheel
    python scripts/port.py --root DIR --base OLD      # OLD: the last verified release's tree

``DIR`` holds the new release's ``vllm/`` (``pip download --no-deps vllm==X``, unzip);
its release is read from ``vllm-*.dist-info`` (or ``--release``). The last verified
release is the newest ``patches/vllm-<release>/`` (or ``--from``). For every patch that
still applies there (not fixed upstream), each target and anchor is:

- ``unchanged``: its source in ``DIR`` has a verified fingerprint;
- ``moved``: it is there, with source no release was verified on; printed with the
  unified diff of upstream's source from the last verified release (``--base``, else
  ``.venv-<release>/``, else the installed vLLM, whose release the header names);
- ``gone``: it is not defined where the registry looks it up;

and each ``patches/vllm-<last>/`` diff is tried on ``DIR`` (``patch --dry-run -p1``, its
``Requires:`` applied first, as ``scripts/patches.py`` does). Exit status 1 when anything
is moved or gone or a diff does not apply. What to do with each answer: README, "A new
vLLM release"; the steps are printed at the end.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from packaging.version import Version

from prime_r3 import fingerprint, guards
from prime_r3.patches import REGISTRY
from prime_r3.spec import Anchor, PatchSpec, Target

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str) -> ModuleType:
    """A sibling script as a module (``scripts/`` is no package)."""
    path = ROOT / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"prime_r3_script_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


fingerprint_script = _script("fingerprint")
diffs_tool = _script("patches")


class Elsewhere(fingerprint.SourceUnavailable):
    """The code is in a module outside ``vllm/`` (numpy, starlette): not in a vLLM tree."""


def release_reader(root: Path) -> fingerprint.Reader:
    """Reads ``root``'s modules; a module outside ``vllm/`` it lacks is ``Elsewhere``."""
    read = fingerprint_script.tree_reader(str(root))

    def reader(module_name: str) -> fingerprint.ModuleText:
        try:
            return read(module_name)
        except fingerprint.SourceUnavailable as error:
            if module_name.split(".")[0] == "vllm":
                raise
            raise Elsewhere(f"{module_name} is not vLLM's: not in the tree") from error

    return reader


@dataclass(frozen=True)
class Item:
    """What became of one target or anchor in the new tree."""

    patch: str
    kind: str  # "target" or "anchor"
    key: str
    #: unchanged, moved, gone, absent (an anchor the release is not meant to have) or
    #: elsewhere (not vLLM's code, so not in a vLLM tree)
    state: str
    #: the unified diff (moved) or the reason (gone, absent, elsewhere)
    detail: str = ""


def classify(
    item: Target | Anchor,
    spec: PatchSpec,
    new: fingerprint.Reader,  # release_reader's
    new_label: str,
    base: fingerprint.Reader,
    base_label: str,
    new_release: str | None,
) -> Item:
    """Whether ``item`` is unchanged, moved (with the diff from ``base``) or gone in ``new``."""
    kind = "anchor" if isinstance(item, Anchor) else "target"
    if isinstance(item, Anchor) and not item.exists_in(new_release):
        return Item(spec.name, kind, item.key, "absent", f"the anchor is for {item.releases}")
    try:
        found = fingerprint.locate(item.module, item.attr, new)
    except Elsewhere as error:
        return Item(spec.name, kind, item.key, "elsewhere", str(error))
    except fingerprint.SourceUnavailable as error:
        return Item(spec.name, kind, item.key, "gone", str(error))
    if found.fingerprint() in item.fingerprints:
        return Item(spec.name, kind, item.key, "unchanged")
    try:
        old = fingerprint.locate(item.module, item.attr, base).segment()
    except fingerprint.SourceUnavailable as error:
        old = f"# not in {base_label}: {error}"
    where = f"{found.module}:{found.qualname}"
    diff = difflib.unified_diff(
        old.splitlines(keepends=True),
        found.segment().splitlines(keepends=True),
        f"{base_label} {where}",
        f"{new_label} {where} {found.fingerprint()}",
    )
    return Item(spec.name, kind, item.key, "moved", "".join(diff) or "(as in the base)")


def try_diffs(release: str, root: Path) -> dict[str, str]:
    """Diff name -> ``applies ...`` or ``does not apply ...``: each ``patches/vllm-<release>/``
    diff on a copy of ``root``'s files, after the diffs it requires."""
    diffs = diffs_tool.series(release)
    results = {}
    for diff in diffs:
        chain = diffs_tool.with_requirements(diff, diffs)
        files = sorted({f for d in chain for f in d.files})
        missing = [f for f in files if not (root / f).is_file()]
        if missing:
            results[diff.name] = f"does not apply: {', '.join(missing)} missing"
            continue
        with tempfile.TemporaryDirectory(prefix="prime_r3_port_") as tmp:
            diffs_tool._copy_files(root, files, Path(tmp))
            for step in chain:
                try:
                    diffs_tool._run_patch(step, Path(tmp), dry_run=step is diff)
                except diffs_tool.PatchError as error:
                    why = _failed_hunks(str(error))
                    if step is not diff:
                        why = f"it requires {step.path.stem}, which does not ({why})"
                    results[diff.name] = f"does not apply: {why}"
                    break
        if diff.name in results:
            continue
        changed = [f for f in diff.files if diffs_tool._sha256(root / f) != diff.sources[f]]
        results[diff.name] = (
            f"applies, but upstream changed {', '.join(changed)} (re-diff: new Source-sha256)"
            if changed
            else f"applies (its files are {release}'s)"
        )
    return results


def _failed_hunks(patch_output: str) -> str:
    """``file: Hunk #N FAILED at L`` from GNU patch's output (all of it if none)."""
    failed, file = [], ""
    for line in patch_output.splitlines():
        if line.startswith(("checking file ", "patching file ")):
            file = line.split(" ", 2)[2]
        elif (line.startswith("Hunk #") and "FAILED" in line) or "can't find file" in line:
            failed.append(f"{file}: {line.strip().rstrip('.')}")
    return "; ".join(failed) or patch_output.replace("\n", "\n    ")


def _base(args: argparse.Namespace, last: str) -> tuple[fingerprint.Reader, str]:
    """The reader of the last verified release's source, and its label (release, place)."""
    if args.base is not None:
        site = args.base
    else:
        sites = sorted(ROOT.glob(f".venv-{last}/lib/python3*/site-packages"))
        site = sites[0] if sites else diffs_tool.installed_site()
    release = fingerprint_script.tree_release(str(site))
    if release is None and args.base is None:
        release = guards.installed_vllm_release()
    return fingerprint_script.tree_reader(str(site)), f"{release} ({site})"


def main(argv: list[str] | None = None) -> int:
    """Print the report and the next steps; exit 1 if anything is moved, gone or a diff
    does not apply, 2 if ``patches/`` has no series for the last verified release."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="the new release's dir with vllm/")
    parser.add_argument("--base", type=Path, help="the last verified release's dir with vllm/")
    parser.add_argument("--from", dest="last", help="last verified release (newest in patches/)")
    parser.add_argument("--release", help="the new release (default: DIR's dist-info)")
    args = parser.parse_args(argv)
    last = args.last or max(
        (p.name.removeprefix("vllm-") for p in diffs_tool.PATCHES.glob("vllm-*")), key=Version
    )
    release = args.release or fingerprint_script.tree_release(str(args.root))
    if release is None:
        parser.error(f"no vllm-*.dist-info under {args.root}: name the release with --release")
    new = release_reader(args.root)
    base, base_label = _base(args, last)
    new_label = f"{release} ({args.root})"
    print(f"vLLM {new_label} against {last}, the last verified release; its source: {base_label}")
    try:
        applied = try_diffs(last, args.root)
    except diffs_tool.PatchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    bad = 0
    for spec in REGISTRY:
        skip = guards.check_version(spec, last)
        if skip is not None:
            print(f"\n{spec.name}: skips on {last} already ({skip}): nothing to port")
            continue
        now = guards.check_version(spec, release) or "in range"
        print(f"\n{spec.name} (vllm{spec.vllm_range}; {release}: {now})")
        for item in (*spec.targets, *spec.anchors):
            found = classify(item, spec, new, new_label, base, base_label, release)
            bad += found.state in ("moved", "gone")
            reason = f": {found.detail}" if found.state != "moved" and found.detail else ""
            print(f"  {found.state:9} {found.kind} {found.key}{reason}")
            if found.state == "moved":
                print("    " + found.detail.rstrip("\n").replace("\n", "\n    "))
        carrier = spec.diff_in or spec.name
        if spec.diff_pending_for(last):
            print(f"  diff: none yet (overlay only): {spec.diff_pending_for(last)}")
        elif carrier in applied:
            bad += not applied[carrier].startswith("applies")
            carries = " (carries this fix)" if spec.diff_in else ""
            print(f"  diff {carrier}{carries}: {applied[carrier]}")
    print(NEXT.format(release=release, last=last, root=args.root))
    return 1 if bad else 0


NEXT = """
Next (README, "A new vLLM release"), per patch:
  all unchanged, diff applies: widen vllm_range in its prime_r3/fixes/ record to take {release}.
  moved: read the diff; if the fix is still correct there (adapt it where it is not), add
    the digest the diff's +++ line shows to the item's fingerprints; else keep the range.
  gone: port the fix to where upstream put the code, keep the range, or delete the patch.
  a diff that does not apply, or whose files upstream changed: patches/vllm-{release}/ from
    patches/vllm-{last}/ (`patch -p1` each on {release}'s files, resolve, re-diff with new
    Source-sha256 lines).
Then add {release} to PRIME_R3_RELEASES in scripts/release.sh, and run:
  python scripts/fingerprint.py --root {root}
  VLLM_VERSION={release} ./scripts/test.sh
  .venv-{release}/bin/python scripts/vllm_tests.py
(every item [verified]; the suite with the parity tests; vLLM's own tests, both modes)"""

if __name__ == "__main__":
    sys.exit(main())
