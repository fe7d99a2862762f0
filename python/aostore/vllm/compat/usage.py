"""What vLLM's code does with the store package's names: attribute use, and its files on disk."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import sys
import types
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .fingerprint import package_directory
from .names import PACKAGE

_ATTRIBUTE_CALLS = {"getattr": False, "hasattr": False, "setattr": True, "delattr": True}


@dataclasses.dataclass
class Usage:
    """Attribute names that vLLM code uses on objects other than its own ``self``/``cls``."""

    read: set[str] = dataclasses.field(default_factory=set)
    """Read (or called), including ``getattr``/``hasattr`` strings."""
    written: set[str] = dataclasses.field(default_factory=set)
    """Assigned or deleted, including ``setattr``/``delattr`` strings."""
    sources: list[str] = dataclasses.field(default_factory=list)
    """The files read."""
    unreadable: list[str] = dataclasses.field(default_factory=list)
    """Modules that name the classes but whose source could not be read or parsed."""


def _scan(tree: ast.AST, found: Usage) -> None:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue  # the class's own use of its own names: replaced along with it
            found.read.add(node.attr)
            if isinstance(node.ctx, ast.Store | ast.Del):
                found.written.add(node.attr)
        elif isinstance(node, ast.Call):
            func = node.func
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else ""
            )
            strings = [
                arg.value
                for arg in node.args
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            ]
            if name in _ATTRIBUTE_CALLS and len(node.args) >= 2:
                second = node.args[1]
                if isinstance(second, ast.Constant) and isinstance(second.value, str):
                    found.read.add(second.value)
                    if _ATTRIBUTE_CALLS[name]:
                        found.written.add(second.value)
            elif name in ("attrgetter", "methodcaller"):
                found.read.update(part for text in strings for part in text.split("."))


def vllm_modules() -> Iterator[tuple[str, types.ModuleType]]:
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "vllm" or name.startswith("vllm.")):
            yield name, module


def usage(
    store_module: Any,
    class_names: Iterable[str],
    sources: Sources | None = None,
    *,
    inside: bool = True,
    attributes: Iterable[str] | None = None,
) -> Usage:
    """What vLLM code uses: the package directory's files, every imported ``vllm`` module whose
    source names the package or one of ``class_names``, and the files of ``sources`` (the
    installed ``vllm`` package on disk, :func:`vllm_sources`) that do. ``inside=False``: only
    the files outside the package directory. ``attributes``: the only names asked about; a
    file outside the package is then parsed only when its text reads one of them on something
    other than ``self``/``cls`` (or names it in a string).

    An object of these classes reaches other code only through code that names its class or
    its package, so files that do neither are not parsed (it keeps start-up cheap).
    """
    found = Usage()
    names = list(class_names)
    paths: dict[Path, str] = {}
    directory = package_directory(store_module)
    if directory is not None and inside:
        for path in sorted(directory.rglob("*.py")):
            paths[path] = path.name
    for name, module in vllm_modules():
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and file.endswith(".py"):
            paths.setdefault(Path(file), name)
    texts: dict[Path, str] = {}
    if sources is not None:
        texts.update(sources.files)
        for path in sources.files:
            paths.setdefault(path, shown(path, sources.root))
        found.unreadable.extend(sources.unreadable)
    words = [PACKAGE, *names]
    wanted = None
    if attributes is not None:
        alternatives = "|".join(re.escape(name) for name in sorted(set(attributes)))
        wanted = re.compile(
            rf"\.({alternatives})\b|[\"']({alternatives})[\"']" if alternatives else "(?!)"
        )
    for path, name in paths.items():
        in_package = directory is not None and path.is_relative_to(directory)
        if in_package and not inside:
            continue
        text = texts.get(path)
        if text is None:
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                found.unreadable.append(name)
                continue
        if not in_package and not any(word in text for word in words):
            continue
        if not in_package and wanted is not None and not _mentions(text, wanted):
            continue
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            found.unreadable.append(name)
            continue
        _scan(tree, found)
        found.sources.append(str(path))
    return found


@dataclasses.dataclass
class Sources:
    """The ``.py`` files of the installed ``vllm`` package that name the package or one of the
    classes the plan looks at: read from disk, so the decision does not depend on which modules
    this process has imported yet (in a worker the plugin runs before the model runner and the
    worker modules are imported)."""

    root: Path | None = None
    """The ``vllm`` package's directory; ``None``: not found (no scan)."""
    files: dict[Path, str] = dataclasses.field(default_factory=dict)
    """Path -> text of each file that names the package or a class."""
    unreadable: list[str] = dataclasses.field(default_factory=list)
    """Files that name them but could not be read or decoded."""
    scanned: int = 0
    """How many ``.py`` files were looked at."""


def _vllm_root(store_module: Any) -> Path | None:
    top = sys.modules.get("vllm")
    file = getattr(top, "__file__", None)
    if isinstance(file, str):
        return Path(file).parent
    directory = package_directory(store_module)
    # vllm/distributed/aux_output_connector/store.py: the package directory's grandparent.
    if (
        directory is not None
        and len(directory.parents) >= 2
        and directory.parents[1].name == "vllm"
    ):
        return directory.parents[1]
    return None


def _python_files(root: str) -> Iterator[str]:
    stack = [root]
    while stack:
        directory = stack.pop()
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            if entry.name != "__pycache__":
                                stack.append(entry.path)
                        elif entry.name.endswith(".py"):
                            yield entry.path
                    except OSError:
                        continue
        except OSError:
            continue


def _fewest_words(words: Iterable[str]) -> list[bytes]:
    """``words`` less those that contain another (``BlockObject`` covers ``BlockObjectStore``)."""
    unique = sorted(set(words), key=len)
    kept: list[str] = []
    for word in unique:
        if not any(shorter in word for shorter in kept):
            kept.append(word)
    return [word.encode() for word in kept]


def vllm_sources(store_module: Any, class_names: Iterable[str]) -> Sources:
    """The installed ``vllm`` package's files that name :data:`PACKAGE` or one of
    ``class_names`` (a substring test on the bytes; only those are decoded and parsed later)."""
    found = Sources(root=_vllm_root(store_module))
    if found.root is None:
        return found
    words = _fewest_words([PACKAGE, *class_names])
    for path in _python_files(str(found.root)):
        found.scanned += 1
        try:
            with open(path, "rb") as file:
                data = file.read()
        except OSError:
            found.unreadable.append(path)
            continue
        if any(word in data for word in words):
            try:
                found.files[Path(path)] = data.decode("utf-8")
            except UnicodeDecodeError:
                found.unreadable.append(path)
    return found


def _mentions(text: str, pattern: re.Pattern[str]) -> bool:
    """Whether ``text`` reads one of ``pattern``'s names on something other than ``self`` or
    ``cls`` (``x.name``), or holds one in a string."""
    for match in pattern.finditer(text):
        start = match.start()
        if match.group(0)[0] != ".":
            return True
        before = text[max(0, start - 5) : start]
        owner = re.search(r"(\w*)$", before)
        if owner is None or owner.group(1) not in ("self", "cls"):
            return True
    return False


def shown(path: Path, root: Path | None) -> str:
    if root is not None and path.is_relative_to(root.parent):
        return path.relative_to(root.parent).as_posix()
    return str(path)
