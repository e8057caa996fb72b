"""Hard-link a release environment's third-party files to identical ones in its siblings.

``share_env_files.py ROOT VENV``: every release environment under ROOT (``.venv/``,
``.venv-<release>/``) holds its own ~6 GB copy of torch, triton, the CUDA wheels vLLM
declares and the rest, though most of those files are byte-identical across releases
(the same torch 2.13.0 build everywhere, mostly the same pins). CI sets up all three on
one disk; a disk that fits one environment must not fail on the second (a CI run did:
``No space left on device`` while setting up 0.32.0). After an install, each file of
VENV's site-packages that has a byte-identical twin at the same path in an already
verified sibling becomes a hard link to it, which leaves the two environments exactly
as pip made them and stores the bytes once.

Not shared: ``vllm/`` (the code prime_r3 patches and the diffs in ``patches/`` are
applied to; a file written in place there must stay in one release) and ``prime_r3``
itself (editable, in the checkout). pip replaces files by unlinking them, so upgrading a
package in one environment never writes through to another.

Prints how much was shared. Safe to rerun (files that already share an inode are skipped,
a temporary link left by an interrupted run is replaced); a file the filesystem will not
link is left as it is.
"""

from __future__ import annotations

import filecmp
import os
import pathlib
import sys

_NOT_SHARED = ("vllm", "prime_r3", "__editable__")
_TMP_SUFFIX = ".prime_r3-link"


def site_packages(venv: pathlib.Path) -> pathlib.Path:
    """The environment's ``site-packages`` (``lib/python3.X/site-packages``)."""
    found = sorted(venv.glob("lib/python3.*/site-packages"))
    if len(found) != 1:
        raise SystemExit(f"share_env_files: no single site-packages under {venv}: {found}")
    return found[0]


def siblings(root: pathlib.Path, venv: pathlib.Path) -> list[pathlib.Path]:
    """Other release environments under ROOT that finished their setup (verified)."""
    out = []
    for candidate in sorted([root / ".venv", *root.glob(".venv-*")]):
        if candidate.resolve() == venv.resolve():
            continue
        if (candidate / "prime_r3-verified").exists():
            out.append(site_packages(candidate))
    return out


def share(venv: pathlib.Path, others: list[pathlib.Path]) -> tuple[int, int]:
    """Link VENV's files to identical twins in ``others``; return (files, bytes) shared."""
    site = site_packages(venv)
    files = shared = 0
    for directory, subdirs, names in os.walk(site):
        here = pathlib.Path(directory)
        rel_dir = here.relative_to(site)
        if rel_dir == pathlib.Path("."):
            subdirs[:] = [d for d in subdirs if not d.startswith(_NOT_SHARED)]
            names = [n for n in names if not n.startswith(_NOT_SHARED)]
        for name in names:
            if name.endswith(_TMP_SUFFIX):
                continue  # an interrupted run's temporary link: replaced or removed below
            path = here / name
            stat = path.lstat()
            if not path.is_file() or path.is_symlink() or stat.st_size == 0:
                continue
            for other_site in others:
                twin = other_site / rel_dir / name
                try:
                    twin_stat = twin.lstat()
                except FileNotFoundError:
                    continue
                if twin.is_symlink() or twin_stat.st_size != stat.st_size:
                    continue
                if (twin_stat.st_dev, twin_stat.st_ino) == (stat.st_dev, stat.st_ino):
                    break  # already one file
                if twin_stat.st_mode != stat.st_mode:
                    continue
                try:
                    same = filecmp.cmp(path, twin, shallow=False)
                except OSError:
                    continue  # the twin went away (its environment is being set up again)
                if not same:
                    continue
                if _link(twin, path):
                    files += 1
                    shared += stat.st_size
                break
    return files, shared


def _link(twin: pathlib.Path, path: pathlib.Path) -> bool:
    """Replace ``path`` by a hard link to ``twin`` atomically; False (file left as it
    is) where the filesystem refuses (another disk, a link limit, permissions): the
    environment is already complete, sharing only saves space."""
    tmp = path.with_name(f".{path.name}{_TMP_SUFFIX}")
    try:
        tmp.unlink(missing_ok=True)  # left by an interrupted run
        os.link(twin, tmp)
        os.replace(tmp, path)
        return True
    except OSError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: share_env_files.py ROOT VENV", file=sys.stderr)
        return 2
    root, venv = pathlib.Path(argv[0]), pathlib.Path(argv[1])
    others = siblings(root, venv)
    if not others:
        return 0
    files, nbytes = share(venv, others)
    print(
        f"prime_r3: {venv.name} shares {files} files ({nbytes / 2**30:.1f} GiB) "
        f"with {', '.join(p.parents[2].name for p in others)}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
