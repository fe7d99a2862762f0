"""``benches/worker.py --quick`` (T10, T12) in a vLLM environment: vLLM's worker connector with
vLLM's store, aostore's, a no-op store, and aostore's data plane, each run twice in ABBA order;
once on W3's schedule (its metadata made here) and once on metadata that vLLM's own
``AuxOutputSchedulerConnector`` makes (``--schedule vllm-scheduler``: prefix hits read back,
speculative rejections, chunked prefill, hashes after rows).

Skips where ``vllm`` is not importable (the main suite); ``make test-vllm`` runs it in each
release's environment. Checks that each run used the store it names (the class vLLM's worker
built, the data plane on exactly in its arm), that prefix-cache hits were read back and every
checked output came back right (the bench raises on a wrong row), and that the table and the
JSON carry every figure; not the ratios, which tiny sizes cannot judge.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not importable here", allow_module_level=True)

from bench_runs import run_quick

STORES = ("noop", "vllm", "aostore", "dataplane")

STORE_CLASSES = {
    "noop": "NoopBlockObjectStore",
    "vllm": "vllm.distributed.aux_output_connector.store.BlockObjectStore",
    "aostore": "aostore.vllm_plugin.GrowBlockObjectStore",
    "dataplane": "aostore.vllm_plugin.GrowBlockObjectStore",
}


def _run(tmp_path: Path, *extra: str) -> tuple[str, dict[str, Any]]:
    return run_quick("worker.py", tmp_path / "worker.json", *extra)


def _check_runs(result: dict[str, Any]) -> None:
    assert result["order"] == [*STORES, *reversed(STORES)]
    assert result["store_slots"] < 1000
    for run in result["runs"]:
        store = run["store"]
        assert run["classes"]["store"].endswith(STORE_CLASSES[store]), run["classes"]
        assert run["classes"]["data_plane"] == (store == "dataplane"), run["classes"]
        assert run["steps"] == result["steps"] > 0
        figures = run["figures"]
        assert figures["total_ms"] > 0 and figures["p99_us"] >= figures["p50_us"]
        per_call = sum(figures[f"{name}_ms"] for name in ("begin_step", "prepare_output"))
        assert 0 < per_call <= figures["total_ms"]
    summary = result["summary"]
    assert set(summary["stores"]) == set(STORES)
    assert len(summary["t12"]["per_block"]) == 1


def test_quick_run_on_w3(tmp_path: Path) -> None:
    stdout, result = _run(tmp_path)
    assert "T10: aostore's store-caused total / vLLM's" in stdout, stdout
    assert "T12: aostore's data plane and store / vLLM's connector and store" in stdout, stdout
    assert result["schedule"] == "w3"
    _check_runs(result)
    for run in result["runs"]:
        assert run["steps"] == result["schedule_steps"]
        assert run["prefix_reads"] > 0
        if run["store"] != "noop":
            # Every prefill's output (read from the store on a prefix-cache hit) was checked.
            assert run["verified_prefills"] == result["requests"]
    assert len(result["summary"]["t10_ratio_per_half"]) == 2


def test_quick_run_on_vllms_scheduler_metadata(tmp_path: Path) -> None:
    stdout, result = _run(tmp_path, "--schedule", "vllm-scheduler")
    assert "T12: aostore's data plane and store / vLLM's connector and store" in stdout, stdout
    assert result["schedule"] == "vllm-scheduler"
    _check_runs(result)

    def scheduled(run: dict[str, Any]) -> dict[str, int]:
        return {k: v for k, v in run["schedule_counts"].items() if k != "outputs_checked"}

    first = scheduled(result["runs"][0])
    # What vLLM's scheduler connector sends, in this small schedule too.
    for what in ("prefix_hits", "chunked_prefill_steps", "rejections", "hashes_after_rows"):
        assert first[what] > 0, (what, first)
    for run in result["runs"]:
        # Same schedule in every arm (same seed); outputs checked in every arm that stores.
        assert scheduled(run) == first, (run["store"], run["schedule_counts"])
        assert run["prefix_reads"] > 0
        if run["store"] != "noop":
            assert run["verified_prefills"] == run["schedule_counts"]["outputs_checked"] > 0
