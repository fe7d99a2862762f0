"""pytest plugin for ``make test-vllm``: vLLM's start-up plugin loading, and what it did.

vLLM loads its general plugins (``vllm.plugins.load_general_plugins()``) when an engine or a
worker starts; a test run never starts one, so this plugin makes that one call when pytest
imports it (``-p engine_plugins``), before it collects vLLM's test modules (they import the
store's names at import time) and before it captures output, so the plugins' start-up lines
show. It changes nothing itself: with ``AOSTORE_VLLM_PLUGIN=0`` the same call leaves vLLM's
classes in place.

At the end it prints, for every module of the run that holds one of the store's names, which
class that name is (``aostore-compat: <module>.<name> is <defining module>.<class>``): proof of
whose classes the tests exercised, read by ``run.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import vllm.plugins

NAMES = (
    "BlockObjectStore",
    "BackgroundBlockObjectStore",
    "BlockObject",
    "BlockObjectStoreError",
    # The data plane's (aostore's subclasses where the plugin installed it).
    "AuxOutputWorkerConnector",
    "RoutedExpertsBuffer",
)
PACKAGE = "vllm.distributed.aux_output_connector."

vllm.plugins.load_general_plugins()


def _holders(root: Path) -> list[str]:
    lines = []
    for name, module in sorted(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if not name.startswith(PACKAGE) and root not in Path(path).parents:
            continue
        for attr in NAMES:
            value = vars(module).get(attr)
            if isinstance(value, type):
                lines.append(f"{name}.{attr} is {value.__module__}.{value.__qualname__}")
    return lines


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in _holders(terminalreporter.config.rootpath):
        terminalreporter.write_line(f"aostore-compat: {line}")
