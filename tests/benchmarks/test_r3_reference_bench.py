"""``benches/r3_reference.py --quick`` (T14) in a vLLM environment: vLLM's rows against R3 rows
by reference over the same requests, a server and a client process, ABBA.

Skips where ``vllm`` is not importable (the main suite); ``make test-vllm`` runs it in each
release's environment. Checks what tiny sizes can judge: every arm's client got every request's
rows right (the bench checks them and fails otherwise), no reference fell back to rows, the
field is a reference of at most 1 KB only in the reference arm, and the table, the orchestrator
figures and the verdict lines are there; not the timings.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not importable here", allow_module_level=True)

from bench_runs import run_quick

ROW_NBYTES = 46 * 8


def test_quick_run(tmp_path: Path) -> None:
    stdout, result = run_quick("r3_reference.py", tmp_path / "t14.json", timeout=600)
    summary = result["summary"]
    assert set(summary) == {"sample", "batch", "rollout"}
    for job, arms in summary.items():
        assert set(arms) == {"vllm", "rows", "reference"}, job
        rows_bytes = arms["vllm"]["rows"] * ROW_NBYTES
        # vLLM's bodies carry base64 .npy of the rows; ours a reference, whatever their size.
        assert arms["vllm"]["body_bytes"] > rows_bytes > arms["reference"]["body_bytes"]
        assert arms["rows"]["body_bytes"] == arms["vllm"]["body_bytes"]
        assert arms["reference"]["field_bytes_max"] <= 1024
        assert arms["reference"]["node_bytes"] > 0 and arms["vllm"]["node_bytes"] == 0
        read = arms["reference"]["read"]
        assert read["bytes"] == rows_bytes and read["floor_ms"] > 0
    for runs in result["runs"].values():
        for run in runs:
            arena = run["server"]["arena"]
            assert (arena is not None) == (run["arm"] == "reference")
            if arena is not None:
                assert arena["fallbacks"] == 0 and arena["references"] > 0
    assert set(result["t14"]) == {"sample", "batch", "rollout"}
    assert "T14 batch: field" in stdout and "orchestrator buffering" in stdout, stdout
