"""The README and docs/ as a user reads them: every Python example runs as written, every link
resolves, the README stays short, and its settings table names every variable aostore reads.

Each ```` ```python ```` block runs alone in a fresh interpreter (in a temporary directory), so
a block that leans on names from another block, or on this test's process, fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import mooncake_util
import pytest
from mooncake_fakes import require_mooncake

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

# Blocks that cannot run here, by a text they contain, and why. Only what needs a service or a
# device this test cannot provide: every other block runs.
SKIPS = {
    "TieredBlockObjectStore.from_config(": (
        "needs a running Mooncake master and client: test_mooncake_block_runs_against_a_master "
        "runs it against one"
    ),
}

_FENCE = re.compile(r"^```(\S*)\s*$")


def _blocks(page: Path) -> list[tuple[int, str, str]]:
    """(line, language, text) of each fenced block of ``page``."""
    found = []
    language, start, lines = None, 0, []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = _FENCE.match(line)
        if language is None:
            if fence:
                language, start, lines = fence.group(1), number, []
        elif line.rstrip() == "```":
            found.append((start, language, "\n".join(lines) + "\n"))
            language = None
        else:
            lines.append(line)
    assert language is None, f"{page.name}: the block opened at line {start} is not closed"
    return found


def _python_blocks() -> list[tuple[str, str]]:
    return [
        (f"{page.relative_to(ROOT)}:{line}", text)
        for page in PAGES
        for line, language, text in _blocks(page)
        if language == "python"
    ]


BLOCKS = _python_blocks()


def test_the_readme_has_python_examples() -> None:
    assert sum(name.startswith("README.md:") for name, _ in BLOCKS) >= 3


def test_every_skip_names_one_block() -> None:
    for marker in SKIPS:
        assert sum(marker in text for _, text in BLOCKS) >= 1, f"no block contains {marker!r}"


@pytest.mark.parametrize(("name", "text"), BLOCKS, ids=[name for name, _ in BLOCKS])
def test_python_block_runs_as_written(name: str, text: str, tmp_path: Path) -> None:
    for marker, why in SKIPS.items():
        if marker in text:
            pytest.skip(why)
    if re.search(r"^import torch$", text, re.M) and importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed here (make test installs it)")
    done = subprocess.run(
        [sys.executable, "-c", text],
        cwd=tmp_path,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"{name} failed:\n{text}\n{done.stderr[-4000:]}"


# The addresses the Mooncake blocks use (docs/mooncake.md's quick start); the test below gives
# them its own master's.
MOONCAKE_MASTER = "127.0.0.1:50051"
MOONCAKE_METADATA = "http://127.0.0.1:8080/metadata"
MOONCAKE_BLOCKS = [(name, text) for name, text in BLOCKS if "TieredBlockObjectStore" in text]

# Run after a Mooncake block, in its process: what it read, and what a reader elsewhere needs.
_REPORT = """
import hashlib as _hashlib, json as _json
print(_json.dumps({"config": config, "keys": keys, "nbytes": len(data) // len(keys),
                   "sha256": _hashlib.sha256(data).hexdigest()}))
"""

# Another process: a fresh tiered store (an empty local tier) reads the same keys from Mooncake.
_READER = """
import hashlib, json, sys
from aostore.mooncake import TieredBlockObjectStore
wrote = json.loads(sys.stdin.read())
store = TieredBlockObjectStore.from_config(
    wrote["config"], max_bytes=1 << 24, object_nbytes=wrote["nbytes"])
data = store.get_concatenated(wrote["keys"])
print(json.dumps({"sha256": hashlib.sha256(data).hexdigest(),
                  "from_mooncake": store.stats()["remote_hit_objects"]}))
