"""A real vLLM engine with vLLM's store, aostore's store, and aostore's data plane: the same
everything.

Each configuration runs ``engine_run.py`` three times, each in its own process (so the plugin
state is clean), the arms of :data:`ARMS`:

- ``vllm``: ``AOSTORE_VLLM_PLUGIN=0``, vLLM's store and vLLM's worker connector code;
- ``aostore``: the plugin with its defaults, aostore's store and its native data plane (the
  connector's ``begin_step``/``prepare_output``/``process_output`` run in Rust);
- ``aostore-plane-off``: the plugin with ``AOSTORE_VLLM_DATA_PLANE=0``, aostore's store under
  vLLM's connector code.

Every arm sets ``AOSTORE_VLLM_DATA_PLANE_REPORT`` to a file of its own, where each connector
aostore's data plane built appends one JSON line at close or exit (inside the worker: its pid,
whether the plane was on, and the steps and outputs it processed). All runs build the same
engine over the same tiny random-weight MoE checkpoint (``tiny_moe.py``) and send the same
seeded requests (``workload.py``): shared prefixes, multi-turn rounds that re-send earlier
prompts and outputs (prefix-cache hits whose routed experts come back from the store) and a
repeat of the first round. The test then checks:

- the worker's store objects are vLLM's classes in the first run and aostore's in the others,
  read inside the worker process (``engine_probe.py``);
- the data plane was on in the ``aostore`` arm, by the worker's own report (every engine step
  and every output went through it) and the plugin's start-up line, and off in the
  ``aostore-plane-off`` arm (start-up line; no connector reports it on);
- identical generated tokens and identical ``routed_experts`` arrays for every request in
  every arm, including the rows of prefix-cache hits, which the engine reads from the store;
- identical final store contents: keys, bytes, LRU order of evictable keys, reference counts;
  between the two aostore arms the store's counters too.

Configurations (each also records every call the worker's connector makes on its Python store
object and replays it on fresh stores of both kinds, ``test_replayed_calls``; the data plane
calls aostore's Rust writer instead, so its arm records none):

- ``roomy``: vLLM's default store size (as many slots as KV blocks): nothing is evicted;
- ``evicting``: 4 sequences at a time over 32 KV blocks and a 40-slot store, so the store
  evicts, and evicted blocks are computed and stored again. The store keeps at least as many
  slots as there are KV blocks: a prefix-cache hit on a block the store no longer holds is a
  fatal error in vLLM ("Increase aux_output_config.max_bytes").

All runs of a configuration must make the same store calls in the same order, or their final
LRU orders could differ whatever the store. ``engine_run.py`` sees to it: the engine core
runs in the driving process (every request of a round is queued before the first step), and
async scheduling is off, so a step's outputs reach the store before the next step begins
(with it on, that is a matter of timing where the worker applies outputs on a thread of its
own, as vLLM's multi-process executor does). With the engine core in the driving process the
worker is that process too; were it a process of vLLM's own, it would inherit the arm's
environment variables.

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
PLUGIN = "AOSTORE_VLLM_PLUGIN"
DATA_PLANE = "AOSTORE_VLLM_DATA_PLANE"
DATA_PLANE_REPORT = "AOSTORE_VLLM_DATA_PLANE_REPORT"
ARMS: dict[str, dict[str, str]] = {
    "vllm": {PLUGIN: "0"},
    "aostore": {PLUGIN: "1"},  # the plugin's defaults: the data plane on
    "aostore-plane-off": {PLUGIN: "1", DATA_PLANE: "0"},
}
"""Each arm's settings; whatever else of these the environment holds is left out."""
AOSTORE_ARMS = ("aostore", "aostore-plane-off")
STARTUP = "aostore vLLM plugin:"
PLANE_ON = "data plane on ("
PLANE_OFF = f"data plane off ({DATA_PLANE}=0)"
CONNECTOR_ON = "aostore data plane: on for vLLM's worker connector"
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
    """The runs of one configuration: what each arm's ``engine_run.py`` wrote, by arm."""

    config: Config
    arms: dict[str, dict[str, Any]]

    @property
    def vllm(self) -> dict[str, Any]:
        return self.arms["vllm"]

    @property
    def aostore(self) -> dict[str, Any]:
        """The data-plane arm."""
        return self.arms["aostore"]

    @property
    def plane_off(self) -> dict[str, Any]:
        return self.arms["aostore-plane-off"]


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


