"""``aostore vllm-fingerprint``: a vLLM tree beside every release record, and what differs.

It is a maintainer's first step when vLLM publishes a release (docs/adding-a-vllm-release.md),
so it must say what it found for any tree and never raise. The trees here are written by the
tests: the real releases are checked by ``make test-vllm`` (test_data_plane.py, with vLLM).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from aostore.vllm.compat import releases

HAS_VLLM = importlib.util.find_spec("vllm") is not None
NEWEST = releases.RELEASES[0]


def _fingerprint(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AOSTORE_")}
    return subprocess.run(
        [sys.executable, "-m", "aostore", "vllm-fingerprint", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def _write_package(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here: the no-vLLM case cannot be seen")
def test_without_vllm_it_says_so_and_exits_2() -> None:
    done = _fingerprint()
    assert done.returncode == 2, done.stdout + done.stderr
    assert "vLLM is not installed here" in done.stdout
    assert done.stderr == ""


def test_a_tree_of_no_release_is_shown_beside_every_record(tmp_path: Path) -> None:
    _write_package(
        tmp_path, {"__init__.py": "", f"{releases.PACKAGE_DIR}/worker.py": "# not vLLM's\n"}
    )
    done = _fingerprint("--root", str(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    header = next(line for line in lines if "file (under vllm/)" in line)
    assert all(record.name in header for record in releases.RELEASES)
    worker = next(line for line in lines if line.split()[0].endswith("/worker.py"))
    # Installed hash, then each record's own (none is "same").
    assert worker.split()[2:] == [NEWEST.package["worker.py"][:12]] + [
        record.package["worker.py"][:12] for record in releases.RELEASES[1:]
    ]
    missing = next(line for line in lines if line.split()[0] == "v1/request.py")
    assert missing.split()[1] == "missing"
    assert lines[-1] == "result: this tree matches no record for any feature (exit status 1)"
    assert done.stderr == ""


def test_a_directory_that_is_not_vllm_is_named_not_tabled(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a package\n")
    done = _fingerprint("--root", str(tmp_path))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    assert f"{tmp_path} is not a vLLM package" in done.stderr


def test_a_partial_match_names_each_feature(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The package is 0.34.0's only in content we can write: use a record made of our files.
    files = {f"{releases.PACKAGE_DIR}/{name}": f"# {name}\n" for name in NEWEST.package}
    _write_package(tmp_path, files)
    record = releases.Release(
        name="vLLM 9.0.0",
        distributions=(),
        layout="0.34",
        package={
            name: releases.digest(tmp_path / path) or ""
            for path, name in zip(files, NEWEST.package, strict=True)
        },
        worker=dict(NEWEST.worker),
        scheduler=dict(NEWEST.scheduler),
        transport=dict(NEWEST.transport or {}),
    )
    lines, status = releases.describe(tmp_path, (record, *releases.RELEASES))
    assert status == 1
    assert "vLLM 9.0.0 (layout 0.34): store matches; worker plane differs (" in "\n".join(lines)
    assert lines[-1] == (
        "result: a partial match (store: vLLM 9.0.0's; worker plane: no record; "
        "scheduler side: no record; transport: no record) (exit status 1)"
    )
    # The whole tree one record's: exit status 0.
    assert record.transport is not None
    for relative in (*record.worker, *record.scheduler, *record.transport):
        _write_package(tmp_path, {relative: f"# {relative}\n"})
    whole = releases.Release(
        name=record.name,
        distributions=(),
        layout="0.34",
        package=record.package,
        worker={path: releases.digest(tmp_path / path) or "" for path in record.worker},
        scheduler={path: releases.digest(tmp_path / path) or "" for path in record.scheduler},
        transport={path: releases.digest(tmp_path / path) or "" for path in record.transport},
    )
    lines, status = releases.describe(tmp_path, (whole,))
    assert (status, lines[-1]) == (
        0,
        "result: this tree is vLLM 9.0.0's for every feature (exit status 0)",
    )
    monkeypatch.setattr(releases, "RELEASES", (whole, *releases.RELEASES))
    assert releases.installed(releases.WORKER, tmp_path) is whole
    assert releases.installed(releases.WORKER, tmp_path / "nothing") is None


def test_an_unreadable_file_is_shown_as_missing_not_raised(tmp_path: Path) -> None:
    _write_package(tmp_path, {f"{releases.PACKAGE_DIR}/store.py": "x"})
    # A directory where a file should be: reading it fails with an OSError.
    (tmp_path / "v1" / "outputs.py").mkdir(parents=True)
    lines, status = releases.describe(tmp_path)
    assert status == 1
    row = next(line for line in lines if line.split()[0] == "v1/outputs.py")
    assert row.split()[1] == "missing"
