"""Runs a test's script in a fresh interpreter, where a hang, a crash or a leak cannot take the
test process with it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

TIMEOUT = 30.0

PRELUDE = """
import gc, os, sys, threading, time
import numpy as np
from aostore import BackgroundBlockObjectStore, BlockObject, BlockObjectStore, BlockObjectStoreError

def rss():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
"""


def run_script(body: str, timeout: float = TIMEOUT, env: dict[str, str] | None = None) -> str:
    """Runs ``body`` after :data:`PRELUDE`; a hang or a non-zero exit fails the test."""
    code = PRELUDE + textwrap.dedent(body)
    try:
        result = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the script hung (no exit within {timeout} s)")
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-3000:]}"
    return result.stdout
