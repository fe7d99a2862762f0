"""Hard-links files that several of the project's virtual environments hold byte for byte.

CI makes five environments (.venv, .venv-vllm, .venv-vllm34, .venv-engine, .venv-engine31), four
of them with a CUDA build of torch and its NVIDIA libraries: about 30 GB, mostly the same files
several times. A CI run once died of a full disk installing the last of them. Linking the copies
that are identical (same path under site-packages, size, mode and bytes) leaves one on disk.

Safe for what the environments are used for: pip never writes into an installed file, it removes
a distribution's files and writes new ones (a reinstall unlinks the link, the other environment
keeps its copy), and Python writes bytecode by renaming a new file over the old one.

Usage: python3 .ci/share_venv_files.py VENV [VENV ...]   (missing environments are skipped)
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

# Files smaller than this are not worth a comparison: the NVIDIA libraries and torch's own
# shared objects, which are what fills the disk, are megabytes to gigabytes each.
MIN_SIZE = 1 << 20
CHUNK = 1 << 22


def site_packages(venv: Path) -> Path | None:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    return found[0] if found else None


def same_bytes(a: Path, b: Path) -> bool:
    with a.open("rb") as fa, b.open("rb") as fb:
        while True:
            ca, cb = fa.read(CHUNK), fb.read(CHUNK)
            if ca != cb:
                return False
            if not ca:
                return True


def share(venvs: list[Path]) -> tuple[int, int]:
    """Links each large file of a later environment to the first identical one; (files, bytes)."""
    first: dict[tuple[str, int, int], list[Path]] = {}
    linked = saved = 0
    for venv in venvs:
        root = site_packages(venv)
        if root is None:
            print(f"{venv}: no site-packages, skipped")
            continue
        for dirpath, _dirs, files in os.walk(root):
            for name in files:
                path = Path(dirpath, name)
                st = path.lstat()  # a symbolic link is no regular file here: left alone
                if not stat.S_ISREG(st.st_mode) or st.st_size < MIN_SIZE:
                    continue
                key = (str(path.relative_to(root)), st.st_size, st.st_mode)
                for kept in first.setdefault(key, []):
                    if kept.stat().st_ino == st.st_ino:
                        break
                    if same_bytes(kept, path):
                        tmp = path.with_name(path.name + ".aostore-link")
                        os.link(kept, tmp)
                        os.replace(tmp, path)
                        linked += 1
                        saved += st.st_size
                        break
                else:
                    first[key].append(path)
    return linked, saved


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    venvs = [Path(a) for a in argv if Path(a).is_dir()]
    linked, saved = share(venvs)
    print(f"shared {linked} files between {len(venvs)} environments: {saved / 2**30:.1f} GiB freed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