def read_report(path: Path) -> list[dict[str, Any]] | None:
    """The data-plane report's lines; ``None`` when no connector wrote the file."""
    if not path.exists():
        return None
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_arm(model: Path, work: Path, name: str, arm: str) -> dict[str, Any]:
    """One engine process; returns what it wrote, plus its wall time, its data-plane report
    and the log lines that say what aostore did."""
    config = CONFIGS[name]
    out = work / f"{arm}.pkl"
    log = work / f"{arm}.log"
    plane_report = work / f"{arm}.data-plane.jsonl"
    plane_report.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in (PLUGIN, DATA_PLANE)}
    env.update(ARMS[arm])
    env[DATA_PLANE_REPORT] = str(plane_report)
    command = [sys.executable, str(HERE / "engine_run.py"), "--model", str(model)]
    command += ["--out", str(out), "--probe", "--record", "--async-scheduling", "off"]
    command += config.args
    start = time.perf_counter()
    with log.open("wb") as sink:
        process = subprocess.run(
            command, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S
        )
    wall_s = time.perf_counter() - start
    text = log.read_text(errors="replace")
    if process.returncode != 0:
        pytest.fail(f"{name}/{arm}: engine_run exited {process.returncode}\n{text[-6000:]}")
    result: dict[str, Any] = pickle.loads(out.read_bytes())
    result["wall_s"] = wall_s
    result["plane_report"] = read_report(plane_report)
    result["plane_report_path"] = str(plane_report)
    lines = text.splitlines()
    result["startup_lines"] = [line[line.index(STARTUP) :] for line in lines if STARTUP in line]
    result["connector_lines"] = [line for line in lines if "aostore data plane:" in line]
    return result