store.close()
"""


def _run(code: str, cwd: Path, stdin: str = "") -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=dict(os.environ),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"failed:\n{code}\n{done.stderr[-4000:]}"
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def mooncake_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[mooncake_util.Cluster]:
    """A master and a segment holder on loopback (free ports), stopped by PID at the end."""
    require_mooncake()
    with mooncake_util.cluster(tmp_path_factory.mktemp("mooncake")) as started:
        yield started


def test_the_readme_has_a_mooncake_block() -> None:
    assert any(name.startswith("README.md:") for name, _ in MOONCAKE_BLOCKS)


@pytest.mark.mooncake
@pytest.mark.parametrize(
    ("name", "text"), MOONCAKE_BLOCKS, ids=[name for name, _ in MOONCAKE_BLOCKS]
)
def test_mooncake_block_runs_against_a_master(
    name: str, text: str, mooncake_cluster: mooncake_util.Cluster, tmp_path: Path
) -> None:
    """The block as written, with the test master's addresses for the quick start's; then a
    second process reads what it published from Mooncake, byte for byte."""
    assert MOONCAKE_MASTER in text and MOONCAKE_METADATA in text, name
    code = text.replace(MOONCAKE_MASTER, mooncake_cluster.master_address)
    code = code.replace(MOONCAKE_METADATA, mooncake_cluster.metadata_server)
    wrote = json.loads(_run(code + _REPORT, tmp_path))
    read = json.loads(_run(_READER, tmp_path, stdin=json.dumps(wrote)))
    assert read == {"sha256": wrote["sha256"], "from_mooncake": len(wrote["keys"])}


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors: set[str] = set()
    inside = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
        heading = re.match(r"^#{1,6} (.*)$", line)
        if heading and not inside:
            slug = _slug(heading.group(1))
            n, unique = 0, slug
            while unique in anchors:
                n += 1
                unique = f"{slug}-{n}"
            anchors.add(unique)
    return anchors


def _links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of each Markdown link outside code."""
    found = []
    inside = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            inside = not inside
            continue
        if inside:
            continue
        prose = re.sub(r"`[^`]*`", "", line)
        found += [(number, target) for target in re.findall(r"\]\(([^)\s]+)\)", prose)]
    return found


def test_slugs_follow_githubs_rules() -> None:
    assert _slug("vLLM's own tests") == "vllms-own-tests"
    assert _slug("Figures (T9)") == "figures-t9"
    assert _slug("Profile `grow` (vLLM 0.33)") == "profile-grow-vllm-033"
    assert _slug("Guarantees, in brief") == "guarantees-in-brief"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_link_resolves(page: Path) -> None:
    broken = []
    for line, target in _links(page):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{page.name}:{line}: {target} (no such file)")
        elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
            broken.append(f"{page.name}:{line}: {target} (no such heading in {where.name})")
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    linked = {
        (README.parent / target.partition("#")[0]).resolve()
        for page in PAGES
        for _, target in _links(page)
        if target.partition("#")[0].endswith(".md")
    }
    assert {page.resolve() for page in DOCS} <= linked
    readme_links = {target.partition("#")[0] for _, target in _links(README)}
    for page in DOCS:
        assert f"docs/{page.name}" in readme_links, f"the README does not link docs/{page.name}"


def test_the_readme_reads_in_five_minutes() -> None:
    assert len(README.read_text().splitlines()) < 300


def test_the_settings_table_names_every_variable_aostore_reads() -> None:
    """Every ``AOSTORE_VLLM_*`` the package reads (digits included: the R3 ones) has a row;
    a row may name several in its first cell. (A trainer's own ``AOSTORE_R3_OWNER`` is read
    by the reader, not by vLLM's processes: docs/r3-reference.md.)"""
    package = ROOT / "python" / "aostore"
    read = set()
    for source in package.rglob("*.py"):
        read |= set(re.findall(r"\bAOSTORE_VLLM_[A-Z0-9_]+\b", source.read_text()))
    assert read >= {"AOSTORE_VLLM_PLUGIN", "AOSTORE_VLLM_R3_BUDGET", "AOSTORE_VLLM_R3_TTL"}
    first_cells = re.findall(r"^\| (`AOSTORE_[^|]*)\|", README.read_text(), re.M)
    named = {name for cell in first_cells for name in re.findall(r"AOSTORE_[A-Z0-9_]+", cell)}
    assert named == read
