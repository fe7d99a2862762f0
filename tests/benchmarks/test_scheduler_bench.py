"""``benches/scheduler.py --quick`` in a vLLM environment: vLLM 0.33.0's scheduler-side
``AuxOutputSchedulerConnector`` over W3's schedule (``benches/worker.py``'s), per engine step.

Skips where vLLM's scheduler connector is not importable (the main suite); run it with the
interpreter of the ``make test-vllm`` environment, e.g. ``.venv-vllm/bin/python -m pytest
tests/benchmarks/test_scheduler_bench.py``. Checks that every run went through the whole
schedule and that its figures are consistent (p50 <= p99 <= total, all positive); not their size,
which tiny sizes cannot judge.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package is missing
        return False


if not _importable("vllm.distributed.aux_output_connector.connector"):
    pytest.skip(
        "vllm.distributed.aux_output_connector.connector (vLLM 0.33.0) is not importable here",
        allow_module_level=True,
    )

from bench_runs import run_quick  # noqa: E402  (tests/support)


def test_quick_run(tmp_path: Path) -> None:
    stdout, result = run_quick("scheduler.py", tmp_path / "scheduler.json", timeout=300)
    assert "median of 3" in stdout, stdout
    assert result["requests"] > 0
    assert result["schedule_steps"] > 0
    assert result["steps"] == result["schedule_steps"]
    assert result["reps"] == len(result["runs"]) == 3
    for figures in [*result["runs"], result["median"]]:
        for prefix in ("", "core_"):
            p50, p99, total = (figures[f"{prefix}{key}_ms"] for key in ("p50", "p99", "total"))
            assert 0 < p50 <= p99 <= total, figures
        assert all(ms > 0 for ms in figures["call_ms"].values()), figures
    for run in result["runs"]:
        assert run["steps"] == result["schedule_steps"]
        counts = run["counts"]
        assert counts["admitted"] == counts["finished"] == result["requests"]
        assert counts["scheduled"] > 0 and counts["hashes_sent"] > 0 and counts["retained"] > 0