@pytest.fixture
def runs(config: str, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Every arm's run of ``config``, made on first use and shared by every test after it."""
    if config not in _RUNS:
        work = tmp_path_factory.mktemp(f"engine-{config}")
        results = {arm: run_arm(model_dir, work, config, arm) for arm in ARMS}
        report(config, results)
        _RUNS[config] = Runs(CONFIGS[config], results)
    return _RUNS[config]


every_config = pytest.mark.parametrize("config", list(CONFIGS))
every_aostore_arm = pytest.mark.parametrize("arm", AOSTORE_ARMS)


def worker_lines(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's lines from worker connectors (the scheduler side writes its own)."""
    return [line for line in result["plane_report"] or [] if line.get("side") == "worker"]


def plane_figures(result: dict[str, Any]) -> tuple[bool, int, int]:
    """From the worker's report: whether a connector's data plane was on, and its steps and
    outputs (summed over connectors; one here)."""
    lines = worker_lines(result)
    on = any(line["on"] for line in lines)
    return on, sum(line["steps"] for line in lines), sum(line["outputs"] for line in lines)


def report(config: str, results: dict[str, dict[str, Any]]) -> None:
    """One line per arm on stdout (``make test-engine`` runs pytest with ``-s``), and the
    same figures as JSON where ``AOSTORE_ENGINE_SUMMARY`` points."""
    rows = {}
    for arm, result in results.items():
        stats = (result["contents"] or {}).get("stats", {})
        plane_on, plane_steps, plane_outputs = plane_figures(result)
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
            "engine_steps": len(result["step_s"]),
            "data_plane": plane_on,
            "data_plane_steps": plane_steps,
            "data_plane_outputs": plane_outputs,
            "startup_s": round(result["startup_s"], 1),
            "generate_s": round(sum(result["round_s"]), 1),
            "wall_s": round(result["wall_s"], 1),
        }
        print(f"\n[engine {config}/{arm}] " + ", ".join(f"{k}={v}" for k, v in rows[arm].items()))
        for line in result["plane_report"] or []:
            print(f"[engine {config}/{arm}] data-plane report: {json.dumps(line)}")
    if SUMMARY is not None:
        SUMMARY.parent.mkdir(parents=True, exist_ok=True)
        existing = json.loads(SUMMARY.read_text()) if SUMMARY.exists() else {}
        existing[config] = rows
        SUMMARY.write_text(json.dumps(existing, indent=1, sort_keys=True))


def by_id(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in result["requests"]}


@every_config
@every_aostore_arm
def test_worker_store_classes(runs: Runs, arm: str) -> None:
    import aostore

    ours, theirs = runs.arms[arm]["classes"], runs.vllm["classes"]
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
    # vLLM 0.31-0.32's store refuses rather than grows: the plugin must have picked that profile.
    if runs.arms[arm]["vllm_version"].startswith(("0.31", "0.32")):
        assert ours["profile"] == "fail-closed"
    assert (ours["num_slots"], ours["object_nbytes"]) == (
        theirs["num_slots"],
        theirs["object_nbytes"],
    )


@every_config
def test_data_plane_on(runs: Runs) -> None:
    """The ``aostore`` arm's worker ran its connector on aostore's data plane: its report,
    written inside the worker, says so, and the plane processed every engine step and
    produced every output; the plugin's start-up line said the plane goes in."""
    result = runs.aostore
    assert result["plane_report"] is not None, f"no report at {result['plane_report_path']}"
    lines = worker_lines(result)
    worker = result["classes"]["pid"]
    on = [line for line in lines if line["on"]]
    assert len(on) == 1 and on[0]["pid"] == worker, lines
    assert on[0]["why_not"] is None, lines
    assert on[0]["steps"] > 0 and on[0]["outputs"] > 0, lines
    # Every engine step runs the model once on this worker, and every output token of a
    # request comes with one routed-experts output (no speculative decoding here).
    assert on[0]["steps"] == len(result["step_s"]), (on[0], len(result["step_s"]))
    output_tokens = sum(len(r["tokens"]) for r in result["requests"])
    assert on[0]["outputs"] == output_tokens, (on[0], output_tokens)
    # Connectors of other ranks have no store (none with one device): none is off otherwise.
    for line in lines:
        assert line["on"] or line["why_not"] == "not the output rank (no store)", lines
    assert result["startup_lines"], "no aostore start-up line in the log"
    for line in result["startup_lines"]:
        assert PLANE_ON in line and "worker and scheduler files recognized" in line, line
    assert any(CONNECTOR_ON in line for line in result["connector_lines"]), result[
        "connector_lines"
    ]


@every_config
def test_scheduler_side_on(runs: Runs) -> None:
    """The ``aostore`` arm's scheduler built every step's metadata natively (aostore's
    scheduler-side connector, its own report line at exit), and no other arm did."""
    lines = [line for line in runs.aostore["plane_report"] or [] if line["side"] == "scheduler"]
    assert len(lines) == 1 and lines[0]["on"], runs.aostore["plane_report"]
    assert lines[0]["steps"] >= len(runs.aostore["step_s"]) > 0, lines
    for arm in (runs.vllm, runs.plane_off):
        assert not any(line["side"] == "scheduler" for line in arm["plane_report"] or [])


@every_config
def test_data_plane_off(runs: Runs) -> None:
    """With ``AOSTORE_VLLM_DATA_PLANE=0`` the plugin keeps vLLM's connector (it does not
    install its subclass, so no connector writes a report); with the plugin off, likewise."""
    result = runs.plane_off
    lines = result["plane_report"]
    assert lines is None or not any(line["on"] for line in lines), lines
    assert result["startup_lines"], "no aostore start-up line in the log"
    for line in result["startup_lines"]:
        assert PLANE_OFF in line, line
    assert not any(CONNECTOR_ON in line for line in result["connector_lines"])
    # vLLM's connector code called the store object itself (the data plane never does).
    assert any(call[0] == "put" for call in result["calls"])
    vllm_lines = runs.vllm["plane_report"]
    assert vllm_lines is None or not any(line["on"] for line in vllm_lines), vllm_lines
    assert not any(PLANE_ON in line for line in runs.vllm["startup_lines"])


@every_config
@every_aostore_arm
def test_same_tokens(runs: Runs, arm: str) -> None:
    ours, theirs = by_id(runs.arms[arm]), by_id(runs.vllm)
    assert ours.keys() == theirs.keys()
    for request_id, request in theirs.items():
        assert ours[request_id]["prompt"] == request["prompt"]
        assert ours[request_id]["tokens"] == request["tokens"], request_id
        assert ours[request_id]["num_cached_tokens"] == request["num_cached_tokens"], request_id


@every_config
@every_aostore_arm
def test_same_routed_experts(runs: Runs, arm: str) -> None:
    ours, theirs = by_id(runs.arms[arm]), by_id(runs.vllm)
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
@every_aostore_arm
def test_same_store_contents(runs: Runs, arm: str) -> None:
    ours, theirs = runs.arms[arm]["contents"], runs.vllm["contents"]
    assert ours["references"] == theirs["references"]
    # Not necessarily empty: the scheduler tells the worker about finished requests with the
    # next step's metadata, and after the last round there is no next step.
    assert list(ours["objects"]) and sorted(ours["objects"]) == sorted(theirs["objects"])
    for key, payload in theirs["objects"].items():
        assert ours["objects"][key] == payload, key
    assert ours["lru"] == theirs["lru"]


@every_config
def test_data_plane_same_store_state(runs: Runs) -> None:
    """aostore's store under the data plane and under vLLM's connector code: the same final
    contents and the same counters (puts, retains, releases, reads, bytes, evictions)."""
    with_plane, without = runs.aostore["contents"], runs.plane_off["contents"]
    assert with_plane["stats"] == without["stats"]
    assert with_plane == without


@every_config
@every_aostore_arm
def test_store_holds_routed_experts_blocks(runs: Runs, arm: str) -> None:
    """Every stored object is one 32-token block of some request's routed experts."""
    blocks = set()
    for request in runs.vllm["requests"]:
        rows = request["routed_experts"]
        for start in range(0, len(rows) - 31, 32):
            blocks.add(rows[start : start + 32].tobytes())
    for key, payload in runs.arms[arm]["contents"]["objects"].items():
        assert payload in blocks, key


@every_config
@every_aostore_arm
def test_eviction_as_configured(runs: Runs, arm: str) -> None:
    stats = runs.arms[arm]["contents"]["stats"]
    slots = runs.arms[arm]["classes"]["num_slots"]
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
    contents as each other and as the engine's store; and both of those runs made the same
    calls.

    Recorded on the worker's Python store object, which vLLM's connector code calls (the
    ``vllm`` and ``aostore-plane-off`` arms); the data plane hands its blocks and reads to
    aostore's Rust writer, so the ``aostore`` arm records none (its store state is compared
    with the plane-off arm's in ``test_data_plane_same_store_state``)."""
    import aostore
    from engine_probe import vllm_store_contents

    assert runs.aostore["calls"] == [], runs.aostore["calls"][:3]
    vllm_store = vllm_store_module()
    for arm, result in (("vllm", runs.vllm), ("aostore-plane-off", runs.plane_off)):
        calls = result["calls"]
        classes = result["classes"]
        assert any(call[0] == "put" and call[1] for call in calls), arm
        engine_reads = [call[2] for call in calls if call[0] == "get"]
        size = {"max_bytes": classes["num_slots"] * classes["object_nbytes"]}
        size["object_nbytes"] = classes["object_nbytes"]
        theirs = vllm_store.BlockObjectStore(**size)
        ours = aostore.BlockObjectStore(**size, profile=runs.plane_off["classes"]["profile"])
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
    assert runs.plane_off["calls"] == runs.vllm["calls"]
