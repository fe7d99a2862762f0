"""``benches/transport.py --quick`` (T13's baseline) in a vLLM environment: vLLM's own classes
for each hop of the routed-experts rows after the worker connector (worker -> engine core ->
frontend, three processes in lockstep), R3 off and on, ABBA.

Skips where ``vllm`` is not importable (the main suite); ``make test-vllm`` runs it in each
release's environment. Checks that every finished request's rows came back right in the R3
arms (the bench checks them against what the capturer produced) and that none came with R3 off,
that vLLM's wire is what it measures (a frame per routed-experts array; one a step with
aostore's transport, rows inline), and that the table and the JSON carry each hop; not the
figures, which tiny sizes cannot judge.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not importable here", allow_module_level=True)

from bench_runs import run_quick

HOPS = {
    "worker.enqueue",
    "engine_core.dequeue",
    "engine_core.update",
    "engine_core.encode_send",
    "frontend.recv",
    "frontend.decode",
    "frontend.process_outputs",
    "frontend.finish",
}


def test_quick_run(tmp_path: Path) -> None:
    stdout, result = run_quick("transport.py", tmp_path / "t13.json", timeout=600)
    assert "R3's share, vllm" in stdout and "T13: aostore / vLLM" in stdout, stdout
    assert result["order"] == ["off", "vllm", "aostore", "aostore", "vllm", "off"]
    assert len(result["runs"]) == 6
    for arm, run in zip(result["order"], result["runs"], strict=True):
        assert set(run["hops"]) == HOPS, run["hops"].keys()
        assert set(run["processes"]) == {"worker", "engine_core", "frontend"}
        assert run["checked"]["finished"] > 0, run["checked"]
        frames = run["processes"]["frontend"]["frames_p50"]  # as the frontend received them
        # vLLM's output thread sends each routed-experts array of 256 B or more as its own frame;
        # aostore's engine core, started by its frontend (the bench stands in), sends vLLM's
        # frame and one of the step's rows (the packed hop); with R3 off, one frame a step.
        expected = {"off": 1, "aostore": 2}
        assert (frames > 2) if arm == "vllm" else (frames == expected[arm]), (arm, frames)
    assert set(result["summary"]["arms"]) == {"off", "vllm", "aostore"}
    # One long sample's finish: the rows came back right in the R3 arm (the bench checks them),
    # and only there the answer's body carries them (base64 .npy: more than their bytes).
    sample = result["summary"]["sample"]
    assert set(sample) == {"off", "vllm", "aostore"}
    assert sample["off"]["rows"] == sample["vllm"]["rows"] == sample["aostore"]["rows"] > 0
    assert sample["vllm"]["body_bytes"] > sample["vllm"]["rows"] * 368 > sample["off"]["body_bytes"]
    # The same answer, byte for byte in size (the bench checks the rows themselves).
    assert sample["aostore"]["body_bytes"] == sample["vllm"]["body_bytes"]
    assert "One sample's finish" in stdout, stdout
    t13 = result["summary"]["t13"]
    assert {"ratio_total", "pickling_ratio", "full_gcs_caused", "rows_held_ratio"} <= set(t13)
    assert "sample_ratio" in t13
