"""``make test-vllm``: vLLM's own store tests, unmodified, against aostore through its plugin.

1. Keeps a virtual environment, ``.venv-vllm``, with ``vllm==0.33.0`` and vLLM's test pin of
   pytest (rebuilt when the pins below change; a stamp file records them) and installs the
   aostore wheel from ``dist/`` into it.
2. Fetches vLLM 0.33.0's source distribution with pip from the configured index. pip prepares
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
   skipping.

Fails (exit status 1) when pip cannot reach the index, when any item fails, errors or is
skipped, when the counts differ from ``EXPECTED``, when the classes in use are not the expected
ones (``engine_plugins`` prints which classes the test modules got), or when the plugin run
shows no start-up line from aostore's plugin.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))
PYTHON = VENV / "bin" / "python"
STAMP = VENV / ".aostore-pins"

VLLM_VERSION = "0.33.0"
PINS = (
    f"vllm=={VLLM_VERSION}",
    "pytest==9.1.0",  # vLLM 0.33.0's requirements/test pin
    # What vLLM's setup.py imports to prepare the sdist's metadata (its build-system table).
    "setuptools>=77.0.3,<81",
    "setuptools-scm>=8",
    "setuptools-rust>=1.9",
)

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
EXPECTED = 124

_OUTCOME = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")


def step(message: str) -> None:
    print(f"== test-vllm: {message}", flush=True)


def run(*command: str | Path, env: dict[str, str] | None = None) -> None:
    done = subprocess.run([str(part) for part in command], env=env, check=False)
    if done.returncode != 0:
        shown = " ".join(map(str, command))
        sys.exit(f"test-vllm: failed (exit status {done.returncode}): {shown}")


def ensure_venv() -> None:
    pins = "\n".join((sys.version.split()[0], *PINS)) + "\n"
    if PYTHON.exists() and STAMP.exists() and STAMP.read_text() == pins:
        step(f"reusing {VENV.name} ({', '.join(PINS[:2])})")
        return
    step(f"creating {VENV.name} with {', '.join(PINS)}")
    shutil.rmtree(VENV, ignore_errors=True)
    run(sys.executable, "-m", "venv", VENV)
    run(PYTHON, "-m", "pip", "install", "-q", "--upgrade", "pip")
    run(PYTHON, "-m", "pip", "install", "-q", *PINS)
    STAMP.write_text(pins)


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
    if not plugin:
        env["AOSTORE_VLLM_PLUGIN"] = "0"
    items = [STORE_TESTS, CAPTURE_TESTS]
    started = time.monotonic()
    status, lines = run_pytest(
        f"vLLM's tests, {label}", ["-p", "engine_plugins", *items], source, env
    )
    summary, problems = outcome(status, lines, EXPECTED)
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
    if problems:
        return f"FAILED {result}: " + "; ".join(problems)
    step(f"OK {result}")
    return ""


def run_plugin_tests() -> str:
    """aostore's own plugin tests and the dry run's (``aostore vllm-check``), whose real-vLLM
    cases skip unless vLLM is installed."""
    files = [
        "plugin/test_plugin.py",
        "plugin/test_vllm_check.py",
        "plugin/test_data_plane.py",
        "plugin/test_data_plane_life.py",
    ]
    label = f"aostore's tests/{' and '.join(files)} with vLLM {VLLM_VERSION} installed"
    env = clean_env()
    env["PYTHONPATH"] = str(ROOT / "tests" / "support")  # vllm_trees.py, without the conftest
    status, lines = run_pytest(label, ["--noconftest", *files], ROOT / "tests", env)
    summary, problems = outcome(status, lines, None)
    if problems:
        return f"FAILED {label}: {summary}: " + "; ".join(problems)
    step(f"OK {label}: {summary}")
    return ""


def main() -> None:
    started = time.monotonic()
    ensure_venv()
    install_wheel()
    with tempfile.TemporaryDirectory(prefix="aostore-test-vllm-") as tmp:
        source = fetch_tests(Path(tmp))
        failures = [run_vllm_tests(source, plugin=True), run_vllm_tests(source, plugin=False)]
    failures.append(run_plugin_tests())
    for failure in filter(None, failures):
        print(f"test-vllm: {failure}", file=sys.stderr)
    step(f"done in {time.monotonic() - started:.0f} s")
    if any(failures):
        sys.exit(1)


if __name__ == "__main__":
    main()
