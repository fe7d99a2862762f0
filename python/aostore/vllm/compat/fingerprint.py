"""Recognizing a vLLM release CI proves: the sha256 of every ``.py`` file of the store package."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from .releases import RELEASES

KNOWN_RELEASES: dict[str, dict[str, str]] = {
    release.name: dict(release.package) for release in RELEASES
}
"""The store feature of each release record (``releases.RELEASES``): the sha256 of each ``.py``
file (path relative to the store module's package directory) of
``vllm/distributed/aux_output_connector``. A store module whose directory holds exactly these
files is swapped in full."""


def package_directory(module: Any) -> Path | None:
    file = getattr(module, "__file__", None)
    return Path(file).parent if isinstance(file, str) else None


def fingerprint(module: Any) -> dict[str, str] | None:
    """sha256 of every ``.py`` file under ``module``'s directory, by relative path.

    ``None`` when the module has no source directory or a file cannot be read.
    """
    directory = package_directory(module)
    if directory is None:
        return None
    try:
        files = sorted(
            path
            for path in directory.rglob("*.py")
            if "__pycache__" not in path.relative_to(directory).parts
        )
        return {
            path.relative_to(directory).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in files
        }
    except OSError:
        return None


def recognize(module: Any) -> str | None:
    """The name of the release in :data:`KNOWN_RELEASES` whose files ``module``'s are."""
    found = fingerprint(module)
    if found is None:
        return None
    for name, files in KNOWN_RELEASES.items():
        if found == files:
            return name
    return None
