"""``benches/worker.py --quick`` (T10) in a vLLM environment: vLLM 0.33.0's worker connector
with vLLM's store, aostore's and a no-op store, each run twice in ABBA order.

Skips where ``vllm`` is not importable (the main suite); run it with the interpreter of the
``make test-vllm`` environment, e.g. ``.venv-vllm/bin/python -m pytest
tests/benchmarks/test_worker_bench.py``. Checks that each run used the store it names (the class
vLLM's
worker built), that prefix-cache hits were read back from the store and came back right, and
that the table and the JSON carry every figure; not the ratio, which tiny sizes cannot judge.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not importable here", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benches" / "worker.py"

STORE_CLASSES = {
    "noop": "NoopBlockObjectStore",
    "vllm": "vllm.distributed.aux_output_connector.store.BlockObjectStore",
    "aostore": "aostore.vllm_plugin.GrowBlockObjectStore",
}


def test_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "t10.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "python"), *filter(None, [env.get("PYTHONPATH")])]
    )
    env.pop("AOSTORE_VLLM_PLUGIN", None)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "| vLLM 0.33.0's store | 2 |" in done.stdout, done.stdout
    assert "T10: aostore's store-caused total / vLLM's" in done.stdout, done.stdout

    result = json.loads(out.read_text())
    assert result["order"] == ["noop", "vllm", "aostore", "aostore", "vllm", "noop"]
    assert result["store_slots"] < 1000
    for run in result["runs"]:
        store = run["store"]
        assert run["classes"]["store"].endswith(STORE_CLASSES[store]), run["classes"]
        assert run["steps"] == result["schedule_steps"]
        assert run["prefix_reads"] > 0
        if store != "noop":
            # Every prefill's output (read from the store on a prefix-cache hit) was checked.
            assert run["verified_prefills"] == result["requests"]
        figures = run["figures"]
        assert figures["total_ms"] > 0 and figures["p99_us"] >= figures["p50_us"]
    summary = result["summary"]
    assert set(summary["stores"]) == {"noop", "vllm", "aostore"}
    assert set(summary["store_caused"]) == {"vllm", "aostore"}
    assert len(summary["t10_ratio_per_half"]) == 2
