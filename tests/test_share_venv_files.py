"""CI's disk saver (.ci/share_venv_files.py): it links only what is the same file in two
environments, and a later reinstall in one environment leaves the other's copy alone."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
MB = 1 << 20


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "share_venv_files", ROOT / ".ci" / "share_venv_files.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def venv(tmp: Path, name: str, files: dict[str, bytes]) -> Path:
    site = tmp / name / "lib" / "python3.11" / "site-packages"
    for rel, data in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)
    return tmp / name


def test_links_identical_files_only(tmp_path: Path) -> None:
    share = load().share
    big = os.urandom(2 * MB)
    other = bytearray(big)
    other[-1] ^= 1  # same size, one byte apart
    a = venv(tmp_path, "a", {"torch/lib/t.so": big, "x/same.so": big, "small.py": b"x" * 10})
    b = venv(
        tmp_path,
        "b",
        {"torch/lib/t.so": big, "x/same.so": bytes(other), "small.py": b"x" * 10, "y/t.so": big},
    )
    linked, saved = share([a, b, tmp_path / "missing"])
    site = "lib/python3.11/site-packages"
    assert (linked, saved) == (1, 2 * MB)
    assert os.path.samefile(a / site / "torch/lib/t.so", b / site / "torch/lib/t.so")
    # Same size, other bytes; another path; a small file: each keeps its own copy.
    assert not os.path.samefile(a / site / "x/same.so", b / site / "x/same.so")
    assert (b / site / "x/same.so").read_bytes() == bytes(other)
    assert not os.path.samefile(a / site / "torch/lib/t.so", b / site / "y/t.so")
    assert not os.path.samefile(a / site / "small.py", b / site / "small.py")
    # A second pass finds nothing left to do.
    assert share([a, b]) == (0, 0)
    # pip's reinstall removes and writes anew: the other environment keeps its bytes.
    (b / site / "torch/lib/t.so").unlink()
    (b / site / "torch/lib/t.so").write_bytes(b"new")
    assert (a / site / "torch/lib/t.so").read_bytes() == big
