"""A real vLLM engine, once with vLLM's store and once with aostore's: the same everything.

Each configuration runs ``engine_run.py`` twice, each in its own process (so the plugin state
is clean): with ``AOSTORE_VLLM_PLUGIN=0`` (vLLM's store) and with the plugin on (aostore's).
Both runs build the same engine over the same tiny random-weight MoE checkpoint
(``tiny_moe.py``) and send the same seeded requests (``workload.py``): shared prefixes,
multi-turn rounds that re-send earlier prompts and outputs (prefix-cache hits whose routed
experts come back from the store) and a repeat of the first round. The test then checks:

- the worker's store objects are vLLM's classes in the first run and aostore's in the second,
  read inside the worker process (``engine_probe.py``);
- identical generated tokens and identical ``routed_experts`` arrays for every request,
  including the rows of prefix-cache hits, which the engine reads from the store;
- identical final store contents: keys, bytes, LRU order of evictable keys, reference counts.

Configurations (each also records every call the worker makes on its store and replays it
on fresh stores of both kinds, ``test_replayed_calls``):

- ``roomy``: vLLM's default store size (as many slots as KV blocks): nothing is evicted;
- ``evicting``: 4 sequences at a time over 32 KV blocks and a 40-slot store, so the store
  evicts, and evicted blocks are computed and stored again. The store keeps at least as many
  slots as there are KV blocks: a prefix-cache hit on a block the store no longer holds is a
  fatal error in vLLM ("Increase aux_output_config.max_bytes").

Both runs of a configuration must make the same store calls in the same order, or their final
LRU orders could differ whatever the store. ``engine_run.py`` sees to it: the engine core
runs in the driving process (every request of a round is queued before the first step), and
async scheduling is off, so a step's outputs reach the store before the next step begins
(with it on, that is a matter of timing where the worker applies outputs on a thread of its
own, as vLLM's multi-process executor does).

Runs only under ``make test-engine`` (``AOSTORE_REQUIRE_ENGINE=1``), where a missing vLLM is
a failure; the main suite skips it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("AOSTORE_REQUIRE_ENGINE") != "1":
    pytest.skip(
        "real vLLM engine test: runs under `make test-engine` (AOSTORE_REQUIRE_ENGINE=1)",
        allow_module_level=True,
    )
for _module in ("vllm", "aostore", "numpy"):
    if importlib.util.find_spec(_module) is None:
        pytest.fail(f"AOSTORE_REQUIRE_ENGINE=1 but {_module} is not importable here", pytrace=False)

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
RUN_TIMEOUT_S = 900
ARMS = {"vllm": "0", "aostore": "1"}
_summary = os.environ.get("AOSTORE_ENGINE_SUMMARY")
SUMMARY = Path(_summary) if _summary else None


@dataclass(frozen=True)
class Config:
    """One configuration: ``engine_run.py`` arguments, and whether its store must evict."""

    args: tuple[str, ...]
    evicts: bool


CONFIGS = {
    "roomy": Config(("--rounds", "2"), evicts=False),
    "evicting": Config(
        ("--max-num-seqs", "4", "--kv-blocks", "32", "--store-slots", "40"), evicts=True
    ),
}


@dataclass(frozen=True)
class Runs:
    """The two runs of one configuration: what each ``engine_run.py`` wrote."""

    config: Config
    vllm: dict[str, Any]
    aostore: dict[str, Any]


_RUNS: dict[str, Runs] = {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-moe")
    subprocess.run(
        [sys.executable, str(HERE / "tiny_moe.py"), str(out)],
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=300,
    )
    return out


def run_arm(model: Path, work: Path, name: str, arm: str) -> dict[str, Any]:
    """One engine process; returns what it wrote, plus its wall time."""
    config = CONFIGS[name]
    out = work / f"{arm}.pkl"
    log = work / f"{arm}.log"
    env = dict(os.environ, AOSTORE_VLLM_PLUGIN=ARMS[arm])
    command = [sys.executable, str(HERE / "engine_run.py"), "--model", str(model)]
    command += ["--out", str(out), "--probe", "--record", "--async-scheduling", "off"]
    command += config.args
    start = time.perf_counter()
    with log.open("wb") as sink:
        process = subprocess.run(
            command, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S
        )
    wall_s = time.perf_counter() - start
    if process.returncode != 0:
        tail = log.read_text(errors="replace")[-6000:]
        pytest.fail(f"{name}/{arm}: engine_run exited {process.returncode}\n{tail}")
    result: dict[str, Any] = pickle.loads(out.read_bytes())
    result["wall_s"] = wall_s
    return result


@pytest.fixture
def runs(config: str, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Both runs of ``config``, made on first use and shared by every test after it."""
    if config not in _RUNS:
        work = tmp_path_factory.mktemp(f"engine-{config}")
        results = {arm: run_arm(model_dir, work, config, arm) for arm in ARMS}
        report(config, results)
        _RUNS[config] = Runs(CONFIGS[config], **results)
    return _RUNS[config]


