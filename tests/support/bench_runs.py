"""Runs one of ``benches/`` at tiny sizes (``--quick``) against the installed aostore, for the
tests that keep the benches from rotting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCHES = Path(__file__).resolve().parents[2] / "benches"


def run_quick(
    script: str, out: Path, *extra: str, timeout: float = 900.0
) -> tuple[str, dict[str, Any]]:
    """``python benches/<script> --quick --out <out> <extra>`` in this interpreter; a non-zero
    exit fails the test with the bench's output. Returns its stdout and the JSON it wrote."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # aostore as installed (the wheel), not the source tree
    for setting in ("AOSTORE_VLLM_PLUGIN", "AOSTORE_VLLM_DATA_PLANE"):
        env.pop(setting, None)  # the benches set these per arm
    done = subprocess.run(
        [sys.executable, str(BENCHES / script), "--quick", "--out", str(out), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, json.loads(out.read_text())
