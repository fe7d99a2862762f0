"""Soak, CI version (issue 5 part 5): millions of mixed operations on a bounded working set
keep RSS flat after warm-up, and ``check()`` holds at the end.

The workload lives in ``benches/soak.py`` (the long run: ``python benches/soak.py --ops
50000000``); ``AOSTORE_SOAK_OPS`` changes the count here.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

OPS = int(os.environ.get("AOSTORE_SOAK_OPS", "5000000"))
MAX_GROWTH = 5 << 20  # bytes of RSS growth after warm-up (or 5%, whichever is larger)


def load_soak() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benches" / "soak.py"
    spec = importlib.util.spec_from_file_location("aostore_soak", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


soak = load_soak()


@pytest.mark.parametrize(
    ("via_writer", "ops"), [(False, OPS), (True, OPS // 2)], ids=["store", "native-writer"]
)
def test_rss_stays_flat_under_millions_of_mixed_operations(via_writer, ops):
    result = soak.run_soak(ops=ops, via_writer=via_writer, samples=30)
    summary = result.summary()
    assert len(result.samples) >= 10, summary
    assert result.ops >= ops
    assert result.stats["evictions"] > 0, summary  # the store was full and churning
    assert result.misses > 0, summary  # reads of evicted keys were exercised
    assert result.stats["reads"] > 0 and result.stats["releases"] > 0, summary
    growth = result.growth
    assert growth < MAX_GROWTH or growth < 0.05 * result.warm_rss, (
        f"RSS grew by {growth / 2**20:.2f} MiB after warm-up: "
        + ", ".join(f"{ops:,}: {rss / 2**20:.2f} MiB" for ops, _, rss in result.samples)
    )