every_config = pytest.mark.parametrize("config", list(CONFIGS))


def report(config: str, results: dict[str, dict[str, Any]]) -> None:
    """One line per arm on stdout (``make test-engine`` runs pytest with ``-s``), and the
    same figures as JSON where ``AOSTORE_ENGINE_SUMMARY`` points."""
    rows = {}
    for arm, result in results.items():
        stats = (result["contents"] or {}).get("stats", {})
        rows[arm] = {
            "requests": len(result["requests"]),
            "output_tokens": sum(len(r["tokens"]) for r in result["requests"]),
            "prefix_hit_requests": sum(r["num_cached_tokens"] > 0 for r in result["requests"]),
            "cached_tokens": sum(r["num_cached_tokens"] for r in result["requests"]),
            "store_slots": result["classes"]["num_slots"],
            "object_nbytes": result["classes"]["object_nbytes"],
            "stored_at_end": len(result["contents"]["objects"]),
            "objects_written": stats.get("objects_written"),
            "evictions": stats.get("evictions"),
            "startup_s": round(result["startup_s"], 1),
            "generate_s": round(sum(result["round_s"]), 1),
            "wall_s": round(result["wall_s"], 1),
        }
        print(f"\n[engine {config}/{arm}] " + ", ".join(f"{k}={v}" for k, v in rows[arm].items()))
    if SUMMARY is not None:
        SUMMARY.parent.mkdir(parents=True, exist_ok=True)
        existing = json.loads(SUMMARY.read_text()) if SUMMARY.exists() else {}
        existing[config] = rows
        SUMMARY.write_text(json.dumps(existing, indent=1, sort_keys=True))


def by_id(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in result["requests"]}


@every_config
def test_worker_store_classes(runs: Runs) -> None:
    import aostore

    ours, theirs = runs.aostore["classes"], runs.vllm["classes"]
    vllm_store = "vllm.distributed.aux_output_connector.store."
    assert ours["pid"] != os.getpid() and theirs["pid"] != os.getpid()
    assert not theirs["plugin_mark"]
    for name in [theirs["background"], theirs["store"], *theirs["modules"].values()]:
        assert name.startswith(vllm_store), theirs
    assert ours["plugin_mark"]
    background = aostore.BackgroundBlockObjectStore
    assert ours["background"] == f"{background.__module__}.{background.__qualname__}"
    assert ours["store"].startswith("aostore."), ours
    for name in ours["modules"].values():
        assert name.startswith("aostore."), ours
    # vLLM 0.32's store refuses rather than grows: the plugin must have picked that profile.
    if runs.aostore["vllm_version"].startswith("0.32"):
        assert ours["profile"] == "fail-closed"
    assert (ours["num_slots"], ours["object_nbytes"]) == (
        theirs["num_slots"],
        theirs["object_nbytes"],
    )


@every_config
def test_same_tokens(runs: Runs) -> None:
    ours, theirs = by_id(runs.aostore), by_id(runs.vllm)
    assert ours.keys() == theirs.keys()
    for request_id, request in theirs.items():
        assert ours[request_id]["prompt"] == request["prompt"]
        assert ours[request_id]["tokens"] == request["tokens"], request_id
        assert ours[request_id]["num_cached_tokens"] == request["num_cached_tokens"], request_id


@every_config
def test_same_routed_experts(runs: Runs) -> None:
    ours, theirs = by_id(runs.aostore), by_id(runs.vllm)
    classes = runs.vllm["classes"]
    hits = 0
    for request_id, request in theirs.items():
        expected = request["routed_experts"]
        got = ours[request_id]["routed_experts"]
        assert isinstance(expected, np.ndarray) and isinstance(got, np.ndarray), request_id
        # Every token but the last was fed to the model: prompt rows served from the store on
        # a prefix-cache hit are in the array like the ones computed in this request.
        rows = len(request["prompt"]) + len(request["tokens"]) - 1
        assert expected.shape[0] == rows, (request_id, expected.shape)
        assert expected.dtype == got.dtype and expected.shape == got.shape, request_id
        assert np.array_equal(expected, got), request_id
        assert classes["object_nbytes"] == 32 * int(np.prod(got.shape[1:])) * got.itemsize
        hits += request["num_cached_tokens"] > 0
    # Every multi-turn and repeated request hits the prefix cache.
    workload = runs.vllm["workload"]
    assert hits >= workload["conversations"] * (workload["rounds"] - 1 + workload["repeat"])


