"""A real vLLM engine with aostore's Mooncake tier on (``AOSTORE_VLLM_MOONCAKE``), and a
trainer's reader in another process that reads what the engine published, by key.

A Mooncake master and a segment holder start on 127.0.0.1 (``tests/support/mooncake_util.py``; the
engine's client mounts no segment, so what it published outlives it). ``engine_run.py`` runs
the engine once, plugin on, with the setting naming a config file for that master; inside the
worker (``engine_probe.py``) the tier is flushed and its local tier's keys and bytes are taken.
After the engine process has exited, ``mooncake_reader.py`` reads those keys from Mooncake with
Mooncake's own calls. The test checks that the worker's store was the tier in front of the
store the plugin builds without the setting, that the start-up line said so, that every key
the local tier holds came back from Mooncake byte for byte, and that each of those objects is
one 32-token block of the routed experts the engine returned for some request.

Runs only under ``make test-engine`` (``AOSTORE_REQUIRE_ENGINE=1``), and skips with the
install command when the engine's environment has no Mooncake.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "support"))  # tests/support/mooncake_util.py
import mooncake_util  # noqa: E402

_missing = mooncake_util.missing_reason()
if _missing is not None:
    pytest.skip(
        f"the engine's environment cannot run Mooncake: {_missing}", allow_module_level=True
    )

RUN_TIMEOUT_S = 900
READ_TIMEOUT_S = 120
BLOCK_TOKENS = 32  # engine_run.py's block size


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[mooncake_util.Cluster]:
    with mooncake_util.cluster(
        tmp_path_factory.mktemp("mooncake"), holder_segment="256MB"
    ) as started:
        yield started


@pytest.fixture(scope="module")
def run(cluster: mooncake_util.Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The engine run with the tier on, then the reader's run; what both wrote."""
    work = tmp_path_factory.mktemp("engine-mooncake")
    model = work / "tiny-moe"
    subprocess.run(
        [sys.executable, str(HERE / "tiny_moe.py"), str(model)],
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=300,
    )
    # No key prefix: Mooncake holds the engine's own keys, as a trainer would look them up.
    config_path = work / "mooncake.json"
    config_path.write_text(json.dumps(cluster.config()))
    out, log = work / "engine.pkl", work / "engine.log"
    env = dict(os.environ, AOSTORE_VLLM_PLUGIN="1", AOSTORE_VLLM_MOONCAKE=str(config_path))
    command = [sys.executable, str(HERE / "engine_run.py"), "--model", str(model)]
    command += ["--out", str(out), "--tier", "--async-scheduling", "off", "--rounds", "2"]
    with log.open("wb") as sink:
        process = subprocess.run(
            command, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S
        )
    text = log.read_text(errors="replace")
    if process.returncode != 0:
        pytest.fail(f"engine_run exited {process.returncode}\n{text[-6000:]}")
    result: dict[str, Any] = pickle.loads(out.read_bytes())
    tier = result["tier"]
    assert tier is not None
    keys_path, read_path = work / "keys.json", work / "read.pkl"
    keys_path.write_text(json.dumps(sorted(tier["objects"])))
    nbytes = result["classes"]["object_nbytes"]
    reader = subprocess.run(
        [
            sys.executable,
            str(HERE / "mooncake_reader.py"),
            *(str(config_path), str(keys_path), str(nbytes), str(read_path)),
        ],
        capture_output=True,
        text=True,
        timeout=READ_TIMEOUT_S,
    )
    assert reader.returncode == 0, reader.stderr[-3000:]
    print(f"\n[engine mooncake] reader: {reader.stdout.strip().splitlines()[-1]}")
    return {
        "result": result,
        "log": text,
        "config_path": config_path,
        "read": pickle.loads(read_path.read_bytes()),
    }


def test_worker_store_is_the_tier_in_front_of_the_plugins_store(
    run: dict[str, Any], cluster: mooncake_util.Cluster
) -> None:
    result, tier = run["result"], run["result"]["tier"]
    assert result["classes"]["plugin_mark"]
    assert result["classes"]["store"] == "aostore.mooncake.TieredBlockObjectStore"
    assert result["classes"]["background"] == "aostore._background.BackgroundBlockObjectStore"
    # vLLM 0.31-0.32's store fails closed: the local tier is what the plugin installs for it.
    if result["vllm_version"].startswith(("0.31", "0.32")):
        assert tier["local"] == "aostore.vllm_plugin.EngineBlockObjectStore"
        assert tier["profile"] == "fail-closed"
    assert tier["remote"] == "aostore.mooncake.MooncakeBlockObjectStore"
    assert tier["master"] == cluster.master_address
    assert tier["key_prefix"] == ""
    line = f"Mooncake tier on (AOSTORE_VLLM_MOONCAKE={run['config_path']}): master "
    assert line + cluster.master_address in run["log"]


def test_reader_gets_every_published_object_byte_for_byte(run: dict[str, Any]) -> None:
    tier, read = run["result"]["tier"], run["read"]
    stats = tier["stats"]
    assert tier["objects"], "the engine stored nothing"
    assert stats["pending_batches"] == 0
    assert stats["published_objects"] >= len(tier["objects"])
    assert stats["read_misses"] == 0
    missing = sorted(key for key in tier["objects"] if read.get(key) is None)
    assert not missing, f"{len(missing)} keys not in Mooncake, e.g. {missing[:3]}"
    for key, payload in tier["objects"].items():
        assert read[key] == payload, key


def test_published_objects_are_the_routed_experts_the_engine_returned(
    run: dict[str, Any],
) -> None:
    import numpy as np

    result = run["result"]
    blocks = set()
    hits = 0
    for request in result["requests"]:
        rows = request["routed_experts"]
        assert isinstance(rows, np.ndarray), request["id"]
        for start in range(0, len(rows) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            blocks.add(rows[start : start + BLOCK_TOKENS].tobytes())
        hits += request["num_cached_tokens"] > 0
    assert hits > 0, "no prefix-cache hit: the engine never read its store"
    for key, payload in run["read"].items():
        assert payload in blocks, key
