"""``AOSTORE_VLLM_DATA_PLANE_REPORT``: one JSON line per connector, appended to a file at close
or exit (the tests' proof from inside the worker and the engine core): which side, whether the
plane ran, why not, and the steps and outputs it handled. The path comes from the plugin's
settings, bound on the installed classes; a failed write is dropped (a report must never fail
vLLM's shutdown)."""

from __future__ import annotations

import json
import os
from typing import Any


def write(path: str, line: dict[str, Any]) -> None:
    try:
        with open(path, "a") as file:
            file.write(json.dumps({**line, "pid": os.getpid()}) + "\n")
    except OSError:
        pass


def report_once(connector: Any, path: str) -> None:
    """The worker connector's line, once (``close`` and exit both ask)."""
    if connector.__dict__.get("_aostore_reported"):
        return
    connector._aostore_reported = True
    plane = connector.__dict__.get("_aostore_plane")
    write(
        path,
        {
            "side": "worker",
            "on": plane is not None,
            "why_not": connector.__dict__.get("_aostore_why_not"),
            "steps": plane.steps if plane is not None else 0,
            "outputs": plane.outputs if plane is not None else 0,
        },
    )


def report_scheduler(connector: Any, path: str) -> None:
    """The scheduler side's line: its metadata built natively, per step."""
    write(
        path,
        {
            "side": "scheduler",
            "on": connector._aostore_fallbacks == 0,
            "why_not": connector._aostore_why_not,
            "steps": connector._aostore_steps,
            "fallbacks": connector._aostore_fallbacks,
        },
    )