@every_config
def test_same_store_contents(runs: Runs) -> None:
    ours, theirs = runs.aostore["contents"], runs.vllm["contents"]
    assert ours["references"] == theirs["references"]
    # Not necessarily empty: the scheduler tells the worker about finished requests with the
    # next step's metadata, and after the last round there is no next step.
    assert list(ours["objects"]) and sorted(ours["objects"]) == sorted(theirs["objects"])
    for key, payload in theirs["objects"].items():
        assert ours["objects"][key] == payload, key
    assert ours["lru"] == theirs["lru"]


@every_config
def test_store_holds_routed_experts_blocks(runs: Runs) -> None:
    """Every stored object is one 32-token block of some request's routed experts."""
    blocks = set()
    for request in runs.vllm["requests"]:
        rows = request["routed_experts"]
        for start in range(0, len(rows) - 31, 32):
            blocks.add(rows[start : start + 32].tobytes())
    for key, payload in runs.aostore["contents"]["objects"].items():
        assert payload in blocks, key


@every_config
def test_eviction_as_configured(runs: Runs) -> None:
    stats = runs.aostore["contents"]["stats"]
    slots = runs.aostore["classes"]["num_slots"]
    assert stats["capacity_errors"] == 0 and stats["read_misses"] == 0
    if runs.config.evicts:
        assert stats["evictions"] > 0
        assert len(runs.vllm["contents"]["objects"]) == slots
    else:
        assert stats["evictions"] == 0


def vllm_store_module() -> Any:
    """vLLM's ``aux_output_connector/store.py``, loaded from its file alone: a fresh copy of
    its classes, untouched by the plugin (vLLM 0.32's imports only the standard library)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin).parent / "distributed" / "aux_output_connector" / "store.py"
    name = "_vllm_store_replayed"
    module_spec = importlib.util.spec_from_file_location(name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses look their module up while building the class
    module_spec.loader.exec_module(module)
    return module


def replay(calls: list[Any], store: Any, block_object: Any) -> list[bytes]:
    """Applies the recorded calls to ``store``; returns what its reads returned."""
    reads = []
    for call in calls:
        if call[0] == "put":
            _, payloads, retains, releases = call
            objects = [block_object(key, payload) for key, payload in payloads]
            store.put(objects, retain_keys=retains, release_keys=releases)
        else:
            reads.append(store.get_concatenated(call[1]))
    return reads


@every_config
def test_replayed_calls(runs: Runs) -> None:
    """Each run's own sequence of store calls, replayed on a fresh vLLM store and a fresh
    aostore store: the same bytes from every read as the engine got, and the same final
    contents as each other and as the engine's store; and both runs made the same calls."""
    import aostore
    from engine_probe import vllm_store_contents

    vllm_store = vllm_store_module()
    for arm, result in (("vllm", runs.vllm), ("aostore", runs.aostore)):
        calls = result["calls"]
        classes = result["classes"]
        assert any(call[0] == "put" and call[1] for call in calls), arm
        engine_reads = [call[2] for call in calls if call[0] == "get"]
        size = {"max_bytes": classes["num_slots"] * classes["object_nbytes"]}
        size["object_nbytes"] = classes["object_nbytes"]
        theirs = vllm_store.BlockObjectStore(**size)
        ours = aostore.BlockObjectStore(**size, profile=runs.aostore["classes"]["profile"])
        try:
            assert replay(calls, theirs, vllm_store.BlockObject) == engine_reads, arm
            assert replay(calls, ours, aostore.BlockObject) == engine_reads, arm
            replayed_theirs = vllm_store_contents(theirs)
            replayed_ours = {k: v for k, v in ours.snapshot().items() if k != "stats"}
            ours.check()
        finally:
            theirs.close()
            ours.close()
        assert replayed_ours == replayed_theirs, arm
        engine = {k: v for k, v in result["contents"].items() if k != "stats"}
        assert replayed_ours == engine, arm
    assert runs.aostore["calls"] == runs.vllm["calls"]
